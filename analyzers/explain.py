"""Verdicts and hangs in words: per kind, one sentence with its figures and, where it helps, a small table.

The console's job page and the CLI's trace summary both tell an engineer why a
window is slow or where a job hangs. They read the words from here, so the
terminal and the browser say the same thing with the same figures, and a
change of wording is made once.

Input is what the store holds: a verdict of ``verdicts_json`` (``{"kind",
"score", "summary", "evidence"}``, analyzers/whatif/verdicts.py), a WINDOW
row (for the window-level verdicts ``clock_skew``, ``analysis_failed``,
``no_op_spans`` and none, whose reason is in ``note``) and a HANG row. Rows
stored by older versions may lack evidence fields: a sentence then leaves
those figures out, or falls back to the verdict's own summary; it never
raises. Pure: no I/O, no Streamlit, no heavy imports (the CLI imports this
at the end of a run).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

MIN_SLOWDOWN = 1.05
"""S below which no verdict is given (``analyzers.whatif.verdicts.MIN_SLOWDOWN``; a unit test keeps them equal)."""

TITLES = {
    "worker": "Slow worker",
    "last_stage_imbalance": "Last pipeline stage too heavy",
    "sequence_imbalance": "Uneven sequence lengths",
    "gc": "Garbage-collection pauses",
    "communication": "Slow communication",
    "clock_skew": "Clocks out of step",
    "analysis_failed": "Analysis failed",
    "no_op_spans": "Links only (no op spans)",
    "none": "No straggling",
    "comm_hang": "Communication hang",
    "noncomm_hang": "Non-communication hang",
    "node_loss": "Node loss",
    "process_loss": "Process loss",
    "hang_ended": "Stall ended",
}
"""What each kind is called where a person reads it (the stored kinds are identifiers)."""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """One verdict (or hang) in words: a title, a sentence with its figures and an optional small table."""

    kind: str
    title: str
    sentence: str
    columns: tuple[str, ...] = ()
    rows: tuple[tuple, ...] = ()

    def lines(self, max_rows: int = 5, indent: str = "  ") -> list[str]:
        """Plain text for a terminal: the title and sentence, then the table's first ``max_rows`` rows."""
        out = [f"{self.title}: {self.sentence}"]
        if self.rows and max_rows > 0:
            cells = [tuple(str(c) for c in self.columns)] + [tuple(str(c) for c in r) for r in self.rows[:max_rows]]
            widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
            out += [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
            if len(self.rows) > max_rows:
                out.append(f"{indent}... {len(self.rows) - max_rows} more")
        return out


def title(kind: str) -> str:
    """The readable name of a verdict or hang kind; an unknown kind in plain words."""
    if not kind:
        return TITLES["none"]
    return TITLES.get(kind, kind.replace("_", " ").capitalize())


# -- figures --------------------------------------------------------------------------------------

def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def ratio(x: Any) -> str:
    """A slowdown such as S: three decimals, the precision the verdicts are judged at."""
    v = _num(x)
    return "n/a" if v is None else f"{v:.3f}"


def pct(x: Any, digits: int = 1) -> str:
    """A share (0.295) as a percentage ('29.5%')."""
    v = _num(x)
    return "n/a" if v is None else f"{100 * v:.{digits}f}%"


def duration(seconds: Any) -> str:
    """A duration in the unit a person reads it in: '45 ms', '12.3 s', '14 min', '3.2 h', '2.0 days'."""
    v = _num(seconds)
    if v is None:
        return "n/a"
    a = abs(v)
    if a < 1:
        return f"{v * 1e3:.1f} ms" if a < 0.1 else f"{v * 1e3:.0f} ms"
    if a < 100:
        return f"{v:.1f} s" if a < 10 else f"{v:.0f} s"
    if a < 2 * 3600:
        return f"{v / 60:.0f} min"
    if a < 2 * 86400:
        return f"{v / 3600:.1f} h"
    return f"{v / 86400:.1f} days"


def _share(part: Any) -> str:
    """The share of the slowdown a fix removes; M_W and M_S can pass 1 by simulation noise."""
    v = _num(part)
    return "n/a" if v is None else f"{100 * min(max(v, 0.0), 1.0):.0f}%"


def _slower(S: Any) -> str:
    """'29.5% slower than ideal (S = 1.295)': the slowdown as a person says it, with S beside it."""
    v = _num(S)
    return "S n/a" if v is None else f"{pct(v - 1.0)} slower than its ideal (S = {ratio(v)})"


def _step_times(ev: Mapping) -> str:
    """'; the mean step would drop from 0.936 s to 0.713 s (ideal 0.722 s)' when the evidence has them."""
    tori, trem, tid = _num(ev.get("tori")), _num(ev.get("trem")), _num(ev.get("tideal"))
    if tori is None or trem is None:
        return ""
    tail = f" (ideal {duration(tid)})" if tid is not None else ""
    return f"; the mean step would drop from {duration(tori)} to {duration(trem)}{tail}"


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one}" if n == 1 else f"{n} {many or one + 's'}"


