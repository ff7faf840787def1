"""The pipeline's entry point: Ray, the shard actors, and their health.

``Pipeline(cfg, source_id).start()`` first checks the broker: it creates the
topics that are missing (``kafka.partitions``, ``kafka.replication_factor``),
refuses input topics with fewer partitions than configured or with
different counts, and refuses to start when offsets stored for
``source_id`` are beyond the end of their partitions (the broker lost
records: ``stragglerscope offsets`` shows them and resets them). Then it
connects to Ray (or starts a local one bound to 127.0.0.1), creates
``cfg.pipeline.shards`` shard actors, each owning the partitions ``p`` with
``p % shards == index`` of every input topic, counted over the topics'
actual partition count (all input topics have the same one, and records are
keyed by job, so a job's records all reach one shard), and starts their
loops. Each shard runs its analyses as Ray tasks. ``status()`` gathers the
shards' counters; ``serve_metrics()`` exposes them to Prometheus on 127.0.0.1.

Actors are restarted by Ray when their process dies (``max_restarts``); a
restarted shard re-reads its stored offsets and replays what was not yet
covered by stored results (``ShardWorker.setup``).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Callable

from core.config import Config
from ray_jobs.shard import ShardWorker

log = logging.getLogger(__name__)

RAY_CONNECT_CHECK_S = 5.0
"""How long the TCP check of ``ray.address`` waits: ray.init() itself retries a dead address for minutes."""


class PipelineError(RuntimeError):
    """The pipeline cannot start or run: Ray unreachable, shard actors not ready. One line, for the CLI."""

    def __init__(self, message: object = "pipeline error") -> None:
        from core.redact import redact

        super().__init__(redact(" ".join(str(message).split()))[:2000])


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) that ``ray.init(address=...)`` will connect to; None for 'auto' and the like."""
    addr = address.strip()
    default = 6379
    if addr.startswith("ray://"):
        addr, default = addr[len("ray://"):], 10001
    elif "://" in addr or addr in ("auto", "local"):
        return None
    host, sep, port = addr.rstrip("/").rpartition(":")
    if not sep:
        host, port = addr.rstrip("/"), str(default)
    try:
        return host.strip("[]") or "127.0.0.1", int(port)
    except ValueError:
        raise PipelineError(f"bad ray.address {address!r}: write host:port (the head's GCS, e.g. "
                            "ray-head:6379) or ray://host:10001") from None


def check_ray_reachable(address: str, timeout_s: float = RAY_CONNECT_CHECK_S) -> None:
    """PipelineError with one line when nothing accepts connections at ``address``.

    ``ray.init`` to a closed port does not fail: it retries for minutes and
    prints its C++ warnings on the terminal (measured with Ray 2.60: no
    answer after 5 minutes). A plain TCP connect says in milliseconds.
    """
    import socket

    endpoint = ray_endpoint(address)
    if endpoint is None:
        return
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return
    except OSError as e:
        reason = e.strerror or type(e).__name__
    raise PipelineError(f"no Ray cluster reachable at {address} ({reason}); set ray.address to the head's "
                        "address (host:6379, or ray://host:10001 with ray[client]), or leave it empty for a local Ray")


