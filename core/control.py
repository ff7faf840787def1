"""Run-time control: what may be changed while jobs run, checked in one place, and what is in force.

A change is one JSON record on the control topic (``core.topics.TOPIC_CONTROL``)::

    {"change_id": "...", "who": "alice", "when": <ns>, "scope": "job:<job id>" | "fleet",
     "what": {"sample": "5/10"}, "until": <ns, 0 = until cleared>, "clears": "",
     "from_step": <the job's first step it covers; absent or 0: none>, "parts": <records of the change>,
     "unset": [<settings a clear ends>]}

The last three are left out of the JSON at their defaults, so a change with none of them reads as it did
before they existed (and an older reader still takes it).

Published one record per setting (``records_of``), keyed ``<scope>|<setting>``: the topic is compacted
(``core.kafka_admin.ensure_topics``), and compaction keeps exactly the newest record of each key, which is
what ``ControlBook`` needs to rebuild what is in force, since a record replaces the earlier ones of its
settings in its scope. A change of several settings is ``parts`` records of one change id, sent together;
a reader applies them together (the next record of another change, or ``flush``, applies what came of one
whose other parts compaction removed: each was replaced by a later record). A clear is a record whose
``clears`` names a change id (``"*"``: every change of its scope) and whose ``unset`` names the settings it
ends, one per record too, so it replaces, and compaction drops, the records it ends. Records written before
keys were per setting (several settings, ``unset`` empty) are still read: such a clear ends the settings its
change holds (``"*"``: every setting of its scope).

A change that runs out (``until``) is skipped by every reader from then on and left on the topic until a
later record of its key replaces it: no one writes tombstones (a tombstone written after reading could
delete a change published in between). The topic holds at most one record per scope and setting.

``from_step`` makes the ranks of a job agree on when a sampling or profiling change starts: each rank
applies it at the end of step ``from_step - 1``, so it covers the steps from ``from_step`` on, on every rank.
The publisher chooses it (``agreed_from_step``) from the job's newest step the store knows; a change without
one (0: for the fleet, or a job the store does not know) applies at each rank's next step end. Only the
exporters' settings (sampling and profiling) wait for the step; the others apply as they are read.

``check`` is the only gate: the command line checks before it publishes, and every
reader checks again what it reads (a record written by anything else is refused there with its reason,
never applied in part). A change applies whole or not at all: one bad setting refuses the record.

``ControlBook`` folds the records read, in topic order, into what is in force at a time: for a job,
the fleet's settings and then the job's own, the later of two records setting the same name in one scope
replacing the earlier (when it runs out or is cleared, the setting is the configured one again, not the one it
replaced: compaction keeps no other). The exporters
(``ingest.control``) take the sampling, pause and heartbeat settings of their job from it; the shards
(``ray_jobs.shard``) the hang thresholds, the regression rule's and the alert rules'; the driver's lemon watch
(``ray_jobs.lemon_watch``) the fleet's lemon-host thresholds. A setting none of the changes in force names keeps
the value the exporter or the pipeline started with, so a change that expires or is cleared restores it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from typing import Any, Callable

FLEET = "fleet"
JOB_PREFIX = "job:"
MAX_JOB_ID_LEN = 128
_JOB_ID = re.compile(r"[A-Za-z0-9._:/@+=-]+")  # the input boundary's rule (ray_jobs/boundary.py)
MAX_WHO_LEN = 128
MAX_RECORD_BYTES = 16_384
"""A control record is a few hundred bytes; anything far larger is not one of ours."""
MAX_UNTIL_S = 30 * 86400
"""A change lasts at most this long past its own time (a forgotten 'every step' must not profile for a year)."""


class ControlError(ValueError):
    """A control record or request that is refused; the message is one line saying why."""


def _number(name: str, low: float, high: float, integral: bool = False) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(str(value))
            except ValueError:
                raise ControlError(f"{name} must be a number, got {value!r}") from None
        if value != value or not low <= value <= high:  # NaN fails the first test
            raise ControlError(f"{name} = {value!r} is out of range ({low:g} to {high:g})")
        if integral and value != int(value):
            raise ControlError(f"{name} must be a whole number, got {value!r}")
        return int(value) if integral else float(value)
    return check


def parse_sample(value: Any) -> tuple[int, int]:
    """``"K/N"``: profile K consecutive steps of every N; 1 <= K <= N <= 1,000,000."""
    m = re.fullmatch(r"\s*(\d{1,7})\s*/\s*(\d{1,7})\s*", str(value))
    if not m:
        raise ControlError(f"sample {value!r} is not K/N (e.g. 10/100; 1/1 profiles every step)")
    k, n = int(m.group(1)), int(m.group(2))
    if not 1 <= k <= n <= 1_000_000:
        raise ControlError(f"sample {k}/{n}: need 1 <= K <= N <= 1000000 (K steps profiled out of every N)")
    return k, n


def _sample(value: Any) -> str:
    k, n = parse_sample(value)
    return f"{k}/{n}"


def _profiling(value: Any) -> str:
    if value not in ("on", "paused"):
        raise ControlError(f"profiling must be 'on' or 'paused', got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    check: Callable[[Any], Any]
    reader: str
    """Who applies it: 'exporter' (each rank, at its next step end), 'shard' (the pipeline) or 'driver' (the
    driver of `run`, at its next lemon-host pass)."""
    doc: str
    fleet_only: bool = False
    """Judged across every job at once (lemon hosts): a change for one job would be applied by nothing."""


def _ranged(name: str, low: float, high: float, reader: str, doc: str, integral: bool = False,
            fleet_only: bool = False) -> Setting:
    """A numeric setting checked to lie in [low, high] (its name said once); ``integral``: a whole number."""
    return Setting(name, _number(name, low, high, integral), reader, doc, fleet_only)


# The hang thresholds keep core.config.HangConfig's field names after the "hang_" prefix; their ranges are
# wide but keep the detector sane (a 0 s threshold would page every job at every pause).
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("sample", _sample, "exporter", "K/N: profile K consecutive steps of every N (1/1: every step)"),
    Setting("profiling", _profiling, "exporter", "'paused' stops profiling (heartbeats go on), 'on' resumes it"),
    _ranged("heartbeat_s", 0.5, 300, "exporter", "seconds between a rank's heartbeats"),
    _ranged("hang_min_s", 1, 86400, "shard",
            "once the job's pace is known, no progress for at least this long is a hang"),
    _ranged("hang_quiet_factor", 1, 100, "shard",
            "... and for this many times the job's longest normal wait between two ops"),
    _ranged("hang_floor_s", 1, 86400, "shard",
            "until the ranks report their pace, no progress for at least this long is a hang"),
    _ranged("hang_k_steps", 1, 10000, "shard", "... and for this many median step times"),
    _ranged("hang_silent_s", 1, 3600, "shard", "in a stall, a rank silent this long is the missing one"),
    _ranged("hang_heartbeat_timeout_s", 5, 86400, "shard",
            "ranks silent this long while others report are lost (node loss)"),
    _ranged("hang_startup_s", 1, 86400, "shard", "before the first step, no progress for this long is a hang"),
    _ranged("hang_checkpoint_s", 1, 86400, "shard",
            "inside a checkpoint save or load, no progress for this long is a hang"),
    # The regression rule's thresholds (core.config.RegressionConfig after the "regression_" prefix), within
    # the bounds core.config.load checks for the [regression] section; a change applies to the windows
    # analysed after it, against the baseline the job already has.
    _ranged("regression_min_change", 0.01, 9, "shard",
            "the smallest slowdown against the job's own baseline that is a regression (0.1: a tenth slower)"),
    _ranged("regression_k_windows", 1, 100, "shard", "... lasting at least this many windows", integral=True),
    _ranged("regression_baseline_windows", 1, 100, "shard",
            "windows whose median step time is the job's baseline (at its start and after each change)",
            integral=True),
    # The alert rules' thresholds (core.config.AlertConfig after the "alerts_" prefix). The link pair must keep
    # the order core.config.load checks (link_shown_confidence <= link_confidence <= link_certain); a change
    # cannot see the configured values, so the shard checks that order when it applies the values in force
    # (``keep_link_order``).
    _ranged("alerts_slowdown_threshold", 1, 100, "shard",
            "a window whose slowdown S is at least this raises a slowdown alert (1.1: a tenth slower)"),
    _ranged("alerts_min_gpus", 0, 1_000_000, "shard", "... for a job of at least this many GPUs", integral=True),
    _ranged("alerts_fidelity_tolerance", 0, 10, "shard",
            "a window whose launch slowdown differs from 1 by more raises a fidelity (info) alert"),
    _ranged("alerts_cooldown_s", 0, 7 * 86400, "shard",
            "the same rule alerts a job at most once per this many seconds (0: every time)"),
    _ranged("alerts_link_confidence", 0, 1, "shard",
            "a window's link finding at least this confident raises a link alert"),
    _ranged("alerts_link_certain", 0, 1, "shard",
            "... a critical one from this confidence (kept at or above alerts_link_confidence)"),
    # The lemon-host rule's thresholds (core.config.LemonConfig after the "lemons_" prefix): the driver scores
    # hosts across every job at once, so only the fleet has them.
    _ranged("lemons_min_jobs", 1, 10_000, "driver",
            "distinct jobs that must implicate a host before it is a lemon (--fleet only)", integral=True,
            fleet_only=True),
    _ranged("lemons_max_p", 1e-12, 1, "driver",
            "... and how unlikely that many jobs may be by chance, at most (--fleet only)", fleet_only=True),
)}
HANG_PREFIX = "hang_"
REGRESSION_PREFIX = "regression_"
ALERTS_PREFIX = "alerts_"
LEMONS_PREFIX = "lemons_"


def describe_settings() -> str:
    """One line per setting, for ``--help``."""
    return "\n".join(f"  {s.name:<28} {s.doc} (applied by the {s.reader})" for s in SETTINGS.values())


def check_job_id(job_id: Any) -> str:
    if not isinstance(job_id, str) or not job_id:
        raise ControlError("the job id is empty")
    if len(job_id) > MAX_JOB_ID_LEN:
        raise ControlError(f"the job id is {len(job_id)} characters long, over {MAX_JOB_ID_LEN}")
    if not _JOB_ID.fullmatch(job_id):
        raise ControlError(f"the job id {job_id[:40]!r} has characters outside A-Z a-z 0-9 . _ - : / @ + =")
    return job_id


def scope_of(job_id: str | None) -> str:
    """The scope naming one job, or the fleet when ``job_id`` is None."""
    return FLEET if job_id is None else JOB_PREFIX + check_job_id(job_id)


def check_scope(scope: Any) -> str:
    if scope == FLEET:
        return scope
    if not isinstance(scope, str) or not scope.startswith(JOB_PREFIX):
        raise ControlError(f"scope must be 'fleet' or 'job:<job id>', got {str(scope)[:60]!r}")
    check_job_id(scope[len(JOB_PREFIX):])
    return scope


def check_what(what: Any) -> dict[str, Any]:
    """Every setting checked, or ControlError naming the first bad one; nothing is returned in part."""
    if not isinstance(what, dict):
        raise ControlError("what must be an object of settings")
    unknown = sorted(k for k in what if k not in SETTINGS)
    if unknown:
        raise ControlError(f"unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")
    out = {name: SETTINGS[name].check(value) for name, value in what.items()}
    hb = out.get("hang_heartbeat_timeout_s")
    silent = out.get("hang_silent_s")
    if hb is not None and silent is not None and silent >= hb:
        raise ControlError(f"hang_silent_s ({silent:g}) must be below hang_heartbeat_timeout_s ({hb:g}): a missing "
                           "rank is named before it is declared lost")
    return out


STEP_SETTINGS = ("sample", "profiling")
"""The settings that wait for a change's step (``from_step``): what a window holds must be the same on every rank.
The others (thresholds, the heartbeat period) apply as they are read."""


@dataclasses.dataclass(frozen=True)
class ControlChange:
    change_id: str
    who: str
    when: int
    scope: str
    what: dict
    until: int = 0
    clears: str = ""
    from_step: int = 0
    """The first step of the job it covers (each rank applies it at the end of the step before); 0: none, each
    rank applies it at its next step end."""
    parts: int = 1
    """How many records the change was published as (one per setting, ``records_of``)."""
    unset: tuple = ()
    """A clear's: the settings it ends; empty (records of before): those of the changes it names."""

    @property
    def job_id(self) -> str | None:
        return None if self.scope == FLEET else self.scope[len(JOB_PREFIX):]

    @property
    def waits_for_a_step(self) -> bool:
        """Whether it sets a setting that waits for a step (``STEP_SETTINGS``): only then is ``from_step`` chosen."""
        return any(k in STEP_SETTINGS for k in self.what)

    def active(self, now_ns: int) -> bool:
        return not self.until or now_ns < self.until

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        for name, default in _LEFT_OUT_AT_DEFAULT.items():
            if d[name] == default:
                del d[name]
        d["unset"] = list(d.get("unset", ()))
        if not d["unset"]:
            del d["unset"]
        return json.dumps(d, sort_keys=True).encode()

    def row(self) -> dict:
        """The store's row (``core.schema.CONTROL_CHANGE``)."""
        return dict(change_id=self.change_id, scope=self.scope, job_id=self.job_id or "", who=self.who,
                    when_ns=self.when, until_ns=self.until, what_json=json.dumps(self.what, sort_keys=True),
                    clears=self.clears, from_step=self.from_step)

    def describe(self) -> str:
        what = ", ".join(f"{k}={v}" for k, v in sorted(self.what.items())) or f"clears {self.clears}"
        return f"{self.scope}: {what}" + (f" from step {self.from_step}" if self.from_step else "")


