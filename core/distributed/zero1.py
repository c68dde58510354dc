"""ZeRO stage 1: optimizer state sharded over the data-parallel ranks (CS336 section 7).

`ShardedOptimizer(params, optimizer_cls, **kwargs)` is a real `torch.optim.Optimizer`. Every
parameter (of every group, `add_param_group` included) is assigned whole to one rank, greedily to
the least-loaded rank so state is balanced; each rank builds `optimizer_cls` over its own
parameters only, steps them, and then the updated parameters are all-gathered (flat, padded
per-owner buffers, in rounds of at most `bucket_size_mb` per rank) so every rank holds them all.

Two ways to get the gradients there ("which is which"):
  zero1      (`grad_reduction="all_reduce"`) the CS336 form: the model is wrapped in our bucketed
             DDP, gradients are all-reduced (overlapped with backward), each rank then uses only
             its own. Communication per step: all-reduce 2*Psi + all-gather Psi  = 3*Psi.
  zero1_rs   (`grad_reduction="reduce_scatter"`) ZeRO-1's own volume: after backward one
             reduce-scatter delivers each owner the summed gradients of its parameters (others'
             gradients are dropped), then the all-gather:  Psi + Psi = 2*Psi.  The reduce-scatter
             runs after backward (not overlapped), so it trades exposed time for volume.
Parameter gathers (`overlap_param_gather`, default on in the strategies): parameters live as views in
one persistent flat buffer per round (owner r's slice at r * width), so the all-gather runs in place
(no staging copies); rounds follow the forward order recorded on the first forward and are launched
asynchronously after the step; each is waited for by the forward pre-hook of the first module that
uses its parameters, so the gather hides behind the next forward. `wait_for_parameters()` is the
barrier for anything else that reads parameters (the strategy calls it from state_dict, load, eval
goes through the hooks, full_parameters, memory accounting, and the optimizer's own next step).
Sharding is elementwise-exact for element-wise optimizers (AdamW, SGD, ...): each parameter's
update depends on its own gradient and state only, so results are bitwise those of the unsharded
optimizer given the same gradients.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from core.distributed.comm import (CommTimer, all_gather_flat, group_rank, group_size, init_optimizer_state,
                                   reduce_scatter_flat, supports_avg)
from core.distributed.ddp import BucketedDDP, DataParallel, _compute_dtype, bucketed_all_reduce_profile, unwrap
from core.distributed.mesh import ParallelMesh
from core.distributed.strategy import (DP_AXES, CollectiveSpec, ModelLayout, Strategy, StrategyProfile, axes_degree,
                                       clip_grads_, expert_group, expert_sharded_parameters, materialize,
                                       tp_sharded_parameters)
from core.errors import require


class ShardedOptimizer(torch.optim.Optimizer):
    """Optimizer-state sharding around any optimizer class (or factory `f(param_groups) -> Optimizer`)."""

    def __init__(self, params: Iterable, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 process_group: Optional[dist.ProcessGroup] = None, grad_reduction: str = "all_reduce",
                 bucket_size_mb: float = 256.0, timer: Optional[CommTimer] = None,
                 overlap_param_gather: bool = False, unsharded: frozenset[int] = frozenset(), **kwargs: Any) -> None:
        require(grad_reduction in ("all_reduce", "reduce_scatter"), "parallelism.grad_reduction",
                f"unknown {grad_reduction!r}", "use all_reduce (gradients already averaged) or reduce_scatter")
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.process_group = process_group
        self.world, self.rank = group_size(process_group), group_rank(process_group)
        self.grad_reduction = grad_reduction
        self.round_bytes = int(bucket_size_mb * 2**20)
        self.timer = timer if timer is not None else CommTimer(enabled=False)
        self._local: Optional[torch.optim.Optimizer] = None
        self._owner: dict[int, int] = {}
        self._load = [0] * self.world
        self._owned: list[list[nn.Parameter]] = [[] for _ in range(self.world)]  # params per owner, in order
        self._grads_reduced = False
        self.overlap_param_gather = overlap_param_gather
        self._unsharded = unsharded  # ids of parameters every rank steps itself (its experts under ep): never gathered
        self._rounds = None
        self._flat: Optional[list[torch.Tensor]] = None    # per round: world * width, parameters are views
        self._round_of: dict[int, int] = {}                # id(param) -> round index
        self._pending: list[tuple[int, Any]] = []          # (round, work) of parameter gathers in flight
        self._fwd_order: list[nn.Parameter] = []           # recorded by `before_use` until the first step
        self._fwd_seen: set[int] = set()
        super().__init__(params, defaults=dict(kwargs))
        self.state = self._local.state  # this rank's shard of the state (what memory accounting sees)

    # ---- parameter assignment ----
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_pending", None):
            self.wait_for_parameters()
        super().add_param_group(param_group)
        full = self.param_groups[-1]
        mine = []
        for p in full["params"]:
            if id(p) in self._unsharded:
                self._owner[id(p)] = self.rank
                mine.append(p)
                continue
            owner = min(range(self.world), key=lambda r: (self._load[r], r))  # same answer on every rank
            self._owner[id(p)] = owner
            self._load[owner] += p.numel()
            self._owned[owner].append(p)
            if owner == self.rank:
                mine.append(p)
        local = {k: v for k, v in full.items() if k != "params"}
        local["params"] = mine
        if self._local is None:
            self._local = self.optimizer_cls([local], **self.kwargs)
            if hasattr(self, "state"):
                self.state = self._local.state
        else:
            self._local.add_param_group(local)
        for k, v in self._local.param_groups[-1].items():  # defaults filled in by the inner optimizer
            if k != "params":
                full.setdefault(k, v)
        self._rounds = None  # rebuilt lazily (flat buffers too: existing values are copied over)
        self._flat = None

    def owner(self, p: nn.Parameter) -> int:
        return self._owner[id(p)]

    def owned_params(self) -> list[nn.Parameter]:
        return self._owned[self.rank]

    # ---- communication rounds: per round each owner contributes a slice of its parameters ----
    def _forward_index(self) -> dict[int, int]:
        """Position of each parameter in the recorded forward order (the same on every rank, checked)."""
        order = {id(p): i for i, p in enumerate(self._fwd_order)}
        if self.world > 1:
            idx = {id(p): i for i, p in enumerate(self._all_params())}
            key = hash(tuple(idx.get(id(p), -1) for p in self._fwd_order)) & (2**62 - 1)
            ref = self._all_params()[0]
            t = torch.tensor([key, -key], dtype=torch.int64, device=ref.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            if int(t[0]) != -int(t[1]):  # ranks saw different forward orders: fall back to group order
                order = {}
        return order

    def _build_rounds(self) -> list[list[list[nn.Parameter]]]:
        rounds: list[list[list[nn.Parameter]]] = []
        fwd = self._forward_index()
        for r in range(self.world):
            chunks, cur, cur_b = [], [], 0
            # forward order (parameters never seen in forward first), so round k is needed before round k+1
            owned = sorted(self._owned[r], key=lambda p: fwd.get(id(p), -1)) if fwd else self._owned[r]
            for p in owned:
                b = p.numel() * p.element_size()
                if cur and (cur_b + b > self.round_bytes or p.dtype != cur[0].dtype):
                    chunks.append(cur)
                    cur, cur_b = [], 0
                cur.append(p)
                cur_b += b
            if cur:
                chunks.append(cur)
            for k, chunk in enumerate(chunks):
                while len(rounds) <= k:
                    rounds.append([[] for _ in range(self.world)])
                rounds[k][r] = chunk
        self._round_of = {id(p): k for k, rnd in enumerate(rounds) for ps in rnd for p in ps}
        return rounds

    def _round_layout(self, rnd: list[list[nn.Parameter]]):
        ref = next(p for ps in rnd for p in ps)
        width = max(sum(p.numel() for p in ps) for ps in rnd)
        return ref, width

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """reduce_scatter mode: each owner receives the averaged gradients of its parameters."""
        if self._grads_reduced or self.grad_reduction != "reduce_scatter" or self.world == 1:
            return
        if self._rounds is None:
            self._rounds = self._build_rounds()
        avg = supports_avg(self.process_group)
        for rnd in self._rounds:
            ref, width = self._round_layout(rnd)
            flat = torch.zeros(self.world * width, dtype=ref.dtype, device=ref.device)
            for r, ps in enumerate(rnd):
                off = r * width
                for p in ps:
                    if p.grad is not None:
                        flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                    off += p.numel()
            out = torch.empty(width, dtype=ref.dtype, device=ref.device)
            with self.timer.blocking():
                reduce_scatter_flat(out, flat, op=dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM,
                                    group=self.process_group)
            if not avg:
                out.div_(self.world)
            off = 0
            for p in rnd[self.rank]:
                g = out[off:off + p.numel()].view_as(p)
                p.grad = g if p.grad is None else p.grad.copy_(g)
                off += p.numel()
        for r, ps in enumerate(self._owned):  # gradients of others' parameters are not needed any more
            if r != self.rank:
                for p in ps:
                    p.grad = None
        self._grads_reduced = True

    @torch.no_grad()
    def _flatten(self) -> None:
        """Move every parameter into one persistent flat buffer per round (owner r's slice at r * width):
        the all-gather then runs in place on the parameters (no staging buffers, no copies back)."""
        self._flat = []
        for rnd in self._rounds:
            ref, width = self._round_layout(rnd)
            buf = torch.zeros(self.world * width, dtype=ref.dtype, device=ref.device)
            for r, ps in enumerate(rnd):
                off = r * width
                for p in ps:
                    view = buf[off:off + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view  # same Parameter object: optimizer state, hooks and tying unaffected
                    off += p.numel()
            self._flat.append(buf)

    @torch.no_grad()
    def _sync_parameters(self) -> None:
        """All-gather the updated parameters, round by round, in place. With `overlap_param_gather` the
        gathers are only launched; `wait_for_parameters` (or `before_use`, from forward pre-hooks) waits."""
        if self.world == 1:
            return
        if self._rounds is None:
            self._rounds = self._build_rounds()
        if self._flat is None:
            self._flatten()
        for k, buf in enumerate(self._flat):
            width = buf.numel() // self.world
            mine = buf[self.rank * width:(self.rank + 1) * width]
            if self.overlap_param_gather:
                work = all_gather_flat(buf, mine, group=self.process_group, async_op=True)
                self._pending.append((k, self.timer.launched(work)))
            else:
                with self.timer.blocking():
                    all_gather_flat(buf, mine, group=self.process_group)

    def wait_for_parameters(self, upto_round: Optional[int] = None) -> None:
        """Block (the compute stream, on NCCL) until the parameter gathers of rounds <= `upto_round`
        (all if None) have completed. Gathers complete in launch order, so this pops from the front."""
        while self._pending and (upto_round is None or self._pending[0][0] <= upto_round):
            _, work = self._pending.pop(0)
            self.timer.wait(work)

    @property
    def has_pending_gathers(self) -> bool:
        return bool(self._pending)

    def before_use(self, params: tuple[nn.Parameter, ...]) -> None:
        """Called before `params` are read (a module's forward pre-hook). Before the first step: records
        the forward order (rounds follow it); afterwards: waits for the gathers holding `params`."""
        if self._rounds is None:
            for p in params:
                if id(p) not in self._fwd_seen:
                    self._fwd_seen.add(id(p))
                    self._fwd_order.append(p)
            return
        if self._pending:
            k = max((self._round_of.get(id(p), -1) for p in params), default=-1)
            if k >= 0:
                self.wait_for_parameters(k)

    # ---- the optimizer interface ----
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_for_parameters()  # the previous step's gathers read the slices this step writes
        self.reduce_gradients()
        for full, local in zip(self.param_groups, self._local.param_groups):
            for k, v in full.items():  # hyperparameters (LR schedules) live in the full groups
                if k != "params":
                    local[k] = v
        self._local.step()
        self._sync_parameters()
        self._grads_reduced = False
        return loss

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer over this rank's owned parameters (its state is `self.state`)."""
        return self._local

    def _all_params(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: state of owned parameters keyed by global parameter index (as str)."""
        self.wait_for_parameters()
        index = {id(p): i for i, p in enumerate(self._all_params())}
        state = {str(index[id(p)]): s for p, s in self._local.state.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_for_parameters()
        params = self._all_params()
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        for key, saved in state_dict["state"].items():
            p = params[int(key)]
            if self.owner(p) != self.rank:
                continue
            cur = self._local.state[p]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(cur.get(k), torch.Tensor):
                    cur[k].copy_(v)
                else:
                    cur[k] = v.clone() if isinstance(v, torch.Tensor) else v


class _LocalGradients(DataParallel):
    """Broadcast at construction, no gradient communication (the optimizer reduce-scatters)."""

    def finish_gradient_synchronization(self) -> None:
        pass


class Zero1Strategy(Strategy):
    """`zero1` / `zero1_rs`: replicated model, optimizer state sharded by `ShardedOptimizer`.

    overlap_param_gather  True: the parameter all-gathers after the optimizer step are launched
                          asynchronously in forward order and each is waited for only when the first
                          module using its parameters is about to run in the next forward (forward
                          pre-hooks registered once), so they overlap the next forward. Everything else
                          that reads parameters (state_dict, checkpoint load, full_parameters, memory
                          accounting, the next optimizer step) calls `wait_for_parameters()` first;
                          evaluation goes through the same forward hooks. Under torch.compile the wait
                          happens at the wrapper's forward (all rounds), hooks inside compiled code are
                          not used.
    comm_dtype            gradient all-reduce dtype of the bucketed DDP (zero1 only; see BucketedDDP)
    compute_dtype         None (default) | "bfloat16" (needs precision=bf16; zero1 only): the bucketed DDP runs
                          the Linear layers on its own persistent bf16 copies, so their gradients are
                          all-reduced in bf16 (numerics and costs: BucketedDDP). With overlap_param_gather
                          each module's copies are refreshed in its forward pre-hook after its gather wait
                          (`BucketedDDP.refresh_leaves_per_module`); under torch.compile, at the wrapper's
                          forward after waiting for every round. Results are bitwise those of ddp_bucketed
                          with the same compute_dtype and the unsharded optimizer (tested).
    """

    name = "zero1"
    data_parallel = True
    supports_expert_parallel = True  # a rank's experts: stepped by it alone, their state unsharded (1/ep of them)
    checkpoint_format = "dcp"  # every rank saves its own optimizer shard

    def __init__(self, grad_reduction: str = "all_reduce", bucket_size_mb: float = 25.0,
                 first_bucket_size_mb: float = 1.0, gather_bucket_mb: float = 128.0,
                 overlap_param_gather: bool = True, comm_dtype: Optional[str] = None,
                 compute_dtype: Optional[str] = None) -> None:
        require(grad_reduction in ("all_reduce", "reduce_scatter"), "parallelism.grad_reduction",
                f"unknown {grad_reduction!r}", "use all_reduce (zero1) or reduce_scatter (zero1_rs)")
        require(compute_dtype is None or grad_reduction == "all_reduce", "parallelism.compute_dtype",
                f"{compute_dtype!r} needs the bucketed DDP's gradient all-reduce (zero1); zero1_rs reduce-scatters "
                "the parameters' own gradients", "set parallelism.compute_dtype=null, or use parallelism=zero1")
        _compute_dtype(compute_dtype)  # an unsupported name fails here, before any process group work
        self.grad_reduction = grad_reduction
        self.bucket_size_mb, self.first_bucket_size_mb = bucket_size_mb, first_bucket_size_mb
        self.gather_bucket_mb = gather_bucket_mb
        self.overlap_param_gather = bool(overlap_param_gather)
        self.comm_dtype = comm_dtype
        self.compute_dtype = compute_dtype
        self.optimizer: Optional[ShardedOptimizer] = None
        self.name = "zero1" if grad_reduction == "all_reduce" else "zero1_rs"

    def profile(self, mesh: ParallelMesh, layout: ModelLayout, grad_accum: int) -> StrategyProfile:
        dp = axes_degree(mesh, DP_AXES)
        if dp == 1:
            return StrategyProfile()
        full = 4 * layout.numel
        # gathers (and reduce-scatters) run in rounds of at most gather_bucket_mb per owner; the padding of
        # each round to its largest owner's share is not counted
        rounds = max(1, math.ceil(full / dp / (self.gather_bucket_mb * 2**20)))
        gather = CollectiveSpec("all_gather", "parameters", full, rounds)
        step_buffer = min(full, int(self.gather_bucket_mb * 2**20))
        if self.grad_reduction == "all_reduce":
            ddp = bucketed_all_reduce_profile(layout, self.bucket_size_mb, self.first_bucket_size_mb, self.comm_dtype,
                                              self.compute_dtype)
            return dataclasses.replace(ddp, optimizer_sharded_over=DP_AXES, collectives=ddp.collectives + (gather,),
                                       step_transient_bytes=step_buffer)
        # every full-size gradient lives until the reduce-scatter after backward, which copies them into
        # flat round buffers
        return StrategyProfile(grads_sharded_over=DP_AXES, optimizer_sharded_over=DP_AXES,
                               collectives=(CollectiveSpec("reduce_scatter", "gradients", full, rounds), gather),
                               backward_transient_bytes=full, step_transient_bytes=step_buffer,
                               copy_bytes_per_step=2 * full)

    def setup(self, model: nn.Module, mesh: ParallelMesh, init_fn) -> nn.Module:
        self.mesh = mesh
        model = materialize(model, mesh.device_obj, init_fn)
        self.timer = CommTimer(mesh.device_obj)
        pg = mesh.group("dp")
        if self.grad_reduction == "all_reduce":
            self.wrapped = BucketedDDP(model, pg, self.timer, bucket_size_mb=self.bucket_size_mb,
                                       first_bucket_size_mb=self.first_bucket_size_mb, comm_dtype=self.comm_dtype,
                                       compute_dtype=self.compute_dtype)
        else:
            self.wrapped = _LocalGradients(model, pg, self.timer)
        return self.wrapped

    def build_optimizer(self, model, param_groups, make_optimizer) -> torch.optim.Optimizer:
        self.optimizer = ShardedOptimizer(param_groups, make_optimizer, process_group=self.mesh.group("dp"),
                                          grad_reduction=self.grad_reduction, bucket_size_mb=self.gather_bucket_mb,
                                          timer=self.timer, overlap_param_gather=self.overlap_param_gather,
                                          unsharded=frozenset(expert_sharded_parameters(unwrap(model))))
        if self.overlap_param_gather and self.optimizer.world > 1:
            self._install_gather_hooks(self.wrapped)
        return self.optimizer

    def _install_gather_hooks(self, wrapped: nn.Module) -> None:
        """Forward pre-hooks (registered once) that wait for a parameter gather just before its module runs."""
        opt = self.optimizer
        raw = unwrap(wrapped)
        compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in raw.modules())
        if compiled:  # hooks inside compiled code would be traced; wait for everything up front
            wrapped.register_forward_pre_hook(lambda _m, _a: opt.wait_for_parameters())
            return
        for m in raw.modules():
            own = tuple(p for p in m.parameters(recurse=False) if p.requires_grad)
            if own:  # first among the module's pre-hooks: nothing may read `own` before the wait
                m.register_forward_pre_hook(lambda _m, _a, own=own: opt.before_use(own), prepend=True)
        # a parameter read outside its module's forward (none in our models) is still safe: rounds of
        # parameters never seen in the recorded forward come first, waited by the first hook
        if isinstance(wrapped, BucketedDDP):  # compute_dtype: cast each module's leaves after its wait, not all
            wrapped.refresh_leaves_per_module()  # at the start of the forward (a no-op without cast parameters)

    def wait_for_parameters(self) -> None:
        """Block until every pending parameter gather has completed (before reading parameters)."""
        if self.optimizer is not None:
            self.optimizer.wait_for_parameters()

    def gradient_sync(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.wrapped.no_sync()

    def finish_gradient_synchronization(self) -> None:
        self.wrapped.finish_gradient_synchronization()
        self.optimizer.reduce_gradients()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.grad_reduction == "all_reduce":
            return super().clip_grad_norm_(model, max_norm)
        # reduce_scatter: each rank holds only its own parameters' gradients
        owned = [p for p in self.optimizer.owned_params() if p.grad is not None]
        dp_group = self.optimizer.process_group if self.optimizer.world > 1 else None
        sharded = tp_sharded_parameters(unwrap(model))
        # a rank's experts (expert parallelism) are owned by no one: their squares are summed over ep alone
        experts = [p for p in unwrap(model).parameters() if id(p) in self.optimizer._unsharded and p.grad is not None]
        return clip_grads_([p.grad for p in owned + experts], [id(p) in sharded for p in owned + experts], max_norm,
                           self.mesh.group("tp"), dp_group, self.mesh.tp,
                           pp_group=self.mesh.group("pp") if self.mesh.pp > 1 else None,
                           expert=[False] * len(owned) + [True] * len(experts), ep_group=expert_group(unwrap(model)))

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self.wait_for_parameters()
        init_optimizer_state(optimizer._local)  # a template before the first step needs every state tensor
        return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.wait_for_parameters()
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def full_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.wait_for_parameters()
        return {n: p.detach() for n, p in unwrap(model).named_parameters()}

    def memory_breakdown(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        self.wait_for_parameters()
        return super().memory_breakdown(model, optimizer)

    def step_metrics(self) -> dict[str, float]:
        return self.timer.metrics()


class Zero1RSStrategy(Zero1Strategy):
    """`zero1_rs`: reduce-scatter gradients to owners + all-gather parameters (ZeRO-1's 2*Psi volume)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("grad_reduction", "reduce_scatter")
        super().__init__(**kwargs)
