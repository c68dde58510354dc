"""The one parallelize step: every way of splitting the model is applied here, in one fixed order.

    model built on the meta device (no memory)
    1. tensor / sequence parallelism over mesh.tp       (the `tensor_parallel` plugin, shards in place)
    1b. pipeline split over mesh.pp                       (the `pipeline` plugin: this rank's stage only)
    1c. context parallelism over mesh.cp                 (the `context_parallel` plugin: ring attention, RoPE slices)
    1d. expert parallelism over mesh.ep                  (the `expert_parallel` plugin: this rank's experts only)
    2. activation checkpointing                           (marks blocks)
    3. torch.compile                                      (in place: parameter names stay the eager model's)
    4. the data-parallel wrap                             (the `parallelism` strategy: DDP family, ZeRO-1, FSDP, ...)
       which materialises this rank's shards and initialises them from the run's seed

Nothing is allocated before step 4, and then only this rank's parts: `TransformerLM.init_weights_each` draws each
full weight from the seed, one at a time, and keeps the rank's slice (tensor-parallel and, under fsdp /
torch_fsdp2, data-parallel shards), so every mesh shape starts from the weights one process would have
(torchtitan's order; our code). The replicating strategies hold the whole (tensor-parallel part of the) model.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from core import activation_checkpointing
from core.distributed.context_parallel import ContextParallel
from core.distributed.expert_parallel import ExpertParallel
from core.distributed.mesh import ParallelMesh
from core.distributed.pipeline import PipelineParallel
from core.distributed.strategy import Strategy
from core.distributed.tensor_parallel import TensorParallel
from core.model import TransformerLM


@dataclass
class Parallelized:
    """What the step returns: the module the trainer calls and what the step marked on the way."""

    module: nn.Module          # the strategy's wrapper (or the model itself)
    checkpointed_blocks: int   # blocks whose activations are recomputed in backward


def parallelize(model: TransformerLM, mesh: ParallelMesh, tensor_parallel: TensorParallel, strategy: Strategy,
                checkpoint_every: int, compile_model: bool, seed: int,
                pipeline: PipelineParallel | None = None,
                context_parallel: ContextParallel | None = None,
                expert_parallel: ExpertParallel | None = None) -> Parallelized:
    """Apply every parallelism to a meta-device `model` on an initialised `mesh`, in the order above."""
    tensor_parallel.apply(model, mesh)
    if pipeline is not None:
        pipeline.apply(model, mesh, tensor_parallel)
    if context_parallel is not None:
        context_parallel.apply(model, mesh)
    if expert_parallel is not None:
        expert_parallel.apply(model, mesh)
    checkpointed = activation_checkpointing.apply(model, checkpoint_every)
    if compile_model:
        model.compile()
    module = strategy.setup(model, mesh, functools.partial(TransformerLM.init_weights_each, seed=seed))
    return Parallelized(module, checkpointed)
