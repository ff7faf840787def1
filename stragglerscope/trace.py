"""`stragglerscope trace -- COMMAND`: diagnose an unchanged training job.

COMMAND (``torchrun ...``, ``python train.py ...``) runs with a
``sitecustomize`` on its PYTHONPATH that arms the automatic instrumentation
(``ingest.autotrace``) in every Python process it starts; a process is
instrumented when it initialises ``torch.distributed``. With ``kafka.bootstrap``
configured the records go there and the fleet's pipeline does the rest.
Without one (the embedded default) this command starts the broker, the store
and the pipeline for the duration of the run, like ``demo``, and when COMMAND
exits prints the job's diagnosis. Its exit code is COMMAND's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import ingest.autotrace
from core.config import AlertConfig, Config
from core.kafka_conn import KafkaConn

# The children need our sitecustomize, and the folder holding our packages (a source checkout is not on
# their path otherwise).
BOOT_DIR = Path(ingest.autotrace.__file__).resolve().parent / "boot"
ROOT = BOOT_DIR.parents[2]


class TraceError(Exception):
    """Bad input to `trace` (printed as one line, exit code 2)."""


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    command: list[str]
    job_id: str = ""
    layout: str = ""
    sample: str = "10/100"
    attempt: int = 0
    timeout_s: float = 300.0
    heartbeat_s: float = 2.0
    probe_kb: int = 256


def default_job_id(command: list[str], now: float | None = None) -> str:
    """A readable, unique id: the script's name and the UTC time."""
    script = next((Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name)
    script = re.sub(r"[^A-Za-z0-9_.-]", "-", script)[:40] or "job"
    return f"{script}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}"


def child_env(settings_env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment COMMAND runs with: our sitecustomize and this checkout first on PYTHONPATH, and
    PyTorch's Flight Recorder on (``ingest.flight_recorder``: the variable the installed torch reads) unless
    the user set its buffer."""
    from importlib import metadata

    from ingest.flight_recorder import ENV as RECORDER_ENV
    from ingest.flight_recorder import env_for

    env = dict(os.environ if base is None else base)
    path = [str(BOOT_DIR), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if not any(k in env for k in RECORDER_ENV):
        try:
            torch_version = metadata.version("torch")  # the job runs in this environment as a rule
        except metadata.PackageNotFoundError:
            torch_version = None
        env.update(env_for(torch_version))
    env.update(settings_env)
    return env


def run_trace(cfg: Config, opts: TraceOptions) -> int:
    """Run COMMAND traced; its exit code (README "Stopping" for Ctrl-C and SIGTERM)."""
    from ingest.autotrace.session import SettingsError, parse_layout, parse_sample
    from stragglerscope.service import Terminated, say, sigterm_as_interrupt

    if not opts.command:
        raise TraceError("give the command to run after --, e.g. stragglerscope trace -- torchrun ... train.py")
    try:
        layout = parse_layout(opts.layout)
        sampling = parse_sample(opts.sample)
    except SettingsError as e:
        raise TraceError(str(e)) from None
    job_id = opts.job_id or default_job_id(opts.command)
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,128}", job_id):
        raise TraceError(f"--job-id {job_id!r}: use 1-128 letters, digits and _ . : @ -")
    sigterm_as_interrupt()  # a SIGTERM while the services start stops them, as Ctrl-C does
    ran: list[int] = []  # COMMAND's exit code, once it has run
    try:
        return _trace(cfg, opts, job_id, layout, sampling, ran)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): everything started is stopped by now
        if ran:
            say(f"trace      stopped: not waiting for the analysis (command exited with {ran[0]})")
            return ran[0]
        # Before COMMAND ran: the code a shell reports for a command that the signal ended.
        say("trace      stopped before the command ran")
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)


def _trace(cfg: Config, opts: TraceOptions, job_id: str, layout, sampling, ran: list[int]) -> int:
    """`run_trace` once its input is checked; COMMAND's exit code goes into ``ran`` as soon as it exits."""
    from core.redact import redact_url
    from ingest.autotrace.session import TraceSettings
    from stragglerscope.service import say

    with contextlib.ExitStack() as stack:
        run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="ss-trace-"))
        embedded = not cfg.kafka.bootstrap
        svc = None
        if embedded:
            from stragglerscope.service import start_services

            svc = start_services(cfg, stack)
            bootstrap = svc.cfg.kafka.bootstrap
        else:
            from core.kafka_admin import check_reachable, prepare_topics

            check_reachable(cfg.kafka.bootstrap)
            # Exporters never create topics by writing to them (a broker would pick the partition count).
            prepare_topics(cfg.kafka.conn(), cfg.kafka.partitions, cfg.kafka.replication_factor, outputs=False,
                           min_insync_replicas=cfg.kafka.min_insync_replicas)
            bootstrap = cfg.kafka.bootstrap
        # The ranks get the transport's settings (TLS, SASL, topic generations) unless they are all defaults.
        conn = (svc.cfg if embedded else cfg).kafka.conn()
        transport = "" if conn == KafkaConn(bootstrap=conn.bootstrap) else conn.to_json()
        spool = os.path.join(run_dir, "spool") if embedded else os.path.join(
            tempfile.gettempdir(), f"stragglerscope-spool-{job_id}")
        settings = TraceSettings(job_id=job_id, bootstrap=bootstrap, layout=layout, sampling=sampling,
                                 attempt=opts.attempt, spool_dir=spool, run_dir=run_dir,
                                 heartbeat_s=opts.heartbeat_s, kafka_transport=transport, probe_kb=opts.probe_kb)
        say(f"trace      job {job_id}, profiling {sampling.profile_steps} of every {sampling.every} steps; "
            f"running: {' '.join(opts.command)}")
        from ingest.nccl_profiler import ensure_built

        # The ranks of a CUDA job arm our NCCL profiler plugin (ingest.autotrace.session) if it is built: build
        # it here, once, when it is missing or older than its source (a second with gcc; without one the
        # ranks say so in their warnings and the job runs as it would).
        ensure_built()
        t0 = time.monotonic()
        code, passed_on = _run_child(opts.command, child_env(settings.to_env()))
        ran.append(code)
        reports = _read_reports(run_dir)
        say(f"trace      command exited with {code} after {time.monotonic() - t0:.1f} s; "
            f"{len(reports)} rank(s) instrumented")
        if signal.SIGTERM in passed_on:  # a SIGKILL follows soon: stop what we started, skip the analysis
            say("trace      stopped by SIGTERM: not waiting for the analysis"
                + (f" (stragglerscope sql job_windows --param job_id={job_id} shows what was stored)"
                   if reports else ""))
            return code
        if not reports:
            say("trace      no process initialised torch.distributed: nothing was recorded")
            return code
        for w in sorted({w for r in reports for w in r.get("warnings", [])}):
            say(f"trace      warning: {w}")
        sent = sum(r["records_sent"] for r in reports)
        dropped = sum(r["records_dropped"] for r in reports)
        say(f"trace      {sent:,} records sent{f', {dropped:,} DROPPED' if dropped else ''}"
            f"{', instrumentation errors: ' + str(sum(r['errors'] for r in reports)) if any(r['errors'] for r in reports) else ''}")
        windows = sorted({w for r in reports for w in r["windows"]})
        waiting = tidy_spool(spool)
        if waiting and not embedded:
            say(f"trace      {waiting:,} message(s) the broker did not take wait in {spool}: a rerun with "
                f"--job-id {job_id} delivers them first")
        elif waiting:  # the embedded broker and its run folder go with this run
            say(f"trace      {waiting:,} message(s) the embedded broker did not take are lost")
        if not embedded:
            say(f"trace      records are in {bootstrap}; the fleet's pipeline analyses them "
                f"(stragglerscope sql job_windows --param job_id={job_id})")
            return code
        from stragglerscope.service import wait_stored

        keys = [(job_id, opts.attempt, w) for w in windows]
        pending = wait_stored(svc, keys, opts.timeout_s) if keys else set()
        if pending:
            say(f"trace      {len(pending)} of {len(keys)} windows were not analysed within {opts.timeout_s:.0f} s")
        try:
            print(summarize(svc.store, job_id, opts.attempt, reports, svc.cfg.alerts.link_shown_confidence),
                  flush=True)
        except Exception as e:  # the training's exit code matters more than our summary
            say(f"trace      error: could not summarise the job: {e!r}; "
                f"see stragglerscope sql job_windows --param job_id={job_id}")
        say(f"console    stragglerscope console --store {redact_url(cfg.store.url)}   (then open job {job_id})")
    return code


