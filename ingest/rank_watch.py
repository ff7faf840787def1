"""A rank's watch: a small process beside each traced rank that speaks for it when it cannot.

A rank's heartbeats come from a thread of the training process. That thread
cannot speak for a process that was stopped (SIGSTOP, a debugger), that died
(kill -9, the OOM killer, a segfault), or whose interpreter lock is held in C
code for a long time; silence alone cannot tell these apart, nor from a lost
host, and a detector that waits for silence to last is slow. The watch is a
separate process, started by the rank's trace session, that hears every
heartbeat through a pipe and reads the rank's state from ``/proc``:

- **stopped**: the kernel says the rank is stopped (state ``T``/``t``, twice
  half a second apart): the watch sends a heartbeat for it every period,
  ``proc_state = stopped``, with what its last own heartbeat said it was in.
- **exited**: the pipe closed without the rank's goodbye (the rank's process
  is gone): one heartbeat, ``proc_state = exited``, and the watch ends.
- **unresponsive**: the rank runs but its own heartbeats are more than three
  periods late (at least 5 s): its heartbeat thread cannot run. The watch
  sends ``proc_state = unresponsive`` every period until they resume.

Nothing is sent while the rank reports for itself: the watch imports its
Kafka client only when it first has something to say. A clean exit of the
rank (its session's ``close``) writes ``bye`` and the watch ends quietly.
It ignores Ctrl-C (SIGINT goes to the whole foreground process group: the
rank's goodbye, or its death, ends the watch), not SIGTERM. Its cost is a
Python process that sleeps in ``select``: about 10 MB until it speaks.

    python -m ingest.rank_watch --pid PID --period S [--out FILE]

reads heartbeats (JSON lines, as ``RankWatch.beat`` writes them) on its
standard input; ``--out`` writes what it would send as JSON lines to FILE
instead of Kafka (``STRAGGLERSCOPE_WATCH_BOOTSTRAP`` and
``STRAGGLERSCOPE_WATCH_TRANSPORT`` say where Kafka is, as the trace session's
producer sees it; secrets come as they do for that producer).
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV_BOOTSTRAP = "STRAGGLERSCOPE_WATCH_BOOTSTRAP"
ENV_TRANSPORT = "STRAGGLERSCOPE_WATCH_TRANSPORT"
BYE = b"bye\n"
LATE_PERIODS = 3
"""Own heartbeats this many periods late (and at least LATE_MIN_S) make a running rank unresponsive."""
LATE_MIN_S = 5.0
STOP_RECHECK_S = 0.5
"""A stop must still hold this much later: a profiler's ptrace pause is not one."""
_DROPPED_FIELDS = ("stack", "flight_recorder")  # big, and never repeated on the rank's behalf


class RankWatch:
    """The rank's end: starts the watch process and tells it of every heartbeat, never blocking."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._fd = proc.stdin.fileno()
        os.set_blocking(self._fd, False)
        self.dropped = 0   # heartbeats the pipe had no room for (the watch is behind: it keeps the latest)
        self._closed = False

    @classmethod
    def start(cls, *, bootstrap: str, transport: str = "", period_s: float = 2.0,
              out: str = "") -> "RankWatch | None":
        """Start the watch of this process; None (and one line on stderr) where it cannot be started."""
        root = str(Path(__file__).resolve().parent.parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRAGGLERSCOPE_TRACE")}
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and "autotrace" not in p])
        env[ENV_BOOTSTRAP], env[ENV_TRANSPORT] = bootstrap, transport
        cmd = [sys.executable, "-m", "ingest.rank_watch", "--pid", str(os.getpid()), "--period", repr(period_s)]
        if out:
            cmd += ["--out", out]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=root,
                                    close_fds=True)
        except OSError as e:
            print(f"stragglerscope trace: no watch process for pid {os.getpid()} ({e}): a stopped or dead rank "
                  "is then known by its silence alone", file=sys.stderr)
            return None
        return cls(proc)

    def beat(self, heartbeat) -> None:
        """Hand the watch one heartbeat (a HEARTBEAT table of one row); dropped if the pipe is full."""
        if self._closed:
            return
        row = heartbeat.to_pylist()[0]
        for k in _DROPPED_FIELDS:
            row.pop(k, None)
        self._write(json.dumps(row, separators=(",", ":")).encode() + b"\n")

    def _write(self, data: bytes) -> bool:
        try:
            os.write(self._fd, data)  # a line is far under PIPE_BUF: written whole or not at all
            return True
        except BlockingIOError:
            self.dropped += 1
        except OSError as e:  # the watch is gone: nothing to tell any more
            if e.errno == errno.EPIPE:
                self._closed = True
        return False

    def close(self, timeout: float = 2.0) -> None:
        """The rank ends cleanly: goodbye, and the watch ends without a word."""
        if self._closed:
            return
        self._closed = True
        self._write(BYE)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- the watch process ----------------------------------------------------------------------------------

def proc_state(pid: int) -> str:
    """'stopped', 'exited' or 'running' as the kernel has it; 'unknown' without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "exited"
    except OSError:
        return "unknown"
    # pid (comm) S ...: comm may hold spaces and parentheses; the state follows the last ')'.
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    if state in (b"T", b"t"):
        return "stopped"
    if state in (b"Z", b"X", b"x"):
        return "exited"
    return "running"


