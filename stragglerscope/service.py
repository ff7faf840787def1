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
    from ray_jobs.broker_checks import check_topics
    from services.broker import LocalBroker

    bootstrap = cfg.kafka.bootstrap
    generation_s = max(0.0, cfg.kafka.topic_generation_s)
    if not bootstrap:
        broker = LocalBroker()
        stack.callback(broker.stop)  # before start(): a SIGTERM while it starts stops it too
        broker.start()
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
    pipeline = Pipeline(run_cfg, source_id, open_store)
    pipeline.check_broker()  # offsets that would skip records are said before anything else starts
    if pipeline.offset_resets:
        say(f"offsets    {len(pipeline.offset_resets)} partitions read from the start of their new logs: the broker "
            "lost the records of the old ones (kafka.on_lost_log = rewind; `sql --query \"SELECT * FROM "
            "offset_resets\"` lists them)")
    keeper = None
    if generation_s:
        from ray_jobs.broker_checks import stored_offsets
        from services.topic_generations import TopicGenerations

        keeper = TopicGenerations(run_cfg.kafka.conn(), partitions,
                                  lambda: stored_offsets(open_store, store_url, source_id),
                                  replication_factor=cfg.kafka.replication_factor).start()
        stack.callback(keeper.stop)
    from ray_jobs.ray_connect import init_ray

    stack.callback(_shutdown_ray)
    # Ray here rather than in Pipeline.start: no signal may cut ray.init short, nor may it keep SIGTERM
    # for itself (_ray_starting).
    with _ray_starting():
        init_ray(run_cfg)
    stack.enter_context(pipeline)
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
        serve_metrics(pipeline, cfg.pipeline.metrics_port, stack)
    return Services(run_cfg, source_id, store, pipeline, keeper)


METRICS_RETRY_S = 2.0


def serve_metrics(pipeline, port: int, stack: contextlib.ExitStack) -> None:
    """The shards' metrics on 127.0.0.1:port. A fixed port still held by another process (in a rolling update,
    the driver this one takes over from, which steps down within seconds) is taken once it is free: the
    metrics wait, the pipeline does not, and nothing the driver adopted is given up for it."""
    import errno
    import threading

    try:
        port = pipeline.serve_metrics(port)
        say(f"metrics    http://127.0.0.1:{port}/metrics")
        return
    except OSError as e:
        if e.errno != errno.EADDRINUSE or port == 0:
            raise
    say(f"metrics    port {port} is in use (the driver this one takes over from, or another program): served "
        "as soon as it is free")
    stop = threading.Event()
    stack.callback(stop.set)

    def retry():
        while not stop.wait(METRICS_RETRY_S):
            try:
                pipeline.serve_metrics(port)
            except OSError:
                continue
            say(f"metrics    http://127.0.0.1:{port}/metrics")
            return
    threading.Thread(target=retry, name="metrics-port", daemon=True).start()


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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C raises KeyboardInterrupt: every ``except KeyboardInterrupt`` stops on both.

    A subclass, so that a command whose exit code says which signal stopped it (`trace`) can tell them apart.
    """


_stopping = False
"""A SIGTERM has started the stop: from then on SIGTERM is ignored. Each step of a stop is bounded (a child
that ignores SIGTERM is killed after a grace period), so a second SIGTERM waits for it rather than cutting a
step short and leaving a process behind; ignored, not handled, because Python gives handled signals their
default action back while it exits, and the process would end with -15 after a clean stop."""


def sigterm_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so every started process is stopped in order.

    Kubernetes, systemd, ``timeout`` and ``kill`` send SIGTERM: without this, its default action ends the
    process at once and the children that run in their own sessions (broker, store daemon, console) are
    left behind. Installed again after Ray starts and stops, which replace it (``_ray_starting``).
    """
    def handler(*_):
        stopping()
        raise Terminated()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if _stopping else handler)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stopping() -> None:
    """The stop has begun: later SIGTERMs are ignored (also for `trace`, which passes the first one on).

    A process started from here on would inherit the ignoring; a stop starts none.
    """
    global _stopping
    _stopping = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def _ray_starting():
    """Around ``ray.init``: Ctrl-C and SIGTERM wait until it returns, then stop everything as at any other time.

    Cut short, ``ray.init`` leaves processes that nothing stops (the raylet's agents, orphaned while they
    start) and has ended the process with a segfault at exit. Nor may it take SIGTERM over, which it does
    twice: it puts a handler raising SystemExit(15) in place of ours, and its core worker installs a
    fatal-signal handler for SIGTERM (a stack dump, then the handler before it) that ``ray.shutdown`` later
    replaces with SIGTERM's default action, so that a second SIGTERM in the middle of our stop would end
    the process there. Both are Ray internals, switched off for this process only (the shard actors, in
    their own processes, keep Ray's crash dumps); where a Ray version lacks them, the SystemExit still
    becomes our stop and ``_shutdown_ray`` puts our handler back. A second Ctrl-C does not wait.
    """
    import ray._private.ray_constants as ray_constants
    import ray._private.utils as ray_utils

    held: list[int] = []

    def hold(signum, _frame):
        if signum == signal.SIGINT and signal.SIGINT in held:
            raise KeyboardInterrupt()
        held.append(signum)

    ray_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if ray_handler is not None:
        ray_utils.set_sigterm_handler = lambda _handler: None
    fatal_off = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    if fatal_off is not None:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True  # read when the driver's core worker starts
    signal.signal(signal.SIGTERM, hold)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, hold)
    try:
        yield
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        held.append(signal.SIGTERM)
    finally:
        if ray_handler is not None:
            ray_utils.set_sigterm_handler = ray_handler
        if fatal_off is not None:
            ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = fatal_off
        sigterm_as_interrupt()
    if signal.SIGTERM in held:
        stopping()
        raise Terminated()
    if held:
        raise KeyboardInterrupt()


