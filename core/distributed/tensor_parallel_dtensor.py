"""PyTorch's tensor parallelism (DTensor `parallelize_module`), the baseline beside our Megatron version.

The same split as `core.distributed.tensor_parallel.MegatronTensorParallel`, expressed as DTensor plans:
colwise qkv / w1 / w3 / LM head, rowwise output_proj / w2 / embedding, `SequenceParallel` norms with
`PrepareModuleInput` gathering the sequence into each region, and `loss_parallel` for the cross-entropy on
vocabulary-sharded logits.

The fused qkv projection is one weight whose rows are [q heads | k heads | v heads]; a plain `Shard(0)` would
hand rank 0 all of q. Its DTensor is therefore laid out rank-major, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: the
seeded init draws the weight in the model's order and reorders it (`_rank_major_qkv`), so the computation equals
the unsplit model's. Checkpoints of this baseline store that order.
"""
from __future__ import annotations

from typing import ContextManager

import torch
from torch import Tensor, nn

from core.distributed.mesh import ParallelMesh
from core.distributed.tensor_parallel import TensorParallel, _rank_slices


class DTensorTensorParallel(TensorParallel):
    """`torch.distributed.tensor.parallel.parallelize_module` plans for the Transformer (torchtitan's layout)."""

    name = "dtensor"
    composes_with = ("none", "torch_fsdp2")
    checkpoints_with = ("torch_fsdp2",)  # its DCP state dicts carry the DTensor placements of both axes

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> None:
        super().apply(model, mesh)
        if not self.active:
            return
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        tp_mesh = mesh.submesh("tp")
        sp = self.sequence_parallel
        stream = Shard(1) if sp else Replicate()  # layout of the residual stream between regions
        root_plan = {
            "token_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
        }
        if sp:
            root_plan["final_norm"] = SequenceParallel()
        parallelize_module(model, tp_mesh, root_plan)
        cfg, world = model.cfg, mesh.tp
        for block in model.blocks:
            plan = {
                "attn": PrepareModuleInput(input_layouts=(stream, None), desired_input_layouts=(Replicate(), None)),
                "attn.qkv_proj": ColwiseParallel(),
                "attn.output_proj": RowwiseParallel(output_layouts=stream),
                "ffn": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
                "ffn.w1": ColwiseParallel(),
                "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=stream),
            }
            if sp:
                plan["ln1"] = SequenceParallel()
                plan["ln2"] = SequenceParallel()
            parallelize_module(block, tp_mesh, plan)
            block.attn.n_heads, block.attn.n_kv_heads = cfg.n_heads // world, cfg.kv_heads // world
            e = cfg.head_dim
            block.attn.qkv_proj.reorder_full = _rank_major_qkv(
                (cfg.n_heads * e, cfg.kv_heads * e, cfg.kv_heads * e), world)

    def loss(self, logits: Tensor, target: Tensor) -> Tensor:
        if not self.active:
            return super().loss(logits, target)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        return loss.full_tensor()  # a replicated DTensor: the same number on every rank, as a plain tensor

    def loss_context(self) -> ContextManager:
        if not self.active:
            return super().loss_context()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


    def finish_gradients(self, model: nn.Module) -> None:
        """Give every gradient its parameter's placements. DTensor's backward leaves the SequenceParallel norms'
        gradients as pending sums (Partial) and the embedding's replicated; the norm and the optimizer need each
        rank's part of the true gradient."""
        if not self.active:
            return
        for p in model.parameters():
            g = p.grad
            if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)


def _rank_major_qkv(segments: tuple[int, ...], world: int):
    """The reordering of a full fused weight's rows into rank-major order (every rank's q, k, v rows together)."""
    def reorder(full: Tensor) -> Tensor:
        return torch.cat([full[s] for r in range(world) for s in _rank_slices(segments, r, world)], dim=0)
    return reorder
