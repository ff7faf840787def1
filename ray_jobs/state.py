"""What a restarted shard resumes from: its reducers' open state, stored with the offsets it covers.

The window reducer's open windows need nothing of this: it holds back the
offsets of every record of an open window, so a restart reads them again.
The hang monitor, the alert rules, the downtime accountant and the link
findings' history (the window reducer's, across windows) cannot do that: their state
(the last heartbeat of every rank, the collectives each entered, the step
times that set a hang's threshold, the hangs already reported, alert
cool-downs, the progress and saves an open incident is measured against)
comes from records long since committed. Before this, a shard killed during
a hang's grace period restarted with none of it: the hang came at another
time or twice, an open incident lost its timeline.

``StateKeeper`` snapshots them (``Stateful.state``) at most every
``interval_s``, and at once after one of them emitted rows (``touch``: a
hang, an alert, an incident), inside ``Checkpoint.commit`` once every unit
emitted so far is stored (so a restored "already reported" never hides a
result that was not stored, and a result stored is never found again with
another id by a shard restored from before it), and stores the snapshot
with the input positions it covers.
Offsets are then stored no further than those positions (``cap``): a
restart restores the snapshot and reads again exactly the records after it.
Records read twice are harmless: each reducer keeps maxima, latest values
and sets, so adding a record again changes nothing. An unchanged snapshot is
not written again.

Each reducer's state is plain data (numbers, strings, lists, dicts, sets):
each class that keeps state says what of it to save and builds itself back
from that (``HangTracker.state``/``from_state``, ``DowntimeAccountant``,
``RegressionDetector``, ``FindingHistory``). The encoding is a pickle of
that, compressed, read back by an unpickler that builds no class but a set:
a state row is data, never code. A snapshot of another
``FORMAT``, of other partitions (the shard count changed) or that does not
decode is logged and ignored: the shard starts empty, as it did before.
"""
from __future__ import annotations

import io
import logging
import pickle
import zlib
from typing import Any, Protocol

from ray_jobs.transports import StateStore

log = logging.getLogger(__name__)

FORMAT = 3
"""Version of the snapshot's encoding and of the state it holds; bump it when either changes.

2: the hang monitor's parameters are the ``[hang]`` configuration (``core.config.HangConfig``); its trackers
keep each rank's watch state and pace, and the job's ended pauses.
3: plain data only (no class of ours is pickled); the window reducer keeps each job's recovery basis."""

_ALLOWED = {"builtins": {"set", "frozenset"}}


class Stateful(Protocol):
    """A reducer whose state outlives the records it was built from."""

    def state(self) -> Any:
        """Plain data (numbers, strings, lists, dicts, sets), enough to resume from."""

    def restore(self, state: Any) -> None:
        """Take back what ``state`` returned (in another process, possibly with other settings)."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a shard's state")


def encode(states: dict[str, Any]) -> bytes:
    return zlib.compress(pickle.dumps(states, protocol=pickle.HIGHEST_PROTOCOL), 3)


def decode(blob: bytes) -> dict[str, Any]:
    states = _Unpickler(io.BytesIO(zlib.decompress(blob))).load()
    if not isinstance(states, dict):
        raise pickle.UnpicklingError(f"a shard's state is a dict, not {type(states).__name__}")
    return states


def shard_key(partitions) -> str:
    """Names the partitions a snapshot covers: a shard of another set (the shard count changed) finds none."""
    return "p" + ",".join(str(int(p)) for p in sorted(partitions))


class StateKeeper:
    """Snapshots ``reducers`` with the positions they cover; caps stored offsets at those positions."""

    def __init__(self, store: StateStore, source_id: str, shard: str, reducers: dict[str, Stateful],
                 interval_s: float = 10.0):
        self.store = store
        self.source_id = source_id
        self.shard = shard
        self.reducers = reducers
        self.interval_s = interval_s
        self.positions: dict | None = None
        """Input positions the last stored snapshot covers; None before the first (nothing may be stored)."""
        self._last: bytes | None = None
        self._due = 0.0
        self.saves = 0
        self.bytes = 0

    def load(self, stored_offsets: dict) -> bool:
        """Restore the reducers from the last snapshot (the stored offsets are where it ends); whether one was."""
        self.positions = dict(stored_offsets)
        try:
            got = self.store.load_state(self.source_id, self.shard)
        except Exception as e:  # the setup reads offsets from the same store: this is rare, and not fatal
            log.warning("reading the saved state of %s failed, starting without it: %s", self.shard, e)
            return False
        if got is None:
            return False
        fmt, blob = got
        if fmt != FORMAT:
            log.warning("the saved state of %s has format %d, this program reads %d: starting without it",
                        self.shard, fmt, FORMAT)
            return False
        try:
            states = decode(blob)
            for name, reducer in self.reducers.items():
                if name in states:
                    reducer.restore(states[name])
        except Exception as e:
            log.warning("the saved state of %s does not decode, starting without it: %s: %s", self.shard,
                        type(e).__name__, e)
            return False
        self._last = blob
        log.info("restored the state of %s (%d bytes): %s", self.shard, len(blob), ", ".join(sorted(states)))
        return True

    def save(self, now: float, positions: dict, force: bool = False) -> None:
        """Store a snapshot covering ``positions`` when one is due (every unit emitted so far must be stored)."""
        if not force and now < self._due:
            return
        self._due = now + self.interval_s
        blob = encode({name: r.state() for name, r in self.reducers.items()})
        if blob != self._last:
            self.store.store_state(self.source_id, self.shard, FORMAT, blob)  # raises: the old positions stand
            self._last = blob
            self.saves += 1
            self.bytes = len(blob)
        self.positions = dict(positions)

    def touch(self) -> None:
        """A reducer emitted rows: snapshot at the next commit, once they are stored. A restart restored from
        an older snapshot would find them again, with new ids (a hang's id is when it was found)."""
        self._due = 0.0

    def rewound(self, tp, offset: int) -> None:
        """``tp`` reads a new log from ``offset`` (the broker lost the old one): the snapshot covers nothing of it."""
        if self.positions is not None:
            self.positions[tp] = offset

    def cap(self, committable: dict) -> dict:
        """The offsets that may be stored: none beyond what the last snapshot covers."""
        if self.positions is None:
            return {}
        return {tp: min(off, self.positions[tp]) for tp, off in committable.items() if tp in self.positions}
