"""Accuracy and speed of the hang detector and the link diagnosis against generated ground truth.

    .venv/bin/python benchmarks/diagnosis_accuracy.py [--per-kind 200] [--max-ranks 8192]
    .venv/bin/python benchmarks/diagnosis_accuracy.py --real-runs 10 [--real-jobs pipe,hier] [--skip-generated]
        [--classes noncomm_slow,none] [--cpu-hogs 1] [--keep DIR]

For every fault kind, ``--per-kind`` incidents over job sizes from 8 to
``--max-ranks`` (powers of two, round-robin), plus as many healthy ones.
A prediction is right when the top finding has the injected kind and names
the injected rank(s): the link's (src, dst), the source's src, the
destination's dst, the late sender; for hangs the missing ranks (comm hang,
node loss) or the stuck rank (non-comm hang). Precision and recall per kind
are printed as a table; the target is 0.95 for both. Then the time to
diagnose the link matrix of one 8,192-rank group (median of 5; target <= 1 s), and
to diagnose a 16,384-rank dp x pp window from enter/exit times alone.

``--real-runs N``: also N real gloo training runs per class and job, each
rank in its own network namespace with one fault shaped by ``tc``
(tests/netfaults/scenarios.py: a slow link, NIC or receiver, a late sender,
healthy; severe and mild alternate), analysed by a real broker and
``stragglerscope run``. Needs root and ``ip netns``; about 25 s a run.
Each run is scored twice: on its top finding at any confidence, and on the
top finding the trace summary prints (``[alerts] link_shown_confidence``, 0.5; below
it a finding is a hint the console lists with the window's matrix).
Printed per job: precision and recall per finding kind, and the median time
from the fault's start to the stored verdict. ``--keep DIR`` saves each
run's CCL records and TCP counters as the exporters sent them (read back from
the broker) to ``DIR/<run>_{ccl_record,tcp_flow}.arrow``, a wrong run's name
ending in ``-WRONG``: a miss can be replayed window by window
(``analyzers.links.diagnose_window``) and kept as a test's data.

Both parts end with a reliability table of the link findings: the top
finding's stated confidence, in bins, against how often a finding in that bin
was right (observed precision). The thresholds at which a finding is printed
and paged (``[alerts] link_shown_confidence``, ``link_alert_confidence``) are
read off it (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzers.hang import HangParams, HangTracker  # noqa: E402
from analyzers.links import diagnose  # noqa: E402
from generators.faultgen import HANG_KINDS, LINK_KINDS, hang_incident, link_incident, pipeline_window  # noqa: E402


def sizes(max_ranks: int) -> list[int]:
    out, n = [], 8
    while n <= max_ranks:
        out.append(n)
        n *= 2
    return out


BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-9)
"""Edges of the confidence bins of the reliability table (the last bin holds 0.9 to 1.0)."""


def reliability(stated: list[tuple[float, bool]], title: str) -> None:
    """Stated confidence against observed precision, by bin, and the precision of everything at or above
    each edge (what a threshold there would print or page)."""
    print(f"-- reliability of {title}: {len(stated)} findings")
    print(f"{'confidence':<12}{'findings':>9}{'stated (mean)':>15}{'right':>7}{'observed precision':>20}"
          f"{'at or above: findings':>23}{'precision':>11}")
    for lo, hi in zip(BINS, BINS[1:]):
        inside = [(c, ok) for c, ok in stated if lo <= c < hi]
        above = [ok for c, ok in stated if c >= lo]
        mean = statistics.mean(c for c, _ in inside) if inside else float("nan")
        right = sum(ok for _, ok in inside)
        prec = right / len(inside) if inside else float("nan")
        prec_above = sum(above) / len(above) if above else float("nan")
        print(f"{lo:.1f}-{min(hi, 1.0):.1f}{'':<5}{len(inside):>9}{mean:>15.2f}{right:>7}{prec:>20.3f}"
              f"{len(above):>23}{prec_above:>11.3f}")


def link_prediction(inc, stated: list | None = None) -> tuple[str, bool]:
    faults = diagnose(inc.ccl)
    if not faults:
        return "none", inc.kind == "none"
    f, t = faults[0], inc.truth
    right = f.kind == inc.kind and {
        "link": (f.src, f.dst) == (t["src"], t["dst"]), "source": f.src == t["src"],
        "destination": f.dst == t["dst"], "noncomm_slow": f.src == t["src"]}.get(f.kind, False)
    if stated is not None:
        stated.append((float(f.confidence), bool(right)))
    return f.kind, right


def hang_prediction(inc) -> tuple[str, bool]:
    tr = HangTracker("bench", params=HangParams(floor_s=60, k_steps=10, heartbeat_timeout_s=30))
    tr.add_ccl(inc.ccl)
    tr.add_heartbeats(inc.heartbeats)
    h = tr.evaluate(inc.now_ns, input_alive=True)
    if h is None:
        return "healthy", inc.kind == "healthy"
    t = inc.truth
    names = h.missing_ranks if h.kind in ("comm_hang", "node_loss") else h.stuck_ranks
    want = t["missing"] if inc.kind in ("comm_hang", "node_loss") else t["stuck"]
    return h.kind, h.kind == inc.kind and names == want


def score(kinds, make, predict, per_kind: int, ns: list[int]) -> None:
    tp, fp, fn = Counter(), Counter(), Counter()
    n_by_size = Counter()
    for kind in kinds:
        for i in range(per_kind):
            n = ns[i % len(ns)]
            if n < 8:
                continue
            inc = make(kind, n, i)
            n_by_size[n] += 1
            pred, right = predict(inc)
            if right:
                tp[kind] += 1
            else:
                fn[kind] += 1
                fp[pred] += 1
    print(f"{'kind':<14}{'incidents':>10}{'precision':>11}{'recall':>9}")
    for kind in kinds:
        p = tp[kind] / max(1, tp[kind] + fp[kind])
        r = tp[kind] / max(1, tp[kind] + fn[kind])
        print(f"{kind:<14}{tp[kind] + fn[kind]:>10}{p:>11.3f}{r:>9.3f}")
    print("sizes:", ", ".join(f"{n}x{c}" for n, c in sorted(n_by_size.items())))


def _cpu_hogs(n: int) -> list:
    """``n`` processes that spin on the CPU for as long as they live: a noisy neighbour on the host."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