TERM_GRACE_S = 40.0
"""How long COMMAND's process group has after SIGTERM before it is killed. Longer than the 30 s torchrun
gives its workers before it kills them: its workers run in sessions of their own, beyond the reach of
our kill, and would outlive a torchrun killed first. (Kubernetes kills the whole pod after 30 s anyway.)"""


def _run_child(command: list[str], env: dict[str, str]) -> tuple[int, set[int]]:
    """Run COMMAND in its own process group; Ctrl-C and SIGTERM are passed on, not taken by us.

    Returns its exit code and the signals passed on. SIGTERM is passed on once (a second one would cut
    torchrun's own stop of its workers short), and what of the group has not exited ``TERM_GRACE_S``
    later is killed. After a signal, what COMMAND started and left running when it exited is stopped
    too: it would hold GPUs and ports with no one to stop it.
    """
    from stragglerscope.demo import stop_process_group
    from stragglerscope.service import say, stopping

    child: list[subprocess.Popen] = []
    early: list[int] = []  # signals that came before the child existed
    passed_on: set[int] = set()
    deadline: list[float] = []  # of the grace period, once SIGTERM is passed on
    killed = threading.Event()

    def kill_group():
        killed.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child[0].pid, signal.SIGKILL)

    killer = threading.Timer(TERM_GRACE_S, kill_group)
    killer.daemon = True

    def forward(signum, _frame):
        if signum == signal.SIGTERM:
            if deadline:
                return
            deadline.append(time.monotonic() + TERM_GRACE_S)
        passed_on.add(signum)
        if child:
            _pass_on(child[0], signum, killer)
        else:
            early.append(signum)

    # Before the child starts: a signal in between is passed on to it as soon as it exists.
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            child.append(subprocess.Popen(command, env=env, start_new_session=True))
        except FileNotFoundError:
            raise TraceError(f"command not found: {command[0]}") from None
        except PermissionError:
            raise TraceError(f"command not executable: {command[0]}") from None
        for signum in early:
            _pass_on(child[0], signum, killer)
        code = child[0].wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if deadline:
            stopping()  # our own stop, which follows, must not be cut short by another SIGTERM
    if passed_on and not killed.is_set():
        stop_process_group(child[0], max(0.5, (deadline[0] if deadline else time.monotonic() + TERM_GRACE_S)
                                         - time.monotonic()))
    killer.cancel()
    if killed.is_set():
        say(f"trace      the command did not stop within {TERM_GRACE_S:.0f} s of SIGTERM: killed its process group")
    return (code if code >= 0 else 128 - code), passed_on  # killed by signal N: the shell's 128 + N