# -- verdicts of the what-if analysis --------------------------------------------------------------

def _worker(ev: Mapping, v: Mapping) -> Explanation:
    top = sorted(ev.get("top_workers") or [], key=lambda c: -(_num(c.get("S_w")) or 0.0))
    names = [f"dp{c['dp_rank']}/pp{c['pp_rank']}" for c in top]
    who = (f"Worker {names[0]} is the straggler" if len(names) == 1
           else f"{len(names)} workers are the stragglers ({_listed(names)})" if names
           else "A few workers are the stragglers")
    sentence = (f"{who}: the job runs {_slower(ev.get('S'))}, and fixing {'it' if len(names) == 1 else 'them'} "
                f"alone would remove {_share(ev.get('M_W'))} of that{_step_times(ev)}. "
                "Check or swap the host, GPU or NIC of the slowest worker first.")
    rows = tuple((n, c["dp_rank"], c["pp_rank"], ratio(c.get("S_w"))) for n, c in zip(names, top[:8]))
    return Explanation("worker", title("worker"), sentence, ("worker", "DP rank", "PP rank", "S_w"), rows)


def _last_stage(ev: Mapping, v: Mapping) -> Explanation:
    s_pp = {int(k): _num(x) for k, x in (ev.get("S_pp") or {}).items()}
    last = max(s_pp) if s_pp else None
    s_last = ev.get("S_pp_last", s_pp.get(last) if last is not None else None)
    others = [x for k, x in s_pp.items() if k != last and x is not None]
    rest = ""
    if others:
        lo, hi = min(others), max(others)
        span = ratio(lo) if ratio(lo) == ratio(hi) else f"{ratio(lo)} to {ratio(hi)}"
        rest = (f" while the other stage runs at {span}" if len(others) == 1
                else f" while the other {len(others)} stages run at {span}")
    stage = f" (pp{last})" if last is not None else ""
    sentence = (f"The last pipeline stage{stage} is too heavy: it runs at S_pp = {ratio(s_last)}{rest}. "
                f"Rebalancing its layers would remove {_share(ev.get('M_S'))} of the slowdown; the job runs "
                f"{_slower(ev.get('S'))}{_step_times(ev)}.")
    # The last stage first, then the others slowest first: a cut table (a terminal's) still shows the culprit.
    stages = ([last] if last is not None else []) + sorted((k for k in s_pp if k != last),
                                                           key=lambda k: (-(s_pp[k] or 0.0), k))[:11]
    rows = tuple((f"pp{k}" + (" (last)" if k == last else ""), ratio(s_pp[k])) for k in stages)
    return Explanation("last_stage_imbalance", title("last_stage_imbalance"), sentence, ("stage", "S_pp"), rows)


def _sequence(ev: Mapping, v: Mapping) -> Explanation:
    corr, pairs, cv = ev.get("corr_fwd_bwd"), ev.get("pairs"), _num(ev.get("cv_fwd"))
    spread = f"; forward times vary by {pct(cv, 0)} around their mean" if cv is not None else ""
    over = f" over {pairs:,} microbatches" if isinstance(pairs, int) else ""
    sentence = (f"Microbatches differ in length: one that is slow in its forward pass is slow in its backward "
                f"pass too (correlation r = {ratio(corr)}{over}{spread}). Forward compute runs at "
                f"S = {ratio(ev.get('S_forward'))} and backward at S = {ratio(ev.get('S_backward'))} of their "
                f"ideal; the job runs {_slower(ev.get('S'))}. Balance the tokens (or attention cost) per "
                "microbatch.")
    rows = tuple((name, ratio(ev.get(key))) for name, key in (("forward-compute", "S_forward"),
                                                                ("backward-compute", "S_backward"))
                 if key in ev)
    return Explanation("sequence_imbalance", title("sequence_imbalance"), sentence, ("op type", "S_t"), rows)


