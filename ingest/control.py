"""Run-time control beside training: a daemon thread follows the control topic for one job.

``ControlFollower`` reads every change (``core.control_topic.ControlReader``) on its own thread, folds them
(``core.control.ControlBook``) and hands the exporter what is in force for its job: the sampling (or a pause
of profiling) and the heartbeat period. The training thread never waits for it: the follower replaces one
attribute of the exporter (``RankExporter.offer_plan``), and the exporter takes the new sampling at its
next step end, so a sampled window is never cut in the middle of a step. A change that carries a step
(``from_step``: the ranks of a job agree on it, ``core.control``) is handed over ahead, as a plan of which
sampling holds from which step (``sampling_plan``): every rank takes it at the end of step ``from_step - 1``,
whenever it heard of it before then; one that heard of it later takes it at its next step end, counts it
(``ExporterStats.control_late``) and says so once. A change without a step, a clear, and a change that runs out
apply at each rank's next step end. A change that runs out or is cleared hands back what the exporter started
with. A record that does not pass ``core.control.check`` is refused and
counted (``book.refused``), never applied in part.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from core.control import STEP_SETTINGS, ControlBook, parse_sample
from core.kafka_conn import KafkaConn

log = logging.getLogger(__name__)


class PausedSampling:
    """Profiling paused by a change: no step is sampled (heartbeats and collectives' hang evidence go on)."""

    profile_steps = 0
    every = 0

    def window_of(self, step: int) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PausedSampling)

    def __hash__(self) -> int:
        return 0


PAUSED = PausedSampling()


def sampling_for(settings: dict[str, Any], base):
    """What the exporter samples under ``settings`` (the changes in force for its job): ``base`` where none
    names the sampling. New samplings are of ``base``'s class (``ingest.exporter.Sampling``), taken from it
    rather than imported: the exporter imports this module, and no import circle is allowed."""
    if settings.get("profiling") == "paused":
        return PAUSED
    if "sample" in settings:
        k, n = parse_sample(settings["sample"])
        return type(base)(k, n)
    return base


def sampling_plan(book: ControlBook, now_ns: int, job_id: str, base) -> tuple:
    """Which sampling holds from which step for ``job_id``: ((0, sampling before any step named), (step,
    sampling from that step), ...), steps increasing (``RankExporter.offer_plan``)."""
    points = book.step_points(job_id, STEP_SETTINGS)
    return ((0, sampling_for(book.settings(now_ns, job_id, step=0), base)),) + tuple(
        (p, sampling_for(book.settings(now_ns, job_id, step=p), base)) for p in points)


class ControlFollower:
    """Follows the control topic for ``exporter``'s job until ``close()``; started by
    ``RankExporter.follow_control``."""

    def __init__(self, exporter, source, poll_s: float = 0.5, retry_s: float = 5.0):
        """``source``: a ``ControlReader`` (its ``poll(timeout_ms)`` returns records), or a fake in tests."""
        self.exporter = exporter
        self.source = source
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.book = ControlBook()
        self.base_sampling = exporter.sampling
        self.base_heartbeat_s = exporter.heartbeat_s
        self.applied: dict[str, Any] = {}  # the settings last handed over (what is in force for the job)
        self._seen = -1
        self._expiry = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_conn(cls, exporter, conn: KafkaConn | str) -> "ControlFollower":
        from core.control_topic import ControlReader

        return cls(exporter, ControlReader(conn, client_id=f"control-{exporter.job_id}-{exporter.rank}"))

    def start(self) -> "ControlFollower":
        self._thread = threading.Thread(target=self._run, name="ss-control", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                records = self.source.poll(int(self.poll_s * 1000))
            except Exception as e:  # the follower must never take the rank down: say it and retry
                log.warning("control topic: %s", e)
                records = []
                self._stop.wait(self.retry_s)
            self.take(records, time.time_ns())
            if not records and getattr(self.source, "problem", ""):
                self._stop.wait(self.retry_s)  # no topic yet, or the broker is away: ask again later

    def take(self, records: list, now_ns: int) -> None:
        """Fold ``records`` in and hand the exporter what is in force for its job at ``now_ns`` (also when a
        change ran out since the last call)."""
        self.book.take(records)
        expired = self._expiry and now_ns >= self._expiry
        if self.book.version == self._seen and not expired:
            return
        self._seen = self.book.version
        self._expiry = self.book.next_expiry(now_ns)
        settings = self.book.settings(now_ns, self.exporter.job_id)
        self.exporter.offer_plan(sampling_plan(self.book, now_ns, self.exporter.job_id, self.base_sampling))
        # A float read by the heartbeat thread each period: replaced whole, no lock needed.
        self.exporter.heartbeat_s = float(settings.get("heartbeat_s", self.base_heartbeat_s))
        if settings != self.applied:
            log.info("control: job %s now runs with %s", self.exporter.job_id, settings or "its own settings")
        self.applied = settings

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
