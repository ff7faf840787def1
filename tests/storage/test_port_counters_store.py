"""Hosts' port counters in the store: stored once per host, port and time, summed by the named queries the console
and the lemon scoring read (``job_port_counters``, ``lemon_port_errors``)."""
from __future__ import annotations

from core import codec
from core import schema as S
from tests.storage.conftest import BASE_NS

SEC = 10**9


def row(host, t_s, job="j", attempt=0, device="mlx5_0", **counts):
    base = dict(job_id=job, attempt=attempt, rank=0, host=host, device=device, port=1, ts_ns=BASE_NS + t_s * SEC,
                elapsed_ns=60 * SEC, state="ACTIVE", xmit_wait=100, xmit_discards=0, rcv_discards=-1, symbol_errors=0,
                rcv_errors=0, link_downed=0, link_error_recovery=0, xmit_bytes=4000, rcv_bytes=8000,
                hw_counters_json='{"out_of_buffer":2}', reset=False)
    return dict(base, **counts)


def test_port_rows_are_summed_per_port_and_errors_found_for_the_lemon_scoring(store):
    rows = [row("h1", 60), row("h1", 120, state="DOWN", link_downed=2, symbol_errors=50), row("h2", 60),
            row("h2", 60, device="mlx5_1", xmit_wait=-1), row("h1", 60, job="k", rcv_errors=3)]
    table = codec.from_rows(S.PORT_COUNTER, rows)
    store.insert("port_counter", table)
    store.insert("port_counter", table)  # a replay stores nothing twice
    got = store.run_named("job_port_counters", {"job_id": "j"}).to_pylist()
    assert [(r["host"], r["device"]) for r in got] == [("h1", "mlx5_0"), ("h2", "mlx5_0"), ("h2", "mlx5_1")]
    h1 = got[0]
    assert (h1["xmit_wait"], h1["link_downed"], h1["symbol_errors"], h1["rcv_discards"], h1["elapsed_ns"],
            h1["state"], h1["samples"]) == (200, 2, 50, -1, 120 * SEC, "DOWN", 2)
    assert got[2]["xmit_wait"] == -1  # the port never had the counter: unknown, not 0
    span = store.run_named("job_port_counters", {"job_id": "j", "since": BASE_NS + 100 * SEC}).to_pylist()
    assert [r["samples"] for r in span] == [1]
    errs = store.run_named("lemon_port_errors", {"since": BASE_NS, "until": BASE_NS + 3600 * SEC}).to_pylist()
    assert [(r["job_id"], r["host"], r["link_downed"], r["rcv_errors"]) for r in errs] == [("j", "h1", 2, 0),
                                                                                          ("k", "h1", 0, 3)]
