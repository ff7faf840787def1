"""The remedies of one stored window, ranked by simulated gain, stored back (`stragglerscope advise`, the console).

The store is passed in: anything with the ``Store`` API's ``run_named`` and
``insert`` (``storage.open_store`` gives one); the console and the command
line share it. It is the only place that hands stored rows to
``analyzers.remedies`` and stores what comes back. Reads the
job's registration, the window's kept raw op spans and its link
faults from the store, runs ``analyzers.remedies.advise`` (which re-simulates
the window with each fix applied), prints the remedies and stores them as
REMEDY rows (one batch per run, stamped ``advised_ns``; readers show the
latest batch of a window), so the console's job page shows them too.

What the trace cannot tell (layers of the model, GPUs per node, spare hosts,
nodes still alive) comes from the registration where it has it and from
options otherwise; a remedy that needs a missing fact is left out.
"""
from __future__ import annotations

import dataclasses
import time

from actions.stored_window import WindowUnavailable, kept_windows, registration, stored_window


class AdviseError(ValueError):
    """The store lacks what advice needs (job, analysed window, kept op spans)."""


@dataclasses.dataclass(frozen=True)
class AdviseOptions:
    window_id: int | None = None
    attempt: int = -1
    num_layers: int | None = None
    gpus_per_node: int = 8
    spare_hosts: tuple[str, ...] = ()
    nodes_alive: int | None = None
    fault_tolerance: int = 1
    min_gain: float = 0.01


def advise_stored(store, job_id: str, opts: AdviseOptions = AdviseOptions()) -> tuple[tuple[str, int, int], list]:
    """((job, attempt, window), remedies) of one stored window; raises AdviseError when it cannot."""
    from analyzers.remedies import JobFacts, advise

    try:
        reg = registration(store, job_id, opts.attempt)
    except WindowUnavailable as e:
        raise AdviseError(str(e)) from None
    attempt = int(reg["attempt"])
    windows = store.run_named("job_windows", {"job_id": job_id}).to_pylist()
    analysed = {int(w["window_id"]) for w in windows if int(w["attempt"]) == attempt}
    if not analysed:
        raise AdviseError(f"job {job_id!r} attempt {attempt} has no analysed window")
    window_id = opts.window_id
    if window_id is None:
        # The latest analysed window that kept its raw spans (the pipeline keeps some: pipeline.keep_op_spans_*).
        kept = [k for k in kept_windows(store, job_id, attempt) if k in analysed]
        window_id = max(kept) if kept else max(analysed)
    elif int(window_id) not in analysed:
        known = ", ".join(str(w) for w in sorted(analysed)[:20])
        raise AdviseError(f"job {job_id!r} has no window {window_id} (windows: {known})")
    try:
        win = stored_window(store, job_id, attempt, int(window_id), reg=reg)
    except WindowUnavailable as e:
        raise AdviseError(str(e)) from None
    window_id = win.window_id
    links = store.run_named("job_links", {"job_id": job_id, "window_id": window_id}).to_pylist()
    links = [f for f in links if int(f["attempt"]) == attempt]
    num_layers = opts.num_layers or int(reg.get("num_layers") or 0) or None
    facts = JobFacts(layout=win.layout, num_layers=num_layers, gpus_per_node=opts.gpus_per_node,
                     spare_hosts=tuple(opts.spare_hosts), nodes_alive=opts.nodes_alive,
                     fault_tolerance=opts.fault_tolerance)
    remedies = advise(win.ops, facts, None, links, min_gain=opts.min_gain)
    return (job_id, attempt, window_id), remedies


def advise_and_store(store, job_id: str, opts: AdviseOptions = AdviseOptions(),
                     keep: bool = True) -> tuple[tuple[str, int, int], list]:
    """``advise_stored``, then (with ``keep``) store the remedies as one batch for the console."""
    from analyzers.remedies import to_tables

    key, remedies = advise_stored(store, job_id, opts)
    if keep and remedies:
        store.insert("remedy", to_tables(remedies, key, time.time_ns())["remedy"])
    return key, remedies


def format_remedies(key: tuple[str, int, int], remedies) -> str:
    job, attempt, window = key
    if not remedies:
        return f"{job} attempt {attempt} window {window}: no remedy with a gain worth acting on."
    lines = [f"{job} attempt {attempt} window {window}: {len(remedies)} remedies, best first", ""]
    for r in remedies:
        gain = "n/a" if r.predicted_gain != r.predicted_gain else (
            "restores progress" if r.predicted_gain == float("inf") else f"+{100 * r.predicted_gain:.1f}%")
        lines.append(f"{r.priority}. [{r.kind}] {gain} step time ({r.step_time_before_s:.3f} s -> "
                     f"{r.step_time_after_s:.3f} s), for {r.verdict}")
        lines.append(f"   {r.action}")
    return "\n".join(lines)
