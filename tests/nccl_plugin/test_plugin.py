"""Our NCCL profiler plugin, built and loaded as NCCL loads it, driven as NCCL drives it (``driver.py``, one
process per rank), and what it writes read by the real exporter path: ``PeerTimingFeed`` -> the collective
records -> the link diagnosis. No GPU, no NCCL: the driver calls the plugin's ``ncclProfiler_vN`` functions
with the descriptors each NCCL release passes, and pins the plugin's clock."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.nccl_plugin.driver import MB, PIPE_HASH, RING_HASH, SLOW, US, VERSIONS, WIRE_NS, WORLD

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def library():
    from ingest.nccl_profiler import build, compiler

    if compiler() is None:
        pytest.skip("no C compiler: make setup-test installs gcc")
    return build()


def drive(tmp_path: Path, scenario: str, version: int, ranks=range(WORLD)) -> dict[int, tuple[Path, dict]]:
    """Run ``scenario`` in one process per rank (at once, as a job's ranks run); each rank's file and
    counters."""
    dirs = {r: tmp_path / f"{scenario}-v{version}-rank{r}" for r in ranks}
    procs = {r: subprocess.Popen([sys.executable, str(DRIVER), scenario, str(version), str(r), str(d)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, d in dirs.items()}
    out = {}
    for r, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {stderr[-3000:]}"
        stats = json.loads(stdout.strip().splitlines()[-1])
        files = list(dirs[r].glob("nccl-peers-*.bin"))
        assert [f.name for f in files] == [f"nccl-peers-{stats['pid']}.bin"], files
        out[r] = (files[0], stats)
    return out


def records(path: Path) -> np.ndarray:
    from ingest.nccl_peers import RECORD

    return np.frombuffer(path.read_bytes(), RECORD)


def took(recs: np.ndarray) -> np.ndarray:
    return recs["end_ns"] - recs["start_ns"] - recs["wait_ns"]


def ccl_tables(files: dict[int, Path], steps: int = 6, per_step: int = 3) -> tuple[pa.Table, list]:
    """Each rank's real exporter, its collective records filled from its plugin file, as in a traced job."""
    from core import codec
    from ingest.exporter import RankExporter, Sampling
    from ingest.nccl_peers import PeerTimingFeed

    tables, feeds = [], []
    world = list(range(WORLD))
    for rank, path in files.items():
        sent: list[pa.Table] = []
        exp = RankExporter("ring", rank, rank, 0, sent.append, sampling=Sampling(1, 1), heartbeat_s=3600,
                           use_cuda=False, tcp_flows=False, nvml=False, peer_timings=PeerTimingFeed(str(path)))
        seq = 0
        for step in range(steps):
            with exp.step(step):
                for _ in range(per_step):
                    t0 = exp.ccl_enter("all_reduce", "world", world, seq)
                    exp.ccl_exit("all_reduce", "world", world, seq, t0, 16 * MB, [r for r in world if r != rank])
                    seq += 1
        exp.close()
        feeds.append(exp.peer_timings)
        tables += [t for t in sent if codec.decode(codec.encode(t))[0] == "ccl_record"]
    return pa.concat_tables(tables), feeds


@pytest.mark.parametrize("version", VERSIONS)
def test_a_ring_all_reduce_through_the_plugin_names_its_slow_link(tmp_path, library, version):
    """4 ranks, 2 channels whose rings run opposite ways, the path 2 -> 3 four times slower, under each
    interface version NCCL 2.23 ... 2.28+ may pick. The plugin's records carry each channel's transfer
    (its time on the wire, not its wait for the GPU or the receiver's credits); the exporter fills its
    records from them and the diagnosis names link 2 -> 3, not rank 2's NIC (its other path is fine)."""
    from analyzers.links import diagnose_window
    from ingest.nccl_peers import KIND_COMM, KIND_PROXY_OP

    ran = drive(tmp_path, "ring", version)
    for rank, (path, stats) in ran.items():
        recs = records(path)
        comm = recs[recs["kind"] == KIND_COMM]
        assert len(comm) == 1 and comm[0]["comm_hash"] == RING_HASH and comm[0]["rank"] == rank
        assert comm[0]["nranks"] == (WORLD if version >= 4 else 0)  # NCCL < 2.27 does not tell the size
        ops = recs[recs["kind"] == KIND_PROXY_OP]
        assert len(ops) == 18 * 4 and sorted(set(ops["seq"].tolist())) == list(range(18))
        assert (ops["bytes"] == 4 * MB).all() and (ops["coll_bytes"] == 16 * MB).all()
        sends = ops[ops["is_send"] == 1]
        want = {(rank + 1) % WORLD: 0, (rank - 1) % WORLD: 1}  # peer -> channel
        assert {(int(p), int(c)) for p, c in zip(sends["peer"], sends["channel"])} == set(want.items())
        for peer in want:
            mine = sends[sends["peer"] == peer]
            assert set(took(mine).tolist()) == {4 * WIRE_NS * (SLOW if (rank, peer) == (2, 3) else 1)}
            # From v4 on, the receiver's credit (20 us) is told apart; before, the wait starts with the wire.
            assert set(mine["wait_ns"].tolist()) == {20 * US if version >= 4 else 0}
        recvs = ops[ops["is_send"] == 0]
        assert (recvs["wait_ns"] > 0).all() and (recvs["end_ns"] >= recvs["start_ns"]).all()
        assert stats["dropped"] == 0 and stats["bad_calls"] == 0 and stats["written"] == stats["records"]
    ccl, feeds = ccl_tables({r: p for r, (p, _) in ran.items()})
    assert all(f.stats.filled == 18 and f.stats.unmatched == 0 and f.stats.bad_records == 0 for f in feeds)
    row = ccl.filter(pa.compute.equal(ccl["rank"], 2)).to_pylist()[0]
    assert row["peers"] == [0, 1, 3] and row["peer_transfer_ns"] == [-1, 4 * WIRE_NS, 4 * WIRE_NS * SLOW]
    assert row["peer_bytes"] == [0, 4 * MB, 4 * MB]
    top = diagnose_window(ccl).faults[0]
    assert (top.kind, top.src, top.dst) == ("link", 2, 3) and top.confidence >= 0.5, top


@pytest.mark.parametrize("version", (5, 3))
def test_send_recv_between_pipeline_stages_is_recorded_per_peer(tmp_path, library, version):
    """A 4-stage pipeline's sends and receives (point-to-point calls, 8 MB in 8 steps), 1 -> 2 slow: one
    record per op, numbered per peer and direction, its transfer four times longer on 1 -> 2. The reader
    counts them and leaves point-to-point records as they are (it cannot tell which of our pairs a
    communicator's peer is yet)."""
    from ingest.nccl_peers import KIND_COMM, KIND_P2P_OP, PeerTimingFeed

    ran = drive(tmp_path, "pipeline", version)
    times = {}
    for rank, (path, _) in ran.items():
        recs = records(path)
        assert recs[recs["kind"] == KIND_COMM]["comm_hash"].tolist() == [PIPE_HASH]
        ops = recs[recs["kind"] == KIND_P2P_OP]
        peers = [p for p in (rank - 1, rank + 1) if 0 <= p < WORLD]
        assert len(ops) == 6 * 2 * len(peers) and (ops["bytes"] == 8 * MB).all()
        assert (ops["coll_bytes"] == 8 * MB).all() and (ops["reserved"] == ops["peer"]).all()
        for peer in peers:
            for is_send in (0, 1):
                mine = ops[(ops["peer"] == peer) & (ops["is_send"] == is_send)]
                assert mine["seq"].tolist() == list(range(6))  # the k-th call to/from that peer
                if is_send:
                    times[(rank, peer)] = set(took(mine).tolist())
        feed = PeerTimingFeed(str(path))
        row = dict(group=f"p2p:{rank}>{rank + 1}", group_ranks=[rank, rank + 1], rank=rank, seq=0, nbytes=8 * MB,
                   peers=[rank + 1], peer_transfer_ns=[], peer_bytes=[], recv_wait_ns=-1)
        assert feed.fill_rows([row]) == [row] and feed.stats.p2p_records == len(ops) and not feed.stats.bad_records
    assert times.pop((1, 2)) == {8 * WIRE_NS * SLOW}
    assert all(t == {8 * WIRE_NS} for t in times.values()), times


def test_grouped_calls_and_interleaved_communicators_keep_their_own_numbers(tmp_path, library):
    """One group: all-reduce and all-gather on one communicator, an all-reduce on a second one between
    them, a send and a receive; every call enqueued before any proxy op runs, the ops interleaved."""
    from ingest.nccl_peers import KIND_COMM, KIND_P2P_OP, KIND_PROXY_OP

    (path, stats), = drive(tmp_path, "grouped", 5, ranks=[1]).values()
    recs = records(path)
    comms = {int(r["comm_hash"]): (r["name"], int(r["rank"]), int(r["nranks"]))
             for r in recs[recs["kind"] == KIND_COMM]}
    assert comms == {0xA1: (b"dp", 1, 4), 0xB2: (b"tp", 1, 2)}
    got = sorted((int(r["comm_hash"]), int(r["kind"]), int(r["seq"]), int(r["peer"]), int(r["is_send"]),
                  int(r["coll_bytes"]), int(r["bytes"]), int(r["end_ns"] - r["start_ns"] - r["wait_ns"]))
                 for r in recs[recs["kind"] != KIND_COMM])
    assert got == sorted([
        (0xA1, KIND_PROXY_OP, 0, 2, 1, 16 * MB, 4 * MB, 400 * US),   # the all-reduce: seq 0
        (0xA1, KIND_PROXY_OP, 1, 2, 1, 4 * MB, MB, 200 * US),        # the all-gather: seq 1 (NCCL's would be 0)
        (0xB2, KIND_PROXY_OP, 0, 0, 1, MB, MB, 50 * US),             # the other communicator's own seq 0
        (0xA1, KIND_P2P_OP, 0, 2, 1, 4 * MB, 4 * MB, 1200 * US),     # the send to 2
        (0xA1, KIND_P2P_OP, 0, 0, 0, 4 * MB, 4 * MB, 900 * US),      # the receive from 0 (first to last data)
    ]), got
    assert stats["bad_calls"] == 0 and stats["dropped"] == 0


def test_calls_nccl_should_never_make_are_ignored_and_counted(tmp_path, library):
    """Stops with no start, states of finished or made-up events, unknown event types, NULL pointers,
    foreign contexts, a PXN op of another process, finalize with events still open: the process lives,
    nothing blocks, and only the two real ops are written."""
    from ingest.nccl_peers import KIND_COMM, KIND_PROXY_OP

    (path, stats), = drive(tmp_path, "bad", 5, ranks=[0]).values()
    recs = records(path)
    assert sorted(recs[recs["kind"] == KIND_COMM]["comm_hash"].tolist()) == [0xC3, 0xD4]
    ops = recs[recs["kind"] == KIND_PROXY_OP]
    assert sorted(ops["is_send"].tolist()) == [0, 1] and (ops["comm_hash"] == 0xC3).all()
    assert ops[ops["is_send"] == 0]["bytes"].tolist() == [4096]  # the op left open at finalize, stopped later
    assert stats["detached"] == 1 and stats["bad_calls"] >= 20 and stats["untracked"] >= 3, stats
    assert stats["dropped"] == 0 and stats["written"] == stats["records"]


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path, library):
    from ingest.nccl_peers import KIND_DROPS, KIND_PROXY_OP, PeerTimingFeed

    (path, stats), = drive(tmp_path, "overflow", 5, ranks=[0]).values()
    recs = records(path)
    ops = recs[recs["kind"] == KIND_PROXY_OP]
    # The queue holds 16,384: the communicator's record and 16,383 ops; the rest were dropped, not waited for.
    assert len(ops) == 16_383 and len(ops) + stats["dropped"] == 20_000, stats
    assert recs[recs["kind"] == KIND_DROPS]["bytes"].max() == stats["dropped"]
    feed = PeerTimingFeed(str(path))
    feed.poll()
    assert feed.stats.plugin_dropped == stats["dropped"] and feed.stats.bad_records == 0