def _gc(ev: Mapping, v: Mapping) -> Explanation:
    S, s_gc = _num(ev.get("S")), _num(ev.get("S_gc"))
    n, hit = ev.get("gc_ops"), ev.get("gc_ops_nonzero")
    parts = []
    if isinstance(n, int) and isinstance(hit, int):
        parts.append(f"{hit} of {n} collection points paused the job ({pct(ev.get('gc_hit_fraction'), 0)})")
    if _num(ev.get("gc_mean_ms")) is not None:
        parts.append(f"{duration(ev['gc_mean_ms'] / 1e3)} on average and up to "
                     f"{duration((_num(ev.get('gc_max_ms')) or 0.0) / 1e3)}")
    share = (s_gc - 1.0) / (S - 1.0) if S is not None and s_gc is not None and S > 1.0 else None
    sentence = ("Garbage collection stops the job: " + (", ".join(parts) + ". " if parts else "")
                + f"GC alone slows it to S_gc = {ratio(s_gc)}, {_share(share)} of the slowdown; the job runs "
                  f"{_slower(S)}.")
    growth = _num(ev.get("gc_growth_corr"))
    if growth is not None and growth >= 0.5:
        sentence += f" The pauses grow over the window (r = {growth:.2f}): the heap keeps growing."
    sentence += " Collect at the same step on every rank, or turn automatic GC off."
    return Explanation("gc", title("gc"), sentence)


def _communication(ev: Mapping, v: Mapping) -> Explanation:
    S, s_t = _num(ev.get("S")), _num(ev.get("S_t"))
    share = (s_t - 1.0) / (S - 1.0) if S is not None and s_t is not None and S > 1.0 else None
    op = ev.get("optype") or "a communication op type"
    sentence = (f"Communication is the largest source of slowdown: {op} runs at S_t = {ratio(s_t)}, "
                f"{_share(share)} of the slowdown; the job runs {_slower(S)}. Where collectives are recorded, "
                "the link diagnosis names the slow link, NIC or late rank.")
    by = sorted(((k, _num(x)) for k, x in (ev.get("by_optype") or {}).items() if _num(x) is not None),
                key=lambda kv: -kv[1])[:6]
    return Explanation("communication", title("communication"), sentence, ("op type", "S_t"),
                       tuple((k, ratio(x)) for k, x in by))


_SKEW = re.compile(r"dp(\d+)/pp(\d+) ([+-]?[\d.]+) s")


def _clock_skew(note: str) -> Explanation:
    found = [(f"dp{d}/pp{p}", float(off)) for d, p, off in _SKEW.findall(note or "")]
    more = re.search(r"(\d+) more workers", note or "")
    n = len(found) + (int(more.group(1)) if more else 0)
    who = (f"The clocks of {_plural(n, 'worker')} sit far off the others' "
           f"({_listed([f'{w} by {_signed(o)}' for w, o in found], 3)})" if found
           else "Some workers' clocks sit far off the others'")
    sentence = (f"{who}: their spans would stretch the window and its GPU-hours, so it was not analysed and is "
                "left out of fleet statistics. Fix time synchronisation (NTP, PTP) on their hosts.")
    return Explanation("clock_skew", title("clock_skew"), sentence, ("worker", "clock offset"),
                       tuple((w, _signed(o)) for w, o in found))


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + duration(abs(seconds))


def _reason(note: str, limit: int | None = 300) -> str:
    """A stored note on one line, cut at ``limit`` characters (None: whole)."""
    note = " ".join((note or "").split())
    return note if limit is None or len(note) <= limit else note[: limit - 1] + "…"


_VERDICTS: dict[str, Callable[[Mapping, Mapping], Explanation]] = {
    "worker": _worker, "last_stage_imbalance": _last_stage, "sequence_imbalance": _sequence, "gc": _gc,
    "communication": _communication,
}


def explain_verdict(v: Mapping) -> Explanation:
    """One stored verdict (``{"kind", "score", "summary", "evidence"}``) in words.

    A kind without its own wording, or evidence missing the figures the wording
    needs (a row of an older version), reads as the verdict's stored summary.
    """
    kind = str(v.get("kind") or "")
    ev = v.get("evidence") or {}
    fn = _VERDICTS.get(kind)
    if fn is not None and isinstance(ev, Mapping):
        try:
            return fn(ev, v)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass  # evidence of another shape: the stored summary still says what was found
    summary = str(v.get("summary") or "no details stored")
    return Explanation(kind, title(kind), summary[:1].upper() + summary[1:] + ("" if summary.endswith(".") else "."))


