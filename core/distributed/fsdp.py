"""Our fully-sharded data parallel (CS336 section 7, FSDP / ZeRO-3 style).

What is sharded: the `weight` of every `nn.Linear` and `nn.Embedding`, by rows (dim 0, padded to a
multiple of the group size; the shard keeps the weight's name and rank, so weight-decay groups by
`ndim` still work). Everything else (norms, biases) stays replicated; its gradients are all-reduced.

One step, per sharded weight ("unit"; a tied weight is one unit used by two modules):
  forward   just before the module runs, its weight is all-gathered (cast to `compute_dtype` first,
            so the gather moves bf16), while the next `prefetch` gathers are already in flight
            (launched asynchronously; NCCL runs them on its own stream). What one gather moves is set
            by `group_by`: "block" (default) gathers the weights of one transformer block (the units
            used consecutively under one element of an `nn.ModuleList`) as one coalesced collective
            (NCCL: one grouped kernel, each weight straight into its own buffer, no copy-in/out), so
            xl takes 34 gathers a pass instead of 162 and `prefetch` counts blocks; "weight" gathers
            each unit on its own and `prefetch` counts units. The module's
            weight is swapped for the gathered tensor during its forward and dropped right after:
            autograd does not keep it (a saved-tensor hook stores a marker instead).
  backward  when autograd needs the weight again, the marker is unpacked by gathering it again
            (prefetching the next `prefetch` groups in backward order: the units of a group whose
            weights autograd saved); the full-weight gradient is
            reduce-scattered (in `reduce_dtype`, default fp32) into the fp32 shard's `.grad`, so
            gradients have the shape and dtype of the master shards.
  step      the optimizer updates the fp32 shards only (master weights stay fp32).
Gradient accumulation reduce-scatters every micro-step (unsharded gradients are never kept).
Under pipeline parallelism (mesh.pp > 1) a step's m micro-batches run interleaved forwards and backwards, so
  gathering per use would cost m (1F1B) to 2m all-gathers of every weight and m reduce-scatters; instead each
  weight is gathered at its first use in the step and held until the step's gradients are reduced, full-size
  gradients accumulate over the micro-batches and are reduce-scattered once (by the last backward, the rest in
  `finish_gradient_synchronization`): one all-gather and one reduce-scatter per weight per step, for holding
  the stage's unsharded weights and gradients during the step (a stage is 1/pp of the model; optimizer state and
  fp32 masters stay sharded).
Not combined with activation checkpointing (the recomputed forward would gather again).

Initialisation: a model on the meta device is wrapped as it is. Each sharded weight gets its (zero-padded) shard
allocated on the device, the replicated rest is materialised, and `init_weight` then fills the shards weight by
weight in the model's init order (`TransformerLM.init_weights_each`): the full weight is drawn from the seed into a
transient tensor, this rank's rows are kept and the transient is freed before the next. No rank ever holds the
whole model, and every rank holds the rows one process would have drawn (no broadcast needed). A materialised
module is broadcast from rank 0 and sharded.
"""
from __future__ import annotations

import contextlib
import datetime
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from core.distributed.checkpoint_boxes import Boxed, as_checkpoint_entries, is_boxed
from core.distributed.comm import (CommTimer, all_gather_coalesced, all_gather_flat, broadcast_module, group_rank,
                                   group_size, init_optimizer_state, reduce_scatter_flat, supports_avg)
from core.distributed.mesh import ParallelMesh
from core.distributed.strategy import (DP_AXES, CollectiveSpec, ModelInit, ModelLayout, Strategy, StrategyProfile,
                                       axes_degree, expert_group, expert_sharded_parameters, materialize)
from core.distributed.tensor_parallel import rows_in_full
from core.dtypes import dtype_bytes, parse_dtype
from core.errors import require
from core.model import init_part, part_of_full


class _Unit:
    """One sharded weight: its fp32 shard (the master) and its full shape."""

    def __init__(self, index: int, shard: nn.Parameter, full_shape: torch.Size, rows: int) -> None:
        self.index, self.shard, self.full_shape, self.rows = index, shard, full_shape, rows
        self.pending = None        # (buffer, _Gather) of an in-flight all-gather
        self.bwd_buf = None        # the gathered weight held for this backward
        self.fwd_buf = None


