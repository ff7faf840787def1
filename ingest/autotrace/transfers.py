"""Pipeline transfers outside ``torch.distributed.pipelining``: which direction, which model chunk.

A hand-written schedule (Megatron's, batched ``P2POp``s or plain ``isend``/``irecv``) says neither. The
tracer reads them from what the job does:

- **direction, by the peer**: in a pipeline of ``pp`` stages a transfer to the next stage (the last stage's
  next is stage 0: an interleaved schedule sends its chunks round) is a forward-send, to the previous one
  a backward-send, and the receives mirror them;
- **direction, by the data**, where the previous and the next stage are one rank (two stages, or an
  interleaved schedule on two): a send of an activation (a tensor that requires grad, or anything before
  the step's first backward) is a forward-send, of a gradient a backward-send; a receive is whatever its
  buffer becomes (``PendingRecvs``): the input of a forward (passed to it, or found with a gradient once a
  backward ran: a leaf that required grad) is a forward-recv, the gradient handed to a backward a
  backward-recv, of that forward's or backward's chunk. What no use settles by the step's end is read
  without wrap-around (to the next stage forward, from it backward), as a non-interleaved pipeline of
  two stages does;
- **model chunk**: a forward's chunk is its outermost module's place among those the rank called in step
  0 (the order of their first forwards: Megatron's schedules start each step on chunk 0); a backward's is
  the chunk of the first parameter it gives a gradient; a send's, the compute op that made its tensor.

Read by peer alone, every transfer of an interleaved schedule on two stages was on chunk 0 and half of
them ran the wrong way (256 of a window's transfers without a peer, 352 launch delays clamped).
"""
from __future__ import annotations

import dataclasses

FORWARD_SEND, BACKWARD_SEND = "forward-send", "backward-send"
FORWARD_RECV, BACKWARD_RECV = "forward-recv", "backward-recv"
AMBIGUOUS = "recv?"
"""A receive from a rank that is both the previous and the next stage: its direction waits for its use."""


def direction(me: int, peer: int, pp: int, is_send: bool, *, activation: bool) -> str | None:
    """The op type of a transfer from stage ``me`` to (or from) stage ``peer`` of ``pp``, or None when the
    peer is no neighbour. ``activation``: what a send between mutual neighbours carries (see the module
    docstring); a receive between them is ``AMBIGUOUS``."""
    if pp < 2 or me == peer:
        return None
    nxt, prev = (me + 1) % pp, (me - 1) % pp
    if nxt == prev == peer:
        if is_send:
            return FORWARD_SEND if activation else BACKWARD_SEND
        return AMBIGUOUS
    if peer == nxt:
        return FORWARD_SEND if is_send else BACKWARD_RECV
    if peer == prev:
        return BACKWARD_SEND if is_send else FORWARD_RECV
    return None


def unwrapped(me: int, peer: int, is_send: bool) -> str:
    """A transfer between mutual neighbours read as a pipeline without wrap-around does: the lower stage
    sends forward and receives backward."""
    if is_send:
        return FORWARD_SEND if peer > me else BACKWARD_SEND
    return BACKWARD_RECV if peer > me else FORWARD_RECV


@dataclasses.dataclass
class PendingRecv:
    """A received buffer whose direction waits for its use. ``start``/``end``: perf_counter ns of its span."""

    tensor: object
    start: int
    end: int
    me: int
    peer: int


class PendingRecvs:
    """The step's receives of unknown direction, until a forward or a backward uses their buffers."""

    def __init__(self) -> None:
        self.items: list[PendingRecv] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: PendingRecv) -> None:
        self.items.append(item)

    def _take(self, keep) -> list[PendingRecv]:
        taken = [p for p in self.items if not keep(p)]
        if taken:
            self.items = [p for p in self.items if keep(p)]
        return taken

    def used_in(self, tensors) -> list[PendingRecv]:
        """The receives whose buffer is one of ``tensors`` (a forward's inputs, a backward's gradients),
        taken out of the book."""
        if not self.items:
            return []
        ids = {id(t) for t in _tensors(tensors)}
        return self._take(lambda p: id(p.tensor) not in ids) if ids else []

    def given_a_grad(self) -> list[PendingRecv]:
        """The receives whose buffer has a gradient now: the input of a forward whose backward just ran."""
        if not self.items:
            return []
        return self._take(lambda p: getattr(p.tensor, "grad", None) is None)

    def drain(self) -> list[PendingRecv]:
        items, self.items = self.items, []
        return items


def _tensors(x, depth: int = 0):
    """The tensors in a forward's inputs or a backward's gradients (tuples, lists and dicts, 3 levels)."""
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif depth < 3 and isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item, depth + 1)