def verdicts_of(row: Mapping) -> list[dict]:
    """The verdict dicts of a WINDOW row (its ``verdicts_json``: a JSON text, or already a list)."""
    raw = row.get("verdicts_json") or "[]"
    try:
        vs = json.loads(raw) if isinstance(raw, str) else list(raw)
    except ValueError:
        return []
    return [v for v in vs if isinstance(v, dict)]


def explain_window(row: Mapping) -> list[Explanation]:
    """Every verdict of one WINDOW row in words, main one first; a window without one says why not."""
    vs = verdicts_of(row)
    if vs:
        return [explain_verdict(v) for v in vs]
    kind, note = str(row.get("verdict") or ""), str(row.get("note") or "")
    if kind == "clock_skew":
        return [_clock_skew(note)]
    if kind == "analysis_failed":
        # Whole: why it failed is what the reader needs (a dependency cycle's ops were cut mid-word).
        return [Explanation(kind, title(kind), f"The analysis of this window failed: {_reason(note, None)}. The "
                                               "window is stored and left out of fleet statistics.")]
    if kind == "no_op_spans":
        return [Explanation(kind, title(kind), "No op spans arrived for this window, only collective records: "
                                               "its links were diagnosed, its stragglers were not.")]
    if kind:  # a verdict named on the row but not in verdicts_json
        return [Explanation(kind, title(kind), _reason(note) or "No evidence stored.")]
    S = _num(row.get("slowdown"))
    if S is None:
        return [Explanation("none", "Not analysed", "This window has no slowdown: " + (_reason(note) or
                                                                                    "no reason stored") + ".")]
    if S < MIN_SLOWDOWN:
        return [Explanation("none", title("none"), f"The job runs {_slower(S)}: below {MIN_SLOWDOWN:.2f}, where a "
                                                   "cause would be named, the shares of the slowdown are noise.")]
    # Slow, yet no cause passed its threshold: a warm-up window, or a slowdown spread over many causes.
    return [Explanation("none", "No single cause", f"The job runs {_slower(S)}, but no worker, stage, op type or "
                                                   "imbalance explains enough of it to be named: a warm-up window, or "
                                                   "a slowdown spread thin over many causes.")]


# -- link findings --------------------------------------------------------------------------------

def link_element(kind: str, src: Any, dst: Any, group: str = "") -> str:
    """What a LINK_FAULT row blames, in words: 'the link from rank 2 to rank 3', 'the NIC of rank 3 (its
    egress)', ... (the alert, the console and the trace summary all say it so)."""
    return {"source": f"the NIC of rank {src} (its egress)",
            "destination": f"rank {dst}'s receiving side (its ingress)",
            "link": f"the link from rank {src} to rank {dst}",
            "endpoint": f"the network of rank {src}, both ways (only collectives saw it)",
            "comm_slow": f"communication{f' in {group}' if group else ''}, not placed on one element",
            "noncomm_slow": f"rank {src}, late to communicate (its own compute or input, not the network)",
            }.get(kind, f"{kind} {src}>{dst}")


def link_basis(row: Mapping) -> str:
    """What a LINK_FAULT row's finding rests on: the bottleneck transfer, what the ports of its hosts said
    (``fabric``, from ``analyzers.fabric.with_fabric_evidence``), and whether it came back."""
    try:
        ev = json.loads(row.get("evidence_json") or "{}")
    except ValueError:
        ev = {}
    basis = ""
    if ev.get("bottleneck"):
        b = ev["bottleneck"][0]
        basis = (f"; transfer {b['flow']} had data in flight {100 * b['busy']:.0f}% of the time at "
                 f"{b['mb_per_s_busy']:.1f} MB/s")
    for host in ev.get("fabric") or ():  # analyzers.fabric: the ports of the finding's hosts waited or erred
        if isinstance(host, Mapping) and host.get("sentence"):
            basis += f"; {host['sentence']}"
    seen = ev.get("persistence") or {}
    if seen.get("first_seen"):  # analyzers.links.history: one window's finding stays low until it comes back
        basis += "; first seen in this window"
    elif "found_before" in seen:
        basis += f"; found in window {seen['found_before']} too"
    return basis