class _Gather:
    """One launched all-gather (of one unit, or coalesced over a group's units): waited for once."""

    __slots__ = ("work", "waited")

    def __init__(self, work) -> None:
        self.work, self.waited = work, work is None

    def wait(self, timer: Optional[CommTimer] = None) -> None:
        """Wait once (through `timer`, which counts the stall as exposed communication)."""
        if not self.waited:
            self.waited = True
            if timer is not None:
                timer.wait(self.work)
            else:
                self.work.wait()


def block_key(name: str) -> str:
    """The gather group of a module: its path up to the first numeric component (`blocks.3.ffn.w1` ->
    `blocks.3`, an element of a ModuleList); a module outside any list is a group of its own."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


class _GatherWeight(torch.autograd.Function):
    """shard -> full weight (forward: all-gather); full grad -> reduce-scatter into shard.grad (backward)."""

    @staticmethod
    def forward(ctx, shard, unit, fsdp):
        ctx.unit, ctx.fsdp = unit, fsdp
        buf = fsdp._take_gathered(unit)
        unit.fwd_buf = buf
        return buf[: unit.full_shape[0]]

    @staticmethod
    def backward(ctx, grad):
        ctx.fsdp._reduce_scatter(ctx.unit, grad)
        ctx.unit.bwd_buf = None
        return None, None, None


class FullyShardedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 compute_dtype: Any = None, reduce_dtype: Any = None, prefetch: int = 1,
                 timer: Optional[CommTimer] = None,
                 reduce_scatter_group: Optional[dist.ProcessGroup] = None, group_by: str = "block",
                 device: Optional[torch.device] = None) -> None:
        """`module` materialised (broadcast from rank 0, then sharded) or on the meta device (shards allocated on
        `device`, left for `init_weight` to fill; module docstring). `reduce_scatter_group`: the same ranks as
        `process_group` in a group of its own, for the gradient reduce-scatters: each group runs its collectives
        in order on its own NCCL stream, so backward's prefetched all-gathers (on the critical path) do not queue
        behind reduce-scatters (which are not).
        None: everything on `process_group`. `group_by`: "block" or "weight", what one all-gather moves
        (module docstring)."""
        super().__init__()
        require(0 <= prefetch <= 2, "parallelism.prefetch", f"must be 0, 1 or 2 gathers ahead, got {prefetch}",
                "set parallelism.prefetch to 0..2")
        require(group_by in ("block", "weight"), "parallelism.group_by", f"unknown {group_by!r}",
                "use block (one coalesced all-gather per transformer block) or weight (one per Linear/Embedding)")
        self.group_by = group_by
        self.module = module
        self.process_group = process_group
        self.rs_group = reduce_scatter_group if reduce_scatter_group is not None else process_group
        self.world, self.rank = group_size(process_group), group_rank(process_group)
        require(group_size(self.rs_group) == self.world, "reduce_scatter_group",
                f"has {group_size(self.rs_group)} ranks, the data-parallel group {self.world}",
                "pass a group of the same ranks as process_group, or None")
        self.avg_in_op = supports_avg(process_group)
        self.compute_dtype = parse_dtype(compute_dtype, "parallelism.compute_dtype")
        self.reduce_dtype = parse_dtype(reduce_dtype, "parallelism.reduce_dtype")
        self.prefetch = prefetch
        on_meta = any(p.is_meta for p in module.parameters())
        device = device if device is not None else next(module.parameters()).device
        require(device.type != "meta", "device", "a meta-device module needs the device its shards go to",
                "pass device=")
        self.device = device
        self.timer = timer if timer is not None else CommTimer(device, enabled=False)
        if not on_meta:  # a meta module is filled from the seed, identically on every rank
            # each rank's own experts (expert parallelism) are not rank 0's
            broadcast_module(module, process_group, exclude=frozenset(expert_sharded_parameters(module)))
        self.units: list[_Unit] = []
        self._group_key = {id(m): block_key(n) if group_by == "block" else n for n, m in module.named_modules()}
        by_param: dict[int, _Unit] = {}
        for m in module.modules():
            if not isinstance(m, (nn.Linear, nn.Embedding)):
                continue
            w = m._parameters["weight"]
            if id(w) not in by_param:
                by_param[id(w)] = self._shard(w)
            unit = by_param[id(w)]
            m._parameters["weight"] = unit.shard
            m.register_forward_pre_hook(self._make_pre_hook(unit))
            m.register_forward_hook(self._make_post_hook(unit))
        self._unit_of = {id(u.shard): u for u in self.units}
        if on_meta:
            _materialize_rest(module, device)
        # expert parallelism: a rank's experts are averaged by core.distributed.expert_parallel over the ranks that
        # hold them, not all-reduced here
        shard_ids = {id(u.shard) for u in self.units} | expert_sharded_parameters(module)
        seen: set[int] = set()
        self.replicated = []
        for p in module.parameters():
            if id(p) not in shard_ids and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.replicated.append(p)
        self._order: list[_Unit] = []      # forward order of unit uses, recorded on the first forward
        self._order_keys: list[str] = []   # the gather group (block) of each use
        self._fwd_groups: list[list[_Unit]] = []   # gather groups in forward order (after the first forward)
        self._group_of_pos: list[int] = []
        self._bwd_groups: list[list[_Unit]] = []   # groups of units whose weight backward needs, backward order
        self._bwd_group_of_pos: dict[int, int] = {}
        self._fwd_next = self._bwd_next = 0        # next group to launch in this forward / backward
        self._recording = True
        self._saves: list[int] = []         # positions whose weight autograd saved (needed in backward)
        self._pos = 0
        self._pending_rs: list[tuple] = []
        self._ctx_stack: list = []
        self._bias_stack: list = []
        # under pipeline parallelism (`pipelined`, set by the strategy) a step runs m micro-batches' forwards and
        # backwards interleaved: each weight is gathered once per step and held until the step's gradients are
        # reduced (`_held`), and full-size gradients accumulate (`_grad_acc`, reduce dtype) until the step's last
        # backward (`sync_grads`) or finish_gradient_synchronization reduce-scatters them once
        self.pipelined, self.sync_grads = False, True
        self._holding = False  # this forward is a pipelined training one (read where grad mode is the caller's)
        self._held: dict[int, torch.Tensor] = {}
        self._grad_acc: dict[int, torch.Tensor] = {}

    # ---- sharding ----
    @torch.no_grad()
    def _shard(self, w: nn.Parameter) -> _Unit:
        """This rank's rows of `w` as a new unit (rows past the end zero); a meta `w` leaves them for `init_weight`."""
        rows = math.ceil(w.shape[0] / self.world)
        local = torch.zeros((rows,) + tuple(w.shape[1:]), dtype=w.dtype,
                            device=self.device if w.is_meta else w.device)
        lo, hi = self.rank * rows, min(w.shape[0], (self.rank + 1) * rows)
        if hi > lo and not w.is_meta:
            local[: hi - lo].copy_(w[lo:hi])
        unit = _Unit(len(self.units), nn.Parameter(local, requires_grad=w.requires_grad), w.shape, rows)
        self.units.append(unit)
        return unit

    def valid_rows(self, unit: _Unit) -> int:
        return max(0, min(unit.rows, unit.full_shape[0] - self.rank * unit.rows))

    @torch.no_grad()
    def init_weight(self, module: nn.Module, draw) -> None:
        """A `core.model.WeightInit`: draw `module`'s full weight into a transient tensor and keep this rank's rows
        in its shard (the transient is the only full weight alive; it is freed on return)."""
        unit = self._unit_of.get(id(module._parameters.get("weight")))
        if unit is None:  # not one of ours (a wrapped module's own weight, another stage's): initialise it in place
            init_part(module, draw)
            return
        shape = getattr(module, "full_weight_shape", None) or unit.full_shape  # a tensor-parallel part's whole
        full = torch.empty(shape, dtype=unit.shard.dtype, device=unit.shard.device)
        draw(full)
        part = part_of_full(module, full)  # the tensor-parallel part, if the module is one (else `full`)
        lo, n = self.rank * unit.rows, self.valid_rows(unit)
        unit.shard.detach()[:n].copy_(part[lo:lo + n])

    # ---- all-gather ----
    def _launch_gather(self, units: list[_Unit], for_backward: bool = False) -> None:
        """All-gather the weights of `units` as one coalesced collective, leaving out those already in flight
        (and, for backward, those whose gathered weight is already held)."""
        units = [u for u in dict.fromkeys(units) if u.pending is None and not (for_backward and u.bwd_buf is not None)
                 and u.index not in self._held]
        if not units:
            return
        srcs = [u.shard.detach() for u in units]
        if self.compute_dtype is not None and srcs[0].dtype != self.compute_dtype:
            cast = [torch.empty_like(s, dtype=self.compute_dtype) for s in srcs]
            torch._foreach_copy_(cast, srcs)  # one multi-tensor cast kernel for the group
            srcs = cast
        if self.world == 1:
            for u, s in zip(units, srcs):
                u.pending = (s, _Gather(None))
            return
        bufs = [torch.empty((self.world * u.rows,) + tuple(u.full_shape[1:]), dtype=s.dtype, device=s.device)
                for u, s in zip(units, srcs)]
        if len(units) == 1:
            work = all_gather_flat(bufs[0], srcs[0], group=self.process_group, async_op=True)
        else:
            work = all_gather_coalesced(bufs, srcs, group=self.process_group)
        gather = _Gather(self.timer.launched(work, group=self.process_group))
        for u, b in zip(units, bufs):
            u.pending = (b, gather)

    def _take_gathered(self, unit: _Unit) -> torch.Tensor:
        held = self._held.get(unit.index)
        if held is not None:
            return held
        self._launch_gather([unit])
        buf, gather = unit.pending
        unit.pending = None
        gather.wait(self.timer)
        if self._holding:  # a training forward's step: keep it for the step's other uses
            self._held[unit.index] = buf
        return buf

    def _build_groups(self) -> None:
        """Gather groups from the recorded forward: consecutive uses with the same group key."""
        self._fwd_groups, self._group_of_pos = [], []
        prev = None
        for unit, key in zip(self._order, self._order_keys):
            if key != prev or not self._fwd_groups:
                self._fwd_groups.append([])
                prev = key
            self._fwd_groups[-1].append(unit)
            self._group_of_pos.append(len(self._fwd_groups) - 1)
        saved_by_group: dict[int, list[int]] = {}  # backward gathers only the weights autograd saved
        for p in self._saves:
            saved_by_group.setdefault(self._group_of_pos[p], []).append(p)
        self._bwd_groups, self._bwd_group_of_pos = [], {}
        for g in sorted(saved_by_group, reverse=True):
            for p in saved_by_group[g]:
                self._bwd_group_of_pos[p] = len(self._bwd_groups)
            self._bwd_groups.append([self._order[p] for p in saved_by_group[g]])

    # ---- forward hooks ----
    def _make_pre_hook(self, unit: _Unit):
        def pre(module: nn.Module, args):
            pos = self._pos
            self._pos += 1
            if self._recording:
                self._order.append(unit)
                self._order_keys.append(self._group_key[id(module)])
            elif pos < len(self._group_of_pos):
                last = min(self._group_of_pos[pos] + self.prefetch, len(self._fwd_groups) - 1)
                while self._fwd_next <= last:  # this use's group and the next `prefetch` ones
                    self._launch_gather(self._fwd_groups[self._fwd_next])
                    self._fwd_next += 1
            full = _GatherWeight.apply(unit.shard, unit, self)
            module._parameters["weight"] = full
            bias = module._parameters.get("bias")
            if self.compute_dtype is not None and bias is not None:  # replicated bias computes in it too
                module._parameters["bias"] = bias.to(self.compute_dtype)
                self._bias_stack.append(bias)
            if torch.is_grad_enabled() and unit.shard.requires_grad:
                ctx = torch.autograd.graph.saved_tensors_hooks(*self._pack_hooks(unit, pos))
            else:
                ctx = contextlib.nullcontext()
            ctx.__enter__()
            self._ctx_stack.append(ctx)
            if self.compute_dtype is not None:
                args = tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                             for a in args)
            return args
        return pre

    def _make_post_hook(self, unit: _Unit):
        def post(module: nn.Module, args, output):
            self._ctx_stack.pop().__exit__(None, None, None)
            module._parameters["weight"] = unit.shard
            if self.compute_dtype is not None and module._parameters.get("bias") is not None:
                module._parameters["bias"] = self._bias_stack.pop()
            unit.fwd_buf = None
        return post

    def _pack_hooks(self, unit: _Unit, pos: int):
        def pack(t: torch.Tensor):
            buf = unit.fwd_buf
            if buf is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                if self._recording and pos not in self._saves:
                    self._saves.append(pos)
                return ("fsdp-weight", unit, pos, t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(x):
            if not (isinstance(x, tuple) and len(x) == 6 and x[0] == "fsdp-weight"):
                return x
            _, u, p, size, stride, offset = x
            g = self._bwd_group_of_pos.get(p)
            if g is not None:  # this use's group and the next `prefetch` ones in backward order
                last = min(g + self.prefetch, len(self._bwd_groups) - 1)
                while self._bwd_next <= last:
                    self._launch_gather(self._bwd_groups[self._bwd_next], for_backward=True)
                    self._bwd_next += 1
            if u.bwd_buf is None:
                u.bwd_buf = self._take_gathered(u)
            return u.bwd_buf.as_strided(size, stride, offset)
        return pack, unpack

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._pos = self._fwd_next = self._bwd_next = 0
        # gathers run inside an autograd Function's forward, where grad mode is off: decide here
        self._holding = self.pipelined and torch.is_grad_enabled()
        out = self.module(*args, **kwargs)
        if self._recording:
            if torch.is_grad_enabled():  # the order, and which weights backward needs, are known: stop recording
                self._saves.sort()
                self._build_groups()
                self._recording = False
            else:  # an evaluation forward saves nothing: record again on the next one
                self._order, self._order_keys = [], []
        return out

    # ---- gradients ----
    def _reduce_scatter(self, unit: _Unit, grad: torch.Tensor) -> None:
        rd = self.reduce_dtype or unit.shard.dtype
        if self.pipelined:
            acc = self._grad_acc.pop(unit.index, None)
            if acc is not None:
                grad = acc.add_(grad)
            if not self.sync_grads:  # not the step's last backward: keep the full-size sum
                self._grad_acc[unit.index] = grad if acc is not None else grad.to(rd, copy=True)
                return
        self._launch_reduce_scatter(unit, grad)

    def _launch_reduce_scatter(self, unit: _Unit, grad: torch.Tensor) -> None:
        rd = self.reduce_dtype or unit.shard.dtype
        g = grad.to(rd)
        n = self.world * unit.rows
        if n != unit.full_shape[0]:
            padded = torch.zeros((n,) + tuple(unit.full_shape[1:]), dtype=rd, device=g.device)
            padded[: unit.full_shape[0]].copy_(g)
            g = padded
        if self.world == 1:
            self._pending_rs.append((unit, g, None))
        else:
            out = torch.empty((unit.rows,) + tuple(unit.full_shape[1:]), dtype=rd, device=g.device)
            op = dist.ReduceOp.AVG if self.avg_in_op else dist.ReduceOp.SUM
            work = reduce_scatter_flat(out, g.contiguous(), op=op, group=self.rs_group, async_op=True)
            self._pending_rs.append((unit, out, self.timer.launched(work, group=self.rs_group)))
        while len(self._pending_rs) > max(2, self.prefetch + 1):  # bound the full-size grads in flight
            self._complete_rs(*self._pending_rs.pop(0))

    @torch.no_grad()
    def _complete_rs(self, unit: _Unit, out: torch.Tensor, work) -> None:
        self.timer.wait(work)
        if work is not None and not self.avg_in_op:
            out.div_(self.world)
        shard = unit.shard
        if shard.grad is None:
            shard.grad = out.to(shard.dtype) if out.dtype != shard.dtype else out
        else:
            shard.grad.add_(out.to(shard.dtype))

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool):
        """Pipelined: reduce-scatter in the backwards inside (`enabled`) or accumulate full-size gradients."""
        prev, self.sync_grads = self.sync_grads, enabled
        try:
            yield
        finally:
            self.sync_grads = prev

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        # units whose last backward accumulated (an interleaved chunk's, or all under torch's schedules), in unit
        # order: every data-parallel rank of the stage issues them alike
        for index in sorted(self._grad_acc):
            self._launch_reduce_scatter(self.units[index], self._grad_acc.pop(index))
        while self._pending_rs:
            self._complete_rs(*self._pending_rs.pop(0))
        self._held.clear()
        for u in self.units:  # drop gathers of weights the optimizer is about to change
            u.bwd_buf = None
            if u.pending is not None:
                u.pending[1].wait()
                u.pending = None
        if self.world == 1:
            return
        grads = [p.grad for p in self.replicated if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(gs)
            with self.timer.blocking():
                dist.all_reduce(flat, op=dist.ReduceOp.AVG if self.avg_in_op else dist.ReduceOp.SUM,
                                group=self.process_group)
            if not self.avg_in_op:
                flat.div_(self.world)
            for g, s in zip(gs, torch._utils._unflatten_dense_tensors(flat, gs)):
                g.copy_(s)

    # ---- full parameters, sharded state ----
    def is_sharded(self, p: nn.Parameter) -> Optional[_Unit]:
        for u in self.units:
            if u.shard is p:
                return u
        return None

    @torch.no_grad()
    def gather_full(self, unit: _Unit, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """All-gather a shard-shaped tensor (default: the fp32 master shard) into the full weight."""
        t = (unit.shard if tensor is None else tensor).detach().contiguous()
        if self.world == 1:
            return t[: unit.full_shape[0]].clone()
        buf = torch.empty((self.world * unit.rows,) + tuple(unit.full_shape[1:]), dtype=t.dtype, device=t.device)
        all_gather_flat(buf, t, group=self.process_group)
        return buf[: unit.full_shape[0]].clone()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.module.named_parameters():
            u = self.is_sharded(p)
            out[name] = self.gather_full(u) if u is not None else p.detach()
        return out


def _materialize_rest(module: nn.Module, device: torch.device) -> None:
    """Allocate every parameter and buffer of `module` still on the meta device on `device` (values left to the
    init), and move those on another device there; tied tensors stay tied."""
    done: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is None:
                    continue
                if id(t) not in done:
                    new = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
                    if new is not t and isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    done[id(t)] = new
                table[key] = done[id(t)]


def _shard_dtensor(local: torch.Tensor, full_shape, device_mesh):
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False, shape=torch.Size(full_shape),
                              stride=stride)


class FSDPStrategy(Strategy):
    """`parallelism=fsdp`: our FullyShardedDataParallel; checkpoints through torch.distributed.checkpoint."""

    name = "fsdp"
    data_parallel = True
    supports_expert_parallel = True  # the 3-D expert weights are replicated over dp: under ep, each rank's own
    checkpoint_format = "dcp"
    reshardable = True  # every entry's global value is the one-process tensor (`state_dict`): any mesh reads it
    supports_activation_checkpointing = False  # its saved-tensor hooks free gathered weights; recompute would miss them

    def __init__(self, compute_dtype: Any = None, reduce_dtype: Any = None, prefetch: int = 1,
                 separate_reduce_scatter: bool = True, group_by: str = "block") -> None:
        self.kwargs = dict(compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, prefetch=prefetch,
                           group_by=group_by)
        self.separate_reduce_scatter = bool(separate_reduce_scatter)

    def profile(self, mesh: ParallelMesh, layout: ModelLayout, grad_accum: int) -> StrategyProfile:
        if axes_degree(mesh, DP_AXES) == 1:
            return StrategyProfile()
        gathered = dtype_bytes(self.kwargs["compute_dtype"], "parallelism.compute_dtype")
        reduced = dtype_bytes(self.kwargs["reduce_dtype"], "parallelism.reduce_dtype")
        sharded = layout.embedding + sum(layout.linear_weights)  # Linear and Embedding weights; norms replicate
        in_flight = int(self.kwargs["prefetch"]) + 1
        if self.kwargs["group_by"] == "block":  # embedding, each block, lm_head; backward skips the embedding
            fwd_calls, bwd_calls = layout.n_blocks + 2, layout.n_blocks + 1
            unit = max(layout.block_params, layout.embedding, max(layout.linear_weights))
        else:
            fwd_calls, bwd_calls = len(layout.linear_weights) + 1, len(layout.linear_weights)
            unit = max(layout.embedding, max(layout.linear_weights))
        if mesh.pp > 1:  # a pipeline stage: gathered once and held for the step, reduce-scattered once
            return StrategyProfile(
                params_sharded_over=DP_AXES, grads_sharded_over=DP_AXES, optimizer_sharded_over=DP_AXES,
                collectives=(CollectiveSpec("all_gather", "parameters", gathered * sharded, fwd_calls),
                             CollectiveSpec("reduce_scatter", "gradients", reduced * sharded,
                                            len(layout.linear_weights) + 1, overlappable=True),
                             CollectiveSpec("all_reduce", "gradients", 4 * (layout.numel - sharded), 1)),
                gathered_param_bytes=gathered * sharded, backward_transient_bytes=reduced * sharded,
                autocast_weight_copies=False)
        return StrategyProfile(
            params_sharded_over=DP_AXES, grads_sharded_over=DP_AXES, optimizer_sharded_over=DP_AXES,
            collectives=(
                CollectiveSpec("all_gather", "parameters", gathered * (2 * sharded - layout.embedding) * grad_accum,
                               (fwd_calls + bwd_calls) * grad_accum, overlappable=True),
                # every micro-step: unsharded gradients are never kept across micro-steps
                CollectiveSpec("reduce_scatter", "gradients", reduced * sharded * grad_accum,
                               (len(layout.linear_weights) + 1) * grad_accum, overlappable=True),
                CollectiveSpec("all_reduce", "gradients", 4 * (layout.numel - sharded), 1)),
            gathered_param_bytes=gathered * in_flight * unit,
            backward_transient_bytes=4 * 2 * layout.block_params,  # full-size gradients awaiting reduce-scatter
            autocast_weight_copies=False)  # the saved-tensor hook drops gathered (and cast) weights

    def validate(self, mesh: ParallelMesh) -> None:
        require(mesh.dp_replicate == 1, "mesh.dp_replicate", "our fsdp shards over the whole data-parallel group",
                "use mesh.dp_shard for the data-parallel size (or torch_fsdp2 for HSDP)")

    def setup(self, model: nn.Module, mesh: ParallelMesh, init_fn: ModelInit) -> nn.Module:
        """Shard a meta-device model and initialise the shards weight by weight (module docstring); a
        materialised one is moved, broadcast and sharded."""
        self.mesh = mesh
        on_meta = any(p.is_meta for p in model.parameters())
        if not on_meta:
            model = materialize(model, mesh.device_obj, init_fn)
        self.timer = CommTimer(mesh.device_obj)
        group = mesh.group("dp")
        rs_group = None
        if self.separate_reduce_scatter and group_size(group) > 1:
            # the same ranks again; every rank takes part in creating every dp group's copy, as new_group requires
            # (under tensor parallelism there is one dp group per tp rank)
            mine = dist.get_process_group_ranks(group)
            for ranks in mesh.dp_group_ranks():
                made = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=mesh.timeout_s))
                if ranks == mine:
                    rs_group = made
        self.wrapped = FullyShardedDataParallel(model, group, timer=self.timer, reduce_scatter_group=rs_group,
                                                device=mesh.device_obj, **self.kwargs)
        self.wrapped.pipelined = mesh.pp > 1  # gather once and reduce-scatter once per step (module docstring)
        if on_meta:
            init_fn(model, init_weight=self.wrapped.init_weight)
        return self.wrapped

    def gradient_sync(self, enabled: bool):
        # only a pipeline's micro-batches accumulate unsharded gradients; gradient accumulation reduce-scatters
        # every micro-step (module docstring)
        return self.wrapped.gradient_sync(enabled) if self.wrapped.pipelined else contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        self.wrapped.finish_gradient_synchronization()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        w = self.wrapped
        dev = self.mesh.device_obj
        sharded = [u.shard.grad for u in w.units if u.shard.grad is not None]
        repl = [p.grad for p in w.replicated if p.grad is not None]
        sq = torch.zeros((), device=dev)
        for g in sharded:
            sq += g.float().pow(2).sum()
        if w.world > 1:
            dist.all_reduce(sq, group=w.process_group)
        tp = self.mesh.tp
        for g in repl:  # identical on every dp rank after the all-reduce, and on every tp rank (the norms)
            sq += g.float().pow(2).sum() / tp
        if tp > 1:
            # the units are tensor-parallel parts too (every Linear and the embedding are split over tp): their
            # squares add up over tp, and the replicated ones were counted 1/tp on each tp rank
            sq = sq.clone()
            dist.all_reduce(sq, group=self.mesh.group("tp"))
        if self.mesh.pp > 1:  # each stage holds other parameters
            dist.all_reduce(sq, group=self.mesh.group("pp"))
        ids = expert_sharded_parameters(w.module)
        experts = [p.grad for p in w.module.parameters() if id(p) in ids and p.grad is not None]
        if experts:  # expert parallelism: disjoint over the ep group, the same on the ranks holding the same ones
            esq = torch.stack([g.float().pow(2).sum() for g in experts]).sum()
            dist.all_reduce(esq, group=expert_group(w.module))
            sq = sq + esq
        norm = sq.sqrt()
        if max_norm > 0 and math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in sharded + repl + experts:
                g.mul_(coef.to(g.dtype))
        return norm

    def _wrap(self, name: str, p: nn.Parameter, t: torch.Tensor, boxed: dict[str, Boxed], key: str):
        """`t` (parameter `name` or optimizer state shaped like it) as a checkpoint entry whose global value is
        the one-process tensor: a DTensor sharded over dp, or, under tensor parallelism, this rank's rows of its
        tp part as boxes of the full weight (recorded in `boxed` under `key`, made into entries collectively); under
        expert parallelism a rank's experts (whole on it) as their box of the whole layer's tensor."""
        from core.distributed.expert_parallel import expert_box

        if torch.is_tensor(t) and (box := expert_box(self.wrapped.module, name, t)) is not None:
            boxed[key] = box
            return key
        u = self.wrapped.is_sharded(p)
        if u is None or not torch.is_tensor(t) or t.shape != p.shape:
            return t
        if self.mesh.tp > 1:
            module = self.wrapped.module.get_submodule(name.rpartition(".")[0])
            lo = self.wrapped.rank * u.rows
            hi = lo + self.wrapped.valid_rows(u)
            boxes = [(t[a - lo:a - lo + n], off) for a, n, off in rows_in_full(module, lo, hi)]
            boxed[key] = Boxed(tuple(getattr(module, "full_weight_shape", None) or u.full_shape), t.dtype, boxes)
            return key
        if self.wrapped.world == 1:
            return t
        return _shard_dtensor(t[: self.wrapped.valid_rows(u)], u.full_shape, self.mesh.submesh("dp"))

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every parameter and its optimizer state by name, each entry's global value the one-process tensor,
        so the checkpoint loads on any mesh (`reshardable`). Loading fills the live shards in place."""
        init_optimizer_state(optimizer)
        named = list(self.wrapped.module.named_parameters())
        boxed: dict[str, Boxed] = {}
        model_sd = {n: self._wrap(n, p, p.detach(), boxed, n) for n, p in named}
        persistent = self.wrapped.module.state_dict().keys()  # not the RoPE tables or pipeline stand-ins' slots
        model_sd.update({n: b for n, b in self.wrapped.module.named_buffers() if n in persistent})
        osd = optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        name_of = {index[id(p)]: n for n, p in named if id(p) in index}
        param_of = {index[id(p)]: p for _, p in named if id(p) in index}
        state = {name_of[i]: {k: self._wrap(name_of[i], param_of[i], v, boxed, f"{name_of[i]}/{k}")
                              for k, v in s.items()} for i, s in osd["state"].items()}
        if boxed:  # placeholders -> ShardedTensors (one exchange of every rank's boxes)
            entries = as_checkpoint_entries(boxed)
            model_sd = {n: entries.get(v, v) if isinstance(v, str) else v for n, v in model_sd.items()}
            state = {n: {k: entries.get(v, v) if isinstance(v, str) else v for k, v in s.items()}
                     for n, s in state.items()}
        # no parameter groups: their hyper-parameters are the resuming run's, and under pipeline parallelism each
        # stage's list of names would be a different value under the same key
        return {"model": model_sd, "optimizer": {"state": state}}

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        tensors = dict(self.wrapped.module.named_parameters())
        tensors.update(dict(self.wrapped.module.named_buffers()))
        for n, t in tensors.items():
            if n in state["model"] and not is_boxed(state["model"][n]):  # boxes were loaded in place
                src = local(state["model"][n])
                t.detach()[: src.shape[0]].copy_(src)
        named = dict(self.wrapped.module.named_parameters())
        osd = optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        new_state = {}
        for n, s in state["optimizer"]["state"].items():
            p = named[n]
            cur = optimizer.state.get(p, {})
            ns = {}
            for k, v in s.items():
                v = cur[k] if is_boxed(v) else local(v)  # boxes: views of the live state, loaded in place
                if torch.is_tensor(v) and torch.is_tensor(cur.get(k)) and cur[k].dim() and v.shape != cur[k].shape:
                    full = cur[k].clone()
                    full[: v.shape[0]].copy_(v)
                    v = full
                ns[k] = v.clone() if torch.is_tensor(v) else v
            new_state[index[id(p)]] = ns
        osd = {"state": new_state, "param_groups": osd["param_groups"]}  # this run's groups (see state_dict)
        optimizer.load_state_dict(osd)

    def full_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.wrapped.full_parameters()

    def step_metrics(self) -> dict[str, float]:
        return self.timer.metrics()
