"""One frozen, validated configuration, read once at the entry point.

Sources, later ones winning: built-in defaults (the embedded local setup), a
TOML file (``--config``), environment variables ``STRAGGLERSCOPE_<SECTION>_<KEY>``
(e.g. ``STRAGGLERSCOPE_KAFKA_BOOTSTRAP``). Everything below the CLI receives
the parts it needs explicitly; nothing else reads the environment.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import Any, Mapping


class ConfigError(ValueError):
    """Bad configuration; the message names the key and what is wrong."""


@dataclasses.dataclass(frozen=True)
class KafkaConfig:
    bootstrap: str = ""
    """host:port[,host:port]; empty = start the embedded Tansu broker on 127.0.0.1."""
    partitions: int = 8
    """Partitions per input topic (same count for every topic: shards are partition-affine)."""
    source_id: str = ""
    """Names the Kafka cluster in stored offsets; empty = the bootstrap string (embedded: per run)."""
    replication_factor: int = 1
    """Replicas of each topic stragglerscope creates (3 on a production cluster, so acks=all means something)."""
    min_insync_replicas: int = 0
    """min.insync.replicas of the topics it creates (2 with 3 replicas: acks=all survives a broker); 0 = broker's."""
    security_protocol: str = "PLAINTEXT"
    """PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL over TLS): for every producer, consumer and admin."""
    sasl_mechanism: str = "SCRAM-SHA-512"
    """SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN (PLAIN only over SASL_SSL: it sends the password as is)."""
    sasl_username: str = ""
    """SASL user name (SASL_PLAINTEXT, SASL_SSL)."""
    sasl_password_file: str = ""
    """File holding the SASL password, read when a client connects; or STRAGGLERSCOPE_KAFKA_SASL_PASSWORD."""
    sasl_password: str = dataclasses.field(default="", repr=False)
    """The SASL password, from STRAGGLERSCOPE_KAFKA_SASL_PASSWORD only (refused in a file; never printed)."""
    ssl_cafile: str = ""
    """PEM CA bundle that signed the brokers' certificates; empty = the system's trust store."""
    ssl_certfile: str = ""
    """PEM client certificate (and its key, or see ssl_keyfile) where the brokers require mutual TLS."""
    ssl_keyfile: str = ""
    """PEM private key of ssl_certfile, when not in the same file."""
    ssl_check_hostname: bool = True
    """Check that a broker's certificate names the host connected to (turn off only for IP-only test setups)."""
    # The embedded broker keeps records in memory until their topic is deleted, so its input topics roll over
    # to a new generation this often and generations read to their end are deleted: its memory stays bounded.
    # A configured Kafka has retention and keeps whole topics (core.topics, services.topic_generations).
    topic_generation_s: float = -1.0
    """Seconds per input-topic generation, deleted once read (-1: 120 on the embedded broker, off on others; 0: off)."""
    on_lost_log: str = "stop"
    """When a partition's log is not the one its stored offset was read from (the broker lost its data): 'stop'
    (refuse, name `stragglerscope offsets reset`) or 'rewind' (read the new log from its start; audited)."""

    def conn(self):
        """The ``core.kafka_conn.KafkaConn`` every Kafka client of this configuration is built from."""
        from core.kafka_conn import KafkaConn

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(KafkaConn)}
        # -1 (the default) is resolved where the embedded broker starts (stragglerscope.service); a
        # configured Kafka keeps its topics whole.
        fields["topic_generation_s"] = max(0.0, self.topic_generation_s)
        return KafkaConn(**fields)


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    url: str = "chdb://./.stragglerscope/store"
    """chdb://PATH (embedded), clickhouse://user@host:9000/db (server; TLS: clickhouse://user@host:9440/db?secure=1&ca_certs=PEM)
    or http://127.0.0.1:PORT?token_file=PATH (the store daemon `stragglerscope store` prints)."""
    password_file: str = ""
    """File holding the clickhouse:// store's password, read when the store is opened; the URL then has none."""
    password: str = dataclasses.field(default="", repr=False)
    """The clickhouse:// store's password, from STRAGGLERSCOPE_STORE_PASSWORD only (refused in a file; never printed)."""


@dataclasses.dataclass(frozen=True)
class RayConfig:
    address: str = ""
    """Empty = a local Ray on 127.0.0.1; else ray.init(address=...) of an existing cluster."""
    num_cpus: int = 2
    """CPUs of the local Ray (ignored with an address)."""
    shard_cpus: float = 1.0
    """CPUs each shard actor requests on a Ray cluster (with an address; a local Ray's shards request none)."""
    shard_memory_mb: int = 1024
    """Memory each shard actor requests on a Ray cluster, MB (its open windows: 0.7-0.9 GB measured)."""


