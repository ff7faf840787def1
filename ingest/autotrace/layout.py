"""Where each rank sits in a traced job, and the checks that a layout holds together (pure functions).

The what-if model has one worker per (dp, pp) coordinate, TP and CP folded in.
A traced process learns its own coordinates from the process groups it uses
(``tracer.Tracer._settle_layout``): the pipeline is the group its stage or its
point-to-point transfers run over, its data-parallel replicas the group its
gradients are reduced over, TP and CP the DeviceMesh's or Megatron's groups.
Only where nothing says is a rank order used: the one ``--layout order=...``
states, else Megatron's (``pp, dp, cp, tp``, tensor parallel fastest), with a
warning.

A rank sees only its own groups, so what a layout must satisfy across ranks
(one rank per worker, every worker spoken for, a pipeline's stages on one DP
coordinate) is checked on the claims every rank sends (``Claim``), gathered
once after step 0 (``check_claims``).
"""
from __future__ import annotations

import dataclasses
import re
import struct

DIMS = ("pp", "dp", "cp", "tp")
DEFAULT_ORDER = ("pp", "dp", "cp", "tp")
"""Megatron-LM's rank order, outermost first: tensor parallel varies fastest, the pipeline stage slowest."""


class LayoutError(ValueError):
    """A rank order or layout that cannot be used."""


def parse_order(text: str) -> tuple[str, ...]:
    """``"dp,pp"`` (or ``"dp-pp"``) -> ('dp', 'pp'): dimensions from the outermost (slowest-varying rank
    index) to the innermost, as a DeviceMesh's shape lists them."""
    names = tuple(n for n in re.split(r"[\s,\-/]+", text.strip().lower()) if n)
    bad = [n for n in names if n not in DIMS]
    if not names or bad:
        raise LayoutError(f"bad rank order {text!r}: want dimensions among {', '.join(DIMS)}, outermost first, "
                          "e.g. order=dp,pp")
    if len(set(names)) != len(names):
        raise LayoutError(f"bad rank order {text!r}: a dimension is named twice")
    return names


def coords_in_order(rank: int, sizes: dict[str, int], order: tuple[str, ...] = DEFAULT_ORDER) -> dict[str, int]:
    """Coordinates of ``rank`` when ranks are numbered in ``order`` (outermost first), e.g. with order
    ``('dp', 'pp')`` rank = dp * pp_size + pp. ``sizes`` maps dimension names to sizes; a dimension of size
    1 may be left out of the order, a larger one may not."""
    missing = [d for d in DIMS if sizes.get(d, 1) > 1 and d not in order]
    if missing:
        raise LayoutError(f"rank order {','.join(order)} leaves out {', '.join(missing)} "
                          f"(size {', '.join(str(sizes[d]) for d in missing)})")
    out = {d: 0 for d in DIMS}
    rest = rank
    for d in reversed(order):
        n = max(1, sizes.get(d, 1))
        out[d] = rest % n
        rest //= n
    return out


def position(ranks, rank: int) -> int | None:
    """The place of ``rank`` in a group's rank list (its group rank), or None."""
    ranks = list(ranks)
    return ranks.index(rank) if rank in ranks else None


def orthogonal(a, b, rank: int) -> bool:
    """True when groups ``a`` and ``b`` share only ``rank``: one can be a coordinate axis beside the other."""
    return set(a) & set(b) == {rank}


# Where a rank's coordinates came from: bits of Claim.sources, the words of JOB.layout_source.
SRC_STAGE, SRC_P2P, SRC_MESH, SRC_MEGATRON, SRC_DP_GROUP, SRC_ORDER, SRC_GUESS, SRC_OVERRULED = (
    1 << i for i in range(8))
_SOURCE_WORDS = ((SRC_STAGE, "the pipeline stage's group"), (SRC_P2P, "the pipeline transfers' group"),
                 (SRC_MESH, "the DeviceMesh"), (SRC_MEGATRON, "Megatron's parallel_state"),
                 (SRC_DP_GROUP, "the gradient reduction's group"), (SRC_ORDER, "the rank order of --layout"),
                 (SRC_GUESS, "Megatron's rank order (guessed)"),
                 (SRC_OVERRULED, "not --layout's rank order, which the groups contradict"))


