"""Two gloo ranks exercising the wrapped torch.distributed as frameworks do (run by test_ccl_transparency)."""
import json
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    from core import schema as S
    from ingest.exporter import RankExporter, Sampling
    from ingest.torch_ccl import instrument_distributed

    captured_isend = dist.isend  # captured before instrumentation, as a module imported early would
    sent, facts = [], {}

    def sink(table):
        if S.kind_of(table.schema) == "op_span" and rank == 1:
            raise RuntimeError("kafka on fire")  # a broken sink must not reach training
        sent.append(table)

    exp = RankExporter("j", rank, 0, rank, sink, sampling=Sampling(1, 1), heartbeat_s=3600, use_cuda=False)
    originals = {n: getattr(dist, n) for n in ("isend", "irecv", "all_reduce", "batch_isend_irecv")}
    undo = instrument_distributed(exp)
    peer = 1 - rank
    with exp.step(0):
        with exp.op("forward-compute"):
            pass
        t, r = torch.full((4,), float(rank)), torch.empty(4)
        # The failure: P2POp rejected the wrapped isend ("Invalid op").
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, r, peer)]
        works = dist.batch_isend_irecv(ops)
        facts["batch_works_are_Work"] = all(isinstance(w, dist.Work) for w in works)
        for w in works:
            w.wait()
        facts["batch_received"] = r.tolist() == [float(peer)] * 4
        r2 = torch.empty(4)
        ops = [dist.P2POp(captured_isend, t, peer), dist.P2POp(dist.irecv, r2, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        facts["captured_original_accepted"] = r2.tolist() == [float(peer)] * 4
        facts["wrapper_equals_original"] = dist.isend == originals["isend"] and hash(dist.isend) == hash(
            originals["isend"])
        w = dist.all_reduce(t, async_op=True)
        facts["async_is_Work"] = isinstance(w, dist.Work)
        facts["async_completed_after_wait"] = w.wait() is not None and w.is_completed()
        out_t = torch.empty(8)
        dist.all_gather_into_tensor(out_t, torch.ones(4) * rank)
        facts["all_gather_result"] = out_t.tolist() == [0.0] * 4 + [1.0] * 4
        # Functional collectives (DTensor, TP): recorded, their results what torch gives.
        import torch.distributed._functional_collectives as fc

        y = fc.all_reduce(torch.ones(4) * (rank + 1), "sum", dist.group.WORLD)
        facts["funcol_is_async"] = isinstance(y, fc.AsyncCollectiveTensor)
        facts["funcol_all_reduce"] = (y + 0).tolist() == [3.0] * 4
        z = fc.all_gather_tensor(torch.ones(2) * rank, 0, dist.group.WORLD)
        facts["funcol_all_gather"] = z.tolist() == [0.0, 0.0, 1.0, 1.0]
        # Compiled, the wrapper steps aside: no graph break, no record (the call is a node of the graph).
        from torch._dynamo.utils import counters

        counters.clear()
        doubled = torch.compile(lambda x: fc.all_reduce(x, "sum", dist.group.WORLD) * 2, backend="aot_eager")
        facts["funcol_compiled"] = doubled(torch.ones(2)).tolist() == [4.0, 4.0]
        facts["funcol_compiled_no_graph_break"] = not counters["graph_break"]
        try:
            dist.all_reduce("not a tensor")
            facts["own_error_passes_through"] = False
        except Exception as e:  # torch's own error, untouched
            facts["own_error_passes_through"] = "stragglerscope" not in repr(e)
    exp.close()
    undo()
    facts["undo_restores"] = all(getattr(dist, n) is f for n, f in originals.items())
    rows = [row for tb in sent if S.kind_of(tb.schema) == "ccl_record" for row in tb.to_pylist()]
    facts["ccl"] = [(row["op"], row["group"], row["seq"]) for row in rows]
    facts["errors"] = exp.stats.errors
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
