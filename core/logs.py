"""Log setup shared by the CLI and the shard actors: plain text for people, JSON lines for machines.

With ``log_format = "json"`` every record is one JSON object per line with
``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, the process id and
any ``extra={...}`` fields, so a log shipper (Loki, Elasticsearch) can index
them without parsing free text. Exceptions are kept, as one ``exc`` string.
"""
from __future__ import annotations

import datetime as dt
import json
import logging

# Attributes every LogRecord has; anything else came from ``extra=`` and is kept.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, **static: object):
        super().__init__()
        self.static = static

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            **self.static,
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(fmt: str = "text", level: int = logging.WARNING, **static: object) -> None:
    """(Re)configure the root logger; ``static`` fields (e.g. shard=3) go on every JSON line."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(**static))
    else:
        label = " ".join(f"{k}={v}" for k, v in static.items())
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{' ' + label if label else ''}: "
                                               "%(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
