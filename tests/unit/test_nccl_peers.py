"""Per-peer times from NCCL's profiler plugin (``ingest/nccl_peers.py``): the plugin's file, as a plugin
writes it (``write_records``), read by the real exporter into its collective records, and the link
diagnosis naming the slow link from them. No NCCL here: the file stands in for the plugin."""
from __future__ import annotations

import pyarrow as pa

from analyzers.links import diagnose_window
from core import codec
from ingest.exporter import RankExporter, Sampling
from ingest.nccl_peers import KIND_COMM, KIND_PROXY_OP, RECORD, PeerTimingFeed, write_records

WORLD = [0, 1, 2, 3]
MB = 1 << 20


def _comm(h, rank, nranks, name=""):
    return dict(kind=KIND_COMM, comm_hash=h, rank=rank, nranks=nranks, name=name)


def _op(h, seq, rank, nranks, peer, is_send, nbytes, took_ns, start=1_000, wait=0, channel=0, coll_bytes=None):
    return dict(kind=KIND_PROXY_OP, comm_hash=h, seq=seq, rank=rank, nranks=nranks, peer=peer, is_send=is_send,
                channel=channel, bytes=nbytes, coll_bytes=nbytes * 2 if coll_bytes is None else coll_bytes,
                start_ns=start, wait_ns=wait, end_ns=start + wait + took_ns)


def _row(group, ranks, rank, seq, nbytes, peers):
    return dict(group=group, group_ranks=ranks, rank=rank, seq=seq, nbytes=nbytes, peers=peers, op="all_reduce",
                peer_transfer_ns=[], peer_bytes=[], recv_wait_ns=-1)


def test_a_communicator_is_matched_by_name_or_by_the_bytes_of_a_collective(tmp_path):
    path = str(tmp_path / "p.bin")
    # Two communicators of the same size and place: the DP group's and the TP group's (rank 2 of 4 in both).
    write_records(path, [_comm(0xA, 1, 2), _comm(0xB, 1, 2),
                         _op(0xA, 0, 1, 2, 0, 1, MB, 5_000, coll_bytes=4 * MB),
                         _op(0xB, 0, 1, 2, 0, 1, MB, 7_000, coll_bytes=2 * MB, wait=3_000)])
    feed = PeerTimingFeed(path)
    got = feed.fill_rows([_row("tp", [0, 2], 2, 0, 2 * MB, [0]), _row("dp", [1, 2], 2, 0, 4 * MB, [1])])
    assert got[0]["peer_transfer_ns"] == [7_000] and got[0]["peer_bytes"] == [MB]  # its wait is not its transfer
    assert got[1]["peer_transfer_ns"] == [5_000]
    # Bound from now on: a later collective of the group is looked up in its communicator only.
    write_records(path, [_op(0xA, 1, 1, 2, 0, 1, MB, 9_000, coll_bytes=2 * MB)])
    (later,) = feed.fill_rows([_row("tp", [0, 2], 2, 1, 2 * MB, [0])])
    assert later["peer_transfer_ns"] == [] and feed.stats.unmatched == 1  # 0xA is dp's, not tp's
    # A name, where NCCL was told one, decides at once.
    write_records(path, [_comm(0xC, 0, 2, "pp"), _comm(0xD, 0, 2), _op(0xC, 0, 0, 2, 1, 1, MB, 4_000)])
    (named,) = feed.fill_rows([_row("pp", [5, 7], 5, 0, 9 * MB, [7])])
    assert named["peer_transfer_ns"] == [] and feed.stats.unmatched == 2  # bytes disagree: never guessed


def test_a_record_cut_in_half_waits_for_its_other_half_and_bad_records_are_counted(tmp_path):
    path = tmp_path / "p.bin"
    write_records(str(path), [_comm(1, 0, 2), _op(1, 0, 0, 2, 1, 1, MB, 2_000)])
    data = path.read_bytes()
    path.write_bytes(data[:RECORD.itemsize + 10])
    feed = PeerTimingFeed(str(path))
    assert feed.poll() == 1 and feed.fill_rows([_row("g", [0, 1], 0, 0, 2 * MB, [1])])[0]["peer_transfer_ns"] == []
    with open(path, "ab") as f:
        f.write(data[RECORD.itemsize + 10:])
    assert feed.poll() == 1
    assert feed.fill(_row("g", [0, 1], 0, 0, 2 * MB, [1]))["peer_transfer_ns"] == [2_000]
    write_records(str(path), [dict(_op(1, 1, 0, 2, 5, 1, MB, 1)), dict(_comm(2, 0, 2), version=9)])
    feed.poll()
    assert feed.stats.bad_records == 2  # a peer outside the communicator, a record of another version
    assert PeerTimingFeed(str(tmp_path / "none.bin")).poll() == 0  # no file yet: the plugin writes it later


def test_the_plugins_per_peer_times_name_the_slow_link_of_a_ring(tmp_path):
    """A ring all-reduce of 4 ranks on 2 channels whose rings run opposite ways (so each rank sends to two
    peers), 6 steps of 3 collectives; the path 2 -> 3 is 4x slower. Through the real exporter: its collective
    records carry each peer's time, and the diagnosis reads them as a measured matrix: link 2 -> 3, not the
    sender's NIC (its other path is healthy). With one ring only, a rank sends to one peer, and a link and
    its sender's NIC look alike (the diagnosis then names the link at half confidence)."""
    tables = []
    for rank in WORLD:
        path = str(tmp_path / f"nccl-peers-{rank}.bin")
        nxt, prv = (rank + 1) % 4, (rank - 1) % 4
        recs = [_comm(0x77, rank, 4)]
        for seq in range(18):
            for ch, (to, frm) in enumerate(((nxt, prv), (prv, nxt))):
                took = 400_000 * (4 if (rank, to) == (2, 3) else 1)
                recs.append(_op(0x77, seq, rank, 4, to, 1, 4 * MB, took, channel=ch, coll_bytes=16 * MB))
                recs.append(_op(0x77, seq, rank, 4, frm, 0, 4 * MB, 400_000, channel=ch, coll_bytes=16 * MB))
        write_records(path, recs)
        sent: list[pa.Table] = []
        exp = RankExporter("ring", rank, rank, 0, sent.append, sampling=Sampling(1, 1), heartbeat_s=3600,
                           use_cuda=False, tcp_flows=False, nvml=False, peer_timings=PeerTimingFeed(path))
        seq = 0
        for step in range(6):
            with exp.step(step):
                for _ in range(3):
                    t0 = exp.ccl_enter("all_reduce", "world", WORLD, seq)
                    exp.ccl_exit("all_reduce", "world", WORLD, seq, t0, 16 * MB, [r for r in WORLD if r != rank])
                    seq += 1
        exp.close()
        assert exp.peer_timings.stats.filled == 18 and exp.peer_timings.stats.unmatched == 0
        tables += [t for t in sent if codec.decode(codec.encode(t))[0] == "ccl_record"]
    ccl = pa.concat_tables(tables)
    assert ccl.num_rows == 4 * 18
    row = ccl.filter(pa.compute.equal(ccl["rank"], 2)).to_pylist()[0]
    assert row["peers"] == [0, 1, 3] and row["peer_transfer_ns"] == [-1, 400_000, 1_600_000]
    assert row["peer_bytes"] == [0, 4 * MB, 4 * MB]  # nothing to the rank across the ring
    top = diagnose_window(ccl).faults[0]
    assert (top.kind, top.src, top.dst) == ("link", 2, 3) and top.confidence >= 0.5, top
