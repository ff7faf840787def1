"""Bring the pipeline's services up in order and down in reverse: broker, store, Ray, shards.

``start_services`` is shared by `stragglerscope run` (long-running, against
configured services) and `stragglerscope demo` (embedded defaults). What the
configuration leaves empty is started locally on 127.0.0.1: the Tansu broker
when ``kafka.bootstrap`` is empty, the store daemon when ``store.url`` is a
chDB path (several processes must share it), a local Ray when
``ray.address`` is empty.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time

from core.config import Config


def say(msg: str) -> None:
    """One progress line on stderr, passwords redacted (``core.redact``)."""
    from core.redact import redact

    print(redact(msg), file=sys.stderr, flush=True)


@dataclasses.dataclass
class Services:
    cfg: Config          # with the addresses actually in use
    source_id: str       # names the Kafka cluster in stored offsets
    store: object        # storage.Store, open on store_url
    pipeline: object     # ray_jobs.pipeline.Pipeline, started
    generations: object = None  # services.topic_generations.TopicGenerations, where input topics roll over


def start_services(cfg: Config, stack: contextlib.ExitStack) -> Services:
    from core.config import EMBEDDED_TOPIC_GENERATION_S
    from core.kafka_admin import check_reachable
    from ray_jobs.pipeline import check_topics
    from services.broker import LocalBroker

    bootstrap = cfg.kafka.bootstrap
    generation_s = max(0.0, cfg.kafka.topic_generation_s)
    if not bootstrap:
        broker = stack.enter_context(LocalBroker())
        bootstrap = broker.bootstrap
        source_id = cfg.kafka.source_id or broker.cluster_id
        say(f"broker     Tansu on {bootstrap}")
        if cfg.kafka.topic_generation_s < 0:  # automatic: its memory is bounded only by deleting topics
            generation_s = EMBEDDED_TOPIC_GENERATION_S
    else:
        check_reachable(bootstrap)
        source_id = cfg.kafka.source_id or bootstrap
        say(f"broker     {cfg.kafka.conn().describe()}")
    kafka = {"bootstrap": bootstrap, "topic_generation_s": generation_s}
    # Topics first: a wrong partition count is an error before anything else starts.
    partitions = check_topics(cfg.replace(kafka=kafka))
    say(f"topics     {partitions} partitions per input topic"
        + (f", a new generation every {generation_s:g} s (read ones are deleted)" if generation_s else ""))

    from ray_jobs.pipeline import Pipeline
    from services.store_daemon import StoreDaemon
    from storage import open_store

    store_url = cfg.store.url
    if store_url.startswith("chdb://"):
        daemon = stack.enter_context(StoreDaemon(store_url, sql_limits=cfg.sql))
        say(f"store      {store_url} (served to the pipeline and console at {daemon.url})")
        store_url = daemon.url
    else:
        say(f"store      {store_url}")
    store = open_store(store_url)
    store.setup()
    stack.callback(store.close)

    run_cfg = cfg.replace(kafka=kafka, store={"url": store_url})
    keeper = None
    if generation_s:
        from ray_jobs.pipeline import stored_offsets
        from services.topic_generations import TopicGenerations

        keeper = TopicGenerations(run_cfg.kafka.conn(), partitions,
                                  lambda: stored_offsets(open_store, store_url, source_id),
                                  replication_factor=cfg.kafka.replication_factor).start()
        stack.callback(keeper.stop)
    import ray

    stack.callback(lambda: ray.shutdown() if ray.is_initialized() else None)
    pipeline = stack.enter_context(Pipeline(run_cfg, source_id, open_store))
    pipeline.wait_ready(cfg.pipeline.ready_timeout_s)
    where = cfg.ray.address or "a local Ray (127.0.0.1)"
    if pipeline.detached:
        say(f"ray        {len(pipeline.actors)} detached shard actors on {where} ({pipeline.adopted} adopted, "
            f"{len(pipeline.actors) - pipeline.adopted} started; they outlive this driver)")
    else:
        say(f"ray        {len(pipeline.actors)} shard actors on {where}")
    say(f"analysis   up to {pipeline.max_inflight} in flight per shard")
    sigterm_as_interrupt()
    if cfg.pipeline.metrics_port >= 0:
        port = pipeline.serve_metrics(cfg.pipeline.metrics_port)
        say(f"metrics    http://127.0.0.1:{port}/metrics")
    return Services(run_cfg, source_id, store, pipeline, keeper)


def wait_stored(svc: Services, keys, timeout_s: float) -> set:
    """Wait until every window key is stored, with a progress bar; returns the keys still missing."""
    from tqdm import tqdm

    keys = list(keys)
    pending = set(keys)
    bar = tqdm(total=len(keys), desc="analyse", unit="window", file=sys.stderr, disable=None)

    def done(_status) -> bool:
        pending.difference_update([k for k in list(pending) if svc.store.window_stored(k)])
        bar.update(len(keys) - len(pending) - bar.n)
        return not pending

    svc.pipeline.wait(done, timeout_s=timeout_s)
    bar.close()
    return pending


def sigterm_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so every started process is stopped in order.

    Called again once Ray is up: Ray's core worker installs its own fatal-signal
    handler for SIGTERM, which would end the process before anything is stopped.
    """
    def handler(*_):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


HEALTH_EVERY_S = 5.0
"""How often `run` checks its shards: a dead one ends the run (exit 2) within this."""
STATUS_EVERY_S = 30.0


def run_service(cfg: Config) -> int:
    """`stragglerscope run`: the pipeline until Ctrl-C, with a status line every 30 s.

    Ends with PipelineError (exit 2) when a shard is dead for good, and with
    exit 0 when a driver started later has taken the detached shards over.
    """
    from ray_jobs.pipeline import Superseded

    sigterm_as_interrupt()
    try:
        with contextlib.ExitStack() as stack:
            svc = start_services(cfg, stack)
            say("running; Ctrl-C stops")
            last = time.monotonic()
            while True:
                time.sleep(HEALTH_EVERY_S)
                try:
                    st = svc.pipeline.check_health()
                except Superseded as e:
                    svc.pipeline.actors = []  # theirs now: leave them running
                    say(f"stopped    a driver started later owns the shards ({e}); they keep running")
                    return 0
                if time.monotonic() - last >= STATUS_EVERY_S:
                    last = time.monotonic()
                    say("status     " + "  ".join(
                        f"shard {s.get('shard')}: windows={s.get('windows_stored', '?')} "
                        f"lag={s.get('lag', '?') if s.get('loops') else '?'}"
                        f"{' ERROR ' + s['error'] if s.get('error') else ''}" for s in st))
    except KeyboardInterrupt:
        say("stopped")
        return 0