def init_ray(cfg: Config) -> None:
    """Connect to ``cfg.ray.address`` or start a local Ray that listens on 127.0.0.1 only."""
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address:
        check_ray_reachable(cfg.ray.address)
        try:
            ray.init(address=cfg.ray.address, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:  # ray[client] missing, refused ...
            raise PipelineError(f"cannot connect to Ray at {cfg.ray.address}: {_first_line(e)}") from None
        return
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set by ray_jobs/__init__.py, before Ray is imported.
    ray.init(
        num_cpus=cfg.ray.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
        log_to_driver=False, configure_logging=True, logging_level=logging.WARNING,
    )


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(e).__name__


def shard_partitions(index: int, shards: int, partitions: int) -> list[int]:
    """Shard ``index``'s partitions: every ``p`` of ``range(partitions)`` with ``p % shards == index``.

    ``partitions`` is the topics' actual count (``check_partitions``), which
    may exceed ``kafka.partitions``: then the shards share the extra ones too.
    """
    return [p for p in range(partitions) if p % shards == index]


def check_topics(cfg: Config) -> int:
    """Create the missing topics and return the input topics' partition count; BrokerError when it does not fit."""
    from core.kafka_admin import prepare_topics

    return prepare_topics(cfg.kafka.conn(), cfg.kafka.partitions, cfg.kafka.replication_factor)


def stored_offsets(open_store: Callable[[str], Any], store_url: str, source_id: str) -> dict[tuple[str, int], int]:
    """The offsets stored for ``source_id`` (every input topic and partition), as the shards load them."""
    from core import topics
    store = open_store(store_url)
    try:
        store.setup()
        return store.load_offsets(source_id, topics.INPUT_TOPICS, None)
    finally:
        store.close()


def check_offsets(cfg: Config, source_id: str, open_store: Callable[[str], Any],
                  stored: dict[tuple[str, int], int] | None = None) -> None:
    """OffsetsAheadError when an offset stored for ``source_id`` is beyond its partition's end.

    The shards would otherwise wait at those offsets and skip the records the
    broker gives them next: the broker lost records (restarted empty, topic
    deleted and re-created), and nothing read them. The message names the way out.
    """
    from core.kafka_admin import OffsetsAheadError, end_offsets, offsets_ahead

    stored = stored_offsets(open_store, cfg.store.url, source_id) if stored is None else stored
    stored = {tp: off for tp, off in stored.items() if off > 0}
    if not stored:
        return
    ahead = offsets_ahead(stored, end_offsets(cfg.kafka.conn(), stored))
    if not ahead:
        return
    (topic, part), (off, end) = next(iter(ahead.items()))
    more = f" and {len(ahead) - 1} more partitions" if len(ahead) > 1 else ""
    raise OffsetsAheadError(
        f"Kafka at {cfg.kafka.bootstrap} lost records: the offsets stored for source {source_id!r} are beyond "
        f"the end of {topic}[{part}] (stored {off}, end {end}){more}. Results of records read before are "
        f"stored; the records the broker lost are gone. If the broker was reset, run `stragglerscope offsets "
        f"reset` (same --config) to read its topics from the beginning; `stragglerscope offsets show` lists "
        f"them", ahead)


def _actor_error(e: BaseException) -> str:
    """The root cause's line of a Ray actor error (Ray puts the actor's traceback in the message)."""
    cause = getattr(e, "cause", None) or getattr(e, "error", None)
    if isinstance(cause, BaseException) and cause is not e:
        return f"{type(cause).__name__}: {_first_line(cause)}"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):  # the last "SomeError: message" line is the actor's own exception
        if ": " in ln and not ln.startswith(("File ", "Traceback")):
            return ln[:300]
    return _first_line(e)


def result_sink(cfg: Config, open_store: Callable[[str], Any]) -> Callable[[], Any]:
    """A shard's ``sink_factory`` in production: a ``ResultWriter`` that opens ``cfg.store.url`` with ``open_store``."""
    from ray_jobs.io import ResultWriter

    return functools.partial(ResultWriter, cfg.store.url, open_store)


def _make_actor_class():
    import ray

    from ray_jobs.analysis import analyze_window

    remote_analyze = ray.remote(num_cpus=1, max_retries=2)(analyze_window)

    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
    class ShardActor:
        """Holds one ShardWorker; Ray only hosts it (its logic is tested without Ray)."""

        def __init__(self, index, partitions, cfg, source_id, open_store):
            from core import logs
            from core.redact import install_log_filter, quiet_libraries

            logs.configure(cfg.pipeline.log_format, logging.INFO, shard=index, source=source_id)
            install_log_filter()
            quiet_libraries()  # the shard reports what fails itself (status, one warning)
            self.worker = ShardWorker(index, partitions, cfg, source_id, sink_factory=result_sink(cfg, open_store),
                                      submit=remote_analyze.remote)
            self.worker.start()

        def status(self) -> dict:
            return self.worker.status()

        def pid(self) -> int:
            return os.getpid()

        def stop(self) -> bool:
            return self.worker.stop()

    return ShardActor