def _pass_on(proc: subprocess.Popen, signum: int, killer: threading.Timer) -> None:
    """``signum`` to COMMAND's process group; for SIGTERM, the timer that kills the group after the grace."""
    if signum == signal.SIGTERM and killer.ident is None:  # not started yet
        killer.start()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def tidy_spool(spool: str) -> int:
    """Remove the ranks' spool folders that hold nothing (every message delivered), and the spool with
    them; messages left wait there for a rerun of the job. Returns how many are left. (Each traced job
    left an empty folder in the temporary directory: 140 on a machine after a day of tests.)"""
    from ingest.spool import Spool

    left = 0
    root = Path(spool)
    for d in sorted(root.glob("rank*")):
        n = Spool.waiting(d)
        left += n
        if not n:
            with contextlib.suppress(OSError):  # a crash's *.tmp, or a rank still writing: keep it
                d.rmdir()
    with contextlib.suppress(OSError):
        root.rmdir()
    return left


def _read_reports(run_dir: str) -> list[dict]:
    out = []
    for p in sorted(Path(run_dir).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(p.read_text()))
    return out


def analysed(w: dict) -> bool:
    """A stored window has a slowdown (layout conflicts, clock skew, failed analyses and windows without op
    spans have NaN)."""
    S = w.get("slowdown")
    return S is not None and S == S


