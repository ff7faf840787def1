"""The job page's fabric panel, without Streamlit: a job's hosts' port counters as sentences and a table.

Input is what ``job_port_counters`` returns (one row per host and port, summed over the period asked for);
the sentences are ``analyzers.fabric.host_verdicts``', so the console words a port as the link evidence does.
"""
from __future__ import annotations

import pandas as pd

from analyzers.fabric import FabricParams, host_verdicts

COLUMNS = ("host", "port", "state", "transmit waits", "discards", "symbol errors", "receive errors", "link downed",
           "link recoveries", "sent GB", "received GB")


def _known(v) -> object:
    """A summed counter for a person: '–' where the port lacks it (-1)."""
    return "–" if v is None or v < 0 else int(v)


def port_panel(ports: pd.DataFrame, params: FabricParams = FabricParams()) -> tuple[list[str], pd.DataFrame]:
    """(one sentence per host whose ports waited or erred, one row per port); ([], empty) without rows."""
    if ports is None or ports.empty:
        return [], pd.DataFrame(columns=list(COLUMNS))
    rows = ports.to_dict("records")
    sentences = [v.sentence for v in host_verdicts(rows, params=params).values() if v.problem]
    out = []
    for r in rows:
        elapsed, wait = int(r.get("elapsed_ns", 0)), int(r.get("xmit_wait", -1))
        discards = [int(r.get(c, -1)) for c in ("xmit_discards", "rcv_discards")]
        out.append({
            "host": r["host"], "port": f"{r['device']}/{r['port']}", "state": r.get("state") or "",
            "transmit waits": (f"{100 * min(1.0, wait * params.tick_ns / elapsed):.1f}%" if wait >= 0 and elapsed > 0
                               else "–"),
            "discards": _known(sum(d for d in discards if d >= 0) if any(d >= 0 for d in discards) else -1),
            "symbol errors": _known(r.get("symbol_errors")), "receive errors": _known(r.get("rcv_errors")),
            "link downed": _known(r.get("link_downed")), "link recoveries": _known(r.get("link_error_recovery")),
            "sent GB": round(r["xmit_bytes"] / 1e9, 2) if r.get("xmit_bytes", -1) >= 0 else "–",
            "received GB": round(r["rcv_bytes"] / 1e9, 2) if r.get("rcv_bytes", -1) >= 0 else "–",
        })
    return sentences, pd.DataFrame(out, columns=list(COLUMNS))