class Pipeline:
    """The running pipeline in this driver process; a context manager."""

    def __init__(self, cfg: Config, source_id: str, open_store: Callable[[str], Any]):
        """``open_store(url)`` opens the result store (``storage.open_store``); the shards call it too,
        so it must be importable by name in Ray's workers (a module-level function)."""
        self.cfg = cfg
        self.source_id = source_id
        self.open_store = open_store
        self.actors: list = []
        self.partitions = cfg.kafka.partitions
        """The input topics' actual partition count, once started."""
        self._metrics = None

    def start(self) -> "Pipeline":
        """Check the broker (topics, stored offsets), then start Ray and the shard actors.

        BrokerError (OffsetsAheadError) or PipelineError, each one line, when the checks fail.
        """
        n = self.cfg.pipeline.shards
        parts = check_topics(self.cfg)
        if n > parts:
            raise PipelineError(f"pipeline.shards ({n}) must not exceed the input topics' partitions ({parts})")
        if parts > self.cfg.kafka.partitions:
            log.warning("the input topics have %d partitions, more than kafka.partitions = %d: the %d shards "
                        "read all %d", parts, self.cfg.kafka.partitions, n, parts)
        check_offsets(self.cfg, self.source_id, self.open_store)
        self.partitions = parts
        init_ray(self.cfg)
        actor_cls = _make_actor_class()
        self.actors = [
            actor_cls.options(name=f"ss-shard-{self.source_id}-{i}").remote(
                i, shard_partitions(i, n, self.partitions), self.cfg, self.source_id, self.open_store)
            for i in range(n)
        ]
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every shard has connected to Kafka and the store and is polling.

        A shard's constructor runs its setup (clients, stored offsets), so its
        first answered call means it is live. Callers that must not miss the
        first seconds of a job (a hang that starts early) wait here first.
        """
        import ray

        try:
            ray.get([a.status.remote() for a in self.actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"shard actors not ready after {timeout_s:.0f} s "
                                "(is Ray short of CPUs, or Kafka or the store unreachable?)") from None
        except ray.exceptions.RayError as e:  # an actor's setup failed (store or broker refused it)
            raise PipelineError(f"a shard actor failed to start: {_actor_error(e)}") from None

    def status(self, timeout_s: float = 10.0) -> list[dict]:
        """One dict of counters per shard; a shard that does not answer reports ``error``."""
        import ray

        out = []
        for i, a in enumerate(self.actors):
            try:
                out.append(ray.get(a.status.remote(), timeout=timeout_s))
            except Exception as e:  # restarting or dead actor: visible, not fatal
                out.append({"shard": i, "error": f"{type(e).__name__}: {str(e)[:200]}", "unavailable": True})
        return out

    def wait(self, done: Callable[[list[dict]], bool], timeout_s: float, poll_s: float = 1.0,
             progress: Callable[[list[dict]], None] | None = None) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.status()
            if progress:
                progress(st)
            if done(st):
                return True
            time.sleep(poll_s)
        return False

    @staticmethod
    def caught_up(statuses: list[dict]) -> bool:
        """Every shard has polled at least once, read all there is, and has no analysis running.

        A shard answers ``status`` before its first poll, when its lag is not
        measured yet (``loops == 0``): that must not count as caught up.
        """
        return all(st.get("loops", 0) > 0 and st.get("lag", 1) == 0 and st.get("inflight", 1) == 0
                   for st in statuses)

    def serve_metrics(self, port: int) -> int:
        """Prometheus metrics of the shards on 127.0.0.1:port (0 = free port); returns the port."""
        from ray_jobs.metrics import MetricsServer

        self._metrics = MetricsServer(self.status, port=port).start()
        return self._metrics.port

    def stop(self) -> None:
        import ray

        if self._metrics is not None:
            self._metrics.stop()
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=40)
            except Exception as e:
                log.warning("shard stop failed: %s", e)
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []

    def __enter__(self) -> "Pipeline":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
