"""Pipeline transfers and model chunks of hand-written schedules (issue 55): their direction by the peer,
by the data where the previous and the next stage are one rank, and the chunk of every compute op and
transfer of an interleaved 1F1B. A tracer on a stand-in session (``test_trace_layout.session``); the
calls that ``ingest.torch_ccl`` would report are handed to it directly. No processes."""
from __future__ import annotations

import pytest

from ingest.autotrace import transfers as X
from tests.unit.test_trace_layout import session


@pytest.mark.parametrize("me,peer,pp,send,activation,want", [
    (1, 2, 4, True, True, "forward-send"), (1, 0, 4, True, False, "backward-send"),
    (1, 0, 4, False, False, "forward-recv"), (1, 2, 4, False, False, "backward-recv"),
    # an interleaved schedule sends its chunks round: the last stage's next is stage 0
    (3, 0, 4, True, True, "forward-send"), (0, 3, 4, False, False, "forward-recv"),
    (0, 3, 4, True, False, "backward-send"), (3, 0, 4, False, False, "backward-recv"),
    (0, 2, 4, True, True, None),  # no neighbour
    # two stages: each is the other's previous and next; a send says by what it carries
    (0, 1, 2, True, True, "forward-send"), (1, 0, 2, True, True, "forward-send"),
    (0, 1, 2, True, False, "backward-send"), (1, 0, 2, False, True, X.AMBIGUOUS),
])
def test_the_direction_of_a_transfer(me, peer, pp, send, activation, want):
    assert X.direction(me, peer, pp, send, activation=activation) == want


def test_a_receive_between_two_stages_is_what_its_buffer_becomes():
    torch = pytest.importorskip("torch")
    book = X.PendingRecvs()
    act, grad, other = (torch.zeros(2, requires_grad=True) for _ in range(3))
    for t in (act, grad, other):
        book.add(X.PendingRecv(t, 0, 1, 0, 1))
    assert [p.tensor for p in book.used_in(((torch.ones(2), grad),))] == [grad]  # a backward's gradients
    assert book.given_a_grad() == []
    act.grad = torch.ones(2)  # the input of a forward whose backward ran
    assert [p.tensor for p in book.given_a_grad()] == [act]
    assert [p.tensor for p in book.drain()] == [other] and len(book) == 0
    # What nothing used is read as a pipeline without wrap-around: stage 0 receives backward.
    assert X.unwrapped(0, 1, False) == "backward-recv" and X.unwrapped(1, 0, False) == "forward-recv"


class Chunk:
    """A model chunk that takes its input through set_input_tensor, as Megatron's do."""

    def __new__(cls, torch, first: bool):
        class _Chunk(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
                self.input_tensor = None

            def forward(self, x):
                return torch.tanh(self.lin(x if first else self.input_tensor))
        return _Chunk()


def test_an_interleaved_schedule_on_two_stages_puts_every_op_on_its_chunk_and_direction():
    """Stage 1 of a pipeline of two, two chunks a rank (global chunks 1 and 3), two microbatches, in the
    order of an interleaved 1F1B's (warm-up forwards, then backwards, transfers batched as Megatron's). Its
    previous and next stage are one rank: every receive's direction comes from its buffer's use."""
    torch = pytest.importorskip("torch")
    from torch.autograd.variable import Variable

    from ingest.torch_ccl import Call

    sess = session(1, 2)
    tr, exp = sess.tracer, sess.exporter
    sent = exp.sink.__self__
    tr.install()

    def call(send: bool, tensor):
        c = Call("isend" if send else "irecv", "pp", [0, 1], 0, 16, [0], 0, 0, tensor, is_p2p=True, is_send=send,
                 is_async=True, via=[0, 1])
        tr.on_enter(c)
        tr.on_exit(c)

    def recv():
        buf = torch.empty(3, 4, requires_grad=True)
        call(False, buf)
        return buf

    def backward(out, grad):
        Variable._execution_engine.run_backward(tensors=(out,), grad_tensors=(grad,), keep_graph=False,
                                                create_graph=False, inputs=tuple(), allow_unreachable=True,
                                                accumulate_grad=True)

    torch.manual_seed(0)
    c0, c1 = Chunk(torch, False), Chunk(torch, False)
    try:
        for _step in range(2):
            ins, outs = {}, {}
            for k in range(2):  # chunk 0's forwards, each sending its activation on
                ins[0, k] = recv()
                c0.input_tensor = ins[0, k]
                outs[0, k] = c0(None)
                call(True, outs[0, k])
            for k in range(2):  # chunk 1 (the last virtual stage): its loss, its backward, its gradient back
                ins[1, k] = recv()
                c1.input_tensor = ins[1, k]
                outs[1, k] = c1(None).pow(2).mean()
                backward(outs[1, k], torch.ones(()))
                call(True, ins[1, k].grad)
            for k in range(2):  # chunk 0's backwards, on the gradients the next stage sent
                grad = recv()
                backward(outs[0, k], grad)
                call(True, ins[0, k].grad)
            tr._opt_pre(None, (), {})
            tr._opt_post(None, (), {})
    finally:
        tr.close()
        exp.close(1)
    spans = [r for t in sent if "optype" in t.column_names for r in t.to_pylist()]
    step1 = sorted((r for r in spans if r["step"] == 1), key=lambda r: r["start_ns"])
    got = [(r["optype"], r["gmc"], r["mb_id"]) for r in step1 if r["optype"] not in ("gc", "optimizer")]
    assert got == [
        ("forward-recv", 1, 0), ("forward-compute", 1, 0), ("forward-send", 1, 0),
        ("forward-recv", 1, 1), ("forward-compute", 1, 1), ("forward-send", 1, 1),
        ("forward-recv", 3, 2), ("forward-compute", 3, 0), ("backward-compute", 3, 0), ("backward-send", 3, 0),
        ("forward-recv", 3, 3), ("forward-compute", 3, 1), ("backward-compute", 3, 1), ("backward-send", 3, 1),
        ("backward-recv", 1, 0), ("backward-compute", 1, 0), ("backward-send", 1, 2),
        ("backward-recv", 1, 1), ("backward-compute", 1, 1), ("backward-send", 1, 3),
    ]
    assert {r["mc"] for r in step1 if r["gmc"] == 3} == {1} and {r["mc"] for r in step1 if r["gmc"] == 1} == {0}
    assert tr.chunks_seen == 2
