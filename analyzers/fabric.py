"""Is it the fabric? What a host's InfiniBand/RoCE ports say over a window, as evidence beside the link diagnosis.

The link diagnosis (``analyzers/links``) names a slow element from timings; the
port counters a host reported (``core.schema.PORT_COUNTER``, read by
``ingest/port_counters.py``) say what the NIC's port saw meanwhile: data kept
waiting for credits (``xmit_wait``: a congested link or switch), discards, and
the errors and flaps of a bad cable or transceiver (``link_downed``,
``link_error_recovery``, ``symbol_errors``, ``rcv_errors``).

- ``host_verdicts(rows, start_ns, end_ns)``: per host, one short sentence ("port
  mlx5_0/1 of host h1: transmit waits 12% of the window" / "link downed 3 times,
  140 symbol errors"), and whether it is a finding.
- ``link_fabric_evidence`` / ``with_fabric_evidence``: the hosts of a link
  finding's ranks whose ports waited or erred, put into its evidence under
  ``fabric`` inside the window's analysis, which ``analyzers.explain.link_basis``
  words.
- ``port_incidents``: port errors (never waits: congestion is the fabric's, not
  the host's) as lemon-host implications (``analyzers.lemons.Incident``).

Waits are ticks whose length the NIC defines; ``FabricParams.tick_ns`` turns them
into time. Its default (1 ns) is a floor, not a measurement: with longer real
ticks the shares are understated, so a finding is never made of a tick
assumed too long. Pure: rows in (dicts of PORT_COUNTER fields), words and
tables out.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any, Iterable, Mapping


from analyzers.lemons import Incident
from analyzers.links.fault import LinkFault

COUNTS = ("xmit_wait", "xmit_discards", "rcv_discards", "symbol_errors", "rcv_errors", "link_downed",
          "link_error_recovery", "xmit_bytes", "rcv_bytes")
"""The summed counters of a PORT_COUNTER row (-1 where the port did not have it)."""
ERRORS = ("link_downed", "link_error_recovery", "symbol_errors", "rcv_errors", "xmit_discards", "rcv_discards")


@dataclasses.dataclass(frozen=True)
class FabricParams:
    tick_ns: float = 1.0
    """Length of one ``port_xmit_wait`` tick. The hardware defines it; see the module docstring."""
    wait_share: float = 0.05
    """Transmit waits over this share of the time a port was read over are a finding."""
    symbol_errors: int = 10
    """Symbol errors at or over this count are a finding (a link corrects a few; a failing lane makes many)."""
    other_errors: int = 1
    """Link downs, link recoveries, receive errors and discards at or over this count are a finding."""


def _port_key(r: Mapping) -> tuple[str, str, int]:
    return str(r.get("host", "")), str(r.get("device", "")), int(r.get("port", 0))


def _hw(text: Any) -> dict[str, int]:
    """The driver counters of a row's ``hw_counters_json``; {} where it is missing or not a JSON object of counts."""
    try:
        hw = json.loads(text or "{}")
    except (TypeError, ValueError):
        return {}
    if not isinstance(hw, dict):
        return {}
    return {str(k): int(v) for k, v in hw.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def merge(rows: Iterable[Mapping]) -> dict[str, Any]:
    """One port's rows summed: the counters (-1 only where every row lacks one), the time read over, the latest
    state and time, whether any counter was reset, and the hardware counters by name."""
    out: dict[str, Any] = {c: -1 for c in COUNTS}
    out.update(elapsed_ns=0, ts_ns=-1, state="", reset=False, hw={}, samples=0)
    for r in rows:
        out["samples"] += 1
        for c in COUNTS:
            v = int(r.get(c, -1))
            if v >= 0:
                out[c] = max(out[c], 0) + v
        out["elapsed_ns"] += max(0, int(r.get("elapsed_ns", 0)))
        if int(r.get("ts_ns", -1)) >= out["ts_ns"]:
            out["ts_ns"], out["state"] = int(r.get("ts_ns", -1)), str(r.get("state") or "")
        out["reset"] |= bool(r.get("reset"))
        for name, v in _hw(r.get("hw_counters_json")).items():
            out["hw"][name] = out["hw"].get(name, 0) + v
    for k in ("host", "device", "port"):
        out[k] = None
    return out


def by_port(rows: Iterable[Mapping], start_ns: int | None = None, end_ns: int | None = None
            ) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Rows summed per (host, device, port); with a span, only the rows whose interval overlaps it (a row covers
    ``ts_ns - elapsed_ns`` to ``ts_ns``; one that only touches the span's edge is left out)."""
    groups: dict[tuple[str, str, int], list[Mapping]] = defaultdict(list)
    for r in rows:
        ts = int(r.get("ts_ns", -1))
        begin = ts - max(0, int(r.get("elapsed_ns", 0)))
        if start_ns is not None and ts <= start_ns:  # ended before the span (touching is not overlapping)
            continue
        if end_ns is not None and begin >= end_ns:
            continue
        groups[_port_key(r)].append(r)
    out = {}
    for key, rs in groups.items():
        m = merge(rs)
        m["host"], m["device"], m["port"] = key
        out[key] = m
    return out


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def port_findings(port: Mapping[str, Any], params: FabricParams = FabricParams()) -> list[dict[str, Any]]:
    """What is wrong with one summed port ({'what', 'value', 'text'} each); [] where it waited and erred little."""
    out = []
    wait, elapsed = port.get("xmit_wait", -1), port.get("elapsed_ns", 0)
    if wait > 0 and elapsed > 0:
        share = wait * params.tick_ns / elapsed
        if share >= params.wait_share:
            out.append(dict(what="xmit_wait", value=min(share, 1.0), ticks=wait,
                            text=f"transmit waits {100 * min(share, 1.0):.0f}% of the window"))
    words = {"link_downed": ("link downed", lambda n: f"link downed {_plural(n, 'time')}"),
             "link_error_recovery": ("link recoveries", lambda n: _plural(n, "link recovery", "link recoveries")),
             "symbol_errors": ("symbol errors", lambda n: _plural(n, "symbol error")),
             "rcv_errors": ("receive errors", lambda n: _plural(n, "receive error")),
             "xmit_discards": ("transmit discards", lambda n: _plural(n, "transmit discard")),
             "rcv_discards": ("receive discards", lambda n: _plural(n, "receive discard"))}
    for name in ERRORS:
        n = int(port.get(name, -1))
        least = params.symbol_errors if name == "symbol_errors" else params.other_errors
        if n >= least:
            out.append(dict(what=name, value=n, text=words[name][1](n)))
    if port.get("state") and port["state"] not in ("ACTIVE", "ACTIVE_DEFER"):
        out.append(dict(what="state", value=port["state"], text=f"port {port['state']} now"))
    return out


@dataclasses.dataclass(frozen=True)
class FabricVerdict:
    host: str
    problem: bool                  # a port of it waited or erred enough to be a finding
    sentence: str                  # "port mlx5_0/1 of host h1: transmit waits 12% of the window"
    ports: tuple[dict, ...] = ()   # per port with a finding: device, port and its findings

    def to_dict(self) -> dict[str, Any]:
        return dict(host=self.host, problem=self.problem, sentence=self.sentence, ports=list(self.ports))


def host_verdicts(rows: Iterable[Mapping], start_ns: int | None = None, end_ns: int | None = None,
                  hosts: Iterable[str] | None = None, params: FabricParams = FabricParams()
                  ) -> dict[str, FabricVerdict]:
    """Per host, what its ports say over [start_ns, end_ns] (all rows without a span).

    ``rows``: PORT_COUNTER rows (dicts) of the hosts involved, e.g. those of a window's ranks. ``hosts``: only
    these (a host asked for without rows gets a verdict saying its ports were not sampled, ``problem`` False).
    A host with a finding: one clause per port that has one ("port mlx5_0/1 of host h1: transmit waits 12% of
    the window; port mlx5_1/1 of host h1: link downed 3 times, 140 symbol errors"); a healthy host: "ports of
    host h3: no waits or errors (2 ports)".
    """
    wanted = None if hosts is None else set(hosts)
    ports_of: dict[str, list[dict]] = defaultdict(list)
    for key, port in sorted(by_port(rows, start_ns, end_ns).items()):
        if wanted is None or key[0] in wanted:
            ports_of[key[0]].append(port)
    out = {}
    for host in sorted(set(ports_of) | (wanted or set())):
        ports = ports_of.get(host, [])
        if not ports:
            out[host] = FabricVerdict(host, False, f"ports of host {host}: not sampled")
            continue
        clauses, bad = [], []
        for p in ports:
            found = port_findings(p, params)
            if found:
                clauses.append(f"port {p['device']}/{p['port']} of host {host}: " + ", ".join(f["text"] for f in found))
                bad.append(dict(device=p["device"], port=p["port"], findings=found))
        if bad:
            out[host] = FabricVerdict(host, True, "; ".join(clauses), tuple(bad))
        else:
            out[host] = FabricVerdict(host, False, f"ports of host {host}: no waits or errors "
                                                   f"({_plural(len(ports), 'port')})")
    return out


def link_fabric_evidence(ranks: Iterable[int], rank_hosts: Mapping[int, str], rows: Iterable[Mapping],
                         start_ns: int | None = None, end_ns: int | None = None,
                         params: FabricParams = FabricParams()) -> list[dict[str, Any]]:
    """The ``fabric`` evidence of a link finding about ``ranks`` (its src and dst; -1 ignored): for each of their
    hosts whose ports waited or erred over the window, {'host', 'ranks', 'sentence', 'ports'}; [] otherwise."""
    hosts: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        if r is not None and r >= 0 and r in rank_hosts:
            hosts[rank_hosts[r]].append(int(r))
    if not hosts:
        return []
    verdicts = host_verdicts(rows, start_ns, end_ns, hosts=hosts, params=params)
    return [dict(verdicts[h].to_dict(), ranks=sorted(set(rs))) for h, rs in sorted(hosts.items())
            if verdicts[h].problem]


def with_fabric_evidence(faults: list[LinkFault], rows: Iterable[Mapping], rank_hosts: Mapping[int, str],
                         start_ns: int | None = None, end_ns: int | None = None,
                         params: FabricParams = FabricParams()) -> list[LinkFault]:
    """A window's link findings, each with ``evidence['fabric']`` (``link_fabric_evidence`` of its src and dst)
    where a host of theirs had port waits or errors in [start_ns, end_ns]; the others as they were. Made inside
    the window's analysis (``analyzers.window``: the shard hands the port rows of the job's hosts in its
    ``WindowContext``); ``analyzers.explain.link_sentence`` then says it."""
    rows = list(rows)
    if not rows or not faults:
        return faults
    out = []
    for f in faults:
        fabric = link_fabric_evidence((f.src, f.dst), rank_hosts, rows, start_ns, end_ns, params)
        out.append(dataclasses.replace(f, evidence={**f.evidence, "fabric": fabric}) if fabric else f)
    return out


def port_incidents(rows: Iterable[Mapping], params: FabricParams = FabricParams()) -> list[Incident]:
    """Port errors as implications of their host, one per job attempt, host and port that had any (``rows``: per
    job attempt, summed or not). Waits are not: a congested port is the fabric's load, not the host's fault."""
    groups: dict[tuple, list[Mapping]] = defaultdict(list)
    for r in rows:
        groups[(str(r.get("job_id", "")), int(r.get("attempt", 0))) + _port_key(r)].append(r)
    out = []
    for (job, attempt, host, device, port), rs in sorted(groups.items()):
        m = merge(rs)
        found = [f for f in port_findings(m, params) if f["what"] in ERRORS]
        if found:
            out.append(Incident(host, job, attempt, m["ts_ns"], "port_errors",
                                f"port {device}/{port}: " + ", ".join(f["text"] for f in found)))
    return out
