"""`stragglerscope replay PATH...`: backfill historical traces through the live path.

Each PATH is a golden-format trace folder (``trace-*.parquet`` with its
``meta-*.yaml``), a golden trace parquet whose meta YAML lies beside it, or an
op-span parquet (``core.schema.OP_SPAN``, as ``stragglerscope import --out``
writes). Every trace is registered (its layout from the meta file, or from
the ranks it contains) and published to Kafka by the same producer the
exporters use, then the pipeline analyses and stores it like live data; the
command returns when every replayed window is stored. Progress bars show
publishing and analysis. With ``--publish-only`` it only publishes to the
configured Kafka, for a pipeline that runs already (``publish_replay``).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core import codec
from core import schema as S
from core.config import Config
from core.layout import JobLayout


class ReplayError(ValueError):
    """A path that cannot be replayed; the message says why."""


def _find_meta(trace: Path) -> Path | None:
    tag = trace.stem.removeprefix("trace-")
    for cand in (trace.with_name(f"meta-{tag}.yaml"), *sorted(trace.parent.glob("meta-*.yaml"))):
        if cand.exists():
            return cand
    return None


def load_trace(path: str) -> tuple[pa.Table, JobLayout]:
    """Op spans and layout of one PATH (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    if p.is_dir():
        traces = sorted(p.glob("trace-*.parquet"))
        if len(traces) != 1:
            raise ReplayError(f"{path}: expected one trace-*.parquet in the folder, found {len(traces)}")
        p = traces[0]
    try:
        schema = pq.read_schema(p)
    except Exception as e:
        raise ReplayError(f"{p}: not a parquet file: {e}") from None
    if "start_ts" in schema.names:  # golden format
        meta = _find_meta(p)
        if meta is None:
            raise ReplayError(f"{p}: golden trace without a meta-*.yaml beside it")
        from core.golden import load_golden

        return load_golden(str(p), str(meta))
    try:
        table = codec.conform(pq.read_table(p), S.OP_SPAN)
    except codec.DecodeError as e:
        raise ReplayError(f"{p}: neither a golden trace nor op spans: {e}") from None
    dp = int(pc.max(table["dp_rank"]).as_py()) + 1
    pp = int(pc.max(table["pp_rank"]).as_py()) + 1
    return table, JobLayout(dp_size=dp, pp_size=pp)


def registrations(table: pa.Table, layout: JobLayout) -> list[pa.Table]:
    """One registration per (job, attempt) of the table, from its layout and window length."""
    rows = []
    keys = table.group_by(["job_id", "attempt"]).aggregate([("step", "count_distinct"), ("start_ns", "min"),
                                                           ("window_id", "count_distinct")])
    for r in keys.to_pylist():
        n_windows = max(1, r["window_id_count_distinct"])
        rows.append(dict(
            job_id=r["job_id"], attempt=r["attempt"], ts_ns=r["start_ns_min"], team="replay", model="",
            n_gpus=layout.world_size, dp_size=layout.dp_size, pp_size=layout.pp_size, tp_size=layout.tp_size,
            cp_size=layout.cp_size, vpp_size=layout.vpp_size, num_microbatches=0,
            profiled_steps=max(1, r["step_count_distinct"] // n_windows), gpu_type="", peak_flops=0.0,
            flops_per_token=0.0, tokens_per_step=0))
    return [codec.from_rows(S.JOB, rows)]


def _window_keys(loaded) -> set:
    keys = set()
    for _, table, _ in loaded:
        k = table.group_by(["job_id", "attempt", "window_id"]).aggregate([])
        keys.update(zip(k["job_id"].to_pylist(), k["attempt"].to_pylist(), k["window_id"].to_pylist()))
    return keys


def _publish(conn, loaded) -> bool:
    """Registrations and op spans of every loaded trace through the exporters' producer; whether all went."""
    from tqdm import tqdm

    from ingest.producer import TelemetryProducer
    from stragglerscope.service import say

    with TelemetryProducer(conn, client_id="stragglerscope-replay") as prod:
        for path, table, layout in tqdm(loaded, desc="publish", unit="trace", file=sys.stderr, disable=None):
            for reg in registrations(table, layout):
                prod.send(reg)
            prod.send(table)
        if not prod.flush(300) or prod.stats.records_dropped:
            say(f"error: the broker did not take every record ({prod.stats.records_dropped} dropped)")
            return False
    return True


def publish_replay(cfg: Config, paths: list[str], wait_s: float | None = None) -> int:
    """`replay --publish-only`: the traces to the configured Kafka for a pipeline that runs already (`run`).

    Starts no driver: a second driver would take the running shards over. With ``wait_s``, waits until the
    store (``store.url``, the one the running pipeline writes) holds every window.
    """
    from core.kafka_admin import check_reachable, prepare_topics
    from stragglerscope.service import say

    if not cfg.kafka.bootstrap:
        raise ReplayError("--publish-only needs the running pipeline's Kafka: set kafka.bootstrap (--config)")
    loaded = [(p, *load_trace(p)) for p in paths]  # fail on bad input before publishing anything
    keys = _window_keys(loaded)
    check_reachable(cfg.kafka.bootstrap)
    prepare_topics(cfg.kafka.conn(), cfg.kafka.partitions, cfg.kafka.replication_factor, outputs=False,
                   min_insync_replicas=cfg.kafka.min_insync_replicas)
    if not _publish(cfg.kafka.conn(), loaded):
        return 1
    say(f"published  {len(loaded)} traces, {len(keys)} windows, {sum(t.num_rows for _, t, _ in loaded):,} op "
        f"records to {cfg.kafka.conn().describe()}")
    if wait_s is None:
        return 0
    from storage import open_store

    pending = wait_windows(lambda: open_store(cfg.store.url), keys, wait_s)
    if pending:
        say(f"error: {len(pending)} of {len(keys)} windows not stored within {wait_s:.0f} s (is `stragglerscope run` "
            "reading this Kafka and writing this store?)")
        return 1
    say(f"stored     {len(keys)} windows")
    return 0


def wait_windows(open_store, keys, wait_s: float, sleep=None, monotonic=None, poll_s: float = 1.0) -> set:
    """Wait up to ``wait_s`` until the store ``open_store()`` opens holds every window of ``keys``; returns the
    keys still missing. A store that cannot be opened or does not answer (a server restarted, a network
    outage) is waited for, said once when it goes and once when it comes back, until the time is up."""
    import time

    from stragglerscope.service import say

    sleep = sleep or time.sleep
    monotonic = monotonic or time.monotonic
    deadline = monotonic() + wait_s
    pending, store, down = set(keys), None, ""
    try:
        while pending:
            try:
                if store is None:
                    store = open_store()
                pending = {k for k in pending if not store.window_stored(k)}
                if down:
                    say(f"waiting    the store answers again; {len(pending)} of {len(keys)} windows to come")
                down = ""
            except Exception as e:  # the store's own errors and its driver's (ClickHouse's NetException ...)
                from storage.errors import missing_table

                why = f"{type(e).__name__}: {_first_line(e)}"
                if not down and missing_table(e) is not None:
                    say("waiting    the store has no tables yet: waiting for `stragglerscope run` to create them "
                        "(or is store.url another store?)")
                elif not down:
                    say(f"waiting    the store does not answer ({why}): waiting for it until the timeout")
                down = why
                if store is not None:
                    _close_quietly(store)
                    store = None
            if not pending or monotonic() >= deadline:
                break
            sleep(poll_s)
    finally:
        if store is not None:
            _close_quietly(store)
    return pending


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:200]


def _close_quietly(store) -> None:
    try:
        store.close()
    except Exception:
        pass


def run_replay(cfg: Config, paths: list[str], timeout_s: float = 1800.0) -> int:
    from stragglerscope.service import say, sigterm_as_interrupt, start_services, wait_stored

    loaded = [(p, *load_trace(p)) for p in paths]  # fail on bad input before starting anything
    keys = _window_keys(loaded)
    sigterm_as_interrupt()
    try:
        with contextlib.ExitStack() as stack:
            svc = start_services(cfg, stack)
            if not _publish(svc.cfg.kafka.conn(), loaded):
                return 1
            say(f"replayed   {len(loaded)} traces, {len(keys)} windows, "
                f"{sum(t.num_rows for _, t, _ in loaded):,} op records")
            pending = wait_stored(svc, keys, timeout_s)
            if pending:
                say(f"error: {len(pending)} of {len(keys)} windows not stored within {timeout_s:.0f} s")
                return 1
            say(f"stored     {len(keys)} windows")
            return 0
    except KeyboardInterrupt:
        say("stopped")
        return 130
