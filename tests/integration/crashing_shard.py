"""A shard in its own process, over messages and a store kept in files, whose decoder segfaults on one payload.

Used by ``test_poison_quarantine``: it stands for a native-library crash that no
``try`` can catch. The process dies for real (SIGSEGV); the next run of this
script is the shard's restart.

    python crashing_shard.py MESSAGES.pickle STORE.pickle STATE_DIR
"""
from __future__ import annotations

import ctypes
import os
import pickle
import sys

from core import codec
from core.config import Config
from ray_jobs.shard import ShardWorker
from tests.fakes import FakeSink, FakeSource, ManualClock

POISON = b"SEGFAULT-ON-DECODE"


class FileSink(FakeSink):
    """FakeSink whose rows and offsets survive the process: written to a file at every flush."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        if os.path.exists(path):
            with open(path, "rb") as f:
                self.rows, self.offsets, self.logs, self.states = pickle.load(f)

    def flush(self):
        super().flush()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump((self.rows, self.offsets, self.logs, self.states), f)
        os.replace(tmp, self.path)

    def store_offsets(self, source_id, offsets, log_ids=None):
        super().store_offsets(source_id, offsets, log_ids)
        self.flush()

    def store_state(self, source_id, shard, fmt, state):
        super().store_state(source_id, shard, fmt, state)
        self.flush()


def main() -> int:
    messages_path, store_path, state_dir = sys.argv[1:4]
    with open(messages_path, "rb") as f:
        messages = pickle.load(f)
    real_decode = codec.decode

    def decode(payload: bytes, **kwargs):
        if payload.startswith(POISON):
            ctypes.string_at(0)  # a read of address 0: SIGSEGV, as a native bug would
        return real_decode(payload, **kwargs)

    codec.decode = decode
    cfg = Config().replace(pipeline={"idle_timeout_s": 1.0, "commit_interval_s": 0.0, "state_interval_s": 0.0,
                                     "state_dir": state_dir},
                           alerts={"min_gpus": 1})
    src, sink = FakeSource(messages, batch=2), FileSink(store_path)
    clock = ManualClock()
    w = ShardWorker(0, [0], cfg, "crashing", consumer_factory=lambda: src, sink_factory=lambda: sink,
                    clock=clock)
    w.setup()
    for i in range(30):
        clock.t = i * 0.5
        w.step(poll_timeout_ms=0)
    w.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