SPANS_KEPT_RULE = ("only windows with a verdict keep them, one per job per pipeline.keep_op_spans_every_s "
                   "and each new verdict; not those over pipeline.keep_op_spans_max_rows, nor past the "
                   "op-span retention")
"""Which windows keep their raw op spans, for messages that say why a window has none."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    shards: int = 2
    """Shard actors; each consumes partitions % shards == index and owns many jobs."""
    max_inflight: int = 0
    """Analyses in flight per shard (at the limit it stops polling); 0 = two per analysis CPU of the Ray cluster."""
    idle_timeout_s: float = 20.0
    """A window with no new record for this long is analysed as incomplete."""
    ccl_grace_s: float = 5.0
    """A window whose op spans are complete waits at most this long for every rank's collectives of its last step."""
    max_buffered_rows: int = 5_000_000
    """Rows held in open windows per shard before the shard stops polling."""
    metrics_port: int = 0
    """Prometheus metrics on 127.0.0.1:PORT; 0 = a free port, -1 = off."""
    keep_op_spans_max_rows: int = 200_000
    """Windows with a verdict and at most this many op rows keep their raw spans (timeline, advise); 0 = none."""
    keep_op_spans_every_s: float = 1800.0
    """Per job, keep spans of one window per this many seconds of its clock, plus each change of verdict; 0 = all."""
    ready_timeout_s: float = 120.0
    """How long to wait at start for every shard actor to be consuming before giving up."""
    handle_budget_s: float = 0.5
    """Seconds per loop iteration spent handling polled records before hangs, results and offsets get a turn."""
    commit_interval_s: float = 2.0
    """Store consumer offsets at most this often (each store is an insert); a restart re-reads at most this much."""
    state_interval_s: float = 10.0
    """Save the shards' hang, alert and downtime state at most this often; offsets wait for it (a restart resumes
    from it and re-reads at most this much more)."""
    state_dir: str = ""
    """Where shards keep their crash journals (which message killed a shard); empty = the temp dir."""
    log_format: str = "text"
    """Shard and CLI logs: 'text', or 'json' for one JSON object per line (for a log shipper)."""


@dataclasses.dataclass(frozen=True)
class AlertConfig:
    slowdown_threshold: float = 1.1
    """Alert when a window's S is at least this (the paper's 'significant' straggling)."""
    min_gpus: int = 8
    """Only for jobs of at least this many GPUs."""
    fidelity_tolerance: float = 0.05
    """Alert (info) when launch slowdown differs from 1 by more (the paper drops such windows)."""
    cooldown_s: float = 600.0
    """The same rule for the same job alerts at most once per cool-down."""
    webhook_url: str = ""
    """POST each alert as JSON here; empty = off."""
    store_down_s: float = 60.0
    """A store unreachable this long is a critical store_down alert on the alert topic and the webhook (not in
    the alert table: it is in the store); its return an info one. 0 = off."""
    link_shown_confidence: float = 0.5
    """Link findings at least this confident are printed (trace's summary) and vote for the job's one answer;
    below it they are hints the console lists with the window's matrix. On 340 real runs (BENCHMARKS.md, 'misses
    kept and replayed', 'every class live'), all 263 top findings from 0.5 were right and 1 of the 13 under it."""
    link_confidence: float = 0.5
    """A window's link finding at least this confident raises a link alert: a warning (0.5 is a finding of the
    network one window made: 35 of 35 at 0.5-0.7 right on those runs; a late sender one window made is 0.45, a
    hint, unless that window had it last in every step), critical when the job's window before found the same
    element or ..."""
    link_certain: float = 0.9
    """... when it is at least this confident (209 of 209 right; a late sender is never critical on one window)."""


