"""The pipeline's entry point: Ray, the shard actors, and their health.

``Pipeline(cfg, source_id).start()`` first checks the broker: it creates the
topics that are missing (``kafka.partitions``, ``kafka.replication_factor``),
refuses input topics with fewer partitions than configured or with
different counts, and refuses to start when offsets stored for
``source_id`` are beyond the end of their partitions or were read from
another log than the partitions have now (the broker lost records:
``stragglerscope offsets`` shows them and resets them; with
``kafka.on_lost_log = rewind`` they are rewound, with an audit row). Then it
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

On a Ray cluster (``ray.address``) with a store server the shards can reach
(``clickhouse://``), the shards outlive the driver: they are detached, named
per source and index in the ``stragglerscope`` namespace, request
``ray.shard_cpus`` and ``ray.shard_memory_mb`` and are spread over the nodes.
A driver that starts finds them and adopts them when their configuration is
its own (else it replaces them: stop, which commits, then new ones that resume
from the stored offsets). A driver stops the shards on exit only while it owns
them: in a rolling update the new driver adopts first, and the old one's exit
leaves the shards running, so there is never a second set reading the same
partitions. Ownership goes to the driver that started last (``Owner``).

What it checks lives beside it, one concern a module: the broker's topics and
stored offsets (``broker_checks``), connecting to Ray (``ray_connect``), what the
cluster's nodes can run and reach (``placement``), who owns the detached shards
(``ownership``); ``errors.PipelineError`` is the one line any of them refuses with.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from typing import Any, Callable

from core.config import Config
from ray_jobs.broker_checks import check_offsets, check_topics
from ray_jobs.errors import PipelineError
from ray_jobs.ownership import SHARD_NAMESPACE, Owner, Superseded, claim_verdict, shard_fingerprint, shard_name
from ray_jobs.placement import check_store_reach
from ray_jobs.ray_connect import first_line, init_ray
from ray_jobs.shard import ShardWorker

log = logging.getLogger(__name__)


def shard_partitions(index: int, shards: int, partitions: int) -> list[int]:
    """Shard ``index``'s partitions: every ``p`` of ``range(partitions)`` with ``p % shards == index``.

    ``partitions`` is the topics' actual count (``check_partitions``), which
    may exceed ``kafka.partitions``: then the shards share the extra ones too.
    """
    return [p for p in range(partitions) if p % shards == index]


def inflight_per_shard(max_inflight: int, shards: int, cluster_cpus: float, shard_cpus: float) -> int:
    """Analyses in flight per shard: ``max_inflight``, or for 0 two per analysis CPU, shared by the shards.

    The analysis CPUs are the cluster's less what the shard actors hold. Two per
    CPU keep a CPU busy while the next window travels to it. A fixed count per
    shard would leave most of a large cluster idle, or queue a small one's
    analyses behind each other while the shards stop polling.
    """
    if max_inflight > 0:
        return max_inflight
    analysis_cpus = max(1.0, cluster_cpus - shards * shard_cpus)
    return max(1, math.ceil(2 * analysis_cpus / max(1, shards)))

def _actor_error(e: BaseException) -> str:
    """The root cause's line of a Ray actor error (Ray puts the actor's traceback in the message)."""
    cause = getattr(e, "cause", None) or getattr(e, "error", None)
    if isinstance(cause, BaseException) and cause is not e:
        return f"{type(cause).__name__}: {first_line(cause)}"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):  # the last "SomeError: message" line is the actor's own exception
        if ": " in ln and not ln.startswith(("File ", "Traceback")):
            return ln[:300]
    return first_line(e)


def result_sink(cfg: Config, open_store: Callable[[str], Any]) -> Callable[[], Any]:
    """A shard's ``sink_factory`` in production: a ``ResultWriter`` that opens ``cfg.store.url`` with ``open_store``."""
    from ray_jobs.result_writer import ResultWriter

    return functools.partial(ResultWriter, cfg.store.url, open_store)


