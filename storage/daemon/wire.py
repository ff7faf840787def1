"""The daemon's wire: framing, and the one declaration of the Store methods it serves (``REMOTE``).

A call is ``POST /v1/<method>``; its body is one line of JSON (the
arguments) followed, for inserts, by an Arrow IPC stream. The answer has
the same shape: a JSON line (``{"ok": true, ...}`` or ``{"error": "one
line"}``) and, for results, an Arrow IPC stream.

``REMOTE`` names every Store method the daemon serves and says how its
arguments and result cross the wire. The server dispatches by these names
only; ``HttpStore`` gets one method per name, with the Store API's
signature. ``LOCAL`` names the abstract methods the client keeps to itself.
"""
from __future__ import annotations

import base64
import datetime as dt
import io
import json
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from storage.errors import StoreError
from storage.sandbox import SQLLimits
from storage.store import filter_offsets


# --------------------------------------------------------------------------
# framing
# --------------------------------------------------------------------------
def encode(envelope: dict, table: pa.Table | None = None) -> bytes:
    """A request or answer body: ``envelope`` as one JSON line, then ``table`` (if any) as an Arrow IPC stream."""
    head = json.dumps(envelope, separators=(",", ":"), default=json_default).encode() + b"\n"
    if table is None:
        return head
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return head + sink.getvalue()


def decode(body: bytes) -> tuple[dict, pa.Table | None]:
    """The envelope and table of a body ``encode`` made."""
    head, _, rest = body.partition(b"\n")
    envelope = json.loads(head or b"{}")
    table = None
    if rest:
        with pa.ipc.open_stream(pa.py_buffer(rest)) as r:
            table = r.read_all()
    return envelope, table


def json_default(o):
    if isinstance(o, (dt.date, dt.datetime)):
        return o.isoformat()
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if hasattr(o, "isoformat"):  # pandas.Timestamp
        return o.isoformat()
    return str(o)


# --------------------------------------------------------------------------
# the remote methods
# --------------------------------------------------------------------------
def _same(value):
    return value


@dataclass(frozen=True)
class Arg:
    """One argument of a remote method: ``send`` makes it JSON (client), ``take`` makes it an argument again (daemon).

    A request without a ``required`` argument fails (KeyError: a broken
    request); a missing optional one is ``default``. ``capped``: the free
    SQL limits a client asks for, which the daemon caps at its own.
    """
    send: Callable[[Any], Any] = _same
    take: Callable[[Any], Any] = _same
    required: bool = False
    default: Any = None
    capped: bool = False


@dataclass(frozen=True)
class Answer:
    """A remote method's result: ``pack`` (daemon) makes the answer's JSON fields and table of it, ``unpack``
    (client) the result again, given the call's arguments as well."""
    pack: Callable[[Any], tuple[dict, pa.Table | None]]
    unpack: Callable[[dict, pa.Table | None, dict], Any]


@dataclass(frozen=True)
class Remote:
    """How one Store method crosses the wire.

    ``args``: one Arg per parameter of the Store method, in its order (the
    test suite and ``HttpStore`` check this against ``Store``); ``table``:
    the parameter that travels as the Arrow stream; ``prepare``: the
    client's look at the arguments first, which may normalise them or
    return None (nothing to send: the call returns None).
    """
    name: str
    args: dict[str, Arg]
    answer: Answer
    table: str | None = None
    prepare: Callable[[dict], dict | None] | None = None

    def send(self, values: dict) -> tuple[dict, pa.Table | None] | None:
        """Client: the JSON arguments and table of a call with ``values`` (by parameter name); None: send nothing."""
        if self.prepare is not None:
            values = self.prepare(values)
            if values is None:
                return None
        args = {name: arg.send(values[name]) for name, arg in self.args.items() if name != self.table}
        return args, values[self.table] if self.table else None

    def take(self, args: dict, table: pa.Table | None) -> dict:
        """Daemon: the method's arguments (by parameter name, in order) from a request's JSON and table."""
        values = {}
        for name, arg in self.args.items():
            if name == self.table:
                if table is None:
                    raise StoreError(f"{self.name} needs an Arrow table")
                values[name] = table
            else:
                values[name] = arg.take(args[name] if arg.required else args.get(name, arg.default))
        return values


def _field(key: str, pack: Callable = _same, unpack: Callable = lambda value, _values: value) -> Answer:
    """An answer in one JSON field ``key``."""
    return Answer(lambda result: ({key: pack(result)}, None),
                  lambda envelope, _table, values: unpack(envelope[key], values))


NOTHING = Answer(lambda _result: ({}, None), lambda _envelope, _table, _values: None)
TABLE = Answer(lambda result: ({}, result),
               lambda _envelope, table, _values: table if table is not None else pa.table({}))