@dataclasses.dataclass(frozen=True)
class HangConfig:
    """When no progress is a hang, and when a silent rank is lost (``analyzers.hang``: the detector's own
    parameters, as set here)."""

    min_s: float = 8.0
    """Once the job's pace is known, no progress (no op ended on any rank) for quiet_factor times its longest
    normal wait between two ops, and at least this long, is a hang: a job whose steps take 0.5-5 s is named
    within about 15 s."""
    quiet_factor: float = 2.5
    """... that many times the median rank's longest wait between two ops over its recent steps (each rank
    reports it from its third step on)."""
    floor_s: float = 45.0
    """Until the ranks report their pace (the job's first steps), no progress for at least this long can be a
    hang (a checkpoint save gets checkpoint_s)."""
    k_steps: float = 10.0
    """... and for at least this many median step times of the job."""
    silent_s: float = 6.0
    """In a stall, a rank that sent no heartbeat (nor its watch) for this long, or three of its heartbeat
    periods, is missing: the one the others wait for."""
    heartbeat_timeout_s: float = 30.0
    """Ranks silent this long while others report, or stopped (SIGSTOP) this long, are lost: node loss, or
    process loss where their host's other ranks still report."""
    exit_grace_s: float = 5.0
    """A rank whose process exited without finishing is lost when its peers still report this long after (a
    launcher that stops a job stops every rank within moments: that is the job's end)."""
    startup_s: float = 600.0
    """Before any rank begins its first step, no progress for this long is a hang (start-up takes minutes)."""
    checkpoint_s: float = 900.0
    """While a rank is inside a checkpoint save or load (its heartbeats say so), no progress for this long is
    a hang (a save of a large model takes minutes)."""


@dataclasses.dataclass(frozen=True)
class RegressionConfig:
    """A job against its own past: a one-sided CUSUM on log step time per job (``analyzers.regression``)."""

    min_change: float = 0.10
    """The smallest slowdown against the job's own baseline that is a regression (below it, step times drift)."""
    k_windows: int = 3
    """... lasting at least this many windows; a bigger change alarms sooner, one slow window never."""
    baseline_windows: int = 5
    """Windows whose median step time is a job's baseline, at its start and after each change."""


@dataclasses.dataclass(frozen=True)
class LemonConfig:
    """Hosts implicated across jobs (``ray_jobs.lemon_watch``), scored by the driver of `run`."""

    every_s: float = 300.0
    """How often the fleet is scored; 0 = never (a pass reads a period of windows and hangs from the store)."""
    period_days: float = 7.0
    """How far back a pass looks: a host's implications and its GPU-hours in that time."""
    min_jobs: int = 3
    """Distinct jobs that must have implicated a host before it is a lemon (one bad job implicates many times)."""
    max_p: float = 1e-3
    """... and how unlikely that many jobs may be at the fleet's own rate for the GPU-hours it ran, at most."""
    topology_file: str = ""
    """Optional 'host,label' lines (a rack or switch per host) that group hosts in the console."""


@dataclasses.dataclass(frozen=True)
class SQLConfig:
    """Limits of free SQL (``stragglerscope sql --query``, the console's SQL tab)."""

    max_execution_time_s: float = 30.0
    """A free query running longer is cancelled."""
    max_memory_mb: int = 2048
    """A free query needing more memory is cancelled."""
    max_result_rows: int = 100_000
    """A free query returning more rows fails (add a LIMIT)."""


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """Bounds on input records; a record outside them is a dead letter with the bound it broke."""

    max_op_duration_s: float = 6 * 3600.0
    """An op or collective longer than this is not a real measurement (a checkpoint save takes minutes)."""
    max_clock_skew_s: float = 600.0
    """Heartbeats and collectives are live: stamped further ahead of the shard's wall clock, a rank's clock is wrong."""
    max_record_age_s: float = 14 * 86400.0
    """A heartbeat this far behind the wall clock has a wrong clock (no backlog is that old); a collective in
    flight this long is not real. Op spans have no age bound: replays and imports carry their own times."""
    max_world_size: int = 262_144
    """Largest dp x pp x tp x cp a registration may declare."""
    max_job_id_len: int = 128
    """Job ids are 1 to this many characters of A-Z a-z 0-9 and . _ - : / @ + =."""
    max_restarts_per_message: int = 3
    """A message whose handling killed its shard process this many times is dead-lettered by offset."""
    max_decoded_mb: float = 64.0
    """A message whose records would take more than this many MB once decompressed is a dead letter, refused before
    decompressing (a compressed bomb would hold the shard's loop; real batches are under 1 MB on the wire)."""


@dataclasses.dataclass(frozen=True)
class UIConfig:
    port: int = 8501
    """Port of the Streamlit console."""
    address: str = "127.0.0.1"
    """Address the console listens on; loopback unless you put it behind a proxy."""
    control_token_file: str = ""
    """File holding the token a console user types to make run-time changes (needs kafka.bootstrap); empty = read-only."""


