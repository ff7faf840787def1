"""Framework hooks that turn an unchanged PyTorch training process into what-if op spans.

What is recorded, and where it comes from (op types of docs/whatif.md):
- **steps**: a step opens at the first forward (or pipeline ``schedule.step``)
  after the previous one closed, and closes at the end of ``optimizer.step()``
  (PyTorch's global optimizer step hooks). A pipeline with no optimizer closes
  its step when the next ``schedule.step`` begins. Steps are numbered from 0 in
  each process; sampling picks which are profiled.
- **forward-/backward-compute**: from ``torch.distributed.pipelining`` stages
  (``forward_one_chunk`` / ``backward_one_chunk``: microbatch and model chunk
  from the schedule), else from the outermost module call (global forward
  hooks: plain loops, DDP, FSDP2, hand-written schedules) and every backward
  the autograd engine runs (``Variable._execution_engine.run_backward``, which
  ``torch.autograd.backward``, ``Tensor.backward``, ``torch.autograd.grad`` and
  Megatron's ``custom_backward`` all reach; a backward started inside another
  span, as reentrant checkpointing does, belongs to that span). Time a
  compute span spends blocked waiting for other ranks of a data-parallel
  group (a collective or a ``wait()`` inside it; for DDP, whose wait is in C++,
  the time after the last gradient was ready) is communication, split off as a
  leading ``params-all-gather`` (a forward: FSDP2's all-gathers) or a trailing
  ``grads-reduce-scatter`` (a backward: DDP's and FSDP2's gradient reduction).
  Waits on TP and CP groups stay in the compute they happen in: the what-if
  model folds those ranks into one worker.
- **pipeline transfers**: the stage's own P2P ops (``get_fwd_recv_ops`` ...)
  are tagged, and their isend/irecv calls become forward-/backward-send/-recv
  spans. Outside ``torch.distributed.pipelining`` (Megatron's batched
  ``P2POp``s, plain ``isend``/``irecv``/``send``/``recv``), a transfer with a
  neighbour in the rank's pipeline group is one too: to the next stage or from
  the previous one it is the forward's, else the backward's; between two
  stages, what it carries or what its buffer becomes says (``transfers.py``);
  its chunk is that of the compute op that made or used it, its microbatch the
  count of such transfers in the step. Each outermost module of a hand-written
  pipeline is a model chunk (an interleaved schedule's virtual stages). A
  receive ends when its wait
  returns and, posted early, starts when the compute before its consumer
  ended; an async send ends when the rank moves on (gloo says nothing of a
  send's completion before its wait, which schedules do late): the
  receiver's span carries the transfer.
- **data-parallel collectives** called outside compute (a hand-written
  gradient all-reduce): a reduction over a group orthogonal to the pipeline is
  ``grads-reduce-scatter``, over the whole world of a pipelined job
  ``optimizer-clip-main-grad``, a gather ``params-all-gather``.
- **optimizer**, **gc** (``gc.callbacks``: one op per step, the pauses between
  the last backward and the first DP collective or the optimizer after it,
  empty when there were none) and
  **checkpoints** (``torch.distributed.checkpoint`` save and load).

- **layout**: where the rank sits, (dp, pp) and whether it sends its worker's
  spans, is settled when step 0 closes, before its spans go out, from the
  groups the job used (``_settle_layout``); after that each rank's claim is
  all-gathered on the session's side group, off the training thread's way,
  and rank 0 registers the job with what contradicts it, if anything, and
  the FLOPs facts for MFU.

Every hook is guarded: an error in here is counted, logged once and never
raised into training. Hooks act on the thread that initialised
torch.distributed only.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import weakref

from ingest.autotrace import layout as L
from ingest.autotrace import transfers as X
from ingest.torch_ccl import Call

log = logging.getLogger(__name__)

_REDUCTIONS = {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced"}
_GATHERS = {"all_gather", "all_gather_coalesced", "all_gather_single", "all_gather_into_tensor", "all_gather_tensor",
            "all_gather_tensor_autograd", "all_gather_into_tensor_coalesced"}  # torch.distributed's and functional
_P2P_TAGS = {"get_fwd_recv_ops": "forward-recv", "get_bwd_recv_ops": "backward-recv",
             "get_fwd_send_ops": "forward-send", "get_bwd_send_ops": "backward-send"}


class Tracer:
    def __init__(self, session):
        self.session = session
        self.exp = session.exporter
        self.thread = threading.get_ident()
        self.step = 0                 # the next (or current) step number
        self.open = False             # a step is open
        self.pending_close = False    # the pipeline schedule ended; close at the optimizer or the next step
        self.windows: set[int] = set()
        self.saw_optimizer_in_step = False
        self.active: str | None = None   # the compute span in progress ('forward-compute', ...)
        self.mod_depth = 0
        self.fwd_in_step = 0
        self.bwd_in_step = 0
        self.last_grad_perf = 0
        self.ddp_wait: tuple[str, int] | None = None  # a syncing DDP backward: (its group, gradients it reduces)
        self.grads_ready = 0          # gradients ready so far in the backward in progress
        self._ddp_facts: dict[int, tuple[str, int]] = {}
        self.blocked_ns = 0           # waits for other ranks inside the compute span in progress (but gathers)
        self.blocked_gather_ns = 0    # waits in all-gathers inside it (FSDP's parameters)
        self.last_compute_end = 0     # perf_counter_ns when the last compute span ended
        self.open_sends: list[Call] = []
        self.p2p_tags: dict[int, tuple[str, int, int]] = {}
        self.pp_group: set[int] | None = None
        self.pp_ranks: list[int] | None = None      # this rank's pipeline group, in stage order
        self.stage_info: tuple[int, int, int] | None = None  # (pp_size, pp_rank, vpp)
        self.p2p_pipe: list[int] | None = None      # the pipeline group learned from transfers (no pipelining)
        self.p2p_counts: dict[str, int] = {}        # transfers of each direction so far in the step
        self.pending_recvs = X.PendingRecvs()        # receives whose direction waits for their use
        self.settled_recvs: list[tuple] = []          # ... and those their use settled: (recv, optype, chunk)
        self.root_chunk: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # outermost module -> chunk
        self.param_chunk: dict[int, int] = {}       # id of each of their parameters -> chunk (tensors compare
                                                    # elementwise: no weak dictionary of them)
        self.root_params: list[int] = []            # parameters of each chunk
        self.chunk_fwds: dict[int, int] = {}        # forwards of each model chunk so far in the step
        self.chunk_bwds: dict[int, int] = {}        # backwards of each model chunk so far in the step
        self.chunks_seen = 1                        # model chunks whose forward ran in step 0
        self.fwd_chunk = self.bwd_chunk = 0         # chunks of the last forward and backward
        self.bwd_chunk_now: int | None = None       # the chunk of the backward in progress, once a gradient says
        self.mesh_sizes: dict[str, int] = {}        # what a DeviceMesh over the job says (see _learn_mesh)
        self.mesh_info: dict | None = None          # that mesh: names, shape, coordinates, this rank's groups
        self.non_dp_groups: list[frozenset[int]] = []     # this rank's TP and CP groups
        self.made_groups: list[tuple[int, ...]] = []      # every group the job made, in order (new_group)
        self.dp_seen: list[tuple[int, ...]] = []          # groups of reductions outside compute in step 0
        self.inside_groups: set[tuple[int, ...]] = set()  # groups of reductions inside compute in step 0
        self.settled = False          # the layout is settled (step 0 closed)
        self.sources = 0              # layout.SRC_* bits: where this rank's coordinates came from
        self.tokens0 = 0              # tokens this rank's model took in step 0
        self.fwd_flops: float | None = None  # FLOPs of the first forward of step 0, counted (see _count_start)
        self.fwd_flops_tokens = 0     # the tokens that forward took
        self._counter = None          # the FLOP-counting dispatch mode while it counts
        self._gather = None           # the claims' all-gather in flight: (work, output buffers)
        self.probe = None             # ingest.path_probe.PathProbe of this rank, made with its claim (_make_probe)
        self.num_microbatches = 0
        self.roots: weakref.WeakSet = weakref.WeakSet()
        self.hooked_params: weakref.WeakSet = weakref.WeakSet()
        self.registered = False
        self.model_name = ""
        self.params = 0
        self._gc_start = 0
        self.gc_pause: tuple[int, int] | None = None  # (first pause start, total pause) in this step
        self.after_backward = False                     # a backward ended and no forward began since
        self.chain_started = False                      # a DP collective began since the last compute op
        self.gc_done = False                            # this step's gc op is recorded
        self._span: tuple = (None, 0)
        self._span_module = None
        self._opt_token = None
        self.pending_since = 0
        self.nonroots: weakref.WeakSet = weakref.WeakSet()
        self._undo: list = []
        self._warned: set[str] = set()
        self._global_fwd_hooks: list = []  # removed once the roots are known (see _narrow_module_hooks)

    # -- guard ----------------------------------------------------------------
    def _failed(self, where: str, e: BaseException) -> None:
        self.exp.stats.errors += 1
        if where not in self._warned:
            self._warned.add(where)
            log.warning("stragglerscope: %s failed (counted, logged once): %r", where, e)

    def _mine(self) -> bool:
        return threading.get_ident() == self.thread

    # -- steps ----------------------------------------------------------------
    def _ensure_step(self) -> None:
        if self.pending_close:
            self._close_step()
        if not self.open:
            self.open = True
            self.saw_optimizer_in_step = False
            self.fwd_in_step = self.bwd_in_step = 0
            self.p2p_counts, self.chunk_fwds, self.chunk_bwds = {}, {}, {}
            self.gc_pause, self.after_backward, self.gc_done, self.chain_started = None, False, False, False
            self.exp.start_step(self.step)
            if self.exp.profiling:
                self.windows.add(self.exp.window)

    def _close_step(self) -> None:
        if not self.open:
            self.pending_close = False
            return
        self._count_stop()  # a forward that never came back to its post-hook (it raised past it) counts no more
        self._close_sends()
        self._settle_recvs(self.pending_recvs.drain(), None)
        self._emit_gc()
        if not self.saw_optimizer_in_step and self.exp.profiling:
            # The analyzer ends a step at its optimizer: a step without one gets an empty one, where the
            # schedule ended (or now).
            at = self.pending_since if self.pending_close and self.pending_since else time.perf_counter_ns()
            self.exp.record_op("optimizer", at, at)
        if self.num_microbatches == 0:
            self.num_microbatches = max(max(self.chunk_fwds.values(), default=0), 1)
        if not self.settled:
            self.chunks_seen = max(1, len(self.chunk_fwds))
        if not self.settled:
            # Before the step's spans go out: they carry the coordinates settled here.
            self.settled = True
            try:
                self._settle_layout()
            except Exception as e:
                self._failed("settling the layout", e)
        self.exp.finish_step(True)
        self.open = self.pending_close = False
        self.step += 1
        if not self.registered:
            try:
                if self._gather is None:
                    self._post_claims()
                self._poll_claims()
            except Exception as e:
                self.registered = True
                self._failed("registering the job", e)
        if self._global_fwd_hooks and self.mod_depth == 0:
            self._narrow_module_hooks()

    # -- the claims of every rank, and the registration ------------------------------------------------------
    def _claim(self) -> L.Claim:
        lay = self.session.layout
        exp = self.exp
        speaks = bool(exp.worker_spans)
        # Model FLOPs of the worker's step: the first forward's, counted, times 3 (forward and backward) for
        # each of its tokens of the step; else the dense rule, 6 x parameters x tokens. One rank of a TP/CP
        # group counts them (DTensor ops and parameters have global sizes).
        if self.fwd_flops and self.fwd_flops_tokens:
            flops = 3.0 * self.fwd_flops * self.tokens0 / self.fwd_flops_tokens
        else:
            flops = 6.0 * self.params * self.tokens0
        flops = flops if speaks else 0.0
        first = min(self.pp_ranks) if self.pp_ranks else -1
        return L.Claim(rank=self.session.rank, dp=int(exp.dp_rank), pp=int(exp.pp_rank), speaks=speaks,
                       pipeline=first, sizes=(lay.dp_size, lay.pp_size, lay.tp_size, lay.cp_size, lay.vpp_size),
                       sources=self.sources, flops=flops, tokens=float(self.tokens0), params=float(self.params),
                       problem="; ".join(getattr(self.session, "problems", ())),
                       probe=self.probe.address if self.probe is not None else "")

    def _make_probe(self) -> None:
        """This rank's path probe (``ingest/path_probe.py``), listening on the address its job's connections use;
        its address travels with the claim. None where the job has no peer to tell apart (fewer than 3 ranks),
        the exporter reads no TCP connections, or it is turned off (``--probe-kb 0``)."""
        from ingest.path_probe import PathProbe, job_host, peer_of

        sess = self.session
        kb = int(getattr(sess.settings, "probe_kb", 0) or 0)
        if kb <= 0 or peer_of(sess.rank, sess.world) is None or not self.exp.probing:
            return
        try:
            host = job_host()
            if host is not None:
                self.probe = PathProbe(host, nbytes=kb << 10)
        except Exception as e:
            self._failed("starting the path probe", e)

    def _aim_probe(self, claims: list[L.Claim]) -> None:
        from ingest.path_probe import peer_of

        peer = peer_of(self.session.rank, self.session.world)
        if self.probe is None or peer is None or peer >= len(claims) or not claims[peer].probe:
            return
        self.probe.aim(claims[peer].probe)
        self.exp.attach_probe(self.probe)

    def _post_claims(self) -> None:
        """Post this rank's claim on the side group (every rank does, once, at the end of its step 0); the
        all-gather completes on gloo's thread while training goes on, and ``_poll_claims`` picks it up."""
        side = getattr(self.session, "side_group", None)
        if side is not None:
            self._make_probe()
        claim = self._claim()
        if side is None:
            self._gather = ("local", [claim])
            return
        try:
            import torch

            mine = torch.frombuffer(bytearray(claim.encode()), dtype=torch.uint8)
            outs = [torch.empty(L.Claim.SIZE, dtype=torch.uint8) for _ in range(self.session.world)]
            self._gather = (side.allgather([outs], [mine]), outs)
        except Exception as e:
            self._failed("posting this rank's layout claim", e)
            self._gather = ("local", [claim])

    def _poll_claims(self, wait_s: float = 0.0) -> None:
        """Register once every rank's claim is in (rank 0); never waits in training (``wait_s`` 0)."""
        if self.registered or self._gather is None:
            return
        work, outs = self._gather
        claims = None
        if work == "local":
            claims = outs if self.session.world == 1 else None
        else:
            try:
                deadline = time.monotonic() + wait_s
                while not work.is_completed():
                    if time.monotonic() >= deadline:
                        return
                    time.sleep(0.05)
                work.wait()
                claims = [L.Claim.decode(bytes(o.numpy())) for o in outs]
                self._aim_probe(claims)
            except Exception as e:
                self._failed("gathering the ranks' layout claims", e)
        self.registered = True
        self._gather = None
        try:
            self._register(claims)
        except Exception as e:
            self._failed("registering the job", e)

    def _register(self, claims: list[L.Claim] | None) -> None:
        """Rank 0 registers the job: its layout, where it was read, what contradicts it, and the FLOPs facts.
        ``claims``: every rank's, or None when they could not be gathered (this rank's word alone)."""
        sess = self.session
        if sess.rank != 0:
            return
        from core import codec
        from core import schema as S

        lay = sess.layout
        st = sess.settings
        mine = self._claim()
        if claims is None:
            problems, sources, everyone = list(sess.problems), mine.sources, [mine]
        else:
            problems = L.check_claims(claims, sess.world)
            for p in problems:
                sess.warn(f"layout conflict: {p}")
            sources = 0
            for c in claims:
                sources |= c.sources
            everyone = claims
        if problems:
            sess.warn("windows of this job are stored as layout_conflict, not analysed: state its layout with "
                      "--layout, sizes and rank order, outermost first (e.g. --layout tp=2,order=tp,pp)")
        tokens = sum(c.tokens for c in everyone if c.speaks and c.pp == 0)
        flops = sum(c.flops for c in everyone)
        params = sum(c.params for c in everyone if c.speaks and c.dp == 0)
        gpu = _gpu_type()
        peak = st.peak_flops or _peak_of(gpu)
        if peak <= 0:
            # Said once, in the job's summary: nothing to do about it while the job runs.
            sess.warn(f"MFU not reported: the peak FLOP/s of device {gpu!r} is not known (set "
                      "STRAGGLERSCOPE_TRACE_PEAK_FLOPS to one device's peak, e.g. 989e12)", now=False)
        elif not flops or not tokens:
            sess.warn("MFU not reported: no model FLOPs counted in step 0 (no forward with parameters seen)",
                      now=False)
        source = L.describe_sources(sources)
        row = dict(job_id=st.job_id, attempt=st.attempt, ts_ns=self.exp.now_ns(), team=st.team,
                   model=st.model or self.model_name, n_gpus=sess.world, dp_size=lay.dp_size,
                   pp_size=lay.pp_size, tp_size=lay.tp_size, cp_size=lay.cp_size, vpp_size=lay.vpp_size,
                   num_microbatches=self.num_microbatches, profiled_steps=st.sampling.profile_steps,
                   gpu_type=gpu, peak_flops=float(peak), flops_per_token=flops / tokens if tokens else 0.0,
                   tokens_per_step=int(tokens), params=int(params), seq_len=0, num_layers=0,
                   layout_source=source, layout_problem="; ".join(problems)[:4000])
        self.exp.send(codec.from_rows(S.JOB, [row]))  # fields it does not name get their defaults

    # -- install --------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_mod

        from ingest.autotrace.imports import when_imported

        h1 = nn_module.register_module_forward_pre_hook(self._fwd_pre)
        h2 = nn_module.register_module_forward_hook(self._fwd_post, always_call=True)
        h3 = optim_mod.register_optimizer_step_pre_hook(self._opt_pre)
        h4 = optim_mod.register_optimizer_step_post_hook(self._opt_post)
        self._global_fwd_hooks = [h1, h2]
        self._undo += [h.remove for h in (h1, h2, h3, h4)]

        self._patch_engine()
        self._patch_new_group()
        gc.callbacks.append(self._gc)
        self._undo.append(lambda: gc.callbacks.remove(self._gc))
        when_imported("torch.distributed.pipelining.stage", self._patch_stage)
        when_imported("torch.distributed.pipelining.schedules", self._patch_schedules)
        when_imported("torch.distributed.checkpoint", self._patch_checkpoint)
        self._provisional()

    def _patch_engine(self) -> None:
        """Every backward passes through ``Variable._execution_engine.run_backward``: wrapping
        ``torch.autograd.backward`` missed Megatron's ``custom_backward``, which calls the engine itself
        (no backward span at all, S 2.37 where 1.55 was right). The engine object is put behind a proxy
        that forwards everything else (``queue_callback``, ...) to it."""
        from torch.autograd.variable import Variable

        engine = Variable.__dict__.get("_execution_engine")
        if engine is None or isinstance(engine, _EngineProxy):
            return
        Variable._execution_engine = _EngineProxy(engine, self)
        self._undo.append(lambda: setattr(Variable, "_execution_engine", engine))

    def _patch_new_group(self) -> None:
        """Note the members of every group the job makes. Every rank makes every group, in the same order,
        so each rank knows groups it is not in: a transfer over the default group is placed in the smallest
        group the job made that holds both ends."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        orig = c10d.new_group
        if getattr(orig, "_stragglerscope", False):
            return
        tracer = self

        def new_group(ranks=None, *args, **kwargs):
            group = orig(ranks, *args, **kwargs)
            try:
                if ranks is not None and len(tracer.made_groups) < 100_000:
                    tracer.made_groups.append(tuple(sorted(int(r) for r in ranks)))
            except Exception as e:
                tracer._failed("noting a new group", e)
            return group
        new_group.__wrapped__ = orig
        new_group.__doc__ = orig.__doc__
        new_group._stragglerscope = True
        c10d.new_group = new_group
        if dist.new_group is orig:
            dist.new_group = new_group

        def undo():
            if c10d.new_group is new_group:
                c10d.new_group = orig
            if dist.new_group is new_group:
                dist.new_group = orig
        self._undo.append(undo)

    def _narrow_module_hooks(self) -> None:
        """Trade the global forward hooks for hooks on the outermost modules, after the first step.

        Global module hooks take every module call of the model (hundreds per forward in a real
        model) off PyTorch's fast path, in every step, sampled or not, and torch.compile traces
        them. One step is enough to learn the outermost modules; from then on only they are hooked
        (a pipeline needs none: its stages are the spans). A module first called as the outermost
        one after step 0 is then not seen as a root: its forward still belongs to the step it runs in.
        """
        try:
            if self.stage_info is None:
                if not self.roots:
                    return  # no forward seen yet: keep looking
                for root in list(self.roots):
                    # Ahead of the module's own pre-hooks, as the global hook was: FSDP2's root all-gathers
                    # in one, which ran outside the forward span from step 1 (a second all-gather a forward).
                    pre = root.register_forward_pre_hook(self._fwd_pre, prepend=True)
                    post = root.register_forward_hook(self._fwd_post, always_call=True)
                    self._undo += [pre.remove, post.remove]
            hooks, self._global_fwd_hooks = self._global_fwd_hooks, []
            for h in hooks:
                h.remove()
        except Exception as e:
            self._failed("narrowing module hooks", e)

    def close(self) -> None:
        if self.open:
            try:
                self._close_step()
            except Exception as e:
                self._failed("closing the last step", e)
        if self.settled and not self.registered:
            # The process is exiting: the other ranks' claims may take a moment more (they post them at
            # the end of their own step 0); rank 0 waits a little for them, then registers regardless.
            self._poll_claims(wait_s=10.0 if self.session.rank == 0 else 0.0)
        if self.probe is not None and self.exp.probe is None:  # never aimed: the exporter does not close it
            self.probe.close()
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:
                pass
        self._undo.clear()

    # -- modules: forward of the outermost module, and the params to watch ------
    def _fwd_pre(self, module, _inputs) -> None:
        if not self._mine():
            return
        try:
            self.mod_depth += 1
            if self.mod_depth != 1 or self.active is not None or self.stage_info is not None:
                return  # nested, inside another span, or a pipeline (its stages are the spans)
            if module not in self.roots:
                if module in self.nonroots:
                    return
                if next(module.parameters(), None) is None:
                    self.nonroots.add(module)  # a loss module or other parameter-free call: not the model
                    return
                self._learn_root(module)
            self._ensure_step()
            self._close_sends()
            if not self.settled:
                self.tokens0 += _tokens(_inputs)
            self.active = "forward-compute"
            self.after_backward = False
            self.blocked_ns = self.blocked_gather_ns = 0
            chunk = self.root_chunk.get(module, 0) if self.p2p_pipe is not None else 0
            mb = self.chunk_fwds.get(chunk, 0)
            self.chunk_fwds[chunk], self.fwd_chunk = mb + 1, chunk
            mc, gmc = self._chunk_ids(chunk)
            self._span = (self.exp.begin_op("forward-compute", mb, mc, gmc), time.perf_counter_ns())
            self.fwd_in_step += 1
            if self.pending_recvs:
                self._settle_recvs(self.pending_recvs.used_in(_inputs), X.FORWARD_RECV, chunk)
            self._span_module = module
            if not self.settled and self.fwd_flops is None and type(module).__name__ != "OptimizedModule":
                self._count_start(_tokens(_inputs))
        except Exception as e:
            self._failed("forward pre-hook", e)

    def _fwd_post(self, module, _inputs, _output) -> None:
        if not self._mine():
            return
        try:
            self.mod_depth = max(0, self.mod_depth - 1)
            if self.mod_depth != 0 or self.active != "forward-compute" or module is not self._span_module:
                return
            self._count_stop()
            token, t0 = self._span
            self.active = None
            self._span_module = None
            self._end_compute(token, t0, "forward-compute")
        except Exception as e:
            self._failed("forward hook", e)

    def _count_start(self, tokens: int) -> None:
        """Count the FLOPs of this forward (the first of step 0) with PyTorch's FLOP counter: its dispatch mode
        alone, without the module tracker of ``FlopCounterMode.__enter__``, whose global module hooks cannot
        be added from inside one (this runs in a global forward pre-hook). The ops run as they would; only
        their shapes are read. Where it cannot count, the dense rule stands (``_claim``)."""
        self.fwd_flops = 0.0  # tried once, counted or not
        try:
            from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

            counter = FlopCounterMode(display=False)
            counter.mode = _FlopCounterMode(counter)
            counter.mode.__enter__()
            self._counter, self.fwd_flops_tokens = counter, tokens
        except Exception as e:
            self._failed("counting a forward's FLOPs", e)

    def _count_stop(self) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        try:
            counter.mode.__exit__(None, None, None)
            self.fwd_flops = float(counter.get_total_flops())
        except Exception as e:
            self.fwd_flops = 0.0
            self._failed("counting a forward's FLOPs", e)

    def _learn_root(self, module) -> None:
        chunk = len(self.root_params)  # its place among the outermost modules, in the order of their first call
        self.roots.add(module)
        self.root_chunk[module] = chunk
        self.root_params.append(sum(p.numel() for p in module.parameters()))
        if not self.model_name:
            inner = _uncompiled(module)
            self.model_name = _class_name(getattr(inner, "module", inner))
        self.params = max(self.params, sum(p.numel() for p in module.parameters()))
        for p in module.parameters():
            if p.requires_grad and p not in self.hooked_params and hasattr(p, "register_post_accumulate_grad_hook"):
                p.register_post_accumulate_grad_hook(self._grad_ready)
                self.hooked_params.add(p)
            self.param_chunk.setdefault(id(p), chunk)

    def _grad_ready(self, param) -> None:
        try:
            if self.active == "backward-compute":
                self.last_grad_perf = time.perf_counter_ns()
                if self.bwd_chunk_now is None:
                    self.bwd_chunk_now = self.param_chunk.get(id(param))
                if self.ddp_wait is not None:
                    self.grads_ready += 1
                    if self.grads_ready == self.ddp_wait[1]:
                        # Every gradient is ready: what is left of this backward is DDP's reducer waiting, in
                        # C++, for the all-reduce of the last buckets, i.e. for the other ranks. The heartbeats
                        # say so, and a rank that never comes is the one the hang detector names.
                        self.exp.waiting_in("all_reduce", self.ddp_wait[0])
        except Exception as e:  # a gradient hook's error would end the backward
            self._failed("gradient hook", e)

    def _chunk_ids(self, chunk: int) -> tuple[int | None, int | None]:
        """(mc, gmc) of a model chunk of this rank (None, None: the exporter's own, chunk 0's): chunk c of
        stage p is global chunk c * pp + p, as Megatron numbers virtual stages."""
        if chunk <= 0 or self.p2p_pipe is None:
            return None, None
        return chunk, chunk * len(self.p2p_pipe) + int(self.exp.pp_rank)

    # -- backward -------------------------------------------------------------
    def _bwd_begin(self, grad_tensors=None):
        if not self._mine() or self.active is not None:
            return None
        try:
            self._ensure_step()
            self._close_sends()
            self.active = "backward-compute"
            self.last_grad_perf = self.blocked_ns = self.blocked_gather_ns = 0
            self.bwd_chunk_now = None
            self.grads_ready = 0
            try:
                self.ddp_wait = self._ddp_reduction()
            except Exception as e:  # the heartbeats then say backward-compute; the span is traced regardless
                self.ddp_wait = None
                self._failed("reading DDP's group", e)
            fed = self.pending_recvs.used_in(grad_tensors) if self.pending_recvs else []
            t0 = time.perf_counter_ns()
            token = self.exp.begin_op("backward-compute", mb_id=self.bwd_in_step)
            self.bwd_in_step += 1
            return (token, t0, _syncs_grads(self.roots), fed)
        except Exception as e:
            self._failed("backward begin", e)
            return None

    def _ddp_reduction(self) -> tuple[str, int] | None:
        """A DDP among the outermost modules whose backward now reduces gradients: (its group, their count);
        learned once per DDP."""
        for m in list(self.roots):
            m = _uncompiled(m)
            if type(m).__name__ == "DistributedDataParallel" and getattr(m, "require_backward_grad_sync", False):
                facts = self._ddp_facts.get(id(m))
                if facts is None:
                    facts = self._ddp_facts[id(m)] = _ddp_facts(m)
                return facts
        return None

    def _bwd_end(self, span) -> None:
        if span is None:
            return
        try:
            token, t0, ddp_sync, fed = span
            self.active = None
            self.after_backward = True
            # Its chunk is the one whose parameters it gave gradients to (a pipeline's; 0 elsewhere), its
            # microbatch the count of that chunk's backwards.
            chunk = self.bwd_chunk_now if self.bwd_chunk_now is not None and self.p2p_pipe is not None else 0
            mb = self.chunk_bwds.get(chunk, 0)
            self.chunk_bwds[chunk], self.bwd_chunk = mb + 1, chunk
            if token is not None:
                mc, gmc = self._chunk_ids(chunk)
                meta = token[1]
                token = (token[0], meta[:2] + (meta[2] if mc is None else mc, meta[3] if gmc is None else gmc, mb)
                         + meta[5:])
            tail_from = self.last_grad_perf if ddp_sync else 0  # DDP waits inside C++: the last gradient marks it
            self._end_compute(token, t0, "backward-compute", tail_from)
            self._settle_recvs(fed, X.BACKWARD_RECV, chunk)
            if self.pending_recvs:
                self._settle_recvs(self.pending_recvs.given_a_grad(), X.FORWARD_RECV, chunk)
        except Exception as e:
            self._failed("backward end", e)

    def _end_compute(self, token, t0: int, optype: str, tail_from: int = 0) -> None:
        """End a compute span, with the time it waited for other ranks split off as communication.

        Waits in all-gathers (FSDP's parameters, in the forward and, resharded after it, in the backward)
        become a leading ``params-all-gather``; a backward's other waits (the gradient reduction of DDP or
        FSDP, where gradients are synced) a trailing ``grads-reduce-scatter``; a forward's are all leading.
        Both carry the span's microbatch and chunk: the what-if model puts such a wait between the compute
        op before it and the one after (``analyzers/whatif/graph.py``), one per microbatch where gradients
        are accumulated. Split off as one trailing reduce-scatter per backward, an FSDP2 job's backward
        all-gathers were put after the whole backward pass, and its window was a dependency cycle.
        """
        t1 = self.last_compute_end = time.perf_counter_ns()
        self.chain_started = False
        lead, tail = self.blocked_gather_ns, self.blocked_ns
        if optype == "forward-compute":
            lead, tail = lead + tail, 0
        if tail_from and t0 < tail_from < t1:
            tail = max(tail, t1 - tail_from)
        self.blocked_ns = self.blocked_gather_ns = 0
        if token is None or lead + tail <= 0 or not isinstance(token[0], int) or lead + tail >= t1 - t0:
            self.exp.end_op(token)  # nothing to split (or CUDA-timed: GPU time excludes host waits)
            return
        meta = token[1]
        mb, mc, gmc = max(0, int(meta[4])), meta[2], meta[3]
        if lead:
            self.exp.record_op("params-all-gather", t0, t0 + lead, mb_id=mb, mc=mc, gmc=gmc)
        self.exp.end_op((t0 + lead, meta), end_perf_ns=t1 - tail)
        if tail:
            self.exp.record_op("grads-reduce-scatter", t1 - tail, t1, mb_id=mb, mc=mc, gmc=gmc)

    # -- optimizer ------------------------------------------------------------
    def _opt_pre(self, _opt, _args, _kwargs) -> None:
        if not self._mine() or not self.open or self.active is not None:
            return
        try:
            self._close_sends()
            self._emit_gc()
            self.active = "optimizer"
            self._opt_token = self.exp.begin_op("optimizer")
        except Exception as e:
            self.active = None
            self._failed("optimizer pre-hook", e)

    def _opt_post(self, _opt, _args, _kwargs) -> None:
        if not self._mine() or self.active != "optimizer":
            return
        try:
            self.active = None
            self.exp.end_op(self._opt_token)
            self.saw_optimizer_in_step = True
            self._close_step()
        except Exception as e:
            self._failed("optimizer hook", e)

    # -- collectives (torch_ccl observer) ----------------------------------------
    def on_enter(self, call: Call) -> None:
        if not self._mine():
            return
        if call.is_p2p:
            self._on_p2p(call)
            return
        if not self.settled and call.op in _REDUCTIONS and 1 < len(call.ranks) < self.session.world \
                and not _is_meta(call.tensor):
            if self.active is not None:
                self.inside_groups.add(tuple(call.ranks))  # reduced inside compute: TP-like, not the DP group
            elif tuple(call.ranks) not in self.dp_seen:
                self.dp_seen.append(tuple(call.ranks))  # a candidate DP group (_settle_layout)
        if not self.exp.profiling:
            return
        self._close_sends()
        if self.active is not None or _is_meta(call.tensor):
            return  # nested in a span: its blocking time is what counts (on_blocked); or shapes only
        optype = self._dp_optype(call)
        if optype is not None:
            self.chain_started = True
            call.note = ("span", self.exp.begin_op(optype))

    def _on_p2p(self, call: Call) -> None:
        tag = self.p2p_tags.pop(id(call.tensor), None) if self.p2p_tags else None
        if tag is not None:
            optype, mc, gmc = tag
            mb = -1
        else:
            optype = self._transfer_optype(call)
            if optype is None:
                return
            if not self.open and self.active is None:
                self._ensure_step()  # a stage's first receive comes before its first forward
            mb, mc, gmc = -1, None, None
            if optype != X.AMBIGUOUS:
                mb = self.p2p_counts.get(optype, 0)
                self.p2p_counts[optype] = mb + 1
                # A send carries what the last compute op of its direction made.
                chunk = self.fwd_chunk if optype == X.FORWARD_SEND else \
                    self.bwd_chunk if optype == X.BACKWARD_SEND else 0
                mc, gmc = self._chunk_ids(chunk)
        if not self.exp.profiling:
            return
        self._close_sends()
        if optype == X.AMBIGUOUS:
            call.note = ("recv?", self.exp.begin_op(X.FORWARD_RECV, -1))  # its type once its buffer is used
            return
        call.note = ("send" if call.is_send else "recv", self.exp.begin_op(optype, mb, mc, gmc))
        if call.is_send and call.is_async and call.note[1] is not None:
            self.open_sends.append(call)

    def _transfer_optype(self, call: Call) -> str | None:
        """forward-/backward-send/-recv for a transfer between neighbour stages of this rank's pipeline,
        outside ``torch.distributed.pipelining`` (whose stages tag their own), ``transfers.AMBIGUOUS`` for a
        receive whose direction its use will tell; None for any other (``ingest/autotrace/transfers.py``)."""
        if self.stage_info is not None or not call.peers:
            return None
        pipe = self.p2p_pipe or self._learn_transfer_pipeline(call)
        if pipe is None:
            return None
        me, peer = self.session.rank, call.peers[0]
        if peer not in pipe or me not in pipe:
            return None
        activation = bool(getattr(call.tensor, "requires_grad", False)) or self.bwd_in_step == 0
        return X.direction(pipe.index(me), pipe.index(peer), len(pipe), call.is_send, activation=activation)

    def _settle_recvs(self, recvs: list, optype: str | None, chunk: int = 0) -> None:
        """Receives whose direction their use told (``optype``, of ``chunk``); None: the step ends, the rest
        are read without wrap-around, and all are recorded, numbered in the order they began."""
        self.settled_recvs += [(r, optype, chunk) for r in recvs]
        if optype is not None:
            return
        done, self.settled_recvs = sorted(self.settled_recvs, key=lambda x: x[0].start), []
        for r, kind, chunk in done:
            mc, gmc = self._chunk_ids(chunk) if kind else (None, None)
            kind = kind or X.unwrapped(r.me, r.peer, False)
            mb = self.p2p_counts.get(kind, 0)
            self.p2p_counts[kind] = mb + 1
            self.exp.record_op(kind, r.start, r.end, mb, mc, gmc)

    def _learn_transfer_pipeline(self, call: Call) -> list[int] | None:
        """This rank's pipeline group from its first transfer: the group the transfer names (Megatron's
        pipeline group), else the smallest group the job made that holds both ends, else, where --layout
        says pp > 1, the rank order's. A transfer over the default group with nothing to place it (a
        hand-made ring all-reduce) is no pipeline transfer."""
        me, peer, world = self.session.rank, call.peers[0], self.session.world
        pipe = None
        if call.via is not None and len(call.via) > 1:
            pipe = list(call.via)  # a group named on purpose, all ranks included (a pipeline-only job)
        else:
            made = [g for g in self.made_groups if me in g and peer in g and 1 < len(g) < world]
            if made:
                pipe = list(min(made, key=len))
            elif self.session.layout.pp_size > 1 and self.session.settings.layout.get("pp_size"):
                pipe = self._order_group(("pp",))
        if pipe is None or me not in pipe or peer not in pipe:
            return None
        self.p2p_pipe, self.pp_ranks, self.pp_group = pipe, pipe, set(pipe)
        stage = pipe.index(me)
        self.session.relayout(pp=len(pipe), mesh=self._mesh_sizes_now())
        self._provisional()
        if self.exp.gmc != stage:
            self.exp.relabel_buffered(0, stage)  # what came before it (a first stage's forward) is chunk 0's
        self.exp.pp_rank, self.exp.mc, self.exp.gmc = stage, 0, stage
        return pipe

    def _provisional(self) -> None:
        """Until step 0 settles the layout: TP and CP groups, and whether this rank sends its worker's spans,
        from the rank order, where --layout names TP or CP and no DeviceMesh says more. A TP wait in step 0
        split off as DP communication made window 0 a dependency cycle."""
        sess = self.session
        if self.settled or self.mesh_info is not None or not hasattr(sess, "order_coords"):
            return
        try:
            lay = sess.layout
            if lay.tp_size * lay.cp_size > 1:
                self.non_dp_groups = [frozenset(self._order_group(("tp", "cp")))]
                self.exp.worker_spans = sess.order_coords(sess.rank, quiet=True)[2]
        except Exception as e:
            self._failed("reading the rank order", e)

    def _order_group(self, dims: tuple[str, ...]) -> list[int]:
        """The ranks that differ from this one only along ``dims`` in the rank order (--layout's, else
        Megatron's), in the order of their coordinates along them."""
        sess = self.session
        lay = sess.layout
        sizes = {"dp": lay.dp_size, "pp": lay.pp_size, "tp": lay.tp_size, "cp": lay.cp_size}
        order = sess.order or L.DEFAULT_ORDER
        try:
            coords = [L.coords_in_order(r, sizes, order) for r in range(sess.world)]
        except L.LayoutError:
            coords = [L.coords_in_order(r, sizes, L.DEFAULT_ORDER) for r in range(sess.world)]
        mine = coords[sess.rank]
        same = [r for r, c in enumerate(coords) if all(c[d] == mine[d] for d in L.DIMS if d not in dims)]
        return sorted(same, key=lambda r: tuple(coords[r][d] for d in dims))

    def on_exit(self, call: Call) -> None:
        note, call.note = call.note, None
        if note is None or note[1] is None:
            return
        token = note[1]
        if note[0] in ("recv", "recv?") and isinstance(token[0], int):
            # A receive posted early (schedules post them ahead) starts, for the model, when the compute
            # before its consumer ended: recv i sits between compute i-1 and compute i.
            token = (max(token[0], self.last_compute_end), token[1])
        if note[0] == "recv?":
            pipe = self.p2p_pipe or []
            me, peer = pipe.index(self.session.rank), pipe.index(call.peers[0])
            if isinstance(token[0], int):
                self.exp.end_op(None)  # out of flight; recorded once its buffer's use says what it was
                self.pending_recvs.add(X.PendingRecv(call.tensor, token[0], time.perf_counter_ns(), me, peer))
                return
            # GPU-timed: its end is an event queued now, so it is read now, as a pipeline without wrap-around
            meta = token[1]
            kind = X.unwrapped(me, peer, False)
            mb = self.p2p_counts.get(kind, 0)
            self.p2p_counts[kind] = mb + 1
            token = (token[0], (kind, self.exp.next_seq(kind)) + meta[2:4] + (mb,) + meta[5:])
        self.exp.end_op(token)

    def _close_sends(self) -> None:
        """End async sends when this rank moves on. Gloo tells a sender nothing of a send's completion until
        it waits, which schedules do late (at the next send or the step's end); the receiver's span carries
        the transfer. Blocking sends keep their real duration."""
        if self.open_sends:
            sends, self.open_sends = self.open_sends, []
            for call in sends:
                self.on_exit(call)

    def on_blocked(self, call: Call, ns: int) -> None:
        """Time the training thread waited in a data-parallel collective inside a compute span: DP
        communication. A wait on a TP or CP group stays in the compute (the what-if folds those ranks into
        the worker): split off as DP communication, whose ideal transfer is nil, a TP peer's slowness
        vanished from the model (S +14.5% on a DTensor job with a worker's second rank slowed)."""
        if self.active in ("forward-compute", "backward-compute") and self._mine() and not call.is_p2p \
                and self._is_dp_group(call.ranks):
            if call.op in _GATHERS:
                self.blocked_gather_ns += ns
            else:
                self.blocked_ns += ns

    def _is_dp_group(self, ranks: list[int]) -> bool:
        """A group orthogonal to this rank's pipeline (no other member of it is a pipeline peer)."""
        if len(ranks) < 2:
            return False
        if frozenset(ranks) in self.non_dp_groups:
            return False
        if self.pp_group is None:
            return True
        return len(self.pp_group.intersection(ranks)) <= 1

    def _dp_optype(self, call: Call) -> str | None:
        if not self.open:
            return None
        if call.op in _REDUCTIONS:
            if len(call.ranks) == self.session.world and self.session.layout.pp_size > 1:
                return "optimizer-clip-main-grad"
            return "grads-reduce-scatter" if self._is_dp_group(call.ranks) else None
        if call.op in _GATHERS and self._is_dp_group(call.ranks):
            return "params-all-gather"
        return None

    # -- gc ---------------------------------------------------------------------
    def _gc(self, phase: str, _info: dict) -> None:
        """Collections between the last backward and the first DP collective after it (or the optimizer):
        the model's one ``gc`` op per step, which its post-compute chain puts before that collective. Pauses
        elsewhere stay in the span they interrupt or in a launch delay: a pause after a gradient-norm
        all-reduce, taken into the gc op, put that op after the all-reduce the model starts after it (a
        launch delay of -30 ms, clamped, on an FSDP2 job)."""
        if not self._mine() or not self.exp.profiling:
            return
        try:
            if phase == "start":
                self._gc_start = time.perf_counter_ns()
            elif phase == "stop" and self._gc_start and self.active is None and self.open and self.after_backward \
                    and not self.chain_started:
                now = time.perf_counter_ns()
                first, total = self.gc_pause or (self._gc_start, 0)
                self.gc_pause = (first, total + now - self._gc_start)
                self._gc_start = 0
        except Exception as e:
            self._failed("gc callback", e)

    def _emit_gc(self) -> None:
        """The step's ``gc`` op, empty when nothing was collected: every worker has one, as in the
        paper's traces, so the ideal (the mean over workers) sees one rank's pauses as its straggling."""
        if not self.exp.profiling or self.gc_done:
            return
        self.gc_done = True
        if self.gc_pause is not None:
            first, total = self.gc_pause
            # A pipeline schedule runs backward chunks after one another: a collection between two of
            # them is still this step's gc, but the model's gc op follows the last compute op. Started
            # between the chunks it made a dependency cycle (gc before a chunk that precedes it).
            first = max(first, self.last_compute_end or first)
        else:  # empty, where the model puts it: right after the last compute op
            first, total = self.last_compute_end or time.perf_counter_ns(), 0
        self.gc_pause = None
        self.exp.record_op("gc", first, first + total)

    # -- torch.distributed.pipelining -------------------------------------------
    def _patch_stage(self, stage_mod) -> None:
        cls = stage_mod._PipelineStageBase
        tracer = self

        def compute(name: str, optype: str):
            orig = getattr(cls, name)

            def wrapper(stage, chunk_id, *args, **kwargs):
                span = tracer._stage_begin(stage, optype, chunk_id)
                counting = span is not None and optype == "forward-compute" and not tracer.settled \
                    and tracer.fwd_flops is None
                if counting:
                    tracer._count_start(0)
                try:
                    out = orig(stage, chunk_id, *args, **kwargs)
                finally:
                    if counting:
                        tracer._count_stop()
                    tracer._stage_end(span)
                if span is not None and not tracer.settled and optype == "forward-compute":
                    tracer.tokens0 += _tokens(out)  # the stage's output: as many rows as it took in
                    if counting:
                        tracer.fwd_flops_tokens = _tokens(out)
                return out
            return orig, wrapper

        def tagging(name: str, optype: str):
            orig = getattr(cls, name)

            def wrapper(stage, chunk_id, *args, **kwargs):
                ops = orig(stage, chunk_id, *args, **kwargs)
                tracer._tag_p2p(stage, ops, optype)
                return ops
            return orig, wrapper

        patches = [("forward_one_chunk", *compute("forward_one_chunk", "forward-compute")),
                   ("backward_one_chunk", *compute("backward_one_chunk", "backward-compute"))]
        patches += [(name, *tagging(name, optype)) for name, optype in _P2P_TAGS.items()]
        for name, orig, wrapper in patches:
            wrapper.__wrapped__ = orig
            setattr(cls, name, wrapper)
            self._undo.append(lambda name=name, orig=orig: setattr(cls, name, orig))

    def _stage_chunk(self, stage) -> tuple[int, int]:
        """(model chunk on this rank, global model chunk) of a stage."""
        idx = int(stage.stage_index)
        pp = max(1, int(getattr(stage, "group_size", 1)))
        return idx // pp, idx

    def _stage_begin(self, stage, optype: str, chunk_id: int):
        if not self._mine() or self.active is not None:
            return None
        try:
            self._ensure_step()
            self._close_sends()
            mc, gmc = self._stage_chunk(stage)
            self.active = optype
            self.blocked_ns = self.blocked_gather_ns = 0
            if optype == "forward-compute":
                self.fwd_in_step += 1
            t0 = time.perf_counter_ns()
            return (self.exp.begin_op(optype, int(chunk_id), mc, gmc), t0, optype)
        except Exception as e:
            self._failed("pipeline stage begin", e)
            return None

    def _stage_end(self, span) -> None:
        if span is None:
            return
        try:
            token, t0, optype = span
            self.active = None
            self.after_backward = optype == "backward-compute"
            self._end_compute(token, t0, optype)
        except Exception as e:
            self._failed("pipeline stage end", e)

    def _tag_p2p(self, stage, ops, optype: str) -> None:
        if not self.exp.profiling or not ops:
            return
        try:
            mc, gmc = self._stage_chunk(stage)
            for op in ops:
                self.p2p_tags[id(op.tensor)] = (optype, mc, gmc)
        except Exception as e:
            self._failed("tagging pipeline transfers", e)

    def _patch_schedules(self, sched_mod) -> None:
        tracer = self
        for cls_name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
            cls = getattr(sched_mod, cls_name, None)
            if cls is None or "step" not in vars(cls):
                continue
            orig = cls.step

            def step(schedule, *args, __orig=orig, **kwargs):
                tracer._schedule_begin(schedule)
                try:
                    return __orig(schedule, *args, **kwargs)
                finally:
                    tracer._schedule_end()
            step.__wrapped__ = orig
            step.__doc__ = orig.__doc__
            cls.step = step
            self._undo.append(lambda cls=cls, orig=orig: setattr(cls, "step", orig))

    def _schedule_begin(self, schedule) -> None:
        if not self._mine():
            return
        try:
            if self.stage_info is None:
                self._learn_pipeline(schedule)
            self._ensure_step()
        except Exception as e:
            self._failed("pipeline schedule begin", e)

    def _schedule_end(self) -> None:
        if self._mine() and self.open:
            self.pending_close = True
            self.pending_since = time.perf_counter_ns()

    def _learn_pipeline(self, schedule) -> None:
        """Pipeline size, this rank's stage and chunks, and its pipeline group from the schedule: they beat
        --layout. The DP coordinate waits for the gradient reduction (``_settle_layout``)."""
        import torch.distributed as dist

        stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        first = stages[0]
        pp = int(first.group_size)
        pp_rank = int(first.group_rank)
        vpp = len(stages)
        self.num_microbatches = int(getattr(schedule, "_n_microbatches", 0))
        self.stage_info = (pp, pp_rank, vpp)
        ranks = list(dist.get_process_group_ranks(first.group)) if first.group is not None else \
            list(range(self.session.world))
        self.pp_group, self.pp_ranks = set(ranks), ranks
        self.params = max(self.params, sum(p.numel() for st in stages for p in st.submod.parameters()))
        if not self.model_name:
            self.model_name = type(first.submod).__name__
        self.session.relayout(pp=pp, vpp=vpp, mesh=self._mesh_sizes_now())
        self._provisional()
        self.exp.pp_rank = pp_rank
        self.exp.mc, self.exp.gmc = 0, int(first.stage_index)
        if self.mod_depth == 0:
            self._narrow_module_hooks()

    # -- DeviceMesh: the job's dimensions where the script names them --------------
    def on_mesh(self, mesh) -> None:
        """A DeviceMesh was made (``session`` wraps ``DeviceMesh.__init__`` when it arms: a mesh made by
        ``init_device_mesh`` before torch.distributed was initialised starts this session from inside its own
        constructor, after which a wrapper installed now would miss it)."""
        try:
            self._learn_mesh(mesh)
        except Exception as e:
            self._failed("reading a DeviceMesh", e)

    def _learn_mesh(self, mesh) -> None:
        """A mesh over every rank, as it is made: its dimensions by name for now (torchtitan's names; an
        unknown one counts as DP), this rank's place in it, and its groups along each dimension, which
        ``_settle_layout`` matches with the groups the job uses (a dimension of any name that the pipeline
        runs over is the pipeline). Its sizes beat --layout (a contradiction is a warning), and a
        pipeline's own stages beat the mesh's pp."""

        names = getattr(mesh, "mesh_dim_names", None)
        sess = self.session
        if int(mesh.size()) != sess.world:
            return
        shape = tuple(int(n) for n in mesh.shape)
        named = bool(names)
        names = tuple(str(n) for n in names) if names else tuple(f"dim{i}" for i in range(len(shape)))
        coords = mesh.get_coordinate()
        if coords is None:
            return
        grid = mesh.mesh
        groups = []
        for i in range(len(shape)):
            at = list(coords)
            at[i] = slice(None)
            groups.append(tuple(int(r) for r in grid[tuple(at)].reshape(-1).tolist()))
        self.mesh_info = dict(names=names, shape=shape, coords=tuple(int(c) for c in coords), groups=groups,
                              grid=[int(r) for r in grid.reshape(-1).tolist()], named=named)
        roles = self._mesh_roles()
        sizes, inner, dp_rank, pp_rank = _mesh_facts(self.mesh_info, roles)
        self.mesh_sizes = sizes
        if self.stage_info is not None:
            sess.relayout(pp=self.stage_info[0], vpp=self.stage_info[2], mesh=sizes)
        else:
            sess.relayout(mesh=sizes)
        self.non_dp_groups = [frozenset(g) for g in inner]
        self.exp.worker_spans = all(g.index(sess.rank) == 0 for g in inner)
        self.exp.dp_rank = dp_rank
        if self.stage_info is None and self.p2p_pipe is None:
            self.exp.pp_rank = self.exp.gmc = pp_rank

    def _mesh_sizes_now(self) -> dict[str, int]:
        """The mesh's sizes with what is known now of its dimensions (the pipeline's group, once known,
        names the mesh's pipeline dimension whatever it is called)."""
        if self.mesh_info is None:
            return {}
        self.mesh_sizes = _mesh_facts(self.mesh_info, self._mesh_roles())[0]
        return self.mesh_sizes

    def _mesh_roles(self) -> list[str]:
        """What each dimension of the mesh is: 'pp', 'dp', 'tp' or 'cp'. A dimension the pipeline runs over
        is the pipeline, whatever its name; one a gradient reduction ran over is data parallel; else its
        name says (torchtitan's and common names), and an unknown name counts as DP, with a warning once it
        is settled."""
        info = self.mesh_info
        roles = []
        for name, group in zip(info["names"], info["groups"]):
            if self.pp_group is not None and len(group) > 1 and set(group) == self.pp_group:
                roles.append("pp")
            elif str(name).lower() in L.MESH_NAMES:
                roles.append(L.mesh_axis(name)[:2])
            elif tuple(sorted(group)) in {tuple(sorted(g)) for g in self.dp_seen}:
                roles.append("dp")
            else:
                roles.append("dp")
        return roles

    # -- the layout, settled at the end of step 0 ------------------------------------------------------------
    def _settle_layout(self) -> None:
        """This rank's worker (dp, pp), whether it sends the worker's spans, and the job's sizes, from what
        the job did in step 0. For each coordinate the first source that has it:

        - pp: the group of a ``torch.distributed.pipelining`` stage (its stage), the group its pipeline
          transfers ran over (its place in it), Megatron's ``parallel_state``, a DeviceMesh dimension;
        - dp: Megatron's ``parallel_state``, a DeviceMesh's DP dimensions, the group its gradients were
          reduced over (orthogonal to the pipeline; its place in it): numbering each stage's replicas by
          rank, which is the same order at every stage of a regular layout (the claims check it);
        - TP and CP groups (folded into the worker; the first rank of each sends the spans): Megatron's
          ``parallel_state``, a DeviceMesh's TP and CP dimensions;
        - else the rank order of ``--layout order=...``, and last Megatron's, with a warning.

        Sizes follow (``session.relayout``: what the processes report beats --layout). The spans of step 0
        are still buffered when this runs: they go out with these coordinates.
        """
        sess, exp = self.session, self.exp
        if not hasattr(sess, "relayout"):
            return  # a stand-in session (unit tests): the coordinates it was given stand
        me, world = sess.rank, sess.world
        src = 0
        pipe, pp_rank, vpp = None, None, None
        inner: list[tuple[int, ...]] = []  # this rank's TP and CP groups
        dp_group, dp_rank = None, None
        reported: dict[str, int] = {}
        if self.stage_info is not None:
            pipe, pp_rank, vpp, src = self.pp_ranks, self.stage_info[1], self.stage_info[2], L.SRC_STAGE
        elif self.p2p_pipe is not None:
            pipe, pp_rank, src = self.p2p_pipe, self.p2p_pipe.index(me), L.SRC_P2P
            if self.chunks_seen > 1:
                # Model chunks of an interleaved schedule: the outermost modules its forwards ran in, each a
                # virtual stage (torch.distributed.pipelining's schedules say theirs, above).
                vpp = self.chunks_seen
                self.params = sum(self.root_params[:vpp])
        mg = _megatron_state()
        if mg is not None:
            src |= L.SRC_MEGATRON
            if pipe is None and len(mg["pp_ranks"]) > 1:
                pipe, pp_rank, vpp = mg["pp_ranks"], mg["pp_rank"], mg["vpp"]
            inner = [g for g in (mg["tp_ranks"], mg["cp_ranks"]) if len(g) > 1]
            reported.update(tp_size=len(mg["tp_ranks"]), cp_size=len(mg["cp_ranks"]))
            dp_group, dp_rank = mg["dp_ranks"], mg["dp_rank"]
        elif self.mesh_info is not None:
            src |= L.SRC_MESH
            roles = self._mesh_roles()
            sizes, inner, mesh_dp, mesh_pp = _mesh_facts(self.mesh_info, roles)
            reported.update({k: v for k, v in sizes.items() if k != "pp_size"})
            if pipe is None and "pp" in roles:
                pipe = list(self.mesh_info["groups"][roles.index("pp")])
                pp_rank = mesh_pp
            if "dp" in roles:
                dp_group, dp_rank = _mesh_dp_group(self.mesh_info, roles), mesh_dp
            unknown = [n for n, r in zip(self.mesh_info["names"], roles) if r == "dp"
                       and str(n).lower() not in L.MESH_NAMES]
            if unknown and self.mesh_info.get("named", True):  # an unnamed mesh (FSDP's 1-D one) is DP
                sess.warn(f"DeviceMesh dimension(s) {', '.join(unknown)} read as data parallel")
        if dp_group is None and pipe is not None:
            dp_group = self._dp_group_of_step0(pipe, inner)
            if dp_group is not None:
                dp_rank, src = dp_group.index(me), src | L.SRC_DP_GROUP
        if dp_group is not None:
            reported["dp_size"] = len(dp_group)
            if pipe is not None and not L.orthogonal(pipe, dp_group, me):
                sess.problem(f"rank {me}'s data-parallel group {_folded(dp_group)} holds more than one stage of "
                             f"its pipeline {_folded(pipe)}")
        named = set(sess.settings.layout)
        if pipe is not None and dp_group is not None and not inner and not named & {"tp_size", "cp_size"}:
            # What the world leaves beside the pipeline and its replicas is folded into the worker: TP or CP
            # that no group names (taken as TP; its first rank is guessed from the rank order below).
            rest, left = divmod(world, len(pipe) * len(dp_group))
            if left == 0 and rest > 1:
                reported["tp_size"] = rest
        said_by = ("Megatron's parallel_state" if src & L.SRC_MEGATRON else "the DeviceMesh" if src & L.SRC_MESH
                   else "the job's process groups")
        sess.relayout(pp=len(pipe) if pipe is not None else None, vpp=vpp, mesh=reported, source=said_by)
        lay = sess.layout
        odp, opp, ospeaks = sess.order_coords(me)
        guessed = []
        if pipe is None:
            pp_rank = opp
            if lay.pp_size > 1:
                guessed.append("pipeline stage")
        if dp_group is None:
            dp_rank = odp
            if lay.pp_size > 1 and lay.dp_size > 1:
                guessed.append("data-parallel replica")
        if inner:
            speaks = all(g.index(me) == 0 for g in inner)
        else:
            speaks = ospeaks
            if lay.tp_size * lay.cp_size > 1:
                guessed.append("place in its TP/CP group")
                inner = [tuple(self._order_group(("tp", "cp")))]
        if guessed and sess.order:
            src |= L.SRC_ORDER
        elif guessed:
            src |= L.SRC_GUESS
            sess.warn(f"no process group says this rank's {' or '.join(guessed)}: taken from Megatron's rank "
                      "order (tensor parallel fastest, then cp, dp, pp); state the order with --layout order=...")
        if sess.order and (odp, opp) != (dp_rank, pp_rank):
            src |= L.SRC_OVERRULED
            sess.warn(f"--layout order={','.join(sess.order)} puts rank {me} at dp {odp}, pp {opp}; the groups it "
                      f"uses say dp {dp_rank}, pp {pp_rank} (used)")
        if not (0 <= dp_rank < lay.dp_size and 0 <= pp_rank < lay.pp_size):
            sess.problem(f"rank {me} sits at dp {dp_rank}, pp {pp_rank}, outside dp={lay.dp_size} pp={lay.pp_size}")
        self.non_dp_groups = [frozenset(g) for g in inner if len(g) > 1]
        if pipe is not None:
            self.pp_ranks, self.pp_group = list(pipe), set(pipe)
        self.sources = src
        exp.dp_rank, exp.pp_rank, exp.worker_spans = int(dp_rank), int(pp_rank), bool(speaks)
        if self.stage_info is None and exp.gmc != pp_rank:
            exp.mc, exp.gmc = 0, int(pp_rank)
            exp.relabel_buffered(0, int(pp_rank))

    def _dp_group_of_step0(self, pipe, inner) -> list[int] | None:
        """The largest group a reduction ran over outside compute in step 0 that crosses the pipeline
        (shares only this rank with it) and no TP/CP group: the replicas of this rank's stage. A group also
        reduced over inside a forward or backward is not: a gradient reduction follows the backward, while
        tensor parallelism reduces activations inside it (a TP group taken for DP gave consistent but wrong
        coordinates)."""
        me = self.session.rank
        fits = [g for g in self.dp_seen if me in g and L.orthogonal(pipe, g, me) and g not in self.inside_groups
                and all(L.orthogonal(t, g, me) for t in inner)]
        return list(max(fits, key=len)) if fits else None

    # -- checkpoints -----------------------------------------------------------
    def _patch_checkpoint(self, dcp) -> None:
        tracer = self
        for name, kind in (("save", "save"), ("load", "load")):
            orig = getattr(dcp, name, None)
            if orig is None or getattr(orig, "_stragglerscope", False):
                continue

            def wrapper(*args, __orig=orig, __kind=kind, **kwargs):
                t0 = tracer.exp.now_ns()
                with tracer.exp.in_flight(f"checkpoint-{__kind}"):  # the hang detector waits longer for it
                    out = __orig(*args, **kwargs)
                try:
                    step = max(0, tracer.step - 1) if __kind == "save" else tracer.step
                    tracer.exp.checkpoint(step, __kind, start_ns=t0, duration_ns=tracer.exp.now_ns() - t0)
                except Exception as e:
                    tracer._failed("checkpoint record", e)
                return out
            wrapper.__wrapped__ = orig
            wrapper.__doc__ = orig.__doc__
            wrapper._stragglerscope = True
            setattr(dcp, name, wrapper)
            self._undo.append(lambda name=name, orig=orig: setattr(dcp, name, orig))


class _EngineProxy:
    """Stands in for ``Variable._execution_engine``: its ``run_backward`` is a backward span (unless one is
    open already: a reentrant checkpoint's recomputation, a backward inside a forward), everything else is
    the engine's own."""

    def __init__(self, engine, tracer: Tracer):
        self._ss_engine = engine
        self._ss_tracer = tracer

    def run_backward(self, *args, **kwargs):
        tracer = self._ss_tracer
        # A backward over meta tensors computes nothing (torch.distributed.pipelining infers its shapes so).
        tensors = args[0] if args else kwargs.get("tensors")
        grads = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
        span = None if _is_meta(tensors) else tracer._bwd_begin(grads)
        try:
            return self._ss_engine.run_backward(*args, **kwargs)
        finally:
            tracer._bwd_end(span)

    def __getattr__(self, name):
        return getattr(self.__dict__["_ss_engine"], name)


def _mesh_facts(info: dict, roles: list[str]) -> tuple[dict[str, int], list[tuple[int, ...]], int, int]:
    """(sizes, this rank's TP/CP groups, its dp coordinate, its pp coordinate) of a mesh whose dimensions
    have these roles. DP dimensions multiply (HSDP), the outermost first in the coordinate."""
    sizes: dict[str, int] = {}
    inner = []
    dp_rank = pp_rank = 0
    for i, (role, n) in enumerate(zip(roles, info["shape"])):
        sizes[role + "_size"] = sizes.get(role + "_size", 1) * n
        if role == "dp":
            dp_rank = dp_rank * n + info["coords"][i]
        elif role == "pp":
            pp_rank = info["coords"][i]
        elif n > 1:
            inner.append(info["groups"][i])
    return sizes, inner, dp_rank, pp_rank


def _mesh_dp_group(info: dict, roles: list[str]) -> list[int]:
    """The ranks that share this rank's place on every dimension but the DP ones, in DP-coordinate order."""
    import itertools

    shape, coords, grid = info["shape"], list(info["coords"]), info["grid"]
    dims = [i for i, r in enumerate(roles) if r == "dp"]
    out = []
    for combo in itertools.product(*(range(shape[i]) for i in dims)):
        at = list(coords)
        for i, c in zip(dims, combo):
            at[i] = c
        flat = 0
        for i, n in enumerate(shape):
            flat = flat * n + at[i]
        out.append(grid[flat])
    return out


def _megatron_state() -> dict | None:
    """Megatron-LM's own word on the layout, where ``megatron.core.parallel_state`` is loaded and set up."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        import torch.distributed as dist

        def ranks(group) -> list[int]:
            return list(dist.get_process_group_ranks(group)) if group is not None else [dist.get_rank()]

        cp = getattr(ps, "get_context_parallel_group", None)
        return dict(pp_ranks=ranks(ps.get_pipeline_model_parallel_group()),
                    pp_rank=int(ps.get_pipeline_model_parallel_rank()),
                    vpp=int(ps.get_virtual_pipeline_model_parallel_world_size() or 1),
                    dp_ranks=ranks(ps.get_data_parallel_group()), dp_rank=int(ps.get_data_parallel_rank()),
                    tp_ranks=ranks(ps.get_tensor_model_parallel_group()),
                    cp_ranks=ranks(cp()) if cp is not None else [dist.get_rank()])
    except Exception as e:
        log.warning("stragglerscope: reading megatron.core.parallel_state failed: %r", e)
        return None


def _folded(ranks) -> str:
    from core.layout import fold_ranks

    return f"[{fold_ranks(ranks)}]"


def _tokens(x) -> int:
    """Tokens in a model's input or output: the ids of an integer tensor, else the rows of its last dimension
    (a batch x sequence x hidden activation is batch x sequence tokens). The first tensor found counts."""
    t = _first_tensor(x)
    if t is None:
        return 0
    try:
        n = int(t.numel())
        if t.is_floating_point() or t.is_complex():
            return n // max(1, int(t.shape[-1])) if t.dim() >= 2 else n
        return n
    except Exception:
        return 0


def _is_meta(x) -> bool:
    t = _first_tensor(x)
    return t is not None and bool(getattr(t, "is_meta", False))


def _first_tensor(x, depth: int = 0):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if depth < 3 and isinstance(x, (list, tuple)):
        for item in x:
            t = _first_tensor(item, depth + 1)
            if t is not None:
                return t
    if depth < 3 and isinstance(x, dict):
        for item in x.values():
            t = _first_tensor(item, depth + 1)
            if t is not None:
                return t
    return None


def _peak_of(gpu: str) -> float:
    from core.gpus import peak_flops_of

    return peak_flops_of(gpu)


def _ddp_facts(ddp) -> tuple[str, int]:
    """(the group a DDP reduces over, named as the collective wrappers name groups; how many gradients it
    reduces: its module's parameters that require them, less those it was told to ignore)."""
    import torch.distributed as dist

    from core.layout import fold_ranks

    pg = getattr(ddp, "process_group", None)
    if pg is None or pg == dist.distributed_c10d._get_default_group():
        name = "world"
    else:
        name = f"ranks:{fold_ranks(dist.get_process_group_ranks(pg))}"
    ignored = set(getattr(ddp, "parameters_to_ignore", None) or ())
    return name, sum(1 for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored)


def _uncompiled(module):
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) stands for; any other module itself."""
    return getattr(module, "_orig_mod", module) if type(module).__name__ == "OptimizedModule" else module


def _class_name(module) -> str:
    """The model's own class name: FSDP2's ``fully_shard`` swaps a module's class for one of its own,
    ``FSDP<Name>`` deriving from ``FSDPModule`` and the model's class, which is the one named."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed.fsdp") and cls.__name__ != "FSDPModule":
            return cls.__name__
    return type(module).__name__


def _syncs_grads(roots) -> bool:
    """True when an outermost module is a DDP (compiled or not) whose next backward reduces gradients.

    A compiled DDP's outermost module is the ``OptimizedModule``: read as itself, every rank's backward
    kept its wait for the slowest in compute and a slowed rank went unseen (S 1.02 where 1.21 was right).
    """
    for m in list(roots):
        m = _uncompiled(m)
        if type(m).__name__ == "DistributedDataParallel" and getattr(m, "require_backward_grad_sync", False):
            return True
    return False


def _gpu_type() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:
        pass
    return "cpu"

