"""Lemon hosts, scored over a real chDB store as the driver of `run` scores them (issue 41).

A fleet of job attempts, each on two hosts (2 ranks per host), some
with a slow-worker window, a hang or a worker over its own best that points
at a host. Host ``h07`` is implicated by one job after another; every other
implicated host once. The pass maps each finding to its machine through the
stored rank hosts and window profiles, weighs hosts by their GPU-hours, and
names h07 a lemon after its third job, not before; the alert is raised once.
"""
from __future__ import annotations

import json

import pytest

from analyzers.lemons import LemonParams
from core import codec
from core import schema as S
from ray_jobs.lemon_watch import LemonWatch, read_topology

pytestmark = pytest.mark.integration

NOW = 1_800_000_000 * 10**9
HOUR = 3600 * 10**9
WINDOW_DEFAULTS = dict(first_step=0, last_step=9, n_steps=10, start_ns=0, end_ns=0, team="t", model="m", n_gpus=4,
                       dp_size=2, pp_size=2, launch_slowdown=1.0, waste_fraction=0.1, step_time_actual=1.0,
                       step_time_sim=1.0, step_time_ideal=0.9, wasted_gpu_hours=0.0, m_w=0.0, m_s=0.0,
                       verdicts_json="[]", complete=True, note="", n_ops=100, mfu=float("nan"),
                       mfu_ideal=float("nan"))


@pytest.fixture
def store(tmp_path):
    from storage import open_store

    s = open_store(f"chdb://{tmp_path / 'store'}")
    s.setup()
    yield s
    s.close()


def hosts_of(j: int) -> tuple[str, str]:
    return f"h{2 * j + 100:03d}", f"h{2 * j + 101:03d}"


def add_job(store, j: int, at_ns: int, slow_host: str | None = None, how: str = "worker", hours: float = 1.0) -> str:
    """Job attempt j: ranks 0-1 on its first host (worker dp0/pp0, dp0/pp1), 2-3 on its second (dp1/*),
    or on ``slow_host`` for its first two ranks; ``hours`` GPU-hours; a finding on its first host when asked."""
    job = f"job-{j:03d}"
    first, second = hosts_of(j)
    if slow_host:
        first = slow_host
    store.insert("rank_host", codec.from_rows(S.RANK_HOST, [
        dict(job_id=job, attempt=0, rank=r, host=first if r < 2 else second, seen_ns=at_ns) for r in range(4)]))
    verdict = "worker" if how == "worker" and slow_host else ""
    store.insert("window", codec.from_rows(S.WINDOW, [dict(
        WINDOW_DEFAULTS, job_id=job, attempt=0, window_id=0, analyzed_ns=at_ns, slowdown=1.3 if verdict else 1.01,
        gpu_hours=hours, verdict=verdict)]))
    store.insert("window_profile", codec.from_rows(S.WINDOW_PROFILE, [
        dict(job_id=job, attempt=0, window_id=0, first_step=0, end_ns=at_ns, dp_rank=d, pp_rank=p, rank=2 * d + p,
             optype="step", seconds=1.0) for d in range(2) for p in range(2)]))
    store.insert("worker_slowdown", codec.from_rows(S.WORKER_SLOWDOWN, [
        dict(job_id=job, attempt=0, window_id=0, step=-1, dp_rank=d, pp_rank=p, s_dp=1.0, s_pp=1.0,
             s_w=1.4 if (d, p) == (0, 1) and verdict else 1.0) for d in range(2) for p in range(2)]))
    if how == "hang" and slow_host:
        store.insert("hang", codec.from_rows(S.HANG, [dict(
            job_id=job, attempt=0, hang_id=at_ns, kind="node_loss", group="world", seq=-1, op="", stuck_ranks="",
            missing_ranks="0-1", suspect_hosts=first, since_ns=at_ns - 60 * 10**9, duration_s=60.0,
            evidence_json="{}")]))
    if how == "degraded" and slow_host:
        store.insert("regression", codec.from_rows(S.REGRESSION, [dict(
            job_id=job, kind="degraded_worker", attempt=0, window_id=0, began_window=0, began_step=0, change=0.2,
            before_s=1.0, after_s=1.2, optypes_json="{}", scope="dp0/pp0", summary="", found_ns=at_ns)]))
    return job