class _Sender:
    """Where the watch's heartbeats go: Kafka through the telemetry producer (imported at the first one),
    or a file of JSON lines (``--out``)."""

    def __init__(self, out: str):
        self.out = out
        self._producer = None

    def send(self, row: dict) -> None:
        if self.out:
            with open(self.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            return
        from core import codec
        from core import schema as S

        if self._producer is None:
            from core.kafka_conn import KafkaConn
            from ingest.producer import TelemetryProducer

            conn = KafkaConn.from_json(os.environ.get(ENV_BOOTSTRAP, ""), os.environ.get(ENV_TRANSPORT, ""))
            self._producer = TelemetryProducer(conn, client_id=f"watch-{row['job_id']}-{row['rank']}")
        self._producer.send(codec.from_rows(S.HEARTBEAT, [row]))

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(10)


def speak_for(last: dict, state: str) -> dict:
    """A heartbeat on the rank's behalf: what it last said of itself, stamped now, with its state."""
    row = dict(last)
    row.update(ts_ns=time.time_ns() + int(last.get("clock_offset_ns") or 0), proc_state=state, stack="",
               flight_recorder="")
    return row


def watch(pid: int, period_s: float, sender: _Sender, stdin_fd: int = 0) -> str:
    """Watch ``pid`` until its goodbye or its end; returns how it ended ('bye' or 'exited')."""
    last: dict | None = None
    last_at = time.monotonic()
    buf = b""
    late_s = max(LATE_PERIODS * period_s, LATE_MIN_S)
    next_check = time.monotonic() + period_s
    while True:
        timeout = max(0.0, next_check - time.monotonic())
        readable, _, _ = select.select([stdin_fd], [], [], timeout)
        if readable:
            chunk = os.read(stdin_fd, 1 << 16)
            if not chunk:  # the rank's end of the pipe closed: it is gone unless it said goodbye
                if last is not None:
                    sender.send(speak_for(last, "exited"))
                return "exited"
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line + b"\n" == BYE:
                    return "bye"
                try:
                    last = json.loads(line)
                    last_at = time.monotonic()
                except ValueError:
                    continue  # not a heartbeat of ours: nothing to repeat
        if time.monotonic() < next_check:
            continue
        next_check = time.monotonic() + period_s
        if last is None:
            continue  # nothing to speak with yet (the rank has not sent its first heartbeat)
        state = proc_state(pid)
        if state == "stopped":
            time.sleep(STOP_RECHECK_S)
            state = proc_state(pid)
        if state == "stopped":
            sender.send(speak_for(last, "stopped"))
        elif state == "exited":
            sender.send(speak_for(last, "exited"))
            return "exited"
        elif time.monotonic() - last_at > late_s:
            sender.send(speak_for(last, "unresponsive"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ingest.rank_watch", description=__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int, required=True, help="the rank's process")
    p.add_argument("--period", type=float, default=2.0, help="the rank's heartbeat period, seconds")
    p.add_argument("--out", default="", help="write what would be sent to this file (JSON lines), not Kafka")
    a = p.parse_args(argv)
    if a.period <= 0:
        p.error("--period must be over 0")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sender = _Sender(a.out)
    try:
        watch(a.pid, a.period, sender)
    finally:
        sender.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