class _RecordTap:
    """Reads the CCL topic(s) of a broker as records arrive, to save one run's records (``--keep``)."""

    KINDS = ("ccl_record", "tcp_flow")

    def __init__(self, bootstrap: str, directory: Path):
        from kafka import KafkaConsumer

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                       enable_auto_commit=False, group_id=None, metadata_max_age_ms=2000)
        self._consumer.subscribe(pattern=r"^ss\.ccl(\.g\d+)?$")  # with or without topic generations
        self._tables: dict[tuple[str, str], list] = {}

    def save(self, job_id: str, name: str, quiet_s: float = 3.0) -> None:
        """Drain what the broker holds (until ``quiet_s`` without a record), then write ``job_id``'s records."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from core.codec import decode

        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < quiet_s:
            polled = self._consumer.poll(timeout_ms=500)
            for msgs in polled.values():
                for m in msgs:
                    kind, table = decode(m.value)
                    if kind in self.KINDS:
                        for job in pc.unique(table["job_id"]).to_pylist():
                            self._tables.setdefault((job, kind), []).append(
                                table.filter(pc.equal(table["job_id"], job)))
                quiet_since = time.monotonic()
        opts = pa.ipc.IpcWriteOptions(compression="zstd")
        for kind in self.KINDS:
            parts = self._tables.pop((job_id, kind), [])
            if parts:
                t = pa.concat_tables(parts, promote_options="permissive").combine_chunks()
                with pa.ipc.new_file(str(self.directory / f"{name}_{kind}.arrow"), t.schema, options=opts) as w:
                    w.write_table(t)

    def close(self) -> None:
        self._consumer.close()


def real_runs(n: int, jobs: list[str], hogs: int = 0, classes: tuple[str, ...] = (),
              keep: Path | None = None) -> None:
    """N runs per class of each job with faults in a real network; precision, recall, time to verdict.

    ``hogs``: that many busy processes beside the job (a shared, noisy host: issue 38 saw a compute hiccup
    read as a slow all-reduce and a shared CPU as a slow link)."""
    import tempfile

    from services.broker import LocalBroker
    from tests.fleet import fleet_config, start_fleet, stop_fleet
    from tests.netfaults.fabric import netns_unavailable
    from tests.netfaults.scenarios import run, scenarios

    reason = netns_unavailable()
    if reason:
        print(f"real runs skipped: network namespaces refused ({reason})")
        return
    with tempfile.TemporaryDirectory() as d, LocalBroker() as broker:
        proc, store = start_fleet(fleet_config(Path(d), broker.bootstrap), Path(d) / "run.log")
        noisy = _cpu_hogs(hogs)
        tap = _RecordTap(broker.bootstrap, keep) if keep else None
        every: list[tuple[float, bool]] = []
        try:
            for job in jobs:
                tp, fp, fn, runs = Counter(), Counter(), Counter(), Counter()
                tp_s, fp_s = Counter(), Counter()  # scored on what the trace summary prints
                confident: dict[tuple, int] = {}
                stated: list[tuple[float, bool]] = []
                secs: dict[str, list[float]] = {}
                t0 = time.perf_counter()
                for i in range(n):
                    for scn in scenarios(job, ("severe", "mild")[i % 2]):
                        if classes and scn.cls not in classes:
                            continue
                        out = run(scn, Path(d) / "fleet.toml", store)
                        want, got = scn.expect[0], out.found[0]
                        runs[want] += 1
                        secs.setdefault(want, []).append(out.seconds_to_verdict)
                        if out.right:
                            tp[want] += 1
                        else:
                            fn[want] += 1
                            fp[got] += 1
                        if tap:
                            tap.save(out.job_id, out.job_id + ("" if out.right_shown else "-WRONG"))
                        if out.right_shown:
                            tp_s[want] += 1
                        else:
                            fp_s[out.shown[0]] += 1
                        conf = out.faults[0]["confidence"] if out.faults else 0.0
                        if out.faults:  # a healthy run's finding is a wrong one; no finding states nothing
                            stated.append((float(conf), bool(out.right)))
                        confident[(want, out.right)] = confident.get((want, out.right), 0) + (conf >= 0.9)
                        print(f"  {scn.name:<28} {scn.fault:<20} found {out.found} (confidence {conf:.2f}) "
                              f"{'ok' if out.right else 'WRONG'} {out.seconds_to_verdict:.1f} s; shown "
                              f"{out.shown} {'ok' if out.right_shown else 'WRONG'}", flush=True)
                sure = sum(confident.values())
                sure_right = sum(v for (_, ok), v in confident.items() if ok)
                print(f"== real runs, job {job} ({n} per class, {hogs} CPU hogs, {time.perf_counter() - t0:.0f} s); "
                      f"findings at confidence >= 0.9: {sure_right} of {sure} right")
                print(f"{'expected kind':<16}{'runs':>6}{'precision':>11}{'recall':>9}{'verdict s (median)':>20}"
                      f"{'shown: precision':>18}{'recall':>9}")
                for kind in runs:
                    p = tp[kind] / max(1, tp[kind] + fp[kind])
                    r = tp[kind] / max(1, runs[kind])
                    ps = tp_s[kind] / max(1, tp_s[kind] + fp_s[kind])
                    rs = tp_s[kind] / max(1, runs[kind])
                    print(f"{kind:<16}{runs[kind]:>6}{p:>11.3f}{r:>9.3f}{statistics.median(secs[kind]):>20.1f}"
                          f"{ps:>18.3f}{rs:>9.3f}")
                reliability(stated, f"the top finding of job {job}'s real runs")
                every.extend(stated)
            if len(jobs) > 1:
                reliability(every, "the top finding of every real run")
        finally:
            if tap:
                tap.close()
            for p in noisy:
                p.kill()
                p.wait()
            stop_fleet(proc, store)


def main() -> int:
    import signal

    # Stopped with SIGTERM (timeout, kill), the fleet, its broker and the CPU hogs are still stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-kind", type=int, default=200)
    ap.add_argument("--max-ranks", type=int, default=8192)
    ap.add_argument("--real-runs", type=int, default=0, help="real gloo runs per class and job (0: none)")
    ap.add_argument("--real-jobs", default="pipe,hier,flat,ring",
                    help="jobs of the real runs: pipe (dp2 x pp2), hier (dp 8, two-level), flat (dp 8, one ring "
                         "all-reduce), ring (a hand-written bidirectional ring of 8)")
    ap.add_argument("--cpu-hogs", type=int, default=0, help="busy processes beside the real runs (a noisy host)")
    ap.add_argument("--classes", default="",
                    help="comma-separated classes of the real runs to run: link, source, destination, noncomm_slow "
                         "(a late sender), none (healthy); default every one")
    ap.add_argument("--skip-generated", action="store_true", help="only the real runs")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="save each real run's CCL records and TCP counters to DIR (a miss's name ends -WRONG)")
    args = ap.parse_args()
    from tests.netfaults.scenarios import CLASSES

    unknown = [c for c in args.classes.split(",") if c and c not in CLASSES]
    if unknown:
        ap.error(f"--classes: unknown {', '.join(unknown)} (one of {', '.join(CLASSES)})")
    if args.real_runs:
        real_runs(args.real_runs, args.real_jobs.split(","), args.cpu_hogs,
                  tuple(c for c in args.classes.split(",") if c), args.keep)
    if args.skip_generated:
        return 0
    ns = sizes(args.max_ranks)
    t0 = time.perf_counter()
    print("== link diagnosis (C4D: link, source, destination, non-communication slow)")
    stated: list[tuple[float, bool]] = []
    score(LINK_KINDS, link_incident, lambda inc: link_prediction(inc, stated), args.per_kind, ns)
    reliability(stated, "the top link finding of generated incidents")
    print("== hang detection")
    score(HANG_KINDS, hang_incident, hang_prediction, args.per_kind, ns)
    print(f"(scored in {time.perf_counter() - t0:.0f} s)")

    inc = link_incident("link", 8192, 0)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        faults = diagnose(inc.ccl)
        times.append(time.perf_counter() - t)
    print(f"8,192-rank group, {inc.ccl.num_rows:,} CCL records: diagnosed in "
          f"{statistics.median(times):.3f} s median of 5 (target <= 1 s); top finding {faults[0].kind} "
          f"{faults[0].src}->{faults[0].dst}")
    ccl = pipeline_window(512, 32, slow_egress=33)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        faults = diagnose(ccl)
        times.append(time.perf_counter() - t)
    print(f"16,384-rank dp 512 x pp 32 window, {ccl.num_rows:,} CCL records with enter/exit only: diagnosed in "
          f"{statistics.median(times):.2f} s median of 3; top finding {faults[0].kind} {faults[0].src} "
          f"(injected: source 33)")
    inc = hang_incident("comm_hang", 8192, 0)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        tr = HangTracker("bench")
        tr.add_ccl(inc.ccl)
        tr.add_heartbeats(inc.heartbeats)
        tr.evaluate(inc.now_ns)
        times.append(time.perf_counter() - t)
    print(f"8,192-rank hang state built and evaluated in {statistics.median(times):.3f} s median of 5")
    return 0


if __name__ == "__main__":
    sys.exit(main())
