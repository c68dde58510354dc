"""The seam between the trainer and a parallelism scheme.

A `Strategy` takes the model (built on the meta device), materialises and wraps it,
builds the optimizer, synchronises gradients and owns checkpoint state. The trainer
calls only the methods below, in this order each step:

    for each micro-step:
        with strategy.gradient_sync(is_last_microstep): forward, backward
    strategy.finish_gradient_synchronization()
    grad_norm = strategy.clip_grad_norm_(model, max_norm)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
    metrics.update(strategy.step_metrics())

Each strategy also describes itself, without a process group, through `profile(mesh, layout, grad_accum)`:
which of parameters / gradients / optimizer state it shards over which mesh axes, which collectives it
issues per optimizer step and with how many bytes, and the buffers it keeps. The planner (core/planner.py)
costs that description; it keeps no table of its own about what a strategy is.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Literal

import torch
import torch.distributed as dist
from torch import nn

from core.distributed.mesh import ParallelMesh
from core.errors import require

OptimizerFactory = Callable[[Iterable[dict[str, Any]]], torch.optim.Optimizer]
# init_fn(model) initialises a materialised model in place from the run's seed; init_fn(model, init_weight=f)
# hands each Linear/Embedding weight to f(module, draw) instead (`TransformerLM.init_weights_each`), so a sharding
# strategy can draw one full weight at a time and keep its shard
ModelInit = Callable[..., None]


DP_AXES = ("dp_replicate", "dp_shard")  # the flattened "dp" group of `ParallelMesh`


@dataclass(frozen=True)
class ModelLayout:
    """The parameter sizes a strategy's profile depends on (numel, not bytes)."""

    tensors: tuple[int, ...]         # every trainable parameter, registration order, tied ones once
    is_linear: tuple[bool, ...]      # per tensor: an nn.Linear weight (what autocast / compute_dtype casts)
    n_blocks: int                    # transformer blocks (FSDP's units)
    block_params: int                # parameters of one block
    embedding: int                   # parameters of the token embedding

    @property
    def numel(self) -> int:
        return sum(self.tensors)

    @property
    def linear_weights(self) -> tuple[int, ...]:
        return tuple(n for n, linear in zip(self.tensors, self.is_linear) if linear)

    def split_over_tp(self, tp: int) -> "ModelLayout":
        """One tensor-parallel rank's layout: every Linear weight and the embedding split tp ways (heads, hidden
        units, vocabulary), the norms whole."""
        if tp == 1:
            return self
        tensors = tuple(n // tp if linear or (i == 0 and n == self.embedding) else n
                        for i, (n, linear) in enumerate(zip(self.tensors, self.is_linear)))
        norms = 0
        if self.n_blocks:  # a block's non-Linear parameters (its norms): all but its share of the Linears
            block_linear = (sum(self.linear_weights) - self.tensors[-1]) // self.n_blocks  # less the LM head
            norms = self.block_params - block_linear
        block = (self.block_params - norms) // tp + norms
        return ModelLayout(tensors, self.is_linear, self.n_blocks, block, self.embedding // tp)

    @classmethod
    def of(cls, model: nn.Module) -> "ModelLayout":
        """The layout of a `TransformerLM` (a meta-device one costs no memory)."""
        linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        seen: set[int] = set()
        params = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        # a pipeline stage's blocks: those it holds (the others are parameter-less stand-ins)
        blocks = [b for b in getattr(model, "blocks", []) if any(True for _ in b.parameters())]
        return cls(tuple(p.numel() for p in params), tuple(id(p) in linear for p in params), len(blocks),
                   sum(p.numel() for p in blocks[0].parameters()) if blocks else 0,
                   model.token_embeddings.weight.numel() if hasattr(model, "token_embeddings") else 0)


@dataclass(frozen=True)
class CollectiveSpec:
    """One kind of collective a strategy issues every optimizer step."""

    name: str                        # all_reduce | reduce_scatter | all_gather
    what: str                        # gradients | parameters
    bytes_per_step: int              # summed over calls; all-gather / reduce-scatter count the full, unsharded size
    calls: int                       # per optimizer step
    axes: tuple[str, ...] = DP_AXES  # the mesh axes whose ranks take part
    overlappable: bool = False       # launched while compute runs (backward hooks, prefetched gathers)


@dataclass(frozen=True)
class StrategyProfile:
    """What one rank of a strategy holds and sends: the strategy's own answer to the planner.

    Sharded-over fields name mesh axes; a state is split over the product of their degrees (empty: replicated).
    Byte fields are per rank."""

    params_sharded_over: tuple[str, ...] = ()
    grads_sharded_over: tuple[str, ...] = ()
    optimizer_sharded_over: tuple[str, ...] = ()
    collectives: tuple[CollectiveSpec, ...] = ()
    comm_buffer_bytes: int = 0          # persistent communication buffers (gradient buckets)
    grads_in_comm_buffer: bool = False  # `.grad` are views into those buffers (counted once)
    compute_copy_bytes: int = 0         # persistent low-precision copies of the Linear weights (compute_dtype)
    gathered_param_bytes: int = 0       # unsharded parameters in flight during forward / backward
    backward_transient_bytes: int = 0   # full-size gradients or flat copies alive at the end of backward
    step_transient_bytes: int = 0       # buffers of the optimizer step (ZeRO's parameter all-gather rounds)
    copy_bytes_per_step: int = 0        # extra memory traffic: flattening gradients into flat buffers and back
    autocast_weight_copies: bool = True  # False: the forward already runs on low-precision weights

    def shard_degree(self, mesh: ParallelMesh, state: str) -> int:
        """How many ways `state` (params | grads | optimizer) is split on `mesh`."""
        return axes_degree(mesh, getattr(self, f"{state}_sharded_over"))


def axes_degree(mesh: ParallelMesh, axes: tuple[str, ...]) -> int:
    """Ranks in one group spanning `axes` of `mesh` (the product of their degrees)."""
    n = 1
    for axis in axes:
        n *= getattr(mesh, axis)
    if "dp_shard" in axes and "cp" not in axes:  # the strategies' 'dp' group spans cp too (mesh.py)
        n *= mesh.cp
    return n


def materialize(model: nn.Module, device: torch.device, init_fn: ModelInit) -> nn.Module:
    """Move a meta-device model to `device` and initialise it with `init_fn` (a seeded init): every rank holds
    the whole model (the replicating strategies; the sharding ones allocate only their shards)."""
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
        init_fn(model)
    else:
        model.to(device)
    return model


class Strategy:
    """Single-process training (`parallelism=none`): no communication at all.

    Subclasses override what they change; every method here is the correct behaviour
    for one rank holding everything.
    """

    name: str = "none"
    data_parallel: bool = False  # replicas synchronised over the mesh's dp axes (else one rank only)
    checkpoint_format: Literal["full", "dcp"] = "full"  # full: rank 0 torch.save; dcp: torch.distributed.checkpoint
    supports_activation_checkpointing: bool = True
    # runs with expert parallelism: leaves the parameters `expert_sharded_parameters` names out of its data-parallel
    # broadcast and gradient sync (`core.distributed.expert_parallel` averages them over the ranks holding them)
    supports_expert_parallel: bool = False

    def validate(self, mesh: ParallelMesh) -> None:
        """Raise `ConfigError` if this strategy cannot run on `mesh` (called before any process starts)."""
        if self.data_parallel:
            return
        require(mesh.dp_size == 1, "parallelism",
                f"parallelism={self.name} keeps independent replicas, but mesh {mesh.describe()} has "
                f"{mesh.dp_size} data-parallel ranks",
                "choose a data-parallel strategy (e.g. parallelism=ddp_bucketed) or mesh.dp_shard=1")

    def profile(self, mesh: ParallelMesh, layout: ModelLayout, grad_accum: int) -> StrategyProfile:
        """What this strategy holds and sends per rank on `mesh` (no process group needed)."""
        return StrategyProfile()

    def setup(self, model: nn.Module, mesh: ParallelMesh, init_fn: ModelInit) -> nn.Module:
        """Materialise, shard or wrap the model; return the module the trainer calls."""
        self.mesh = mesh
        return materialize(model, mesh.device_obj, init_fn)

    def build_optimizer(self, model: nn.Module, param_groups: list[dict[str, Any]],
                        make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        return make_optimizer(param_groups)

    def gradient_sync(self, enabled: bool) -> ContextManager:
        """Context around one micro-step's forward+backward; `enabled` is False on all but the last."""
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        """Block until every gradient is synchronised (all-reduced / reduce-scattered)."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients to `max_norm` (inf: just measure) and return the global norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros(())
        experts = expert_sharded_parameters(model)
        if self.mesh.tp == 1 and self.mesh.pp == 1 and not experts:
            return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        sharded = tp_sharded_parameters(model)
        # under pipeline parallelism each stage holds other parameters: their squares are summed over pp
        return clip_grads_([p.grad for p in params], [id(p) in sharded for p in params], max_norm,
                           self.mesh.group("tp"), None, self.mesh.tp,
                           pp_group=self.mesh.group("pp") if self.mesh.pp > 1 else None,
                           expert=[id(p) in experts for p in params], ep_group=expert_group(model))

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Model and optimizer state to checkpoint (see `checkpoint_format`)."""
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def full_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded parameters by name (for tests and exports); collective under sharding."""
        return {n: p.detach() for n, p in model.named_parameters()}

    def step_metrics(self) -> dict[str, float]:
        """Per-step numbers this strategy measures (communication time, exposed part, ...)."""
        return {}

    def measure_communication(self, enabled: bool) -> None:
        """Time the collectives of the steps that follow, or not.

        Timing keeps every NCCL work, and with it the tensors the collective used (gradients, gathered
        weights), until `step_metrics()` reads the durations: left on across steps it would hold last step's
        gradients while the next backward allocates new ones. The trainer turns it on for the steps it
        logs (and reads them at the end of each), and off for all others."""
        timer = getattr(self, "timer", None)
        if timer is None:
            return
        if enabled and not timer.enabled:
            timer.reset()
        timer.enabled = enabled

    def memory_breakdown(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return memory_breakdown(model.parameters(), optimizer)


def tp_sharded_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of `model` that are one rank's part of a weight split over tp: those of our split
    modules (they carry `shard_of_full`) and DTensors with a Shard placement."""
    out = {id(m.weight) for m in model.modules() if hasattr(m, "shard_of_full")}
    for p in model.parameters():
        placements = getattr(p, "placements", None)
        if placements is not None and any(pl.is_shard() for pl in placements):
            out.add(id(p))
    return out


def expert_sharded_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of `model` that hold one expert-parallel rank's experts: the routed experts of MoE
    layers given a `dispatcher` (`core.distributed.expert_parallel`)."""
    return {id(p) for m in model.modules() if getattr(m, "dispatcher", None) is not None
            for p in m.expert_parameters()}


def expert_group(model: nn.Module):
    """The expert-parallel process group of `model`'s MoE layers (None without expert parallelism)."""
    return next((m.dispatcher.group for m in model.modules() if getattr(m, "dispatcher", None) is not None), None)


def clip_grads_(grads: list[torch.Tensor], tp_sharded: list[bool], max_norm: float, tp_group, dp_group,
                tp: int, pp_group=None, expert: list[bool] | None = None, ep_group=None) -> torch.Tensor:
    """Clip `grads` in place to a global norm of `max_norm` (<= 0 or inf: only measure); return the norm.

    `grads` are this rank's parts: a tp-sharded gradient is one of tp disjoint parts of its weight, any other is
    the same on every tp rank, so it counts 1/tp on each before the squares are summed over the tp group.
    With `dp_group`, the gradients are also disjoint parts over the data-parallel ranks (ZeRO / FSDP shards);
    with `pp_group`, over the pipeline stages (each holds its own blocks). Those flagged `expert` are disjoint parts
    over `ep_group` (each rank's experts) and the same on the other data-parallel ranks: summed over ep only."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), device=device, dtype=torch.float32)
    esq = torch.zeros((), device=device, dtype=torch.float32)
    for g, sharded, is_expert in zip(local, tp_sharded, expert or [False] * len(local)):
        part = g.detach().float().pow(2).sum()
        if is_expert:
            esq += part
        else:
            sq += part if sharded else part / tp
    if ep_group is not None:
        dist.all_reduce(esq, group=ep_group)
    if tp > 1:
        dist.all_reduce(sq, group=tp_group)
    if dp_group is not None:
        dist.all_reduce(sq, group=dp_group)
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    norm = (sq + esq).sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))
    return norm


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor counts its local shard
        if local.data_ptr() not in seen:
            seen.add(local.data_ptr())
            total += local.numel() * local.element_size()
    return total


def memory_breakdown(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held on this rank (shared storage counted once)."""
    params = list(params)
    state_tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": _tensor_bytes(params),
        "grad_bytes": _tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state_bytes": _tensor_bytes(state_tensors),
    }