def late_margin(row: Mapping) -> str:
    """How late a late sender (``noncomm_slow``) came, from its evidence (``analyzers.links.localise``): '40 ms
    after its exchange peers 5 and 7 (6.4% of its 0.62 s step) in 5 of 5 steps, beyond the job's jitter of 3 ms',
    or, judged by its work between exchanges, '60 ms more work between exchanges than the job's median rank
    (...)'; '' without it."""
    try:
        ev = json.loads(row.get("evidence_json") or "{}")
    except ValueError:
        return ""
    margin = _num(ev.get("margin_ns", ev.get("median_wait_ns")))
    if margin is None:
        return ""
    peers = ev.get("exchange_peers") or []
    who = (f"its exchange peers {', '.join(str(p) for p in peers[:-1])} and {peers[-1]}" if len(peers) > 1
           else "the others")
    if ev.get("late_by") == "work":  # its own work between two exchanges, against the job's median rank
        said = f"{margin / 1e6:.0f} ms more work between exchanges than the job's median rank"
    else:
        said = f"{margin / 1e6:.0f} ms after {who}"
    share, step = _num(ev.get("margin_share_of_step")), _num(ev.get("step_ns"))
    if share is not None and step:
        said += f" ({100 * share:.1f}% of its {step / 1e9:.2f} s step)"
    if _num(ev.get("steps")):
        said += f" in {ev.get('late_steps')} of {ev['steps']} steps"
    jitter = _num(ev.get("jitter_ns"))
    if jitter is not None:
        said += f", beyond the job's jitter of {jitter / 1e6:.0f} ms"
    return said


def link_sentence(row: Mapping) -> str:
    """One line for a LINK_FAULT row: the element, how slow (how late, for a late sender), how sure, and what
    it rests on."""
    what = link_element(row["kind"], row["src"], row["dst"], row.get("group") or "")
    late = late_margin(row) if row["kind"] == "noncomm_slow" else ""
    if late:
        source = row.get("group") or ("exchanges" if " exchange" in late else "collectives")
        return f"{what}: {late} (confidence {row['confidence']:.2f}, from {source}{link_basis(row)})"
    return (f"{what} is slow ({row['slowdown']:.1f}x slower than the job's other transfers, confidence "
            f"{row['confidence']:.2f}, from {row.get('group') or 'collectives'}{link_basis(row)})")


def job_link_sentence(f: Any) -> str:
    """The job's one answer (``analyzers.links.job.JobFinding``): 'the NIC of rank 3 (its egress), in 5 of 6
    windows with a finding since window 0; also named: the link from rank 3 to rank 4 (1)'."""
    if f.kind == "endpoint":
        how = "; ".join(f"{link_element(k, s, d)} in {n}" for k, s, d, n in f.named_as)
        return (f"the network of rank {f.src}: every window with a finding named it, as {how} (of {f.voting} "
                f"windows, since window {f.since}); the windows differ only on its direction")
    also = ", ".join(f"{link_element(k, s, d)} ({n})" for k, s, d, n in f.others)
    late = getattr(f, "late_by", None)
    by = ""
    if late is not None:  # how late, as the window's sentence says it: in ms and as a share of the step
        ms, share = late[0] / 1e6, late[1]
        by = f", {ms:.0f} ms late" + (f" ({100 * share:.1f}% of its step)" if share == share else "")
    return (f"{link_element(f.kind, f.src, f.dst, f.group)}{by}, in {len(f.windows)} of {f.voting} window"
            f"{'s' if f.voting > 1 else ''} with a finding since window {f.since} (confidence up to "
            f"{f.confidence:.2f})" + (f"; also named: {also}" if also else ""))


# -- hangs ----------------------------------------------------------------------------------------

def parse_ranks(folded: str) -> list[int]:
    """'0-3,5' -> [0, 1, 2, 3, 5] (``core.layout.fold_ranks`` undone); junk parts are skipped."""
    out: set[int] = set()
    for part in (folded or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def layout_sizes(layout: Mapping | None, world: int = 0) -> dict[str, int]:
    """dp/pp/tp/cp sizes from a JOB row (or anything with ``*_size``); without one, every rank its own DP rank."""
    sizes = {k: int((layout or {}).get(f"{k}_size") or 0) for k in ("dp", "pp", "tp", "cp")}
    if sizes["dp"] < 1 or sizes["pp"] < 1:
        return {"dp": max(world, 1), "pp": 1, "tp": 1, "cp": 1}
    return {k: max(v, 1) for k, v in sizes.items()}


def rank_coords(rank: int, sizes: Mapping[str, int]) -> dict[str, int]:
    """A global rank's place in Megatron's order: TP fastest, then CP, DP, and PP slowest."""
    tp, cp, dp = sizes["tp"], sizes["cp"], sizes["dp"]
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}


