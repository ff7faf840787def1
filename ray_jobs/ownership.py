"""Who owns the detached shard actors on a Ray cluster: their names, their fingerprint, the owning driver.

Detached shards outlive the driver that made them. A driver that starts finds
them by name (``shard_name`` in ``SHARD_NAMESPACE``) and adopts those whose
configuration is its own (``shard_fingerprint``); the driver started last owns
them (``Owner``, ``claim_verdict``), and an older one learns it through
``Superseded`` and exits, leaving them running (rolling updates).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time

from core.config import Config

SHARD_NAMESPACE = "stragglerscope"
"""Ray namespace of the detached shard actors (named ``ss-shard-SOURCE-INDEX``)."""

def shard_name(source_id: str, index: int) -> str:
    """A shard actor's Ray name: a driver finds its source's running shards by it."""
    return f"ss-shard-{source_id}-{index}"


def shard_fingerprint(cfg: Config, partitions: list[int]) -> str:
    """What a running shard must share with a driver to be adopted: its whole configuration and partitions."""
    import hashlib

    return hashlib.sha256(repr((cfg, partitions)).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, order=True)
class Owner:
    """The driver that owns the detached shards: the one started last wins (rolling updates).

    Ordered by start time, then name; the clocks of two driver pods need only
    agree to within the seconds between their starts.
    """
    started_ns: int
    driver: str

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(time.time_ns(), f"{socket.gethostname()}:{os.getpid()}")


def claim_verdict(current: Owner | None, current_fingerprint: str, owner: Owner, fingerprint: str | None) -> str:
    """What a running shard answers a driver that claims it.

    'newer': a driver started after ``owner`` owns it (``owner`` steps back);
    'replace': it runs another configuration (``fingerprint`` None: retire it);
    'ours': ``owner`` already owns it; 'adopted': ``owner`` takes it over.
    """
    if current is not None and owner < current:
        return "newer"
    if fingerprint != current_fingerprint:
        return "replace"
    return "ours" if owner == current else "adopted"


class Superseded(Exception):
    """A driver started later owns the shards now: this one exits and leaves them running."""
