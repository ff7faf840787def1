"""A bounded on-disk spool of Kafka messages that could not be delivered.

One file per message, named by the message's sequence number (given by the
producer when the message was first sent, a nanosecond timestamp, so it keeps
growing across restarts) so that replay is oldest first even when a message
fails, and is spooled, after a younger one; written to a temporary name and renamed, so a
crash never leaves a half message behind. When the spool would exceed its
byte bound the message is refused (the producer counts it as dropped):
training must never fill a disk because the broker is down.

File layout: 4-byte big-endian length of the header, a JSON header
({"topic", "key", "rows"}), then the payload bytes.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path


class Spool:
    def __init__(self, directory: str | os.PathLike, max_bytes: int = 256 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        for tmp in self.dir.glob("*.tmp"):  # left by a crash mid-write
            tmp.unlink(missing_ok=True)
        self._bytes = sum(f.stat().st_size for f in self.dir.glob("*.msg"))

    def __len__(self) -> int:
        return self.waiting(self.dir)

    @staticmethod
    def waiting(directory: str | os.PathLike) -> int:
        """Messages spooled in ``directory``, without opening it (a closed spool's, a folder never made: 0)."""
        return sum(1 for _ in Path(directory).glob("*.msg"))

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, topic: str, key: bytes | None, payload: bytes, rows: float, seq: int) -> bool:
        """Spool one message under its sequence number; False when the bound would be exceeded."""
        header = json.dumps({"topic": topic, "key": key.decode() if key else None, "rows": rows}).encode()
        blob = struct.pack(">I", len(header)) + header + payload
        with self._lock:
            if self._bytes + len(blob) > self.max_bytes:
                return False
            self._bytes += len(blob)
        path = self.dir / f"{seq:020d}.msg"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        return True

    def oldest(self, n: int = 64) -> list[tuple[Path, str, bytes | None, bytes, float]]:
        """Up to ``n`` spooled messages, oldest first: (path, topic, key, payload, rows)."""
        out = []
        for path in sorted(self.dir.glob("*.msg"))[:n]:
            blob = path.read_bytes()
            (hlen,) = struct.unpack(">I", blob[:4])
            header = json.loads(blob[4:4 + hlen])
            key = header["key"].encode() if header["key"] is not None else None
            out.append((path, header["topic"], key, blob[4 + hlen:], header["rows"]))
        return out

    def remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._bytes -= size