def _make_actor_class():
    import ray

    from analyzers.window import analyze_window_for_shard

    remote_analyze = ray.remote(num_cpus=1, max_retries=2)(analyze_window_for_shard)

    # Resources and placement are per-call options (Pipeline._actor_options); these hold everywhere.
    @ray.remote(max_restarts=-1, max_task_retries=0)
    class ShardActor:
        """Holds one ShardWorker; Ray only hosts it (its logic is tested without Ray).

        ``owner`` and ``fingerprint`` matter to detached shards, which outlive
        the driver that made them (``claim``). A restart by Ray runs this again
        with the creating driver's values; the owning driver claims it back on
        its next health check.
        """

        def __init__(self, index, partitions, cfg, source_id, open_store, owner=None, fingerprint=""):
            from core import logs
            from core.redact import install_log_filter, quiet_libraries

            logs.configure(cfg.pipeline.log_format, logging.INFO, shard=index, source=source_id)
            install_log_filter()
            quiet_libraries()  # the shard reports what fails itself (status, one warning)
            self.owner, self.fingerprint = owner, fingerprint
            self.worker = ShardWorker(index, partitions, cfg, source_id, sink_factory=result_sink(cfg, open_store),
                                      submit=remote_analyze.remote)
            self.worker.start()

        def claim(self, owner, fingerprint) -> str:
            """``claim_verdict``; on 'ours' or 'adopted' the shard is ``owner``'s from now on.

            Actor calls run one at a time, so two drivers claiming at once get one answer each, in order.
            """
            verdict = claim_verdict(self.owner, self.fingerprint, owner, fingerprint)
            if verdict in ("ours", "adopted"):
                self.owner = owner
            return verdict

        def status(self) -> dict:
            return self.worker.status()

        def pid(self) -> int:
            return os.getpid()

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def stop(self, owner=None) -> bool | None:
            """Stop (committing what is done); None, doing nothing, when ``owner`` is given and is not the owner."""
            if owner is not None and owner != self.owner:
                return None
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
        self.max_inflight = cfg.pipeline.max_inflight
        """Analyses in flight per shard, once started (``inflight_per_shard``)."""
        self.owner = Owner.this_process()
        self.detached = bool(cfg.ray.address) and cfg.store.url.startswith("clickhouse://")
        """Shards that outlive this driver: a Ray cluster and a store server that does not live in it."""
        self.adopted = 0
        """Detached shards found running and adopted at start (the others were created)."""
        self._metrics = None
        self._fingerprints: list[str] = []
        self.offset_resets: list[dict] = []
        """Stored offsets rewound at start because the broker lost their logs (``kafka.on_lost_log = rewind``)."""
        self.placement = None
        """``ray_jobs.placement.Placement`` at the last start or health check: what the cluster cannot run."""
        self._broker_checked = False

    def check_broker(self) -> "Pipeline":
        """The topics (created where missing, partitions counted) and the stored offsets against them; once.

        BrokerError (OffsetsAheadError, LogChangedError) or PipelineError, each one line, when they do not fit.
        A caller may run it before starting Ray (a broker that lost its data is said at once); ``start`` runs it
        otherwise.
        """
        if self._broker_checked:
            return self
        n = self.cfg.pipeline.shards
        parts = check_topics(self.cfg)
        if n > parts:
            raise PipelineError(f"pipeline.shards ({n}) must not exceed the input topics' partitions ({parts})")
        if parts > self.cfg.kafka.partitions:
            log.warning("the input topics have %d partitions, more than kafka.partitions = %d: the %d shards "
                        "read all %d", parts, self.cfg.kafka.partitions, n, parts)
        self.offset_resets = check_offsets(self.cfg, self.source_id, self.open_store)
        self.partitions = parts
        self._broker_checked = True
        return self

    def start(self) -> "Pipeline":
        """Check the broker (``check_broker``), then start Ray and the shard actors (or adopt them).

        BrokerError (OffsetsAheadError, LogChangedError) or PipelineError, each one line, when the checks fail.
        """
        n = self.cfg.pipeline.shards
        self.check_broker()
        init_ray(self.cfg)
        import ray

        if self.cfg.ray.address:
            check_store_reach(self.cfg.store.url, [nd["NodeManagerAddress"] for nd in ray.nodes() if nd["Alive"]])
        placement = self.check_placement()
        if not placement.ok:  # Ray would wait for ever, and the pipeline would store nothing without a word
            raise PipelineError(f"the Ray cluster cannot run this configuration: {placement.problems[0]}")
        self.max_inflight = inflight_per_shard(self.cfg.pipeline.max_inflight, n,
                                               ray.cluster_resources().get("CPU", 1.0),
                                               self._actor_options()["num_cpus"])
        shard_cfg = self.cfg.replace(pipeline={"max_inflight": self.max_inflight})
        actor_cls = _make_actor_class()
        layout = [shard_partitions(i, n, self.partitions) for i in range(n)]
        self._fingerprints = [shard_fingerprint(shard_cfg, p) for p in layout]
        if self.detached:
            self.actors = [self._adopt(actor_cls, i, layout[i], shard_cfg) for i in range(n)]
            self._retire_beyond(n)
        else:
            self.actors = [actor_cls.options(name=shard_name(self.source_id, i), **self._actor_options()).remote(
                i, layout[i], shard_cfg, self.source_id, self.open_store) for i in range(n)]
        return self

    def _actor_options(self) -> dict:
        """Resources and placement: a cluster's shards ask for what they use and spread over the nodes.

        On the local Ray, sized by ``ray.num_cpus`` for the analyses, the shards
        ask for nothing: on two cores they would take the analyses' slots.
        """
        if not self.cfg.ray.address:
            return {"num_cpus": 0}
        return {"num_cpus": self.cfg.ray.shard_cpus, "memory": self.cfg.ray.shard_memory_mb << 20,
                "scheduling_strategy": "SPREAD"}

    def _adopt(self, actor_cls, index: int, partitions: list[int], shard_cfg: Config):
        """Shard ``index``'s detached actor: the running one when its configuration is ours, else a new one."""
        import ray

        name = shard_name(self.source_id, index)
        deadline = time.monotonic() + self.cfg.pipeline.ready_timeout_s
        while True:
            actor = actor_cls.options(name=name, namespace=SHARD_NAMESPACE, lifetime="detached", get_if_exists=True,
                                      **self._actor_options()).remote(
                index, partitions, shard_cfg, self.source_id, self.open_store, self.owner,
                self._fingerprints[index])
            try:
                verdict = ray.get(actor.claim.remote(self.owner, self._fingerprints[index]),
                                  timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise PipelineError(f"shard actor {name} did not answer in {self.cfg.pipeline.ready_timeout_s:.0f} s "
                                    "(is the Ray cluster short of CPUs or memory for ray.shard_cpus and "
                                    "ray.shard_memory_mb?)") from None
            except ray.exceptions.RayError:
                return actor  # its setup failed: wait_ready says why, in one line
            if verdict in ("ours", "adopted"):
                self.adopted += verdict == "adopted"
                return actor
            if verdict == "newer":
                raise PipelineError(f"a driver started after this one owns shard {name}: not starting a second one")
            log.warning("shard %s runs another configuration: stopping it (it commits) and starting this one", name)
            self._retire(actor, name, deadline)
            if time.monotonic() > deadline:
                raise PipelineError(f"shard actor {name} of another configuration could not be replaced in "
                                    f"{self.cfg.pipeline.ready_timeout_s:.0f} s")

    def _retire(self, actor, name: str, deadline: float) -> None:
        """Stop a detached shard (it commits), kill it and wait until its name is free."""
        import ray

        try:
            ray.get(actor.stop.remote(), timeout=40)
        except ray.exceptions.RayError as e:
            log.warning("shard %s did not stop cleanly: %s", name, first_line(e))
        ray.kill(actor, no_restart=True)
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=SHARD_NAMESPACE)
            except ValueError:
                return
            time.sleep(0.2)

    def _retire_beyond(self, n: int) -> None:
        """Retire this source's detached shards numbered ``n`` and up (a configuration with more shards)."""
        import ray

        prefix = shard_name(self.source_id, 0)[:-1]
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry.get("name", "")
            if entry.get("namespace") != SHARD_NAMESPACE or not name.startswith(prefix):
                continue
            tail = name[len(prefix):]
            if not tail.isdigit() or int(tail) < n:
                continue
            actor = ray.get_actor(name, namespace=SHARD_NAMESPACE)
            try:
                verdict = ray.get(actor.claim.remote(self.owner, None), timeout=30)
            except ray.exceptions.RayError:
                verdict = "replace"
            if verdict != "newer":
                log.warning("shard %s is beyond pipeline.shards = %d: stopping it", name, n)
                self._retire(actor, name, time.monotonic() + 30)

    def check_placement(self):
        """What of the shards and analyses the alive nodes cannot run (``ray_jobs.placement``); kept in
        ``placement`` for the status and the metrics."""
        import ray

        from ray_jobs.placement import nodes_of, plan

        opts = self._actor_options()
        self.placement = plan(nodes_of(ray.nodes()), self.cfg.pipeline.shards, opts["num_cpus"],
                              opts.get("memory", 0) / (1 << 20))
        return self.placement

    def check_health(self) -> list[dict]:
        """The shards' statuses; PipelineError for a shard that is dead for good, Superseded when a later
        driver owns the detached shards. A shard that Ray is restarting is not an error.

        Detached shards are claimed again by name: that also takes back one that
        Ray restarted with its creator's ownership.
        """
        import ray

        if self.detached:
            for i in range(len(self.actors)):
                name = shard_name(self.source_id, i)
                try:
                    actor = ray.get_actor(name, namespace=SHARD_NAMESPACE)
                except ValueError:
                    raise PipelineError(f"shard actor {name} is gone (killed, or its node and every restart lost)"
                                        ) from None
                try:
                    verdict = ray.get(actor.claim.remote(self.owner, self._fingerprints[i]), timeout=10)
                except ray.exceptions.GetTimeoutError:
                    continue  # restarting: the status below says so
                except ray.exceptions.ActorDiedError as e:
                    raise PipelineError(f"shard actor {name} died: {_actor_error(e)}") from None
                except ray.exceptions.RayError:
                    continue
                if verdict == "newer":
                    raise Superseded(name)
                if verdict == "replace":
                    raise Superseded(f"{name} runs another configuration (a later driver replaced it)")
                self.actors[i] = actor
        try:
            self.check_placement()
        except Exception as e:  # a GCS that does not answer now: the shards' statuses tell the rest
            log.debug("placement check failed: %s", e)
        statuses = self.status()
        for st in statuses:
            if st.get("dead"):
                raise PipelineError(f"shard {st.get('shard')} died and Ray will not restart it: {st.get('error')}")
        return statuses

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
            except Exception as e:  # restarting or dead actor: visible; a dead one is for check_health
                out.append({"shard": i, "error": _actor_error(e) if isinstance(e, ray.exceptions.RayError)
                            else f"{type(e).__name__}: {str(e)[:200]}", "unavailable": True,
                            "dead": isinstance(e, ray.exceptions.ActorDiedError)})
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

        self._metrics = MetricsServer(self.status, port=port, placement=lambda: self.placement).start()
        return self._metrics.port

    def stop(self) -> None:
        import ray

        if self._metrics is not None:
            self._metrics.stop()
        for a in self.actors:
            try:
                stopped = ray.get(a.stop.remote(self.owner if self.detached else None), timeout=40)
            except Exception as e:
                log.warning("shard stop failed: %s", e)
                stopped = False
            if stopped is None:  # a later driver adopted it: it runs on
                continue
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []

    def __enter__(self) -> "Pipeline":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        if self.detached and exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            # This driver failed (its start, a port, a store): the detached shards it started or adopted run
            # on and keep their work; a driver that fails never takes the pipeline down with it.
            log.warning("leaving %d detached shard actor(s) running: this driver failed (%s)", len(self.actors),
                        exc_type.__name__)
            if self._metrics is not None:
                self._metrics.stop()
            self.actors = []
            return
        self.stop()