ROWS = Answer(lambda rows: ({}, pa.Table.from_pylist(rows) if rows else None),
              lambda _envelope, table, _values: table.to_pylist() if table is not None else [])


def _json_params(params: dict | None) -> dict | None:
    """Query parameters as JSON takes them (dates as ISO text, numpy scalars as numbers)."""
    if params is None:
        return None
    return json.loads(json.dumps(dict(params), default=json_default))


def _send_limits(limits) -> dict | None:
    return None if limits is None else SQLLimits.of(limits).as_dict()


def _send_key(key) -> list:
    job_id, attempt, window_id = key
    return [str(job_id), int(attempt), int(window_id)]


def _take_key(key) -> tuple:
    job_id, attempt, window_id = key
    return (job_id, attempt, window_id)


def _prepare_insert(values: dict) -> dict | None:
    """A RecordBatch goes as a table; anything else but a table is refused here; an empty table is not sent."""
    table = values["table"]
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise StoreError(f"insert({values['kind']!r}) needs a pyarrow Table, got {type(table).__name__}")
    return {**values, "table": table} if table.num_rows else None


def _unpack_offsets(rows: list, values: dict) -> dict[tuple[str, int], int]:
    rows = [{"topic": t, "partition": p, "next_offset": o} for t, p, o in rows]
    return filter_offsets(rows, values["topics"], values["partitions"])


_PARAMS = Arg(send=_json_params)

REMOTE: dict[str, Remote] = {r.name: r for r in (
    Remote("setup", {"target_version": Arg()}, NOTHING),
    Remote("insert", {"kind": Arg(take=str), "table": Arg()}, NOTHING, table="table", prepare=_prepare_insert),
    Remote("query", {"sql": Arg(take=str, default=""), "params": _PARAMS,
                     "limits": Arg(send=_send_limits, capped=True)}, TABLE),
    Remote("run_named", {"name": Arg(take=str, default=""), "params": _PARAMS}, TABLE),
    Remote("window_stored", {"key": Arg(send=_send_key, take=_take_key, required=True)},
           _field("stored", unpack=lambda stored, _values: bool(stored))),
    Remote("load_offsets", {"source_id": Arg(required=True),
                            "topics": Arg(send=lambda topics: None if topics is None else list(topics)),
                            "partitions": Arg(send=lambda parts: None if parts is None else [int(p) for p in parts])},
           _field("offsets", pack=lambda offsets: [[t, p, o] for (t, p), o in offsets.items()],
                  unpack=_unpack_offsets)),
    Remote("store_offsets", {"source_id": Arg(required=True),
                             "offsets": Arg(send=lambda offsets: [[t, int(p), int(o)] for (t, p), o in offsets.items()],
                                            take=lambda rows: {(t, int(p)): int(o) for t, p, o in rows},
                                            required=True),
                             "log_ids": Arg(send=lambda ids: None if not ids else
                                            [[t, int(p), str(i)] for (t, p), i in ids.items()],
                                            take=lambda rows: {(t, int(p)): str(i) for t, p, i in rows or ()})},
           NOTHING, prepare=lambda values: values if values["offsets"] else None),
    Remote("load_offset_logs", {"source_id": Arg(required=True),
                                "topics": Arg(send=lambda topics: None if topics is None else list(topics)),
                                "partitions": Arg(send=lambda parts: None if parts is None
                                                  else [int(p) for p in parts])},
           _field("logs", pack=lambda logs: [[t, p, i] for (t, p), i in logs.items()],
                  unpack=lambda rows, values: filter_offsets(
                      [{"topic": t, "partition": p, "next_offset": i} for t, p, i in rows],
                      values["topics"], values["partitions"], value=str))),
    Remote("store_state", {"source_id": Arg(required=True), "shard": Arg(take=str, required=True),
                           "fmt": Arg(take=int, required=True),
                           "state": Arg(send=lambda b: base64.b64encode(bytes(b)).decode("ascii"),
                                        take=lambda text: base64.b64decode(text, validate=True), required=True)},
           NOTHING),
    Remote("load_state", {"source_id": Arg(required=True), "shard": Arg(take=str, required=True)},
           _field("state", pack=lambda got: None if got is None else [got[0], base64.b64encode(got[1]).decode()],
                  unpack=lambda got, _values: None if got is None else (int(got[0]), base64.b64decode(got[1])))),
    Remote("load_jobs", {}, ROWS),
    Remote("enforce_retention", {"now_ns": Arg()}, _field("dropped")),
)}

# Abstract Store methods the daemon does not serve: the client does them itself.
LOCAL = ("close",)