@dataclasses.dataclass(frozen=True)
class Config:
    kafka: KafkaConfig = KafkaConfig()
    store: StoreConfig = StoreConfig()
    ray: RayConfig = RayConfig()
    pipeline: PipelineConfig = PipelineConfig()
    alerts: AlertConfig = AlertConfig()
    hang: HangConfig = HangConfig()
    regression: RegressionConfig = RegressionConfig()
    lemons: LemonConfig = LemonConfig()
    sql: SQLConfig = SQLConfig()
    validation: ValidationConfig = ValidationConfig()
    ui: UIConfig = UIConfig()

    def replace(self, **sections: Mapping[str, Any]) -> "Config":
        """A copy with some keys of some sections changed: replace(kafka={"bootstrap": "..."})."""
        return _merge(self, {k: dict(v) for k, v in sections.items()}, "override")


def _coerce(value: Any, typ: type, where: str) -> Any:
    if typ is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: not a boolean: {value!r}")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}") from None


# Keys whose value must be one of a few words.
_CHOICES = {("pipeline", "log_format"): ("text", "json"),
            ("kafka", "on_lost_log"): ("stop", "rewind"),
            ("kafka", "security_protocol"): ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
            ("kafka", "sasl_mechanism"): ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")}

# Secrets: accepted from the environment (or code), never from a configuration file.
_ENV_ONLY = {("store", "password"): "STRAGGLERSCOPE_STORE_PASSWORD",
             ("kafka", "sasl_password"): "STRAGGLERSCOPE_KAFKA_SASL_PASSWORD"}


def _merge(cfg: Config, data: Mapping[str, Mapping[str, Any]], source: str) -> Config:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    updated = {}
    for sname, values in data.items():
        if sname not in sections:
            raise ConfigError(f"{source}: unknown section [{sname}] (known: {', '.join(sections)})")
        current = getattr(cfg, sname)
        fields = {f.name: f for f in dataclasses.fields(current)}
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{sname}] must be a table")
        changes = {}
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown key {sname}.{key} (known: {', '.join(fields)})")
            if (sname, key) in _ENV_ONLY and source not in ("environment", "override"):
                raise ConfigError(f"{source}: {sname}.{key} does not belong in a file: set the "
                                  f"{_ENV_ONLY[sname, key]} environment variable or {sname}.{key}_file")
            typ = type(getattr(current, key))
            changes[key] = _coerce(value, typ, f"{source}: {sname}.{key}")
            allowed = _CHOICES.get((sname, key))
            if allowed and changes[key] not in allowed:
                raise ConfigError(f"{source}: {sname}.{key} must be one of {', '.join(allowed)}, not {value!r}")
        updated[sname] = dataclasses.replace(current, **changes)
    return dataclasses.replace(cfg, **updated)