def _shutdown_ray() -> None:
    """``ray.shutdown``, whether or not Ray says it is initialized (a ray.init that failed half-way has
    started processes), then our SIGTERM handler again in case Ray's core worker replaced it."""
    import ray

    try:
        ray.shutdown()
    finally:
        sigterm_as_interrupt()


HEALTH_EVERY_S = 5.0
"""How often `run` checks its shards: a dead one ends the run (exit 2) within this."""
STATUS_EVERY_S = 30.0


def run_service(cfg: Config) -> int:
    """`stragglerscope run`: the pipeline until Ctrl-C, with a status line every 30 s.

    Ends with PipelineError (exit 2) when a shard is dead for good, and with
    exit 0 when a driver started later has taken the detached shards over.
    """
    from core.logs import NativeStderr
    from ray_jobs.ownership import Superseded

    sigterm_as_interrupt()
    try:
        with contextlib.ExitStack() as stack:
            # Ray's native lines (retries, forwarded raylet messages, state dumps after a node loss) to a file:
            # the driver's output is its own status lines.
            native = stack.enter_context(NativeStderr(driver_log_path(cfg)))
            say(f"logs       Ray's own output goes to {native.path}")
            svc = start_services(cfg, stack)
            lemons = LemonPasses.start(svc.cfg, svc.store)
            if lemons is not None:
                stack.callback(lemons.close)
            say("running; Ctrl-C stops")
            last, problems, brokers_seen, brokers_now = time.monotonic(), (), 0, 0
            while True:
                time.sleep(HEALTH_EVERY_S)
                if lemons is not None:
                    lemons.maybe_run()
                try:
                    st = svc.pipeline.check_health()
                except Superseded as e:
                    svc.pipeline.actors = []  # theirs now: leave them running
                    say(f"stopped    a driver started later owns the shards ({e}); they keep running")
                    return 0
                placed = svc.pipeline.placement
                now_problems = placed.problems if placed is not None else ()
                if now_problems != problems:  # said at once, not at the next status line
                    for line in now_problems:
                        say(f"WARNING    {line}")
                    if problems and not now_problems:
                        say("placement  the Ray cluster can run every shard and analysis again")
                    problems = now_problems
                # A broker that stops leaves the shards' metadata (its partitions get new leaders; reading and
                # the exporters' sends go on through the others) and comes back after it restarts: said at
                # each change, as the operator's first question after a page is whether Kafka is whole.
                now = kafka_brokers(st)
                if now and now != brokers_now:
                    if now < brokers_seen:
                        say(f"WARNING    kafka: {now} of the {brokers_seen} brokers seen answer; the others' "
                            "partitions moved to new leaders and reading goes on (replication factor 1: "
                            "their partitions wait for them)")
                    elif brokers_now and brokers_now < brokers_seen:
                        say(f"kafka      all {now} brokers answer again")
                    brokers_now, brokers_seen = now, max(brokers_seen, now)
                if time.monotonic() - last >= STATUS_EVERY_S:
                    last = time.monotonic()
                    say(status_line(st, placed, brokers_seen))
    except KeyboardInterrupt:
        say("stopped")
        return 0


def run_broker(host: str, port: int, advertise: str = "") -> int:
    """`stragglerscope broker`: Tansu on host:port until Ctrl-C or SIGTERM (exit 0)."""
    from services.broker import LocalBroker

    sigterm_as_interrupt()
    try:
        with LocalBroker(port=port, host=host, advertise=advertise or None) as broker:
            say(f"broker     Tansu on {broker.bootstrap} (cluster {broker.cluster_id}; memory storage: a restart "
                "starts it empty); Ctrl-C stops")
            while broker.alive():
                time.sleep(1.0)
            say("error: the broker exited")
            return 2
    except KeyboardInterrupt:
        say("stopped")
        return 0