_LEFT_OUT_AT_DEFAULT = {"from_step": 0, "parts": 1}
MAX_PARTS = 64


def check(record: Any) -> ControlChange:
    """A control record (JSON bytes or text, or a dict) as a ``ControlChange``, or ControlError saying why not."""
    if isinstance(record, (bytes, bytearray, str)):
        if len(record) > MAX_RECORD_BYTES:
            raise ControlError(f"the record is {len(record)} bytes, over {MAX_RECORD_BYTES}")
        try:
            record = json.loads(record)
        except (ValueError, UnicodeDecodeError) as e:
            raise ControlError(f"the record is not JSON: {e}") from None
    if not isinstance(record, dict):
        raise ControlError("the record is not a JSON object")
    fields = {f.name for f in dataclasses.fields(ControlChange)}
    extra = sorted(set(record) - fields)
    if extra:
        raise ControlError(f"unknown field {extra[0]!r} in the record")
    missing = sorted(n for n in ("change_id", "who", "when", "scope", "what") if n not in record)
    if missing:
        raise ControlError(f"the record has no {missing[0]!r}")
    change_id, who = record["change_id"], record["who"]
    if not isinstance(change_id, str) or not 1 <= len(change_id) <= 64:
        raise ControlError("change_id must be 1 to 64 characters")
    if not isinstance(who, str) or not 1 <= len(who) <= MAX_WHO_LEN:
        raise ControlError(f"who must be 1 to {MAX_WHO_LEN} characters (a user name)")
    when, until = record["when"], record.get("until", 0)
    for name, v in (("when", when), ("until", until)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ControlError(f"{name} must be nanoseconds since the epoch (an integer >= 0), got {v!r}")
    if when <= 0:
        raise ControlError("when must be the change's time in ns since the epoch")
    if until and not when < until <= when + MAX_UNTIL_S * 10**9:
        raise ControlError(f"until must be after when and at most {MAX_UNTIL_S // 86400} days later")
    clears = record.get("clears", "")
    if not isinstance(clears, str) or len(clears) > 64:
        raise ControlError("clears must be a change id or '*'")
    from_step, parts, unset = record.get("from_step", 0), record.get("parts", 1), record.get("unset", [])
    for name, v, low in (("from_step", from_step, 0), ("parts", parts, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= (MAX_PARTS if name == "parts" else 2**62):
            raise ControlError(f"{name} must be a whole number from {low}, got {str(v)[:40]!r}")
    if not isinstance(unset, list) or any(s not in SETTINGS for s in unset):
        raise ControlError(f"unset must be a list of settings, got {str(unset)[:60]!r}")
    if unset and not clears:
        raise ControlError("only a record that clears a change unsets settings")
    if clears and from_step:
        raise ControlError("a clear takes no step: each rank applies it at its next step end")
    what = check_what(record["what"])
    scope = check_scope(record["scope"])
    fleet_only = sorted(k for k in what if SETTINGS[k].fleet_only)
    if fleet_only and scope != FLEET:
        raise ControlError(f"{fleet_only[0]} is for the fleet only (lemon hosts are scored across every job, not "
                           "per job): give --fleet")
    if clears and what:
        raise ControlError("a record that clears a change sets nothing")
    if not clears and not what:
        raise ControlError("the change sets nothing (name at least one setting)")
    return ControlChange(change_id, who, when, scope, what, until, clears, from_step, parts, tuple(unset))


def make_change(who: str, when_ns: int, job_id: str | None, what: dict, for_s: float = 0.0,
                clears: str = "", from_step: int = 0, unset: list[str] | None = None) -> ControlChange:
    """A new change, checked (ControlError on bad input): ``job_id`` None for the fleet; ``for_s`` 0: until
    cleared. A clear (``clears``) of ``"*"`` ends every setting of its scope unless ``unset`` names them."""
    if for_s < 0 or for_s > MAX_UNTIL_S:
        raise ControlError(f"the duration must be 0 (until cleared) to {MAX_UNTIL_S // 86400} days")
    until = when_ns + int(for_s * 1e9) if for_s else 0
    scope = scope_of(job_id)
    if clears == "*" and unset is None:
        unset = [n for n, s in SETTINGS.items() if scope == FLEET or not s.fleet_only]
    record = dict(change_id=uuid.uuid4().hex[:16], who=who, when=when_ns, scope=scope, what=what,
                  until=until, clears=clears, from_step=from_step, unset=sorted(unset or []))
    return check(record)


def key_of(scope: str, setting: str) -> bytes:
    """The control topic's key of a record of ``setting`` in ``scope``: compaction keeps the newest of each."""
    return f"{scope}|{setting}".encode()


def records_of(change: ControlChange) -> list[tuple[bytes, ControlChange]]:
    """The records ``change`` is published as, with their keys: one per setting it sets or (a clear) unsets, each
    saying how many there are, in the order of the settings' names."""
    names = sorted(change.unset if change.clears else change.what)
    if not names:
        raise ControlError("a clear is published with the settings it ends (unset): its key is theirs")
    parts = len(names)
    if change.clears:
        return [(key_of(change.scope, n), dataclasses.replace(change, unset=(n,), parts=parts)) for n in names]
    return [(key_of(change.scope, n), dataclasses.replace(change, what={n: change.what[n]}, parts=parts))
            for n in names]


# How far ahead of the job's newest step a change of its sampling starts, so that every rank hears of it before
# the end of the step before (``agreed_from_step``). Publishing a change of three settings took 0.11 s (median,
# 0.22 s at most) and a polling reader had it whole 0.25 s after the publish began (0.32 s at most; 10 changes,
# Tansu, 2 cores); a follower that lost the broker asks again after 5 s (``ingest.control.ControlFollower
# .retry_s``), which the lead covers once. Erring late costs only a later start, the same on every rank.
STEP_LEAD_S = 5.0
STEP_DRIFT = 0.1
"""... plus this share of the time since the newest window the step is extrapolated over (a window's mean step
time is not the steps' after it: profiled steps are slower)."""
MIN_STEP_LEAD = 2
"""At least this many steps: the step in progress may end before any rank hears of the change."""
STALE_WINDOW_S = 900.0
"""A newest window ended longer ago than this (and three of the job's sampling periods) says nothing of the
job's step now (it stalled, ended, or the pipeline is that far behind): no step is chosen."""


def agreed_from_step(last_step: int, end_ns: int, step_time_s: float, now_ns: int, period_s: float = 0.0) -> int:
    """The step from which a change of a job's sampling applies on all its ranks, from its newest window
    (``last_step``, ended at ``end_ns``, of mean step ``step_time_s``; ``period_s``: the time between its two
    newest windows, 0 if unknown): the newest step extrapolated to ``now_ns``, plus ``STEP_LEAD_S`` worth of
    steps (at least ``MIN_STEP_LEAD``). 0 when it cannot be told (no window, no step time, too old)."""
    if last_step < 0 or not step_time_s > 0 or not math.isfinite(step_time_s):
        return 0
    elapsed = max(0.0, (now_ns - end_ns) / 1e9)
    if elapsed > max(STALE_WINDOW_S, 3 * period_s):
        return 0
    newest = last_step + int(elapsed / step_time_s)
    return newest + max(MIN_STEP_LEAD, math.ceil((STEP_LEAD_S + STEP_DRIFT * elapsed) / step_time_s))


def parse_duration(text: str) -> float:
    """``90s``, ``10m``, ``2h``, ``1d`` or plain seconds, as seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise ControlError(f"duration {text!r}: want a number with s, m, h or d (e.g. 10m)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


class ControlBook:
    """The records read so far, in topic order, and what is in force at a given time.

    Kept per scope and setting (the topic's key): the newest record of each replaces the earlier, so what is in
    force from a whole log is what it is from the compacted one (the newest record of each key). Older records
    of a key stay only while a newer one's ``from_step`` is ahead of them: until that step, they are what the
    job's ranks sample by (``settings(..., step=...)``); a record without a step ends them at once."""

    MAX_KEPT = 8  # records of one key kept for the steps before a newer one's from_step

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], list[ControlChange]] = {}  # (scope, setting) -> records, newest last
        self.refused: list[str] = []                  # one line per record refused, bounded
        self.version = 0                              # bumped by every change taken: readers re-derive on change
        self._seen: set[tuple] = set()
        self._pending: list[ControlChange] = []       # the parts read so far of the newest change
        self._order: dict[str, int] = {}              # change_id -> when it was taken (topic order)

    def take(self, records) -> list[ControlChange]:
        """Take records in topic order (bytes, text, dicts or ``ControlChange``s); returns the changes completed by
        them, each whole (its parts merged). A bad record is counted and refused, never raised."""
        done = []
        for record in records:
            try:
                part = record if isinstance(record, ControlChange) else check(record)
            except ControlError as e:
                self.refused = (self.refused + [str(e)])[-20:]
                continue
            ident = (part.change_id, tuple(sorted(part.what)), part.unset, part.clears)
            if ident in self._seen:
                continue  # read again (a reader started over): taken once
            self._seen.add(ident)
            if self._pending and self._pending[0].change_id != part.change_id:
                done.append(self._apply_pending())  # its other parts were compacted away: each was replaced
            self._pending.append(part)
            if len(self._pending) >= part.parts:
                done.append(self._apply_pending())
        return done

    def add(self, record: Any) -> ControlChange | None:
        """Take one record; returns the change it completed (the last, if it also completed an earlier one)."""
        done = self.take([record])
        return done[-1] if done else None

    def flush(self) -> list[ControlChange]:
        """Apply the change whose parts were still awaited (the end of the topic was read: there are no more)."""
        return [self._apply_pending()] if self._pending else []

    def _apply_pending(self) -> ControlChange:
        parts, self._pending = self._pending, []
        what, unset = {}, set()
        for p in parts:
            what.update(p.what)
            unset.update(p.unset)
        change = dataclasses.replace(parts[0], what=what, unset=tuple(sorted(unset)))
        self._order.setdefault(change.change_id, len(self._order))
        if change.clears:
            if change.unset:
                ended = [(change.scope, n) for n in change.unset]
            else:  # a record of before per-setting keys: the settings its change holds, or all of its scope
                ended = [k for k, held in self.held.items() if k[0] == change.scope
                         and (change.clears == "*" or held[-1].change_id == change.clears)]
            for k in ended:
                self.held.pop(k, None)
        else:
            for name in change.what:
                kept = [c for c in self.held.get((change.scope, name), [])
                        if change.from_step and c.from_step < change.from_step]
                self.held[(change.scope, name)] = (kept + [change])[-self.MAX_KEPT:]
        self.version += 1
        return change

    @staticmethod
    def _pick(records: list[ControlChange], step: int | None) -> ControlChange | None:
        """The record of a key that holds at ``step`` (None: the newest, whatever its step)."""
        if step is None:
            return records[-1]
        for c in reversed(records):
            if c.from_step <= step:
                return c
        return None

    def _scopes(self, job_id) -> tuple[str, ...]:
        return (FLEET,) if job_id is None else (FLEET, JOB_PREFIX + job_id)

    @property
    def changes(self) -> dict[str, ControlChange]:
        """change_id -> change, of every change that holds a setting now (in force, coming or run out)."""
        out = {}
        for records in self.held.values():
            out.setdefault(records[-1].change_id, records[-1])
        return out

    def in_force(self, now_ns: int, job_id: str | None = ...) -> list[ControlChange]:  # type: ignore[assignment]
        """The changes in force at ``now_ns``, each with only the settings it still holds, fleet's first then the
        jobs', each in topic order; ``job_id`` given: only those that apply to it (None: the fleet's only)."""
        held: dict[str, dict] = {}
        first: dict[str, ControlChange] = {}
        for (scope, name), records in self.held.items():
            c = records[-1]
            if not c.active(now_ns) or (job_id is not ... and scope not in self._scopes(job_id)):
                continue
            first.setdefault(c.change_id, c)
            held.setdefault(c.change_id, {})[name] = c.what[name]
        out = [dataclasses.replace(first[i], what=dict(sorted(w.items()))) for i, w in held.items()]
        return sorted(out, key=lambda c: (c.scope != FLEET, self._order.get(c.change_id, 0)))

    def settings(self, now_ns: int, job_id: str | None, step: int | None = None) -> dict[str, Any]:
        """The settings in force for ``job_id`` (None: fleet-wide only), the job's own over the fleet's; ``step``
        given: those that hold at that step of the job (a record whose ``from_step`` is ahead is not yet)."""
        out: dict[str, Any] = {}
        for scope in self._scopes(job_id):
            for (sc, name), records in sorted(self.held.items()):
                c = self._pick(records, step) if sc == scope else None
                if c is not None and c.active(now_ns):
                    out[name] = c.what[name]
        return out

    def own_settings(self, now_ns: int, job_id: str) -> dict[str, Any]:
        """The settings ``job_id``'s own changes in force set (without the fleet's)."""
        scope = JOB_PREFIX + job_id
        return {name: records[-1].what[name] for (sc, name), records in sorted(self.held.items())
                if sc == scope and records[-1].active(now_ns)}

    def step_points(self, job_id: str, names) -> list[int]:
        """The steps (above 0) at which one of ``names`` changes for ``job_id``, by the records held."""
        scopes = self._scopes(job_id)
        return sorted({c.from_step for (sc, name), records in self.held.items() if sc in scopes and name in names
                       for c in records if c.from_step > 0})

    def jobs(self) -> set[str]:
        return {sc[len(JOB_PREFIX):] for sc, _ in self.held if sc != FLEET}

    def next_expiry(self, now_ns: int) -> int:
        """When the next change in force runs out (0: none does)."""
        ends = [c.until for records in self.held.values() for c in records if c.until and c.until > now_ns]
        return min(ends) if ends else 0


def _overrides(settings: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in settings.items() if k.startswith(prefix)}


def layered(base, fleet: dict, jobs: dict[str, dict]):
    """(``base`` with the fleet's overrides, {job: that with the job's own}): what a reducer judges by after a
    run-time change. Built whole each time, so an override that ended is simply absent (the configured value)."""
    params = dataclasses.replace(base, **fleet)
    return params, {job: dataclasses.replace(params, **o) for job, o in jobs.items() if o}

def hang_overrides(settings: dict[str, Any]) -> dict[str, float]:
    """The hang detector's fields (``core.config.HangConfig``) a change's settings name."""
    return _overrides(settings, HANG_PREFIX)


def regression_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    """The regression detector's fields (``core.config.RegressionConfig``) a change's settings name."""
    return _overrides(settings, REGRESSION_PREFIX)


def alert_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    """The alert rules' fields (``core.config.AlertConfig``) a change's settings name."""
    return _overrides(settings, ALERTS_PREFIX)


def lemon_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    """The lemon scoring's fields (``core.config.LemonConfig``) a change's settings name."""
    return _overrides(settings, LEMONS_PREFIX)


LINK_SETTINGS = ("alerts_link_confidence", "alerts_link_certain")


def link_order_problem(settings: dict[str, Any], configured: Any) -> str:
    """'' when the link thresholds in force (``settings``, over ``configured``: a ``core.config.AlertConfig``)
    keep the order ``core.config.load`` checks at start, else one line saying how they break it."""
    shown = configured.link_shown_confidence
    conf = settings.get("alerts_link_confidence", configured.link_confidence)
    certain = settings.get("alerts_link_certain", configured.link_certain)
    if shown <= conf <= certain:
        return ""
    return (f"link thresholds out of order: need alerts.link_shown_confidence ({shown:g}, configured) <= "
            f"alerts_link_confidence ({conf:g}) <= alerts_link_certain ({certain:g})")


def keep_link_order(fleet: dict[str, Any], jobs: dict[str, dict[str, Any]], configured: Any) \
        -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[str]]:
    """The settings in force, the fleet's and each job's (``jobs``: each job's own, ``ControlBook.own_settings``),
    with the link thresholds of every scope whose values break the configured order refused: the fleet's fall
    back to the configured ones, a job's to the fleet's. Returns the fleet's, each job's over the fleet's, and
    one line per scope refused.

    Checked where the values are applied, not when a change is made: only the applier knows the configured
    values, and a change that was in order can leave another out of order when it ends or is cleared (a job's
    confidence of 0.95 was in order under the fleet's certain of 0.99, not under the configured 0.9). The fleet
    is checked first, so a job is judged against the fleet's values actually in force."""
    problems = []
    why = link_order_problem(fleet, configured)
    if why:
        problems.append(f"fleet: {why}; the configured link thresholds stay in force")
        fleet = {k: v for k, v in fleet.items() if k not in LINK_SETTINGS}
    merged = {}
    for job, own in jobs.items():
        settings = {**fleet, **own}
        why = link_order_problem(settings, configured)
        if why:
            problems.append(f"job:{job}: {why}; the fleet's link thresholds stay in force for it")
            settings = {**fleet, **{k: v for k, v in own.items() if k not in LINK_SETTINGS}}
        merged[job] = settings
    return fleet, merged, problems