def load(path: str | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then STRAGGLERSCOPE_* variables of ``env``."""
    cfg = Config()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        cfg = _merge(cfg, data, path)
    env = os.environ if env is None else env
    from_env: dict[str, dict[str, str]] = {}
    for f in dataclasses.fields(Config):
        section = getattr(cfg, f.name)
        for sf in dataclasses.fields(section):
            var = f"STRAGGLERSCOPE_{f.name}_{sf.name}".upper()
            if var in env:
                from_env.setdefault(f.name, {})[sf.name] = env[var]
    if "STRAGGLERSCOPE_STORE" in env:  # short form used by `sql` and the console
        from_env.setdefault("store", {})["url"] = env["STRAGGLERSCOPE_STORE"]
    cfg = _merge(cfg, from_env, "environment") if from_env else cfg
    return check_kafka_transport(with_store_credentials(cfg))


MIN_TOPIC_GENERATION_S = 5.0
# A generation is deleted about 2.25 periods + 30 s after it began (services.topic_generations), so the
# embedded broker holds about 5 minutes of records: some 220 MB at the 3,000-job soak's 44 MB a minute.
EMBEDDED_TOPIC_GENERATION_S = 120.0


def check_kafka_transport(cfg: Config) -> Config:
    """Refuse Kafka TLS/SASL settings that cannot work (a missing CA file, SASL without a user) at load."""
    from core.kafka_conn import KafkaConnError

    if cfg.kafka.sasl_password:
        from core.redact import add_secret

        add_secret(cfg.kafka.sasl_password)
    if not cfg.kafka.bootstrap and cfg.kafka.security_protocol != "PLAINTEXT":
        raise ConfigError(f"kafka.security_protocol = {cfg.kafka.security_protocol} needs kafka.bootstrap: "
                          "the embedded broker (no bootstrap) listens in plaintext on 127.0.0.1 only")
    try:
        cfg.kafka.conn().check()
    except KafkaConnError as e:
        raise ConfigError(str(e)) from None
    h = cfg.hang
    if not (h.min_s > 0 and h.quiet_factor >= 1 and h.silent_s > 0 and h.heartbeat_timeout_s > h.silent_s
            and min(h.floor_s, h.k_steps, h.exit_grace_s, h.startup_s, h.checkpoint_s) >= 0):
        raise ConfigError(f"hang: min_s, silent_s over 0, quiet_factor at least 1, heartbeat_timeout_s over "
                          f"silent_s and the other keys at least 0 (got min_s {h.min_s:g}, quiet_factor "
                          f"{h.quiet_factor:g}, silent_s {h.silent_s:g}, heartbeat_timeout_s {h.heartbeat_timeout_s:g})")
    r = cfg.regression
    if not (0 < r.min_change < 10 and r.k_windows >= 1 and r.baseline_windows >= 1):
        raise ConfigError(f"regression: min_change must be in (0, 10), k_windows and baseline_windows at least 1 "
                          f"(got {r.min_change:g}, {r.k_windows}, {r.baseline_windows})")
    lem = cfg.lemons
    if lem.every_s < 0 or lem.period_days <= 0 or lem.min_jobs < 1 or not 0 < lem.max_p <= 1:
        raise ConfigError(f"lemons: every_s at least 0, period_days over 0, min_jobs at least 1 and max_p in (0, 1] "
                          f"(got {lem.every_s:g}, {lem.period_days:g}, {lem.min_jobs}, {lem.max_p:g})")
    al = cfg.alerts
    if not 0.0 <= al.link_shown_confidence <= al.link_confidence <= al.link_certain <= 1.0:
        raise ConfigError(f"alerts: need 0 <= link_shown_confidence <= link_confidence <= link_certain <= 1 (got "
                          f"{al.link_shown_confidence:g}, {al.link_confidence:g}, {al.link_certain:g})")
    gen = cfg.kafka.topic_generation_s
    if gen not in (-1.0, 0.0) and gen < MIN_TOPIC_GENERATION_S:
        raise ConfigError(f"kafka.topic_generation_s must be -1 (automatic), 0 (off) or at least "
                          f"{MIN_TOPIC_GENERATION_S:g} s, not {gen:g}: each generation's topics are created one "
                          "generation ahead and consumers look for new ones every few seconds")
    return cfg


def with_store_credentials(cfg: Config) -> Config:
    """``store.url`` with the password's source folded in, so every process that opens it finds it.

    ``store.password_file`` becomes the URL's ``password_file=`` parameter
    (``storage.open_store`` reads the file when it opens the store: the URL
    travels to the console and the shard actors without the secret);
    ``store.password`` (STRAGGLERSCOPE_STORE_PASSWORD) becomes the URL's
    password. Only ``clickhouse://`` URLs have passwords; one source at most.
    Idempotent: call it again after changing ``store.url``.
    """
    from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

    st = cfg.store
    url = st.url.strip()
    if not url.lower().startswith("clickhouse://") or not (st.password or st.password_file):
        return cfg
    from core.redact import add_secret

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, raw_pw = userinfo.partition(":")
    url_pw, url_file = unquote(raw_pw), dict(query).get("password_file", "")
    sources = [name for name, given in (
        ("a password in store.url", url_pw and url_pw != st.password),
        ("STRAGGLERSCOPE_STORE_PASSWORD", st.password),
        ("password_file= in store.url", url_file and url_file != st.password_file),
        ("store.password_file", st.password_file)) if given]
    if len(sources) > 1:
        raise ConfigError(f"the store password comes from {' and '.join(sources)}: keep one")
    if st.password:
        add_secret(st.password)
        parts = parts._replace(netloc=f"{user or 'default'}:{quote(st.password, safe='')}@{host}")
    elif not url_file:
        parts = parts._replace(query=urlencode(query + [("password_file", st.password_file)]))
    return dataclasses.replace(cfg, store=dataclasses.replace(st, url=urlunsplit(parts)))


def describe() -> str:
    """Every key with its default and meaning, for --help and the README."""
    lines = []
    for f in dataclasses.fields(Config):
        section = f.default if not isinstance(f.default, dataclasses._MISSING_TYPE) else f.default_factory()
        lines.append(f"[{f.name}]")
        docs = _field_docs(type(section))
        for sf in dataclasses.fields(section):
            lines.append(f"  {sf.name} = {getattr(section, sf.name)!r}   {docs.get(sf.name, '')}")
    return "\n".join(lines)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs = {}
    body = tree.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)
    return docs