class LemonPasses:
    """The fleet's lemon-host scoring (``ray_jobs.lemon_watch``) every ``lemons.every_s``, off the driver's
    loop on a thread of its own: a pass over a week of a big fleet takes seconds, health checks do not wait."""

    def __init__(self, watch, every_s: float):
        self.watch, self.every_s = watch, every_s
        self._next = time.monotonic() + min(every_s, 60.0)  # the first soon after start, then every every_s
        self._thread = None

    @classmethod
    def start(cls, cfg: Config, store) -> "LemonPasses | None":
        if cfg.lemons.every_s <= 0:
            return None
        from core.control_topic import ControlReader
        from ray_jobs.alerts import AlertOutlet, AlertTopic, DriverAlerts
        from ray_jobs.lemon_watch import LemonWatch, read_topology, restore_lemons

        # The same way out as the shards' alerts: the alert table, topic and webhook.
        topic = AlertTopic.for_conn(cfg.kafka.conn(), "stragglerscope-driver-alerts")
        alerts = DriverAlerts(cfg.alerts, store, AlertOutlet(topic.send, cfg.alerts.webhook_url, topic.flush))
        # The fleet's lemon thresholds changed at run time (`stragglerscope control set --fleet --lemons-...`):
        # read from the control topic before each pass, on the pass's own thread (the only user of the reader).
        controls = ControlReader(cfg.kafka.conn(), client_id="stragglerscope-driver-control")
        watch = LemonWatch(store, cfg.lemons, cfg.lemons.period_days * 86400,
                           read_topology(cfg.lemons.topology_file), restore_lemons(store), alerts, controls)
        say(f"lemons     hosts scored across jobs every {cfg.lemons.every_s:g} s over {cfg.lemons.period_days:g} "
            "days (`sql lemon_hosts`)")
        return cls(watch, cfg.lemons.every_s)

    def close(self) -> None:
        """The pass in progress finishes (bounded), and what its alerts left queued goes out."""
        if self._thread is not None:
            self._thread.join(30)
        self.watch.alerts.outlet.close()
        if self.watch.controls is not None:
            self.watch.controls.close()

    def maybe_run(self) -> None:
        import threading

        if time.monotonic() < self._next or (self._thread is not None and self._thread.is_alive()):
            return
        self._next = time.monotonic() + self.every_s
        self._thread = threading.Thread(target=self._pass, name="lemon-hosts", daemon=True)
        self._thread.start()

    def _pass(self) -> None:
        try:
            scores = self.watch.score()
            lemons = [s.host for s in scores if s.lemon]
            if lemons:
                say(f"lemons     {len(lemons)} lemon host(s): {', '.join(lemons[:10])}")
        except Exception as e:  # the store is busy or away: the next pass tries again
            say(f"WARNING    lemon-host scoring failed, next try in {self.every_s:g} s: {type(e).__name__}: {e}")


def kafka_brokers(statuses: list[dict]) -> int:
    """Brokers the shards' Kafka metadata lists now: the fewest any shard lists (the one that refreshed last
    after a broker stopped); 0 when none knows yet."""
    known = [int(s["kafka_brokers"]) for s in statuses if s.get("kafka_brokers")]
    return min(known) if known else 0


def status_line(statuses: list[dict], placement=None, brokers_seen: int = 0) -> str:
    """One line: each shard's stored windows, lag and what is wrong now; what the Ray cluster cannot run;
    ``brokers_seen``: the most Kafka brokers seen at once in this run (fewer now: said)."""
    line = "status     " + "  ".join(
        f"shard {s.get('shard')}: windows={s.get('windows_stored', '?')} "
        f"lag={s.get('lag', '?') if s.get('loops') else '?'} waiting={s.get('windows_waiting', '?')}"
        # records of windows already analysed (ss_late_records_total): a sender held up longer than
        # pipeline.idle_timeout_s, whose window went without them, or records read again after a restart
        f"{' late=%d' % s['late_records'] if s.get('late_records') else ''}"
        f"{' STORE DOWN %.0f s' % s['store_down_s'] if s.get('store_down_s') else ''}"
        f"{' ERROR ' + s['error'] if s.get('error') else ''}" for s in statuses)
    if placement is not None and placement.problems:
        line += "  RAY: " + "; ".join(placement.problems)
    now = kafka_brokers(statuses)
    if 0 < now < brokers_seen:
        line += f"  KAFKA: {now} of {brokers_seen} brokers"
    return line


def driver_log_path(cfg: Config) -> str:
    """Where `run` puts Ray's native output: beside the shards' crash journals (``pipeline.state_dir``)."""
    import os
    import tempfile

    base = cfg.pipeline.state_dir or os.path.join(tempfile.gettempdir(), "stragglerscope")
    return os.path.join(base, f"ray-driver-{os.getpid()}.log")
