"""The pipeline's own health as Prometheus metrics, served on 127.0.0.1.

A custom collector reads the shards' counters at scrape time (one
``status()`` round trip), so nothing is double-bookkept: the shard's
``ShardStats`` is the one place a number lives.
"""
from __future__ import annotations

from typing import Callable

# (status key, metric name, kind, help)
_METRICS = (
    ("messages", "ss_messages_total", "counter", "Kafka messages handled"),
    ("records", "ss_records_total", "counter", "op-span records routed to windows"),
    ("dead_letters", "ss_dead_letters_total", "counter", "messages rejected to the dead-letter topic"),
    ("late_records", "ss_late_records_total", "counter", "records that arrived after their window was analysed"),
    ("heartbeats", "ss_heartbeats_total", "counter", "heartbeat records seen"),
    ("ccl_records", "ss_ccl_records_total", "counter", "collective records seen"),
    ("tcp_flows", "ss_tcp_flows_total", "counter", "TCP connection samples seen"),
    ("port_counters", "ss_port_counters_total", "counter", "NIC port-counter readings seen"),
    ("windows_stored", "ss_windows_stored_total", "counter", "windows analysed and stored"),
    ("windows_failed", "ss_windows_failed_total", "counter", "windows whose analysis task failed"),
    ("span_windows_kept", "ss_span_windows_kept_total", "counter", "windows whose raw op spans were stored"),
    ("alerts", "ss_alerts_total", "counter", "alerts raised"),
    ("control_changes", "ss_control_changes_total", "counter",
     "run-time changes read from the control topic and stored (stragglerscope control)"),
    ("control_refused", "ss_control_refused_total", "counter", "control records refused by the one check of a change"),
    ("webhook_sent", "ss_webhook_sent_total", "counter", "alerts POSTed to the webhook"),
    ("webhook_failed", "ss_webhook_failed_total", "counter", "alerts the webhook refused after retries"),
    ("webhook_dropped", "ss_webhook_dropped_total", "counter", "alerts dropped because the webhook fell behind"),
    ("dispatch_to_stored_seconds", "ss_window_dispatch_to_stored_seconds_total", "counter",
     "seconds from a window's dispatch to its stored result, summed over windows"),
    ("window_latency_s_last", "ss_window_latency_seconds", "gauge", "dispatch-to-stored latency of the last window"),
    ("inflight", "ss_inflight_analyses", "gauge", "analyses in flight"),
    ("open_windows", "ss_open_windows", "gauge", "windows being filled"),
    ("buffered_rows", "ss_buffered_rows", "gauge", "op-span rows held in open windows"),
    ("lag", "ss_consumer_lag", "gauge", "records not yet consumed"),
    ("units_dropped", "ss_units_dropped_total", "counter", "result units dropped: refused repeatedly by a live store"),
    ("loops", "ss_loop_passes_total", "counter", "shard loop passes run (0: not polling yet, lag unknown)"),
    ("heartbeat_age_s", "ss_heartbeat_age_seconds", "gauge", "age of the newest heartbeat on arrival"),
    ("heartbeat_silence_s", "ss_heartbeat_silence_seconds", "gauge", "seconds since any heartbeat arrived"),
    ("hang_clock_held_back_s", "ss_hang_clock_held_back_seconds", "gauge",
     "how far hang checks judged behind the wall clock, waiting for lagging input"),
    ("loop_seconds_max", "ss_loop_seconds_max", "gauge", "longest shard loop iteration in the last 1-2 minutes"),
    ("quarantined", "ss_quarantined_total", "counter",
     "messages dead-lettered by offset because handling them killed the shard repeatedly"),
    ("clock_corrected_rows", "ss_clock_corrected_rows_total", "counter",
     "heartbeat and collective rows whose implausible rank clock was corrected"),
    ("bad_stored_jobs", "ss_bad_stored_jobs", "gauge", "stored registrations skipped at start: they do not validate"),
    ("jobs_registered", "ss_jobs_registered_total", "counter", "job registrations accepted"),
    ("hangs", "ss_hangs_total", "counter", "hangs detected"),
    ("checkpoints", "ss_checkpoints_total", "counter", "checkpoint save and load records seen"),
    ("downtime_incidents", "ss_downtime_incidents_total", "counter", "downtime incidents stored"),
    ("regression_jobs", "ss_regression_jobs", "gauge", "jobs whose history the regression detector follows"),
    ("regressions", "ss_regressions_total", "counter", "regressions against a job's own past stored"),
    ("recoveries", "ss_recoveries_total", "counter", "returns to a job's baseline stored"),
    ("degraded_workers", "ss_degraded_workers_total", "counter", "workers found over their own best, stored"),
    ("commits", "ss_offset_commits_total", "counter", "offset stores, each after the results it covers were stored"),
    ("store_down_s", "ss_store_down_seconds", "gauge",
     "seconds the store has been unreachable, results and offsets waiting (0: it takes writes)"),
    ("windows_waiting", "ss_windows_waiting", "gauge",
     "windows closed and not stored yet: in analysis, or waiting for the store"),
    ("kafka_brokers", "ss_kafka_brokers", "gauge",
     "brokers in the shard's Kafka metadata: fewer than the cluster has, one is away"),
)


class MetricsServer:
    def __init__(self, status: Callable[[], list[dict]], port: int = 0, host: str = "127.0.0.1",
                 placement: Callable[[], object] | None = None):
        """``placement()``: the driver's last ``ray_jobs.placement.Placement`` (None: not known yet)."""
        self._status = status
        self._placement = placement
        self.port = port
        self.host = host
        self._server = None

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        shards = self._status()
        for key, name, kind, doc in _METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(name[:-6] if kind == "counter" and name.endswith("_total") else name, doc, labels=["shard"])
            for st in shards:
                if key in st:
                    fam.add_metric([str(st.get("shard", "?"))], float(st[key]))
            yield fam
        store_up = GaugeMetricFamily("ss_store_up", "1 while the store takes the shard's writes", labels=["shard"])
        for st in shards:
            if "store_down_s" in st:
                store_up.add_metric([str(st.get("shard", "?"))], 0.0 if st["store_down_s"] > 0 else 1.0)
        yield store_up
        up = GaugeMetricFamily("ss_shard_up", "1 when the shard answered its status call", labels=["shard"])
        for st in shards:
            up.add_metric([str(st.get("shard", "?"))], 0.0 if st.get("unavailable") else 1.0)
        yield up
        placed = self._placement() if self._placement is not None else None
        if placed is not None:
            yield GaugeMetricFamily("ss_shards_unplaceable", "shard actors no alive Ray node can hold",
                                    value=float(placed.unplaced))
            yield GaugeMetricFamily("ss_analysis_slots",
                                    "analyses the Ray nodes can run at once beside the shards (0: none ever runs)",
                                    value=float(placed.analysis_slots))

    def start(self) -> "MetricsServer":
        from prometheus_client import CollectorRegistry, start_http_server

        reg = CollectorRegistry()
        reg.register(self)
        # Port 0 binds a free port atomically (no probe-then-bind race); the server says which.
        self._server, _ = start_http_server(self.port, addr=self.host, registry=reg)
        self.port = self._server.server_port
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()  # release the port now, not when the object is collected
            self._server = None