def test_a_host_implicated_by_three_jobs_is_a_lemon_after_the_third(store, tmp_path):
    topo = tmp_path / "topology.csv"
    topo.write_text("# host,switch\nh07,switch-3\nh06,switch-3\n")
    watch = LemonWatch(store, LemonParams(min_jobs=3, max_p=1e-3), period_s=7 * 86400.0,
                       labels=read_topology(str(topo)))
    t = NOW - 100 * HOUR
    # 60 healthy job attempts of 4 GPU-hours and 6 short ones with a slow worker each on a different host:
    # the fleet's own rate of implications per GPU-hour (a host that straggles once is that rate).
    for j in range(60):
        add_job(store, j, t + j * HOUR, hours=4.0)
    for j, host in zip(range(60, 66), ("h11", "h15", "h21", "h25", "h31", "h35")):
        add_job(store, j, t + j * HOUR, slow_host=host)
    passes = []
    for k, how in enumerate(("worker", "hang", "degraded")):  # h07's three jobs, each a different finding
        add_job(store, 70 + k, t + (70 + k) * HOUR, slow_host="h07", how=how)
        passes.append(watch.score(now_ns=NOW + k))
    lemons = [[s.host for s in p if s.lemon] for p in passes]
    assert lemons == [[], [], ["h07"]], lemons
    top = passes[-1][0]
    assert top.host == "h07" and top.jobs == 3 and {e["kind"] for e in top.evidence} == {
        "worker", "node_loss", "degraded_worker"}, top
    (row,) = store.run_named("lemon_hosts", {"lemons_only": 1}).to_pylist()
    assert row["host"] == "h07" and row["label"] == "switch-3" and row["jobs"] == 3
    assert [e["job_id"] for e in json.loads(row["evidence_json"])] == ["job-070", "job-071", "job-072"]
    # one alert, and no second one on the next pass
    watch.score(now_ns=NOW + 10)
    alerts = store.query("SELECT rule, severity, summary FROM alerts WHERE rule = 'lemon_host'").to_pylist()
    assert len(alerts) == 1 and alerts[0]["severity"] == "critical", alerts
    assert alerts[0]["summary"].startswith("host h07 (switch-3) is a lemon: 3 jobs implicated it"), alerts
    # the hosts that straggled once stay hosts, not lemons
    assert all(not s.lemon for s in passes[-1] if s.host != "h07")


def test_a_lemon_alert_leaves_by_the_shards_path_to_the_webhook_and_the_topic(store, broker):
    """Issue 50: lemon-host alerts were inserted into the table alone and never reached the pager. The driver's
    alerts now go out as the shards' do: a real webhook receiver on 127.0.0.1 and the real alert topic."""
    import http.server
    import threading

    from kafka import KafkaConsumer

    from core import topics
    from core.config import AlertConfig
    from core.kafka_admin import ensure_topics
    from core.kafka_conn import KafkaConn
    from ray_jobs.alerts import AlertOutlet, AlertTopic, DriverAlerts

    received: list[dict] = []
    got = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            got.set()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ensure_topics(broker.bootstrap, [topics.TOPIC_ALERTS], 1)
    consumer = KafkaConsumer(topics.TOPIC_ALERTS, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=20000, group_id=None)
    topic = AlertTopic.for_conn(KafkaConn(broker.bootstrap), "test-driver")
    outlet = AlertOutlet(topic.send, f"http://127.0.0.1:{srv.server_port}/hook", topic.flush)
    watch = LemonWatch(store, LemonParams(min_jobs=3, max_p=1e-3), period_s=7 * 86400.0,
                       alerts=DriverAlerts(AlertConfig(), store, outlet))
    try:
        t = NOW - 100 * HOUR
        for j in range(40):
            add_job(store, j, t + j * HOUR, hours=4.0)
        for k in range(3):
            add_job(store, 70 + k, t + (70 + k) * HOUR, slow_host="h07")
        watch.score(now_ns=NOW)
        assert got.wait(20), "the webhook got nothing"
        outlet.close()
        assert [a["rule"] for a in received] == ["lemon_host"]
        assert received[0]["summary"].startswith("host h07 is a lemon"), received
        on_topic = []
        for m in consumer:  # up to 20 s for the first
            a = json.loads(m.value)
            if a["rule"] == "lemon_host":
                on_topic.append(a)
                break
        assert [a["alert_id"] for a in on_topic] == [received[0]["alert_id"]]
        stored = store.query("SELECT alert_id FROM alerts WHERE rule = 'lemon_host'").to_pylist()
        assert [r["alert_id"] for r in stored] == [received[0]["alert_id"]]
    finally:
        consumer.close()
        srv.shutdown()
