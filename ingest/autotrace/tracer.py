"""Framework hooks that turn an unchanged PyTorch training process into what-if op spans.

What is recorded, and where it comes from (op types of WHATIF.md):
- **steps**: a step opens at the first forward (or pipeline ``schedule.step``)
  after the previous one closed, and closes at the end of ``optimizer.step()``
  (PyTorch's global optimizer step hooks). A pipeline with no optimizer closes
  its step when the next ``schedule.step`` begins. Steps are numbered from 0 in
  each process; sampling picks which are profiled.
- **forward-/backward-compute**: from ``torch.distributed.pipelining`` stages
  (``forward_one_chunk`` / ``backward_one_chunk``: microbatch and model chunk
  from the schedule), else from the outermost module call (global forward
  hooks: plain loops, DDP, FSDP2) and ``torch.autograd.backward``. Time a
  compute span spends blocked waiting for other ranks (a collective or a
  ``wait()`` inside it; for DDP, whose wait is in C++, the time after the last
  gradient was ready) is communication, split off as a leading
  ``params-all-gather`` (a forward: FSDP2's all-gathers) or a trailing
  ``grads-reduce-scatter`` (a backward: DDP's and FSDP2's gradient reduction).
- **pipeline transfers**: the stage's own P2P ops (``get_fwd_recv_ops`` ...)
  are tagged, and their isend/irecv calls become forward-/backward-send/-recv
  spans. A receive ends when its wait returns and, posted early, starts when
  the compute before its consumer ended; an async send ends when the rank
  moves on (gloo says nothing of a send's completion before its wait, which
  schedules do late): the receiver's span carries the transfer.
- **data-parallel collectives** called outside compute (a hand-written
  gradient all-reduce): a reduction over a group orthogonal to the pipeline is
  ``grads-reduce-scatter``, over the whole world of a pipelined job
  ``optimizer-clip-main-grad``, a gather ``params-all-gather``.
- **optimizer**, **gc** (``gc.callbacks``: one op per step, the pauses between
  the last backward and the optimizer, empty when there were none) and
  **checkpoints** (``torch.distributed.checkpoint`` save and load).

Every hook is guarded: an error in here is counted, logged once and never
raised into training. Hooks act on the thread that initialised
torch.distributed only.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

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
        self.blocked_ns = 0           # waits for other ranks inside the compute span in progress
        self.last_compute_end = 0     # perf_counter_ns when the last compute span ended
        self.open_sends: list[Call] = []
        self.p2p_tags: dict[int, tuple[str, int, int]] = {}
        self.pp_group: set[int] | None = None
        self.stage_info: tuple[int, int, int] | None = None  # (pp_size, pp_rank, vpp)
        self.mesh_sizes: dict[str, int] = {}        # what a DeviceMesh over the job says (see _learn_mesh)
        self.mesh_coords: tuple[int, int] | None = None   # this rank's (dp_rank, pp_rank) in that mesh
        self.non_dp_groups: list[frozenset[int]] = []     # this rank's TP and CP groups of that mesh
        self.num_microbatches = 0
        self.roots: weakref.WeakSet = weakref.WeakSet()
        self.hooked_params: weakref.WeakSet = weakref.WeakSet()
        self.registered = False
        self.model_name = ""
        self.params = 0
        self._gc_start = 0
        self.gc_pause: tuple[int, int] | None = None  # (first pause start, total pause) in this step
        self.after_backward = False                     # a backward ended and no forward began since
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
            self.gc_pause, self.after_backward, self.gc_done = None, False, False
            self.exp.start_step(self.step)
            if self.exp.profiling:
                self.windows.add(self.exp._window)

    def _close_step(self) -> None:
        if not self.open:
            self.pending_close = False
            return
        self._close_sends()
        self._emit_gc()
        if not self.saw_optimizer_in_step and self.exp.profiling:
            # The analyzer ends a step at its optimizer: a step without one gets an empty one, where the
            # schedule ended (or now).
            at = self.pending_since if self.pending_close and self.pending_since else time.perf_counter_ns()
            self.exp.record_op("optimizer", at, at)
        if self.num_microbatches == 0:
            self.num_microbatches = max(self.fwd_in_step, 1)
        self.exp.finish_step(True)
        self.open = self.pending_close = False
        self.step += 1
        if not self.registered:
            self.registered = True
            self._register()
        if self._global_fwd_hooks and self.mod_depth == 0:
            self._narrow_module_hooks()

    def _register(self) -> None:
        if self.session.rank != 0:
            return
        from core import codec
        from core import schema as S

        lay = self.session.layout
        st = self.session.settings
        row = dict(job_id=st.job_id, attempt=st.attempt, ts_ns=self.exp.now_ns(), team=st.team,
                   model=st.model or self.model_name, n_gpus=self.session.world, dp_size=lay.dp_size,
                   pp_size=lay.pp_size, tp_size=lay.tp_size, cp_size=lay.cp_size, vpp_size=lay.vpp_size,
                   num_microbatches=self.num_microbatches, profiled_steps=st.sampling.profile_steps,
                   gpu_type=_gpu_type(), peak_flops=0.0, flops_per_token=0.0, tokens_per_step=0,
                   params=self.params if lay.pp_size == 1 else 0, seq_len=0, num_layers=0)
        self.exp._send(codec.from_rows(S.JOB, [row]))  # fields it does not name get their defaults

    # -- install --------------------------------------------------------------
    def install(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_mod

        from ingest.autotrace.imports import when_imported

        h1 = nn_module.register_module_forward_pre_hook(self._fwd_pre)
        h2 = nn_module.register_module_forward_hook(self._fwd_post, always_call=True)
        h3 = optim_mod.register_optimizer_step_pre_hook(self._opt_pre)
        h4 = optim_mod.register_optimizer_step_post_hook(self._opt_post)
        self._global_fwd_hooks = [h1, h2]
        self._undo += [h.remove for h in (h1, h2, h3, h4)]

        orig_backward = torch.autograd.backward
        tracer = self

        def backward(*args, **kwargs):
            token = tracer._bwd_begin()
            try:
                return orig_backward(*args, **kwargs)
            finally:
                tracer._bwd_end(token)
        backward.__wrapped__ = orig_backward
        backward.__doc__ = orig_backward.__doc__
        torch.autograd.backward = backward
        self._undo.append(lambda: setattr(torch.autograd, "backward", orig_backward))

        gc.callbacks.append(self._gc)
        self._undo.append(lambda: gc.callbacks.remove(self._gc))
        when_imported("torch.distributed.pipelining.stage", self._patch_stage)
        when_imported("torch.distributed.pipelining.schedules", self._patch_schedules)
        when_imported("torch.distributed.checkpoint", self._patch_checkpoint)
        when_imported("torch.distributed.device_mesh", self._patch_device_mesh)

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
                    pre = root.register_forward_pre_hook(self._fwd_pre)
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
            self.active = "forward-compute"
            self.after_backward = False
            self.blocked_ns = 0
            self._span = (self.exp.begin_op("forward-compute", mb_id=self.fwd_in_step), time.perf_counter_ns())
            self.fwd_in_step += 1
            self._span_module = module
        except Exception as e:
            self._failed("forward pre-hook", e)

    def _fwd_post(self, module, _inputs, _output) -> None:
        if not self._mine():
            return
        try:
            self.mod_depth = max(0, self.mod_depth - 1)
            if self.mod_depth != 0 or self.active != "forward-compute" or module is not self._span_module:
                return
            token, t0 = self._span
            self.active = None
            self._span_module = None
            self._end_compute(token, t0, "forward-compute")
        except Exception as e:
            self._failed("forward hook", e)

    def _learn_root(self, module) -> None:
        self.roots.add(module)
        if not self.model_name:
            inner = _uncompiled(module)
            self.model_name = type(getattr(inner, "module", inner)).__name__
        self.params = max(self.params, sum(p.numel() for p in module.parameters()))
        for p in module.parameters():
            if p.requires_grad and p not in self.hooked_params and hasattr(p, "register_post_accumulate_grad_hook"):
                p.register_post_accumulate_grad_hook(self._grad_ready)
                self.hooked_params.add(p)

    def _grad_ready(self, _param) -> None:
        if self.active == "backward-compute":
            self.last_grad_perf = time.perf_counter_ns()

    # -- backward -------------------------------------------------------------
    def _bwd_begin(self):
        if not self._mine() or self.active is not None:
            return None
        try:
            self._ensure_step()
            self._close_sends()
            self.active = "backward-compute"
            self.last_grad_perf = self.blocked_ns = 0
            t0 = time.perf_counter_ns()
            token = self.exp.begin_op("backward-compute", mb_id=self.bwd_in_step)
            self.bwd_in_step += 1
            return (token, t0, _syncs_grads(self.roots))
        except Exception as e:
            self._failed("backward begin", e)
            return None

    def _bwd_end(self, span) -> None:
        if span is None:
            return
        try:
            token, t0, ddp_sync = span
            self.active = None
            self.after_backward = True
            tail_from = self.last_grad_perf if ddp_sync else 0  # DDP waits inside C++: the last gradient marks it
            self._end_compute(token, t0, "backward-compute", tail_from)
        except Exception as e:
            self._failed("backward end", e)

    def _end_compute(self, token, t0: int, optype: str, tail_from: int = 0) -> None:
        """End a compute span, with the time it waited for other ranks split off as communication.

        A forward's waits (FSDP's all-gathers) become a leading ``params-all-gather``, a backward's
        (the gradient reduction of DDP or FSDP) a trailing ``grads-reduce-scatter``: the what-if model's
        DP collectives before the first forward and after the last backward.
        """
        t1 = self.last_compute_end = time.perf_counter_ns()
        wait = self.blocked_ns
        if tail_from and t0 < tail_from < t1:
            wait = max(wait, t1 - tail_from)
        self.blocked_ns = 0
        if token is None or wait <= 0 or not isinstance(token[0], int) or wait >= t1 - t0:
            self.exp.end_op(token)  # nothing to split (or CUDA-timed: GPU time excludes host waits)
            return
        if optype == "forward-compute":
            self.exp.record_op("params-all-gather", t0, t0 + wait)
            self.exp.end_op((t0 + wait, token[1]))
        else:
            self.exp.end_op(token, end_perf_ns=t1 - wait)
            self.exp.record_op("grads-reduce-scatter", t1 - wait, t1)

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
        if not self._mine() or not self.exp.profiling:
            return
        self._close_sends()
        if call.is_p2p:
            tag = self.p2p_tags.pop(id(call.tensor), None)
            if tag is not None:
                optype, mc, gmc = tag
                call.note = ("send" if call.is_send else "recv", self.exp.begin_op(optype, -1, mc, gmc))
                if call.is_send and call.is_async and call.note[1] is not None:
                    self.open_sends.append(call)
            return
        if self.active is not None:
            return  # nested in a span: its blocking time is what counts (on_blocked)
        optype = self._dp_optype(call)
        if optype is not None:
            call.note = ("span", self.exp.begin_op(optype))

    def on_exit(self, call: Call) -> None:
        note, call.note = call.note, None
        if note is None or note[1] is None:
            return
        token = note[1]
        if note[0] == "recv" and isinstance(token[0], int):
            # A receive posted early (schedules post them ahead) starts, for the model, when the compute
            # before its consumer ended: recv i sits between compute i-1 and compute i.
            token = (max(token[0], self.last_compute_end), token[1])
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
        """Time the training thread waited in a collective inside a compute span: communication."""
        if self.active in ("forward-compute", "backward-compute") and self._mine():
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
        """Collections between the last backward and the optimizer: the model's one ``gc`` op per step
        (its post-compute chain). Pauses elsewhere stay in the span they interrupt or in a launch delay."""
        if not self._mine() or not self.exp.profiling:
            return
        try:
            if phase == "start":
                self._gc_start = time.perf_counter_ns()
            elif phase == "stop" and self._gc_start and self.active is None and self.open and self.after_backward:
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
                try:
                    return orig(stage, chunk_id, *args, **kwargs)
                finally:
                    tracer._stage_end(span)
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
            self.blocked_ns = 0
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
        """Pipeline size, this rank's stage and chunks from the schedule: they beat --layout."""
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
        self.pp_group = set(ranks)
        sess = self.session
        sess.relayout(pp=pp, vpp=vpp, mesh=self.mesh_sizes)
        lay = sess.layout
        dp_rank = (min(ranks) // (lay.tp_size * lay.cp_size)) % lay.dp_size
        if self.mesh_coords is not None and self.mesh_coords[1] == pp_rank:
            dp_rank = self.mesh_coords[0]
        if (self.exp.dp_rank, self.exp.pp_rank) != (dp_rank, pp_rank) and sess.settings.layout:
            sess.warn(f"rank order of --layout puts this rank at dp {self.exp.dp_rank}, pp {self.exp.pp_rank}; "
                      f"the pipeline says dp {dp_rank}, pp {pp_rank} (used)")
        self.exp.dp_rank, self.exp.pp_rank = dp_rank, pp_rank
        self.exp.mc, self.exp.gmc = 0, int(first.stage_index)
        if self.mod_depth == 0:
            self._narrow_module_hooks()

    # -- DeviceMesh: the job's dimensions where the script names them --------------
    def _patch_device_mesh(self, dm) -> None:
        """Read every DeviceMesh over the whole job as it is made (``init_device_mesh`` makes one)."""
        cls = getattr(dm, "DeviceMesh", None)
        orig = getattr(cls, "__init__", None)
        if orig is None or getattr(orig, "_stragglerscope", False):
            return
        tracer = self

        def __init__(mesh, *args, **kwargs):
            orig(mesh, *args, **kwargs)
            if kwargs.get("_root_mesh") is None:  # a slice or a flattening of a mesh says nothing new
                try:
                    tracer._learn_mesh(mesh)
                except Exception as e:
                    tracer._failed("reading a DeviceMesh", e)
        __init__.__wrapped__ = orig
        __init__.__doc__ = orig.__doc__
        __init__._stragglerscope = True
        cls.__init__ = __init__
        self._undo.append(lambda: setattr(cls, "__init__", orig))

    def _learn_mesh(self, mesh) -> None:
        """DP, PP, TP and CP sizes and this rank's place from a named mesh over every rank: they beat
        --layout (a contradiction is a warning), and a pipeline's own stages beat the mesh's pp."""
        from ingest.autotrace.session import mesh_axis, mesh_layout

        names = getattr(mesh, "mesh_dim_names", None)
        sess = self.session
        if not names or int(mesh.size()) != sess.world:
            return
        shape = tuple(int(n) for n in mesh.shape)
        coords = mesh.get_coordinate()
        sizes, dp_rank, pp_rank, unknown = mesh_layout(tuple(names), shape, tuple(coords) if coords else None)
        if unknown:
            sess.warn(f"DeviceMesh dimension(s) {', '.join(unknown)} read as data parallel")
        if self.stage_info is not None:
            sess.relayout(pp=self.stage_info[0], vpp=self.stage_info[2], mesh=sizes)
        else:
            sess.relayout(mesh=sizes)
        self.mesh_sizes = sizes
        if coords is None:
            return
        grid = mesh.mesh
        self.non_dp_groups = []
        first_of_worker = True
        for i, name in enumerate(names):
            if mesh_axis(name) in ("tp_size", "cp_size"):
                at = list(coords)
                at[i] = slice(None)
                self.non_dp_groups.append(frozenset(int(r) for r in grid[tuple(at)].reshape(-1).tolist()))
                first_of_worker = first_of_worker and int(coords[i]) == 0
        self.exp.worker_spans = first_of_worker
        self.mesh_coords = (dp_rank, pp_rank)
        if self.stage_info is None:
            if (self.exp.dp_rank, self.exp.pp_rank) != (dp_rank, pp_rank) and sess.settings.layout:
                sess.warn(f"rank order of --layout puts this rank at dp {self.exp.dp_rank}, pp {self.exp.pp_rank}; "
                          f"the DeviceMesh says dp {dp_rank}, pp {pp_rank} (used)")
            self.exp.dp_rank, self.exp.pp_rank = dp_rank, pp_rank

    # -- checkpoints -----------------------------------------------------------
    def _patch_checkpoint(self, dcp) -> None:
        tracer = self
        for name, kind in (("save", "save"), ("load", "load")):
            orig = getattr(dcp, name, None)
            if orig is None or getattr(orig, "_stragglerscope", False):
                continue

            def wrapper(*args, __orig=orig, __kind=kind, **kwargs):
                t0 = tracer.exp.now_ns()
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


def _uncompiled(module):
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) stands for; any other module itself."""
    return getattr(module, "_orig_mod", module) if type(module).__name__ == "OptimizedModule" else module


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

