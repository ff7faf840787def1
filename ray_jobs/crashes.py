"""Messages that kill their shard's process are quarantined after a bounded number of deaths.

An exception while handling a message is caught and the message dead-lettered
(``ShardWorker._handle``). A crash of the process is not: a segfault in a
native library, an out-of-memory kill. Ray then restarts the shard, which
re-reads from its stored offsets, meets the same message and dies again,
forever, and the partitions it owns stall. So, before handling a message, the
shard writes which one it is to a small file (``CrashJournal.begin``), and
clears it after (``end``). Both are one ``pwrite`` of a fixed-size slot, no
fsync: a process crash leaves the page cache intact, and only a kernel crash
(after which nothing is crash-looping) can lose the mark.

When the shard starts, a mark left in the slot means the process died while
handling that message: its death count goes up. A message that reached
``validation.max_restarts_per_message`` deaths is quarantined: the next time
it is polled it is dead-lettered by offset, without being decoded, and its
partition moves on.

The journal is a local file. On a multi-node Ray cluster a shard restarted on
another node starts that count again there, so the bound is per node.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

log = logging.getLogger(__name__)

_SLOT = 512  # bytes: topic, partition and offset of the message being handled, padded with spaces
MAX_REMEMBERED = 1000  # death counts kept (a crash loop needs one; this bounds a pathological history)

Position = tuple[str, int, int]  # (topic, partition, offset)


def default_path(source_id: str, shard: int, state_dir: str = "") -> str:
    base = state_dir or os.path.join(tempfile.gettempdir(), "stragglerscope-shards")
    digest = hashlib.sha1(source_id.encode()).hexdigest()[:16]  # source ids hold ':' and '/'
    return os.path.join(base, f"{digest}-shard{shard}.journal")


class CrashJournal:
    def __init__(self, path: str, max_deaths: int):
        self.path = path
        self.max_deaths = max(1, max_deaths)
        self.deaths: dict[Position, int] = {}
        self.quarantined: set[Position] = set()
        self._fd: int | None = None

    def open(self) -> None:
        """Count a death for the message the previous process left marked; find the quarantined ones."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.deaths = self._load_counts()
        try:
            with open(self.path, "rb") as f:
                mark = f.read(_SLOT).decode("utf-8", "replace").strip()
        except FileNotFoundError:
            mark = ""
        if mark:
            try:
                topic, part, off = mark.rsplit("\t", 2)
                pos = (topic, int(part), int(off))
            except ValueError:
                log.warning("crash journal %s: unreadable mark %r ignored", self.path, mark[:100])
            else:
                self.deaths[pos] = self.deaths.get(pos, 0) + 1
                log.warning("the previous shard process died while handling %s:%d@%d (death %d of %d allowed)",
                            *pos, self.deaths[pos], self.max_deaths)
                self._save_counts()
        self.quarantined = {p for p, n in self.deaths.items() if n >= self.max_deaths}
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.end()

    def begin(self, topic: str, partition: int, offset: int) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, f"{topic}\t{partition}\t{offset}".encode()[:_SLOT].ljust(_SLOT), 0)

    def end(self) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, b" " * _SLOT, 0)

    def forget(self, pos: Position) -> None:
        """The quarantined message was dead-lettered: its count is no longer needed."""
        self.quarantined.discard(pos)
        if self.deaths.pop(pos, None) is not None:
            self._save_counts()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _counts_path(self) -> str:
        return self.path + ".deaths.json"

    def _load_counts(self) -> dict[Position, int]:
        try:
            with open(self._counts_path()) as f:
                rows = json.load(f)
            return {(str(t), int(p), int(o)): int(n) for t, p, o, n in rows}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError) as e:
            log.warning("crash journal counts %s unreadable, starting afresh: %s", self._counts_path(), e)
            return {}

    def _save_counts(self) -> None:
        rows = [[t, p, o, n] for (t, p, o), n in list(self.deaths.items())[-MAX_REMEMBERED:]]
        tmp = self._counts_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, self._counts_path())