def window_header(w: dict) -> str:
    """A window's first line in the summary: its slowdown and step times, or that it was not analysed (its
    verdict's sentence follows, with the reason in full). It printed 'S = nan, waste nan%'."""
    from analyzers.explain import title

    where = f"window {w['window_id']} (steps {w['first_step']}-{w['last_step']}"
    if not analysed(w):
        return f"{where}): not analysed ({title(w.get('verdict') or '').lower()})"
    state = "complete" if w["complete"] else "INCOMPLETE"
    return (f"{where}, {state}): S = {w['slowdown']:.3f}, waste {100 * (w['waste_fraction'] or 0):.1f}%, "
            f"step {w['step_time_actual']:.3f} s actual vs {w['step_time_ideal']:.3f} s ideal "
            f"(fidelity {w['launch_slowdown']:.3f})")


def summarize(store, job_id: str, attempt: int, reports: list[dict],
              shown: float = AlertConfig.link_shown_confidence) -> str:
    """The job's diagnosis, for a terminal: S per window, verdicts with evidence, top workers, waste, hangs.
    ``shown``: link findings at least this confident are printed (``[alerts] link_shown_confidence``)."""
    from analyzers.explain import hang_lines, job_link_sentence, link_sentence, window_lines
    from analyzers.links.job import job_finding

    lay = reports[0]["layout"]
    lines = [f"\n== stragglerscope: job {job_id} (attempt {attempt}) ==",
             f"{len(reports)} ranks, layout dp={lay['dp_size']} pp={lay['pp_size']} tp={lay['tp_size']} "
             f"cp={lay['cp_size']} vpp={lay['vpp_size']}; {max(r['steps'] for r in reports)} steps"]
    wins = [w for w in store.run_named("job_windows", {"job_id": job_id}).to_pylist() if w["attempt"] == attempt]
    links_of_window: dict[int, list[dict]] = {}
    for f in store.run_named("job_links", {"job_id": job_id}).to_pylist():
        if f["attempt"] == attempt and f["confidence"] >= shown:
            links_of_window.setdefault(f["window_id"], []).append(f)
    for found in links_of_window.values():
        found.sort(key=lambda f: -f["confidence"])
    answer = job_finding((f for found in links_of_window.values() for f in found), shown)
    if answer is not None:  # one answer for the job first; each window's own findings under it
        lines += textwrap.wrap(f"network: {job_link_sentence(answer)}", width=110, initial_indent="",
                               subsequent_indent="    ", break_on_hyphens=False)
    if not wins:
        lines.append("no window was analysed (were any steps profiled? see --sample)")
    wasted = total = 0.0
    for w in sorted(wins, key=lambda r: r["window_id"]):
        wasted += w["wasted_gpu_hours"] or 0.0
        total += w["gpu_hours"] or 0.0
        lines.append("\n" + window_header(w))
        lines += window_lines(w)  # the console's words for each verdict (analyzers.explain)
        workers = store.run_named("job_workers", {"job_id": job_id, "window_id": w["window_id"],
                                                  "attempt": attempt}).to_pylist()
        top = sorted(workers, key=lambda r: -(r.get("s_w") or 0))[:3]
        if top:
            lines.append("  top workers  " + ", ".join(
                f"dp {r['dp_rank']} pp {r['pp_rank']} (S_w {r['s_w']:.3f})" for r in top))
        for f in links_of_window.get(w["window_id"], [])[:2]:
            lines.append(f"  network  {link_sentence(f)}")  # analyzers.explain
        if w["note"] and not w["complete"] and analysed(w):  # a window not analysed: its verdict said why
            lines += textwrap.wrap(w["note"], width=110, initial_indent="  note     ", subsequent_indent=" " * 11,
                                   break_on_hyphens=False)
    if wins:
        lines.append(f"\nwasted {wasted:.6f} of {total:.6f} GPU-hours in the analysed windows")
    hangs = store.run_named("job_hangs", {"job_id": job_id}).to_pylist()
    reg = store.run_named("job_info", {"job_id": job_id, "attempt": attempt}).to_pylist() if hangs else []
    for h in hangs[:3]:
        lines += hang_lines(h, reg[0] if reg else None)
    return "\n".join(lines)
