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
from core.distributed.strategy import Strategy, materialize
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
        self.params = unique_trainable(module)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.timer = timer if timer is not None else CommTimer(device, enabled=False)
        self.require_backward_grad_sync = True
        broadcast_module(module, process_group)

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
    __slots__ = ("params", "offsets", "numel", "buffer", "remaining", "work", "index")

    def __init__(self, params: list[nn.Parameter], index: int) -> None:
        self.params = params
        self.index = index
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.buffer: Optional[torch.Tensor] = None
        self.remaining = len(params)
        self.work = None


class BucketedDDP(DataParallel):
    """Asynchronous all-reduce of gradient buckets launched from post-accumulate-grad hooks.

    bucket_size_mb        bucket capacity (a larger parameter gets a bucket of its own, reduced in place)
    first_bucket_size_mb  capacity of the first bucket to become ready, kept small so communication
                          starts early in backward
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
    """

    def __init__(self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 timer: Optional[CommTimer] = None, bucket_size_mb: float = 25.0,
                 first_bucket_size_mb: Optional[float] = 1.0, comm_dtype: Optional[str] = None) -> None:
        super().__init__(module, process_group, timer)
        require(bucket_size_mb >= 0, "parallelism.bucket_size_mb", f"must be >= 0, got {bucket_size_mb}",
                "set a bucket size in MB (0: one parameter per bucket)")
        self.bucket_bytes = int(bucket_size_mb * 2**20)
        self.first_bucket_bytes = self.bucket_bytes if first_bucket_size_mb is None else \
            min(self.bucket_bytes, int(first_bucket_size_mb * 2**20))
        self.comm_dtype = getattr(torch, comm_dtype) if isinstance(comm_dtype, str) else comm_dtype
        self._ready_order: Optional[list[nn.Parameter]] = []  # recorded on the first synced backward
        self._launched: list[_Bucket] = []
        self._next_bucket = 0  # buckets launch in index order; this is the next one to go
        self._build_buckets(list(reversed(self.params)))
        # A parameter's hooks live in C++ (its autograd metadata), where Python's collector cannot see them:
        # a hook holding this wrapper would keep wrapper, model and process group alive forever.
        on_grad_ready = weakref.WeakMethod(self._on_grad_ready)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p: on_grad_ready()(p)) for p in self.params]

    def _build_buckets(self, order: list[nn.Parameter]) -> None:
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        cur: list[nn.Parameter] = []
        cur_bytes = 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            cap = self.first_bucket_bytes if not self.buckets else self.bucket_bytes
            if cur and (cur_bytes + nbytes > cap or p.dtype != cur[0].dtype or p.device != cur[0].device):
                self.buckets.append(_Bucket(cur, len(self.buckets)))
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += nbytes
        if cur:
            self.buckets.append(_Bucket(cur, len(self.buckets)))
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b

    def _in_place(self, b: _Bucket) -> bool:
        return len(b.params) == 1 and self.comm_dtype in (None, b.params[0].dtype)

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_backward_grad_sync or self.world == 1:
            return
        if self._ready_order is not None:
            self._ready_order.append(p)
        b = self._bucket_of[id(p)]
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
            if b.remaining < len(b.params) or any(p.grad is not None for p in b.params):
                self._launch(b)
        self._next_bucket = 0
        dst, src = [], []  # low-precision buckets: copied back (cast) in one multi-tensor pass at the end
        for b in self._launched:
            self.timer.wait(b.work)
            b.work = None
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
        self._launched = []
        for b in self.buckets:
            b.remaining = len(b.params)
        if self._ready_order is not None:
            order, self._ready_order = self._ready_order, None
            seen = {id(p) for p in order}
            rest = [p for p in reversed(self.params) if id(p) not in seen]
            index = {id(p): i for i, p in enumerate(self.params)}
            new_order = [index[id(p)] for p in order + rest]
            # every rank takes rank 0's observed order, so bucket contents agree even if hook order differed
            box = [new_order]
            src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
            dist.broadcast_object_list(box, src=src, group=self.process_group)
            new_order = box[0]
            if len(new_order) == len(self.params) and new_order != list(reversed(range(len(self.params)))):
                self._build_buckets([self.params[i] for i in new_order])


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


def require_pure_dp(mesh: ParallelMesh, strategy: str) -> None:
    for axis in ("pp", "cp", "tp"):
        require(getattr(mesh, axis) == 1, f"mesh.{axis}", f"parallelism={strategy} is data-parallel only",
                f"set mesh.{axis}=1 (or choose a strategy that supports {axis})")


class DDPStrategy(Strategy):
    """Replicated parameters, gradients averaged by one of the wrappers above."""

    name = "ddp"
    wrapper_cls: type[DataParallel] = BucketedDDP

    def __init__(self, **wrapper_kwargs: Any) -> None:
        self.wrapper_kwargs = wrapper_kwargs

    def validate(self, mesh: ParallelMesh) -> None:
        require_pure_dp(mesh, self.name)

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


class DDPFlatStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_flat", FlatDDP


class DDPOverlapStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_overlap", OverlapDDP


class DDPBucketedStrategy(DDPStrategy):
    name, wrapper_cls = "ddp_bucketed", BucketedDDP