def where(rank: int, sizes: Mapping[str, int]) -> str:
    """'dp 3, pp 1, tp 1' (TP and CP only when the job has them)."""
    c = rank_coords(rank, sizes)
    return ", ".join(f"{k} {c[k]}" for k in ("dp", "pp", "tp", "cp") if k in ("dp", "pp") or sizes[k] > 1)


def _ranks_named(ranks: list[int], sizes: Mapping[str, int] | None) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}" + (f" ({where(ranks[0], sizes)})" if sizes else "")
    from core.layout import fold_ranks

    return f"ranks {fold_ranks(ranks)}"


def _chain_rows(evidence: Mapping) -> list[dict]:
    chain = evidence.get("wait_chain") or {}
    return [r for r in chain.get("rows") or [] if isinstance(r, dict)]


def _last_op(ranks: Iterable[int], rows: list[dict]) -> str:
    """What the named ranks were last seen doing (their wait-chain row), if one op covers them all."""
    want = set(ranks)
    ops = {(r.get("last_op") or r.get("op") or "") + (f" #{r.get('seq')} of group {r['group']}" if r.get("group")
                                                      else "")
           for r in rows if want & set(parse_ranks(str(r.get("ranks", ""))))}
    ops.discard("")
    return ops.pop() if len(ops) == 1 else ""


def _waiting_in(group: str, seq: Any, rows: list[dict]) -> int:
    """How many ranks the wait chain shows inside collective ``seq`` of ``group``."""
    return sum(len(parse_ranks(str(r.get("ranks", "")))) for r in rows
               if r.get("group") == group and r.get("seq") == seq)


_STATE_WORDS = {"stopped": "is stopped (SIGSTOP, a debugger or the scheduler's suspend)",
                "exited": "exited without finishing (killed, or it crashed)",
                "finished": "finished its work and left (uneven data, or fewer steps than its peers)",
                "silent": "fell silent (no heartbeat, nor its watch's)",
                "unresponsive": "runs but its heartbeat thread cannot (its interpreter lock held in C code)"}
"""What a rank's state (``analyzers.hang``: its watch, its last heartbeat, its silence) says, in words."""


def _states(evidence: Mapping, ranks: list[int]) -> str:
    """' It is stopped (...).' for the named ranks whose state is known; empty when none is."""
    states = evidence.get("states") or {}
    by: dict[str, list[int]] = {}
    for r in ranks:
        st = states.get(str(r)) if isinstance(states, Mapping) else None
        if st:
            by.setdefault(str(st), []).append(r)
    if not by:
        return ""
    from core.layout import fold_ranks

    parts = [(f"rank {rs[0]}" if len(rs) == 1 else f"ranks {fold_ranks(rs)}") + " " + _STATE_WORDS.get(st, st)
             for st, rs in by.items()]
    text = "; ".join(parts)
    return f" {text[0].upper()}{text[1:]}."


def _recovery_words(row: Mapping) -> str:
    """' Recovery plan: ...' of a loss (``analyzers.hang.recovery_sentence``), or ' No recovery plan: why.'"""
    from analyzers.hang import recovery_plan_missing, recovery_plan_of, recovery_sentence

    plan = recovery_plan_of(dict(row))
    if plan:
        return f" Recovery plan: {recovery_sentence(plan)}."
    why = recovery_plan_missing(dict(row))
    return f" No recovery plan: {why}." if why else ""


