"""Our DDP family (CS336 sections 5-6): four ways to average gradients over the data-parallel group.

    ddp_naive     one all-reduce per parameter gradient, after backward
    ddp_flat      one all-reduce of all gradients flattened together, after backward
    ddp_overlap   one asynchronous all-reduce per parameter, launched from its post-accumulate-grad
                  hook while the rest of backward runs (= bucketed with one parameter per bucket)
    ddp_bucketed  the same with gradients grouped into buckets of `bucket_size_mb`, in the order
                  they become ready (recorded on the first step; reverse registration order before)

All four share `DataParallel`: it broadcasts rank 0's parameters and buffers at construction,
forwards `forward`, skips parameters that do not require grad, counts tied parameters once
(one `nn.Parameter` object, one hook, one reduction), and communicates only on the last
micro-step of gradient accumulation (`no_sync()` around the others).
A bucket holding a single parameter is reduced in place on the gradient (no copy); a bucket of
several copies them into one flat buffer and afterwards leaves each `.grad` as a view into it.
`ddp_bucketed` can also run the Linear layers on bf16 copies of their parameters that it makes itself
(`compute_dtype`), so their gradients arrive, and are all-reduced, in bf16.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from core.distributed.comm import CommTimer, broadcast_module, group_size, supports_avg
from core.distributed.mesh import ParallelMesh
from core.distributed.strategy import (DP_AXES, CollectiveSpec, ModelLayout, Strategy, StrategyProfile, axes_degree,
                                       expert_sharded_parameters, materialize)
from core.dtypes import dtype_bytes, parse_dtype
from core.errors import require


def unique_trainable(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that require grad, each object once (tied weights counted once), in registration order."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class DataParallel(nn.Module):
    """Base wrapper. Subclasses decide when and how gradients are reduced (`_reduce_after_backward`
    for the blocking variants, buckets + hooks for the overlapping ones)."""

    def __init__(self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 timer: Optional[CommTimer] = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world = group_size(process_group)
        self.avg_in_op = supports_avg(process_group)
        # under expert parallelism each rank holds other experts: core.distributed.expert_parallel averages their
        # gradients over the ranks holding the same ones, so they are neither broadcast nor reduced here
        experts = frozenset(expert_sharded_parameters(module))
        self.params = [p for p in unique_trainable(module) if id(p) not in experts]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.timer = timer if timer is not None else CommTimer(device, enabled=False)
        self.require_backward_grad_sync = True
        broadcast_module(module, process_group, exclude=experts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this context."""
        prev, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = prev

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    # ---- shared pieces ----
    def _op(self):
        return dist.ReduceOp.AVG if self.avg_in_op else dist.ReduceOp.SUM

    def _all_reduce(self, t: torch.Tensor, async_op: bool):
        return dist.all_reduce(t, op=self._op(), group=self.process_group, async_op=async_op)

    def _scale(self, t: torch.Tensor) -> None:
        if not self.avg_in_op:
            t.div_(self.world)


class NaiveDDP(DataParallel):
    """All-reduce every parameter gradient after backward, one blocking call each."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if self.world == 1 or not self.require_backward_grad_sync:
            return
        for p in self.params:
            if p.grad is not None:
                with self.timer.blocking():
                    self._all_reduce(p.grad, async_op=False)
                self._scale(p.grad)


class FlatDDP(DataParallel):
    """One all-reduce of all gradients flattened together (one per dtype), after backward."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if self.world == 1 or not self.require_backward_grad_sync:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            with self.timer.blocking():
                self._all_reduce(flat, async_op=False)
            self._scale(flat)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)


class _Bucket:
    __slots__ = ("params", "offsets", "numel", "buffer", "remaining", "work", "index", "cast")

    def __init__(self, params: list[torch.Tensor], index: int, cast: bool) -> None:
        self.params = params  # gradient sources: parameters, or the compute-dtype leaves standing in for them
        self.index = index
        self.cast = cast      # holds leaves: the reduced gradients belong to their fp32 parameters
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.buffer: Optional[torch.Tensor] = None
        self.remaining = len(params)
        self.work = None


