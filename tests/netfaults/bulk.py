"""Times TCP messages between two rank namespaces: the measuring stick of the fabric's shaping.

    python bulk.py serve HOST PORT             # prints "ready", then acknowledges every message
    python bulk.py send HOST PORT SIZE COUNT   # prints {"seconds": [...]}: one per message

A message is an 8-byte length and that many bytes; the server answers one byte once it has them
all, so a message's time covers the whole transfer, not only the filling of socket buffers. One
2 MB message measures bulk throughput; a few 64 KB ones show whether a message of the size of a
gradient bucket is shaped or slips through in the bucket of tokens.
"""
from __future__ import annotations

import json
import socket
import sys
import time


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        data = conn.recv(min(n - got, 1 << 20))
        if not data:
            return None
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        print("ready", flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                while (head := _recv_exactly(conn, 8)) is not None:
                    if _recv_exactly(conn, int.from_bytes(head, "big")) is None:
                        break
                    conn.sendall(b"k")


def send(host: str, port: int, size: int, count: int) -> None:
    payload = size.to_bytes(8, "big") + bytes(size)
    seconds = []
    with socket.create_connection((host, port), timeout=60) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            t0 = time.perf_counter()
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise SystemExit("server closed before acknowledging")
            seconds.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    mode, host, port, *rest = sys.argv[1:]
    if mode == "serve":
        serve(host, int(port))
    else:
        send(host, int(port), int(rest[0]), int(rest[1]))
