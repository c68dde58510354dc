"""PyTorch's own data parallelism as baselines: DistributedDataParallel and FSDP2 `fully_shard`.

torch_ddp    DDP with 25 MB buckets, gradients as bucket views (no copy back), `static_graph`
             off (our models may change), broadcast of rank 0's parameters at construction.
torch_fsdp2  `fully_shard` per TransformerBlock and then the root, reshard after forward (not under pp), bf16
             `param_dtype` / fp32 `reduce_dtype` when `compute_dtype` is set (what the reference
             measured); checkpoints through torch.distributed.checkpoint's state_dict helpers.
             A meta-device model is sharded first and then materialised (`to_empty` allocates only the local
             shards) and initialised: each weight is drawn whole into a transient tensor, one at a time, and this
             rank's chunk kept (`core.model.part_of_full`; over tensor-parallel DTensors, FSDP2's chunk of this
             rank's TP part: each rank allocates only its dp x tp shard).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from core.distributed.comm import broadcast_module, init_optimizer_state
from core.distributed.ddp import bucket_layout, unwrap
from core.distributed.mesh import ParallelMesh
from core.distributed.strategy import (DP_AXES, CollectiveSpec, ModelInit, ModelLayout, Strategy, StrategyProfile,
                                       axes_degree, clip_grads_, materialize)
from core.dtypes import parse_dtype


class TorchDDPStrategy(Strategy):
    name = "torch_ddp"
    data_parallel = True

    def __init__(self, bucket_cap_mb: float = 25.0, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False) -> None:
        self.kwargs = dict(bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
                           static_graph=static_graph)

    def profile(self, mesh: ParallelMesh, layout: ModelLayout, grad_accum: int) -> StrategyProfile:
        if axes_degree(mesh, DP_AXES) == 1:
            return StrategyProfile()
        cap = int(self.kwargs["bucket_cap_mb"] * 2**20)
        # torch's Reducer: buckets in reverse registration order, the first one 1 MiB
        buckets = bucket_layout([4 * n for n in reversed(layout.tensors)], cap, min(cap, 2**20))
        return StrategyProfile(
            collectives=(CollectiveSpec("all_reduce", "gradients", 4 * layout.numel, len(buckets),
                                        overlappable=True),),
            comm_buffer_bytes=4 * layout.numel,  # every bucket allocated at wrap time and kept
            grads_in_comm_buffer=bool(self.kwargs["gradient_as_bucket_view"]))

    def setup(self, model: nn.Module, mesh: ParallelMesh, init_fn) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.mesh = mesh
        model = materialize(model, mesh.device_obj, init_fn)
        pg = mesh.group("dp")
        if pg is None:
            self.wrapped = model
            return model
        dev = mesh.device_obj
        self.wrapped = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, process_group=pg,
                           broadcast_buffers=False, **self.kwargs)
        return self.wrapped

    def gradient_sync(self, enabled: bool):
        if not hasattr(self.wrapped, "no_sync"):
            return contextlib.nullcontext()
        if self.mesh.pp > 1 and enabled:
            return self._armed()
        return contextlib.nullcontext() if enabled else self.wrapped.no_sync()

    @contextlib.contextmanager
    def _armed(self):
        """Under pipeline parallelism: the step's last backward, whose forward ran long before (under no_sync, as
        every forward of a pipeline does: DDP arms its reducer in a synced forward and expects that forward's
        backward next). Arm the reducer here, as torch.distributed.pipelining's stages do, so this backward's
        hooks all-reduce the buckets, the gradients of the earlier micro-batches included."""
        self.wrapped.reducer.prepare_for_backward([])
        self._reduced = True
        yield

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Under pipeline parallelism, a step whose schedule never armed the reducer (torch's schedules run our
        stage wrapper, not the DDP module, so they cannot drive it) gets its gradients averaged over dp here: one
        flat all-reduce per dtype."""
        if self.mesh.pp == 1 or not hasattr(self.wrapped, "no_sync"):
            return
        if getattr(self, "_reduced", False):
            self._reduced = False
            return
        group = self.mesh.group("dp")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.wrapped.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat.div_(self.mesh.dp_size)
            for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(s)

    def state_dict(self, model, optimizer):
        return {"model": _inner(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model, optimizer, state):
        _inner(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def full_parameters(self, model):
        return {n: p.detach() for n, p in _inner(model).named_parameters()}


def _inner(model: nn.Module) -> nn.Module:
    model = unwrap(model)
    return model.module if hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel) \
        else model


class TorchFSDP2Strategy(Strategy):
    name = "torch_fsdp2"
    data_parallel = True
    checkpoint_format = "dcp"

    def __init__(self, compute_dtype: Any = None, reduce_dtype: Any = "float32",
                 reshard_after_forward: bool = True) -> None:
        self.compute_dtype = parse_dtype(compute_dtype, "parallelism.compute_dtype")
        self.reduce_dtype = parse_dtype(reduce_dtype, "parallelism.reduce_dtype")
        self.reshard_after_forward = reshard_after_forward

    def profile(self, mesh: ParallelMesh, layout: ModelLayout, grad_accum: int) -> StrategyProfile:
        if axes_degree(mesh, DP_AXES) == 1:
            return StrategyProfile()
        # fully_shard on the 2-D (dp_replicate, dp_shard) mesh is HSDP: parameters, gradients and optimizer
        # state are sharded over dp_shard only and replicated over dp_replicate
        shard_axes = ("dp_shard",)
        shards = mesh.dp_shard
        low = (torch.bfloat16, torch.float16)
        gathered = 2 if self.compute_dtype in low else 4
        reduced = 2 if self.reduce_dtype in low else 4
        units = layout.n_blocks + 1  # fully_shard per block, then the root (embedding, final norm, lm_head)
        colls = []
        if shards > 1 and mesh.pp > 1:  # a pipeline stage: gathered once, held for the step, reduced once
            colls += [CollectiveSpec("all_gather", "parameters", gathered * layout.numel, units, axes=shard_axes,
                                     overlappable=True),
                      CollectiveSpec("reduce_scatter", "gradients", reduced * layout.numel, units, axes=shard_axes,
                                     overlappable=True)]
        elif shards > 1:
            colls += [CollectiveSpec("all_gather", "parameters", 2 * gathered * layout.numel * grad_accum,
                                     2 * units * grad_accum, axes=shard_axes, overlappable=True),
                      CollectiveSpec("reduce_scatter", "gradients", reduced * layout.numel, units, axes=shard_axes,
                                     overlappable=True)]
        if mesh.dp_replicate > 1:  # the sharded gradients are then all-reduced across the replicas
            colls.append(CollectiveSpec("all_reduce", "gradients", reduced * -(-layout.numel // shards), units,
                                        axes=("dp_replicate",), overlappable=True))
        return StrategyProfile(
            params_sharded_over=shard_axes, grads_sharded_over=shard_axes, optimizer_sharded_over=shard_axes,
            collectives=tuple(colls),
            # the running and the prefetched block, plus the root's embedding and lm_head; a pipeline stage holds
            # all its weights unsharded and their accumulated full-size gradients (reduce dtype) for the step
            gathered_param_bytes=0 if shards == 1 else gathered * layout.numel if mesh.pp > 1 else
            gathered * (2 * layout.block_params + 2 * layout.embedding),
            backward_transient_bytes=0 if shards == 1 else reduced * layout.numel if mesh.pp > 1 else
            4 * 2 * layout.block_params,
            autocast_weight_copies=self.compute_dtype not in low)

    def setup(self, model: nn.Module, mesh: ParallelMesh, init_fn: ModelInit) -> nn.Module:
        """`fully_shard` the blocks and the root; a meta-device model is sharded before it is materialised."""
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

        self.mesh = mesh
        if mesh.world_size == 1:
            self.wrapped = materialize(model, mesh.device_obj, init_fn)
            return self.wrapped
        shard_first = any(p.is_meta for p in model.parameters())
        if not shard_first:
            model = materialize(model, mesh.device_obj, init_fn)  # identical init on every rank (seeded)
            broadcast_module(model, mesh.group("dp"))
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)
        dm = mesh.submesh("dp")
        if mesh.dp_replicate > 1:
            dm = mesh.device_mesh[("dp_replicate", "dp_shard")]
        self._shard_group = dm["dp_shard"].get_group() if dm.ndim > 1 else dm.get_group()
        # under pipeline parallelism a stage runs up to m forwards before their backwards: resharding after each
        # forward would all-gather every weight again in each backward and each forward (2m per step instead of
        # 1). Like torchtitan under pp, keep the stage's weights gathered for the step (1/pp of the model)
        reshard = self.reshard_after_forward and mesh.pp == 1
        blocks = getattr(model, "blocks", None)
        for block in (blocks if blocks is not None else []):
            fully_shard(block, mesh=dm, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=dm, mp_policy=mp, reshard_after_forward=reshard)
        if shard_first:
            model.to_empty(device=mesh.device_obj)  # only this rank's shards (FSDP2 re-registers them)
            init_fn(model)  # each weight drawn whole, one at a time, and chunked to this rank's shard
        self.wrapped = model
        return model

    def gradient_sync(self, enabled: bool):
        """Off: the backward accumulates unsharded gradients (reduce dtype) and skips the reduce-scatter. Under
        pipeline parallelism (every forward and every backward but the step's last run with it off) also: the
        weights stay gathered after such a backward, and FSDP2's end-of-backward bookkeeping (waiting for the
        reductions, resetting its prefetch state) waits for the step's last backward (`set_is_last_backward`),
        which then reduce-scatters each weight's accumulated gradient once and reshards (what
        torch.distributed.pipelining's stage sets for an FSDP module)."""
        w = self.wrapped
        if hasattr(w, "set_requires_gradient_sync"):
            w.set_requires_gradient_sync(enabled)
            if self.mesh.pp > 1:
                if hasattr(w, "set_is_last_backward"):
                    w.set_is_last_backward(enabled)
                if hasattr(w, "set_reshard_after_backward"):
                    w.set_reshard_after_backward(enabled)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in self.wrapped.parameters() if p.grad is not None]
        if self.mesh.pp > 1:
            # each stage holds other weights: their local shards' squares summed over dp_shard and over pp (no
            # tensor parallelism composes with torch_fsdp2 under pp)
            return clip_grads_([p.grad for p in params], [True] * len(params), max_norm, None,
                               self._shard_group, 1, pp_group=self.mesh.group("pp"))
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def state_dict(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.mesh.world_size == 1:
            return super().state_dict(model, optimizer)
        init_optimizer_state(optimizer)
        return {"model": get_model_state_dict(self.wrapped), "optimizer": get_optimizer_state_dict(self.wrapped, optimizer)}

    def load_state_dict(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if self.mesh.world_size == 1:
            return super().load_state_dict(model, optimizer, state)
        set_model_state_dict(self.wrapped, state["model"])
        set_optimizer_state_dict(self.wrapped, optimizer, state["optimizer"])

    def full_parameters(self, model):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for n, p in self.wrapped.named_parameters()}

    def memory_breakdown(self, model, optimizer):
        # DTensors: count each rank's local shard (the base helper dedups by data_ptr, which DTensors share)
        def nbytes(ts):
            total = 0
            for t in ts:
                t = t.to_local() if hasattr(t, "to_local") else t
                total += t.numel() * t.element_size()
            return total

        params = list(self.wrapped.parameters())
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return {"param_bytes": nbytes(params), "grad_bytes": nbytes(p.grad for p in params if p.grad is not None),
                "optimizer_state_bytes": nbytes(state)}
