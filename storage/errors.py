"""The one exception type of the storage layer."""
from __future__ import annotations


class StoreError(RuntimeError):
    """A store could not do what was asked: bad URL, unreachable server, refused SQL, bad parameter.

    The message is one line fit for a command line (``stragglerscope sql``
    prints it as is), with any password it would show replaced by ``***``
    (``core.redact``); the backend's own exception, if any, is the cause.
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        from core.redact import redact

        text = " ".join(str(message).split()) if message else "store error"
        super().__init__(redact(text)[:2000])
        self.transient = transient
        """The store answers but cannot take writes for now (a replicated shard short of its quorum,
        ZooKeeper away): the caller waits and retries, as for an unreachable store; it is not bad data."""


def first_line(exc: BaseException, limit: int = 500) -> str:
    """The first non-empty line of an exception's text, shortened."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(exc).__name__