def explain_hang(row: Mapping, layout: Mapping | None = None) -> Explanation:
    """A HANG row in words: who waits where, who never came (the culprits), what state they are in and for how
    long; for a stall that ended, how long it lasted and what it was.

    ``layout``: the job's registration (JOB row) to place ranks as dp/pp/tp; without it ranks are named only.
    """
    kind = str(row.get("kind") or "")
    stuck, missing = parse_ranks(str(row.get("stuck_ranks") or "")), parse_ranks(str(row.get("missing_ranks") or ""))
    try:
        evidence = json.loads(row.get("evidence_json") or "{}")
    except ValueError:
        evidence = {}
    rows = _chain_rows(evidence)
    world = max(stuck + missing + [r for x in rows for r in parse_ranks(str(x.get("ranks", "")))], default=-1) + 1
    sizes = layout_sizes(layout, world) if layout else None
    hosts = [h for h in str(row.get("suspect_hosts") or "").split(",") if h]
    on = f" on {_listed(hosts, 3)}" if hosts else ""
    for_ = duration(row.get("duration_s"))
    op, group, seq = row.get("op") or "", row.get("group") or "", row.get("seq")
    numbered = isinstance(seq, int) and seq >= 0
    coll = (f"{op} #{seq} of group {group}" if numbered else f"{op} of group {group}") if group else (op or "an op")
    named = _states(evidence, missing or stuck)
    if kind == "hang_ended":
        from analyzers.hang import ended_sentence

        sentence = ended_sentence(dict(row)).capitalize() + "."
        if missing:
            sentence += f" It waited for {_ranks_named(missing, sizes)}{on}."
        return Explanation(kind, title(kind), sentence)
    if kind == "comm_hang" and missing:
        last = _last_op(missing, rows)
        n_c = "it is the culprit" if len(missing) == 1 else "they are the culprits"
        inside = _waiting_in(group, seq, rows) if rows else len(stuck)
        if inside >= len(stuck):
            sentence = (f"{_plural(len(stuck), 'rank')} have waited in {coll} for {for_}; "
                        f"{_ranks_named(missing, sizes)}{on} never entered it: {n_c}.")
        else:  # a chain: most ranks wait in other collectives, on ranks that wait on the ones named here
            sentence = (f"{_plural(len(stuck), 'rank')} wait in collectives, with no progress for {for_}. Their "
                        f"chain of waits ends at {coll} ({_plural(inside, 'rank')} in it), which "
                        f"{_ranks_named(missing, sizes)}{on} never entered: {n_c}.")
        if last and last != "(none)":
            sentence += f" Last seen in {last}."
        sentence += named
    elif kind == "comm_hang":
        sentence = (f"Every member entered {coll} and none has left it for {for_}: the collective itself is "
                    "stuck (a link or NIC of the group, or the library).")
    elif kind == "node_loss" and op not in ("", "host silent"):
        kind = "process_loss"
        sentence = (f"{_ranks_named(missing, sizes)}{on} {'has' if len(missing) == 1 else 'have'} been gone for "
                    f"{for_} ({op}) while {_plural(len(stuck), 'rank')} of the job still report: its process is "
                    f"lost, not its host.{named} The others cannot go on without "
                    f"{'it' if len(missing) == 1 else 'them'}." + _recovery_words(row))
    elif kind == "node_loss":
        sentence = (f"{_ranks_named(missing, sizes)}{on} stopped sending heartbeats {for_} ago: "
                    f"{'its host is' if len(hosts) == 1 else 'their hosts are'} lost. "
                    f"The other {_plural(len(stuck), 'rank')} cannot go on without "
                    f"{'it' if len(missing) == 1 else 'them'}." + _recovery_words(row))
    elif kind == "noncomm_hang" and missing:
        sentence = (f"No rank is inside a collective and none has made progress for {for_}; "
                    f"{_ranks_named(missing, sizes)}{on} {'is' if len(missing) == 1 else 'are'} gone while "
                    f"the others wait: {'it is the culprit' if len(missing) == 1 else 'they are the culprits'}."
                    f"{named}")
    elif kind == "noncomm_hang" and op:
        sentence = (f"No rank is inside a collective and none has made progress for {for_}; "
                    f"{_ranks_named(stuck, sizes)}{on} {'has' if len(stuck) == 1 else 'have'} been in {op} "
                    f"the longest: the suspect{'s' if len(stuck) > 1 else ''} (compute, data loading or I/O).{named}")
    elif kind == "noncomm_hang":
        sentence = (f"No rank is inside a collective or reports an op in flight, and none has made progress for "
                    f"{for_}: the whole job is suspect.")
    else:
        sentence = f"{coll}: stuck {row.get('stuck_ranks') or '–'}, missing {row.get('missing_ranks') or '–'}."
    def doing(r: dict) -> str:
        num = f" #{r.get('seq')}" if isinstance(r.get("seq"), int) and r["seq"] >= 0 else ""
        where_ = f"{r.get('op')}{num} ({r.get('group')})" if r.get("group") else (r.get("op") or "(none)")
        state = f"{r['state']}, " if r.get("state") else ""
        if set(parse_ranks(str(r.get("ranks", "")))) <= set(missing) and kind in ("comm_hang", "node_loss",
                                                                                    "process_loss", "noncomm_hang"):
            return f"{state}last seen in {where_}"  # a culprit's own row is where it was before it went missing
        return state + (f"waits in {where_}" if r.get("group") else f"in {where_}")

    table = tuple((r.get("ranks", ""), doing(r), r.get("waits_for") or "–") for r in rows[:8])
    return Explanation(kind, title(kind), sentence, ("ranks", "doing", "waiting for"), table)


