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


class NativeStderr:
    """What native code writes to this process's stderr goes to a file; Python's own output keeps the terminal.

    Ray's C++ core in the driver writes its warnings straight to file
    descriptor 2: a retry loop printed a line a second while `run` connected to
    a cluster that refused its token, and after a node loss its lines and state
    dumps buried the driver's own status lines. ``start`` points descriptor 2 at
    ``path`` and gives Python a stream on a copy of the terminal
    (``sys.stderr`` and the logging handlers that wrote to the old one), so
    ``say``, logging, progress bars and tracebacks stay on the terminal while
    native writes land in the file. ``stop`` undoes it. Only ``current()``'s
    file is read back (``tail``), e.g. to say why Ray refused a connection.
    """

    _active: "NativeStderr | None" = None

    def __init__(self, path: str):
        self.path = path
        self._saved_fd: int | None = None
        self._old_stderr = None
        self._moved: list[logging.StreamHandler] = []
        self._routed: list[logging.StreamHandler] = []   # library handlers sent to the file (``route``)
        self._file_stream = None

    def start(self) -> "NativeStderr":
        import os
        import sys

        if self._saved_fd is not None:
            return self
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        terminal = os.fdopen(os.dup(self._saved_fd), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
        self._old_stderr, sys.stderr = sys.stderr, terminal
        for h in self._handlers():
            if h.stream in (self._old_stderr, sys.__stderr__):
                h.setStream(terminal)
                self._moved.append(h)
        NativeStderr._active = self
        return self

    @staticmethod
    def _handlers() -> list[logging.StreamHandler]:
        loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                           if isinstance(lg, logging.Logger)]
        return [h for lg in loggers for h in lg.handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]

    def stop(self) -> None:
        import os
        import sys

        if self._saved_fd is None:
            return
        terminal, sys.stderr = sys.stderr, self._old_stderr
        for h in self._moved:
            h.setStream(self._old_stderr)
        terminal.flush()
        for h in self._routed:
            h.setStream(self._old_stderr)
        if self._file_stream is not None:
            self._file_stream.close()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        terminal.close()
        self._saved_fd, self._moved, self._routed, self._file_stream = None, [], [], None
        if NativeStderr._active is self:
            NativeStderr._active = None
        try:  # a run that had nothing to say leaves no empty file behind
            if os.path.getsize(self.path) == 0:
                os.remove(self.path)
        except OSError:
            pass

    def route(self, prefixes: tuple[str, ...] = ("ray",)) -> None:
        """The Python loggers of these libraries to the file too. Ray, imported after ``start``, gave its
        handlers the terminal's stream: after a node loss its lines (44 of them) buried the driver's status
        lines while the file stayed empty."""
        import os

        if self._saved_fd is None:
            return
        if self._file_stream is None:
            self._file_stream = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
        loggers = [lg for name, lg in logging.Logger.manager.loggerDict.items()
                   if isinstance(lg, logging.Logger) and name.split(".")[0] in prefixes]
        for lg in loggers:
            for h in lg.handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) \
                        and h.stream is not self._file_stream and h not in self._routed:
                    h.setStream(self._file_stream)
                    self._routed.append(h)

    def tail(self, max_bytes: int = 65536) -> str:
        """The end of the file (what native code wrote last)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    @classmethod
    def current(cls) -> "NativeStderr | None":
        return cls._active

    def __enter__(self) -> "NativeStderr":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
