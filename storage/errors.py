"""The one exception type of the storage layer, and the words for a store that has no tables yet."""
from __future__ import annotations

import re

from core.errors import RetryLater


class StoreError(RuntimeError):
    """A store could not do what was asked: bad URL, unreachable server, refused SQL, bad parameter.

    The message is one line fit for a command line (``stragglerscope sql``
    prints it as is), with any password it would show replaced by ``***``
    (``core.redact``); the backend's own exception, if any, is the cause.
    """

    def __init__(self, message: str) -> None:
        from core.redact import redact

        text = " ".join(str(message).split()) if message else "store error"
        super().__init__(redact(text)[:2000])

    @property
    def transient(self) -> bool:
        """The store answers but cannot take writes for now (``StoreBusy``)."""
        return isinstance(self, RetryLater)


class StoreBusy(StoreError, RetryLater):
    """The store answers but cannot take writes for now (a replicated shard short of its quorum, ZooKeeper
    away): the caller waits and retries, as for an unreachable store; it is not bad data."""


def first_line(exc: BaseException, limit: int = 500) -> str:
    """The first non-empty line of an exception's text, shortened."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(exc).__name__


_MISSING_TABLE = re.compile(r"Unknown table expression identifier '([^']+)'|Table (?:\S+\.)?(\S+) (?:doesn't|does not) "
                            r"exist|UNKNOWN_TABLE|Code: 60\b")


def missing_table(error: BaseException | str) -> str | None:
    """The table an error says does not exist (ClickHouse's code 60, from a server, chDB or the store daemon),
    '' when it names none; None when the error is about something else."""
    m = _MISSING_TABLE.search(str(error))
    if m is None:
        return None
    return next((g for g in m.groups() if g), "")


def no_tables_yet(url: str, table: str) -> str:
    """What to do about a store without the project's tables, in one line."""
    what = f"table {table}" if table else "the project's tables"
    return (f"the store {url} has no {what} yet: start `stragglerscope run` on it first (it creates them), or "
            "the store URL is wrong")
