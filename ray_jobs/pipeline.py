"""The pipeline's entry point: Ray, the shard actors, and their health.

``Pipeline(cfg, source_id).start()`` connects to Ray (or starts a local one
bound to 127.0.0.1), creates ``cfg.pipeline.shards`` shard actors, each
owning the partitions ``p`` with ``p % shards == index`` of every input topic
(all input topics have the same partition count, and records are keyed by
job, so a job's records all reach one shard), and starts their loops. Each
shard runs its analyses as Ray tasks. ``status()`` gathers the shards'
counters; ``serve_metrics()`` exposes them to Prometheus on 127.0.0.1.

Actors are restarted by Ray when their process dies (``max_restarts``); a
restarted shard re-reads its stored offsets and replays what was not yet
covered by stored results (``ShardWorker.setup``).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

from ray_jobs.shard import ShardWorker
from stragglerscope.config import Config

log = logging.getLogger(__name__)


def init_ray(cfg: Config) -> None:
    """Connect to ``cfg.ray.address`` or start a local Ray that listens on 127.0.0.1 only."""
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=False)
        return
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set by ray_jobs/__init__.py, before Ray is imported.
    ray.init(
        num_cpus=cfg.ray.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
        log_to_driver=False, configure_logging=True, logging_level=logging.WARNING,
    )


def shard_partitions(index: int, shards: int, partitions: int) -> list[int]:
    return [p for p in range(partitions) if p % shards == index]


def _make_actor_class():
    import ray

    from ray_jobs.analysis import analyze_window

    remote_analyze = ray.remote(num_cpus=1, max_retries=2)(analyze_window)

    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
    class ShardActor:
        """Holds one ShardWorker; Ray only hosts it (its logic is tested without Ray)."""

        def __init__(self, index, partitions, cfg, source_id):
            from stragglerscope import logs

            logs.configure(cfg.pipeline.log_format, logging.INFO, shard=index, source=source_id)
            self.worker = ShardWorker(index, partitions, cfg, source_id, submit=remote_analyze.remote)
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

    def __init__(self, cfg: Config, source_id: str):
        self.cfg = cfg
        self.source_id = source_id
        self.actors: list = []
        self._metrics = None

    def start(self) -> "Pipeline":
        init_ray(self.cfg)
        actor_cls = _make_actor_class()
        n, parts = self.cfg.pipeline.shards, self.cfg.kafka.partitions
        if n > parts:
            raise ValueError(f"pipeline.shards ({n}) must not exceed kafka.partitions ({parts})")
        self.actors = [
            actor_cls.options(name=f"ss-shard-{self.source_id}-{i}").remote(
                i, shard_partitions(i, n, parts), self.cfg, self.source_id)
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
            raise TimeoutError(f"shard actors not ready after {timeout_s:.0f} s "
                               "(is Ray short of CPUs, or Kafka or the store unreachable?)") from None

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
