"""``python -m storage.daemon chdb://PATH``: serve a chDB store on 127.0.0.1 (what ``StoreDaemon`` runs).

Prints ``READY PORT`` once it serves; ``--watch-stdin`` stops it when its
stdin closes (the parent died or called ``StoreDaemon.stop``).
"""
from __future__ import annotations

import argparse
import sys
import threading

from storage.daemon.server import serve
from storage.errors import StoreError
from storage.sandbox import SQLLimits


def _watch_stdin(stop: threading.Event) -> None:
    def run():
        try:
            while sys.stdin.buffer.read(1):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m storage.daemon", description="Serve a chDB store on 127.0.0.1.")
    p.add_argument("url", help="chdb://PATH")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes (the parent died)")
    base = SQLLimits()
    p.add_argument("--max-execution-time-s", type=float, default=base.max_execution_time_s,
                   help="free SQL: longest run, seconds")
    p.add_argument("--max-memory-mb", type=int, default=base.max_memory_mb, help="free SQL: most memory, MiB")
    p.add_argument("--max-result-rows", type=int, default=base.max_result_rows, help="free SQL: most result rows")
    args = p.parse_args(argv)
    out = sys.stdout

    def ready(port: int) -> None:
        out.write(f"READY {port}\n")
        out.flush()

    stop = threading.Event()
    if args.watch_stdin:
        _watch_stdin(stop)
    try:
        limits = SQLLimits(args.max_execution_time_s, args.max_memory_mb, args.max_result_rows)
        serve(args.url, args.host, args.port, ready, stop, sql_limits=limits)
    except StoreError as e:
        print(f"store daemon: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