def describe_sources(bits: int) -> str:
    """``layout_source`` of a registration: the sources used by any rank, in words."""
    return "; ".join(words for bit, words in _SOURCE_WORDS if bits & bit) or "the world size alone"


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one rank says of itself after step 0: its worker, the sizes it sees, the job facts it counted."""

    rank: int
    dp: int
    pp: int
    speaks: bool              # this rank sends its worker's op spans (the first TP/CP rank of the worker)
    pipeline: int             # the lowest rank of its pipeline group; -1 when it knows none
    sizes: tuple[int, int, int, int, int]  # dp, pp, tp, cp, vpp
    sources: int = 0          # SRC_* bits
    flops: float = 0.0        # model FLOPs of this rank's worker per step (speakers only)
    tokens: float = 0.0       # tokens its stage takes per step
    params: float = 0.0       # parameters of its stage (the whole stage, TP shards included)
    problem: str = ""         # what this rank found wrong on its own
    probe: str = ""           # ip:port its path probe listens on (ingest/path_probe.py), "" without one

    _HEAD = struct.Struct("<8q3d")
    SIZE = 512
    _PROBE = 64               # the record's last bytes: the probe's address, its length first

    def encode(self) -> bytes:
        """A fixed-size record (``SIZE`` bytes) for one all-gather of bytes."""
        packed = (self.sizes[0] | self.sizes[1] << 16 | self.sizes[2] << 32 | self.sizes[3] << 48)
        head = self._HEAD.pack(self.rank, self.dp, self.pp, int(self.speaks), self.pipeline, packed, self.sizes[4],
                               self.sources, self.flops, self.tokens, self.params)
        room = self.SIZE - self._PROBE - len(head) - 2
        text = self.problem.encode()[:room]
        probe = self.probe.encode()[: self._PROBE - 1]
        return (head + struct.pack("<H", len(text)) + text + bytes(room - len(text))
                + bytes([len(probe)]) + probe + bytes(self._PROBE - 1 - len(probe)))

    @classmethod
    def decode(cls, data: bytes) -> "Claim":
        vals = cls._HEAD.unpack_from(data)
        n = struct.unpack_from("<H", data, cls._HEAD.size)[0]
        text = bytes(data[cls._HEAD.size + 2: cls._HEAD.size + 2 + n]).decode(errors="replace")
        at = cls.SIZE - cls._PROBE
        probe = bytes(data[at + 1: at + 1 + data[at]]).decode(errors="replace")
        packed = vals[5]
        sizes = tuple((packed >> s) & 0xFFFF for s in (0, 16, 32, 48)) + (vals[6],)
        return cls(rank=vals[0], dp=vals[1], pp=vals[2], speaks=bool(vals[3]), pipeline=vals[4], sizes=sizes,
                   sources=vals[7], flops=vals[8], tokens=vals[9], params=vals[10], problem=text, probe=probe)


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


def check_claims(claims: list[Claim], world: int) -> list[str]:
    """What contradicts the layout the ranks claim, one sentence per contradiction; [] when it holds.

    Checked: every rank sees the same sizes and they multiply to the world; each worker (dp, pp) has
    exactly one rank sending its spans, inside the sizes; the stages of one pipeline share a DP
    coordinate; and whatever a rank found wrong on its own.
    """
    problems: list[str] = []
    said: dict[str, list[int]] = {}
    for c in claims:
        for p in filter(None, c.problem.split("; ")):
            said.setdefault(p, []).append(c.rank)
    problems += [p if len(rs) == len(claims) else f"{_ranks(rs)}: {p}" for p, rs in said.items()]
    by_sizes: dict[tuple, list[int]] = {}
    for c in claims:
        by_sizes.setdefault(c.sizes[:4], []).append(c.rank)
    if len(by_sizes) > 1:
        views = sorted(by_sizes.items(), key=lambda kv: min(kv[1]))
        problems.append("the ranks disagree on the layout: " + "; ".join(
            f"{_ranks(rs)} {'sees' if len(rs) == 1 else 'see'} dp={s[0]} pp={s[1]} tp={s[2]} cp={s[3]}"
            for s, rs in views))
    dp, pp, tp, cp = min(by_sizes.items(), key=lambda kv: min(kv[1]))[0] if by_sizes else (1, 1, 1, 1)
    if dp * pp * tp * cp != world:
        problems.append(f"dp={dp} x pp={pp} x tp={tp} x cp={cp} is {dp * pp * tp * cp} ranks, but the job has "
                        f"{world}")
    speakers: dict[tuple[int, int], list[int]] = {}
    for c in claims:
        if not c.speaks:
            continue
        if not (0 <= c.dp < dp and 0 <= c.pp < pp):
            problems.append(f"rank {c.rank} claims worker dp {c.dp}, pp {c.pp}, outside dp={dp} pp={pp}")
            continue
        speakers.setdefault((c.dp, c.pp), []).append(c.rank)
    for (d, p), rs in sorted(speakers.items()):
        if len(rs) > 1:
            problems.append(f"{_ranks(rs)} all claim worker dp {d}, pp {p}")
    if len(claims) == world and dp * pp * tp * cp == world:
        silent = [(d, p) for d in range(dp) for p in range(pp) if (d, p) not in speakers]
        if silent:
            shown = ", ".join(f"dp {d} pp {p}" for d, p in silent[:6]) + (" ..." if len(silent) > 6 else "")
            problems.append(f"no rank speaks for worker{'s' if len(silent) > 1 else ''} {shown}")
    pipes: dict[int, set[int]] = {}
    for c in claims:
        if c.speaks and c.pipeline >= 0:
            pipes.setdefault(c.pipeline, set()).add(c.dp)
    for first, dps in sorted(pipes.items()):
        if len(dps) > 1:
            problems.append(f"the pipeline of rank {first} has stages on dp {', '.join(map(str, sorted(dps)))}")
    return problems


# DeviceMesh dimension names, as torchtitan and others spell them, to the size they are part of. A name
# not listed is data parallel, with a warning: every other axis of parallelism must be named to be seen.
MESH_NAMES = {"pp": "pp_size", "pipe": "pp_size", "pipeline": "pp_size",
               "tp": "tp_size", "tensor": "tp_size",
               "cp": "cp_size", "context": "cp_size",
               "dp": "dp_size", "data": "dp_size", "dp_replicate": "dp_size", "dp_shard": "dp_size",
               "dp_shard_cp": "dp_size", "fsdp": "dp_size", "ddp": "dp_size", "hsdp": "dp_size",
               "replicate": "dp_size", "shard": "dp_size"}


def mesh_axis(name: str) -> str:
    """The layout size (``"tp_size"``, ...) a DeviceMesh dimension of this name is part of; unknown: DP."""
    return MESH_NAMES.get(str(name).lower(), "dp_size")