def _compute_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return parse_dtype(name, "parallelism.compute_dtype", allowed=(torch.bfloat16,))


def _linear_params(module: nn.Module) -> set[int]:
    """ids of parameters registered only in modules whose forward is `nn.Linear.forward` (F.linear, which
    autocast runs in its low-precision dtype). A parameter also registered elsewhere (a weight tied to an
    embedding, which autocast does not cast) is left out: a low-precision copy would change its numerics."""
    linear, other = set(), set()
    for m in module.modules():
        # a Linear subclass may declare that its forward runs the weight in autocast's dtype as F.linear does
        # (core.model.LMHead: F.linear, or the chunked loss, which casts the weight to autocast's dtype itself)
        uses_f_linear = isinstance(m, nn.Linear) and (type(m).forward is nn.Linear.forward
                                                      or getattr(m, "weight_in_autocast_dtype", False))
        for p in m._parameters.values():
            if p is not None:
                (linear if uses_f_linear else other).add(id(p))
    return linear - other


class BucketedDDP(DataParallel):
    """Asynchronous all-reduce of gradient buckets launched from post-accumulate-grad hooks.

    bucket_size_mb        bucket capacity (a larger parameter gets a bucket of its own, reduced in place)
    first_bucket_size_mb  capacity of the first bucket (of each gradient dtype) to become ready, kept small
                          so communication starts early in backward
    comm_dtype            None (default): reduce in the gradient's dtype. fp32: the result is the fp32
                          sum of the ranks' gradients (only summation order differs from one process).
                          "bfloat16": halves the bytes on the wire and the SM/HBM time NCCL takes from
                          backward. Each bucket is cast into a persistent bf16 buffer (one multi-tensor
                          copy), all-reduced there (NCCL: AVG inside the reduction, bf16 accumulation),
                          and cast back into the fp32 `.grad` in one multi-tensor pass after backward:
                          no fp32 temporaries. Numerics: bf16 keeps 8 significant bits; every rank's
                          gradient is rounded to bf16 (relative error <= 2^-8) and each of the world-1
                          additions rounds again, so the averaged gradient differs from the exact fp32
                          mean by up to about world * 2^-8 * mean_r |g_r| per element (2 ranks: 2^-7,
                          tested); round-to-nearest, so unbiased on average. Optimizer state and master
                          weights stay fp32; the default fp32 path is exact up to summation order.
                          Costs a persistent bf16 buffer of all gradients (half the fp32 gradient bytes).
    compute_dtype         None (default): autocast casts the Linear weights in the forward; the backward of
                          that cast widens their bf16 gradients to fp32, which are then reduced in fp32.
                          "bfloat16" (needs bf16 autocast around the forward, i.e. precision=bf16): the
                          wrapper makes the bf16 copies itself. Cast parameters: every trainable parameter
                          of a module whose forward is `nn.Linear.forward` (F.linear), unless also
                          registered in another module (a weight tied to an embedding, which autocast does
                          not cast, stays on the fp32 path). Each has a persistent bf16 leaf; a synced
                          forward refreshes the leaves (one multi-tensor cast) and runs the module with
                          them in the parameters' places. Autocast does not re-cast bf16 tensors, so the
                          forward is bitwise autocast's. The gradients arrive in bf16, fill bf16 buckets, are
                          all-reduced in bf16 (half the bytes, no cast kernels) and only then widened, in one
                          multi-tensor pass, into the fp32 `.grad` of the parameter (overwritten; averaged in
                          fp32 where the op has no AVG). Numerics: each rank's gradient is exactly autocast's
                          bf16 gradient before widening; each of the world-1 additions of the all-reduce
                          rounds to bf16 (2 ranks: the average is within 2^-8 relative per element of the
                          fp32 mean of the same bf16 gradients; tested bitwise against R(g_0 + g_1) / 2).
                          Master weights and optimizer state stay fp32.
                          Accumulation: micro-steps under `no_sync()` take autocast's own path, so their
                          gradients accumulate in the fp32 `.grad` exactly as in one process; the synced
                          micro-step adds its bf16 gradient there and rounds the sum to bf16 once before the
                          all-reduce (so does a `.grad` not zeroed since the last step). The forward picks
                          the path (`no_sync()` around it); a backward run outside that state still ends with
                          the same gradients. One synced forward per backward: a second one refreshes the
                          leaves the first one's graph saved, and autograd raises.
                          On one rank, and without grad (evaluation), the forward is autocast's own.
                          Activation checkpointing: the recomputation runs on the fp32 parameters and casts
                          them again (as without this option); the gradients still reach the leaves.
                          Costs a persistent bf16 copy of the cast parameters (half their fp32 bytes).
                          `refresh_leaves_per_module()` moves the refresh into each owning module's forward
                          pre-hook (for ZeRO-1's overlapped parameter gathers; see there).
    """

    def __init__(self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 timer: Optional[CommTimer] = None, bucket_size_mb: float = 25.0,
                 first_bucket_size_mb: Optional[float] = 1.0, comm_dtype: Optional[str] = None,
                 compute_dtype: Optional[str] = None) -> None:
        super().__init__(module, process_group, timer)
        require(bucket_size_mb >= 0, "parallelism.bucket_size_mb", f"must be >= 0, got {bucket_size_mb}",
                "set a bucket size in MB (0: one parameter per bucket)")
        self.bucket_bytes = int(bucket_size_mb * 2**20)
        self.first_bucket_bytes = self.bucket_bytes if first_bucket_size_mb is None else \
            min(self.bucket_bytes, int(first_bucket_size_mb * 2**20))
        self.comm_dtype = parse_dtype(comm_dtype, "parallelism.comm_dtype")
        self.compute_dtype = _compute_dtype(compute_dtype)
        require(self.compute_dtype is None or self.comm_dtype in (None, self.compute_dtype), "parallelism.comm_dtype",
                f"{comm_dtype} differs from compute_dtype={compute_dtype}, whose gradients are reduced in it",
                "set parallelism.comm_dtype=null (or equal to parallelism.compute_dtype)")
        self._init_leaves()
        self._sources = [self._leaf.get(id(p), p) for p in self.params]  # whose .grad each hook sees
        self._ready_order: Optional[list[torch.Tensor]] = []  # recorded on the first synced backward
        self._launched: list[_Bucket] = []
        self._next_bucket = 0  # buckets launch in index order; this is the next one to go
        self._build_buckets(list(reversed(self._sources)))
        # A parameter's hooks live in C++ (its autograd metadata), where Python's collector cannot see them:
        # a hook holding this wrapper would keep wrapper, model and process group alive forever.
        on_grad_ready = weakref.WeakMethod(self._on_grad_ready)
        self._hooks = [s.register_post_accumulate_grad_hook(lambda s: on_grad_ready()(s)) for s in self._sources]

    def _init_leaves(self) -> None:
        """One persistent compute-dtype leaf per cast parameter, and every module slot it stands in for."""
        self._leaf: dict[int, torch.Tensor] = {}         # id(parameter) -> its leaf
        self._master: dict[int, nn.Parameter] = {}       # id(leaf) -> its parameter
        self._slots: list[tuple[nn.Module, str, torch.Tensor, nn.Parameter]] = []  # (module, name, leaf, param)
        self._device_type = self.params[0].device.type if self.params else "cpu"
        linear = _linear_params(self.module) if self.compute_dtype is not None else set()
        for p in self.params:
            if id(p) in linear and p.is_floating_point() and p.dtype != self.compute_dtype:
                leaf = torch.empty_like(p, dtype=self.compute_dtype).requires_grad_()
                self._leaf[id(p)], self._master[id(leaf)] = leaf, p
        for m in self.module.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in self._leaf:
                    self._slots.append((m, name, self._leaf[id(p)], p))
        self._leaves = list(self._leaf.values())
        self._leaf_params = [self._master[id(w)] for w in self._leaves]
        self._refresh_hooks: list[Any] = []        # per-module refresh (refresh_leaves_per_module), else empty
        self._stale: Optional[set[int]] = None     # ids of leaves not refreshed yet in this synced forward

    def refresh_leaves_per_module(self) -> None:
        """Refresh each module's leaves in a forward pre-hook of that module (one multi-tensor cast of its
        leaves not yet refreshed in this forward) instead of all of them at the start of the forward.

        For ZeRO-1 with overlapped parameter gathers (core.distributed.zero1): a parameter's new value arrives
        only when the pre-hook of the first module using it has waited for its gather, so the leaves may be
        cast only after that hook. Those hooks must run before these (register them first, or with
        `prepend=True`). Only a synced forward refreshes (the conditions of the one-shot cast); activation
        checkpointing's recomputation in backward and forwards without grad leave the leaves alone. A leaf is
        refreshed once per forward, by the first module holding it that runs; a leaf whose module does not run
        keeps its old values (read by nobody: Linear parameters are read by F.linear in their module's forward,
        which is what makes them cast parameters). Idempotent; nothing to do without cast parameters."""
        if self._refresh_hooks or not self._slots:
            return
        by_module: dict[int, tuple[nn.Module, list[tuple[torch.Tensor, nn.Parameter]]]] = {}
        for m, _, leaf, p in self._slots:
            by_module.setdefault(id(m), (m, []))[1].append((leaf, p))
        this = weakref.ref(self)  # the module must not keep the wrapper (and its process group) alive

        def hook(_m: nn.Module, _args: Any, pairs: list) -> None:
            ddp = this()
            if ddp is not None and ddp._stale is not None:
                ddp._refresh(pairs)

        for m, pairs in by_module.values():
            self._refresh_hooks.append(m.register_forward_pre_hook(
                lambda m_, a, pairs=pairs: hook(m_, a, pairs)))

    @torch.no_grad()
    def _refresh(self, pairs: list[tuple[torch.Tensor, nn.Parameter]]) -> None:
        dst, src = [], []
        for leaf, p in pairs:
            if id(leaf) in self._stale:
                self._stale.discard(id(leaf))
                dst.append(leaf)
                src.append(p)
        if dst:
            torch._foreach_copy_(dst, src)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is None or not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        dev = self._device_type
        active = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        require(active == self.compute_dtype, "parallelism.compute_dtype",
                f"bfloat16 Linear weights need bfloat16 autocast ({dev}) around the forward, found {active or 'none'}",
                "use precision=bf16, or set parallelism.compute_dtype=null")
        if self.world == 1 or not self.require_backward_grad_sync or not self._slots:
            return self.module(*args, **kwargs)  # autocast's own casts: gradients accumulate in fp32 .grad
        if self._refresh_hooks:  # each module's pre-hook casts its leaves (refresh_leaves_per_module)
            self._stale = {id(w) for w in self._leaves}
        else:
            with torch.no_grad():
                torch._foreach_copy_(self._leaves, self._leaf_params)  # one multi-tensor cast
        for m, name, leaf, _ in self._slots:
            m._parameters[name] = leaf
        try:
            return self.module(*args, **kwargs)
        finally:
            self._stale = None
            for m, name, _, p in self._slots:
                m._parameters[name] = p

    def _build_buckets(self, order: list[torch.Tensor]) -> None:
        """Fill buckets along `order` (gradient sources in ready order) with one open bucket per gradient
        dtype, device and kind (leaf or parameter), so that interleaved kinds (bf16 Linear leaves, fp32 norm
        weights) do not cut each other's buckets short. Buckets are numbered by when their last member is
        ready, the order in which they can launch. With one kind this is plain consecutive filling."""
        open_: dict[tuple, list[torch.Tensor]] = {}
        held: dict[tuple, int] = {}
        started: set[tuple] = set()  # kinds whose first (small) bucket is closed
        groups: list[tuple[bool, list[torch.Tensor]]] = []
        for s in order:
            key = (s.dtype, s.device, id(s) in self._master)
            nbytes = s.numel() * s.element_size()
            cap = self.bucket_bytes if key in started else self.first_bucket_bytes
            if key in open_ and held[key] + nbytes > cap:
                groups.append((key[2], open_.pop(key)))
                started.add(key)
            if key not in open_:
                open_[key], held[key] = [], 0
            open_[key].append(s)
            held[key] += nbytes
        groups += [(key[2], members) for key, members in open_.items()]
        position = {id(s): i for i, s in enumerate(order)}
        groups.sort(key=lambda g: position[id(g[1][-1])])
        self.buckets: list[_Bucket] = [_Bucket(members, i, cast) for i, (cast, members) in enumerate(groups)]
        self._bucket_of: dict[int, _Bucket] = {id(s): b for b in self.buckets for s in b.params}

    def _in_place(self, b: _Bucket) -> bool:
        return len(b.params) == 1 and self.comm_dtype in (None, b.params[0].dtype)

    @torch.no_grad()
    def _on_grad_ready(self, s: torch.Tensor) -> None:
        p = self._master.get(id(s))
        if not self.require_backward_grad_sync or self.world == 1:
            if p is not None:  # a leaf's forward ran synced, its backward under no_sync: keep it locally
                if p.grad is None:
                    p.grad = s.grad.to(p.dtype)
                else:
                    p.grad.add_(s.grad)
                s.grad = None
            return
        if p is not None and p.grad is not None:
            # earlier micro-steps (no_sync) accumulated in fp32 .grad, as autocast does: add this one there
            # and reduce the sum, rounded to the compute dtype once
            s.grad.copy_(p.grad.add_(s.grad))
        if self._ready_order is not None:
            self._ready_order.append(s)
        b = self._bucket_of[id(s)]
        b.remaining -= 1
        # Launch strictly in bucket order, as torch's DDP reducer does: NCCL needs every rank to issue
        # collectives in one order, and hooks may fire in a different order on different ranks.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].remaining == 0:
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    @torch.no_grad()
    def _launch(self, b: _Bucket) -> None:
        if self._in_place(b):
            g = b.params[0].grad
            if g is None:
                return
            b.work = self.timer.launched(self._all_reduce(g, async_op=True))
        else:
            dtype = self.comm_dtype or b.params[0].dtype
            if b.buffer is None or b.buffer.dtype != dtype:  # persistent: allocated once per bucket
                b.buffer = torch.empty(b.numel, dtype=dtype, device=b.params[0].device)
            dst, src = [], []
            for p, off in zip(b.params, b.offsets):
                view = b.buffer[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    dst.append(view)
                    src.append(p.grad)
                    if self.comm_dtype is None:
                        p.grad = view  # accumulation (no_sync micro-steps) goes straight into the bucket
            if dst:  # one multi-tensor kernel per bucket (casts to comm_dtype on the way)
                torch._foreach_copy_(dst, src)
            b.work = self.timer.launched(self._all_reduce(b.buffer, async_op=True))
        self._launched.append(b)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if self.world == 1 or not self.require_backward_grad_sync:
            return
        # buckets not launched yet (a parameter got no gradient this step), still in bucket order
        for b in self.buckets[self._next_bucket:]:
            if b.cast:  # a leaf without gradient whose parameter got one in no_sync micro-steps: reduce that
                for s in b.params:
                    p = self._master[id(s)]
                    if s.grad is None and p.grad is not None:
                        s.grad = p.grad.to(s.dtype)
            if b.remaining < len(b.params) or any(p.grad is not None for p in b.params):
                self._launch(b)
        self._next_bucket = 0
        dst, src = [], []  # low-precision buckets: copied back (cast) in one multi-tensor pass at the end
        widened = []       # parameter gradients written from leaves' reduced ones: averaged after the copy
        for b in self._launched:
            self.timer.wait(b.work)
            b.work = None
            if b.cast:
                for s, off in zip(b.params, b.offsets):
                    p = self._master[id(s)]
                    if p.grad is None:
                        p.grad = torch.empty_like(p)
                    dst.append(p.grad)
                    src.append(s.grad if self._in_place(b) else b.buffer[off:off + s.numel()].view_as(s))
                    widened.append(p.grad)
                continue
            if self._in_place(b):
                self._scale(b.params[0].grad)
                continue
            self._scale(b.buffer)  # no-op on NCCL (AVG in the reduction)
            for p, off in zip(b.params, b.offsets):
                view = b.buffer[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.to(p.dtype) if self.comm_dtype is not None else view
                elif p.grad.data_ptr() != view.data_ptr():
                    dst.append(p.grad)
                    src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)
        if widened and not self.avg_in_op:
            torch._foreach_div_(widened, self.world)  # in fp32, after widening: no second bf16 rounding
        for leaf in self._leaves:
            leaf.grad = None
        self._launched = []
        for b in self.buckets:
            b.remaining = len(b.params)
        if self._ready_order is not None:
            order, self._ready_order = self._ready_order, None
            seen = {id(s) for s in order}
            rest = [s for s in reversed(self._sources) if id(s) not in seen]
            index = {id(s): i for i, s in enumerate(self._sources)}
            new_order = [index[id(s)] for s in order + rest]
            # every rank takes rank 0's observed order, so bucket contents agree even if hook order differed
            box = [new_order]
            src_rank = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
            dist.broadcast_object_list(box, src=src_rank, group=self.process_group)
            new_order = box[0]
            if len(new_order) == len(self._sources) and new_order != list(reversed(range(len(self._sources)))):
                self._build_buckets([self._sources[i] for i in new_order])


class OverlapDDP(BucketedDDP):
    """One asynchronous all-reduce per parameter, launched as soon as its gradient is accumulated."""

    def __init__(self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 timer: Optional[CommTimer] = None) -> None:
        super().__init__(module, process_group, timer, bucket_size_mb=0, first_bucket_size_mb=0)


# ---- strategies (the `parallelism=` options) -----------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    while isinstance(model, DataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DataParallel) else model._orig_mod
    return model


def bucket_layout(sizes: list[int], bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Sizes (bytes) per bucket, filled along `sizes` (one gradient kind in ready order) the way
    `BucketedDDP._build_buckets` fills each kind: consecutive, the first bucket capped lower."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    for s in sizes:
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if cur and sum(cur) + s > cap:
            buckets.append(cur)
            cur = []
        cur.append(s)
    return buckets + [cur] if cur else buckets


def bucketed_all_reduce_profile(layout: ModelLayout, bucket_size_mb: float, first_bucket_size_mb: Optional[float],
                                comm_dtype: Optional[str], compute_dtype: Optional[str]) -> StrategyProfile:
    """What `BucketedDDP` holds and sends: one asynchronous all-reduce per bucket during backward, a flat
    buffer per bucket of several gradients, and (compute_dtype) bf16 Linear copies whose gradients travel in
    bf16. Before the first step records the ready order, buckets follow reverse registration order."""
    cap = int(bucket_size_mb * 2**20)
    first = cap if first_bucket_size_mb is None else min(cap, int(first_bucket_size_mb * 2**20))
    wire = dtype_bytes(comm_dtype, "parallelism.comm_dtype")
    if compute_dtype is not None:  # two gradient kinds, bucketed separately: bf16 Linear leaves and fp32 rest
        ready = list(zip(reversed(layout.tensors), reversed(layout.is_linear)))
        kinds = [[2 * n for n, linear in ready if linear], [4 * n for n, linear in ready if not linear]]
    else:
        kinds = [[4 * n for n in reversed(layout.tensors)]]
    # buckets fill by the gradients' own bytes; a bf16 comm_dtype halves what travels (and its buffers)
    scale = wire / 4 if compute_dtype is None else 1
    buckets = [[int(n * scale) for n in b] for sizes in kinds for b in bucket_layout(sizes, cap, first)]
    flat = sum(sum(b) for b in buckets if len(b) > 1 or scale != 1)  # comm_dtype casts every bucket into a buffer
    return StrategyProfile(
        collectives=(CollectiveSpec("all_reduce", "gradients", sum(map(sum, buckets)), len(buckets),
                                    overlappable=True),),
        comm_buffer_bytes=flat,
        compute_copy_bytes=2 * sum(layout.linear_weights) if compute_dtype is not None else 0,
        autocast_weight_copies=compute_dtype is None)


class DDPStrategy(Strategy):
    """Replicated parameters, gradients averaged by one of the wrappers above."""

    name = "ddp"
    data_parallel = True
    supports_expert_parallel = True
    wrapper_cls: type[DataParallel] = BucketedDDP

    def __init__(self, **wrapper_kwargs: Any) -> None:
        self.wrapper_kwargs = wrapper_kwargs

    def profile(self, mesh: ParallelMesh, layout: ModelLayout, grad_accum: int) -> StrategyProfile:
        if axes_degree(mesh, DP_AXES) == 1:
            return StrategyProfile()
        return self._profile(layout)

    def _profile(self, layout: ModelLayout) -> StrategyProfile:
        kw = {"bucket_size_mb": 25.0, "first_bucket_size_mb": 1.0, "comm_dtype": None, "compute_dtype": None,
              **self.wrapper_kwargs}
        return bucketed_all_reduce_profile(layout, kw["bucket_size_mb"], kw["first_bucket_size_mb"],
                                           kw["comm_dtype"], kw["compute_dtype"])

    def setup(self, model: nn.Module, mesh: ParallelMesh, init_fn) -> nn.Module:
        self.mesh = mesh
        model = materialize(model, mesh.device_obj, init_fn)
        self.timer = CommTimer(mesh.device_obj)
        self.wrapped = self.wrapper_cls(model, process_group=mesh.group("dp"), timer=self.timer,
                                        **self.wrapper_kwargs)
        return self.wrapped

    def gradient_sync(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.wrapped.no_sync()

    def finish_gradient_synchronization(self) -> None:
        self.wrapped.finish_gradient_synchronization()

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def full_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in unwrap(model).named_parameters()}

    def step_metrics(self) -> dict[str, float]:
        return self.timer.metrics()


class DDPNaiveStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_naive", NaiveDDP

    def _profile(self, layout: ModelLayout) -> StrategyProfile:  # one blocking all-reduce per gradient
        return StrategyProfile(collectives=(CollectiveSpec("all_reduce", "gradients", 4 * layout.numel,
                                                           len(layout.tensors)),))


class DDPFlatStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_flat", FlatDDP

    def _profile(self, layout: ModelLayout) -> StrategyProfile:
        # one all-reduce of a flat copy of every gradient: the copy exists at the end of backward, and
        # flattening and unflattening read and write every gradient twice
        return StrategyProfile(collectives=(CollectiveSpec("all_reduce", "gradients", 4 * layout.numel, 1),),
                               backward_transient_bytes=4 * layout.numel, copy_bytes_per_step=16 * layout.numel)


class DDPOverlapStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_overlap", OverlapDDP

    def _profile(self, layout: ModelLayout) -> StrategyProfile:  # one bucket per gradient, reduced in place
        return bucketed_all_reduce_profile(layout, 0.0, 0.0, None, None)


class DDPBucketedStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_bucketed", BucketedDDP