# -- for the pager ----------------------------------------------------------------------------------
# One line each, the alert's summary (the alert table, the alert topic, the webhook): ``ray_jobs.alerts``
# decides when an alert fires and how severe it is; what it says is worded here, with everything else.

def slowdown_alert(row: Mapping) -> str:
    """A straggling window: 'job: straggling S=1.42 (slow worker; its GPU: ...), 30% of 64 GPUs wasted ...'."""
    why = f" ({title(row['verdict']).lower()})" if row["verdict"] else ""
    hw = next((v["hardware"]["sentence"] for v in verdicts_of(row) if v.get("hardware")), "")
    if hw:  # what the slow worker's GPU says against its peers' (NVML)
        why = f" ({title(row['verdict']).lower()}; its GPU: {hw})"
    return (f"{row['job_id']}: straggling S={row['slowdown']:.2f}{why}, {row['waste_fraction']:.0%} of "
            f"{row['n_gpus']} GPUs wasted in window {row['window_id']}")


def fidelity_alert(row: Mapping) -> str:
    return (f"{row['job_id']}: simulation fidelity off, launch slowdown {row['launch_slowdown']:.3f} in window "
            f"{row['window_id']}")


def analysis_failed_alert(row: Mapping) -> str:
    return f"{row['job_id']}: window {row['window_id']} could not be analysed: {row['note'][:200]}"


def link_alert(top: Mapping, findings: int, found_before: bool) -> str:
    """The most confident link finding of a window: 'job: slow: NIC egress of rank 3, in group world (4.0x,
    confidence 0.95, found in the window before too); 2 finding(s)'."""
    where = link_element(top["kind"], top["src"], top["dst"])
    return (f"{top['job_id']}: slow: {where}, in group {top['group']} ({top['slowdown']:.1f}x, confidence "
            f"{top['confidence']:.2f}{', found in the window before too' if found_before else ''}); "
            f"{findings} finding(s)")


def lemon_alert(score: Any, label: str = "") -> str:
    """A lemon host (``analyzers.lemons.HostScore``): how many jobs implicated it against how many were expected
    for its GPU-hours, and the latest finding."""
    last = score.evidence[-1]
    jobs = sorted({e["job_id"] for e in score.evidence})
    where = f" ({label})" if label else ""
    return (f"host {score.host}{where} is a lemon: {score.jobs} jobs implicated it ({score.incidents} findings) "
            f"where {score.expected_jobs:.2f} were expected for its {score.gpu_hours:.1f} GPU-hours; jobs "
            f"{', '.join(jobs[:5])}{' and more' if len(jobs) > 5 else ''}; latest: {last['what']}")


# -- for a terminal -------------------------------------------------------------------------------

def _wrapped(label: str, e: Explanation, indent: str, width: int, max_rows: int) -> list[str]:
    import textwrap

    first, *table = e.lines(max_rows=max_rows, indent=indent + "    ")
    # A figure and its unit, or a name and its value, stay on one line: no-break spaces while wrapping.
    first = re.sub(r"(\d) (ms|s|min|h|days)\b", "\\1\u00a0\\2", first).replace(" = ", "\u00a0=\u00a0")
    text = textwrap.fill(first, width=width, initial_indent=f"{indent}{label}", subsequent_indent=indent + "    ",
                         break_on_hyphens=False)
    return text.replace("\u00a0", " ").splitlines() + table


def window_lines(row: Mapping, most: int = 3, indent: str = "  ", width: int = 110) -> list[str]:
    """A WINDOW row's verdicts for a terminal (the trace summary): each wrapped at ``width``, with its table."""
    return [line for e in explain_window(row)[:most] for line in _wrapped("verdict  ", e, indent, width, 3)]


def hang_lines(row: Mapping, layout: Mapping | None = None, indent: str = "", width: int = 110) -> list[str]:
    """A HANG row for a terminal: its sentence wrapped at ``width``, then the wait chain's first rows."""
    return _wrapped("hang     ", explain_hang(row, layout), indent, width, 4)
