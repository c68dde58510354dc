"""Tensors a rank holds as explicit boxes of a larger (global) tensor, as torch.distributed.checkpoint entries.

DTensor placements describe a rank's piece only when it is a chunk of a chunk (torch.chunk along each mesh
dimension). Our FSDP under our tensor parallelism holds rows of a tensor-parallel part, and such rows can straddle
the fused qkv weight's q, k and v segments: up to three boxes of the one-process tensor, on no grid. DCP's other
sharded type, `ShardedTensor`, takes any non-overlapping boxes with explicit offsets: DCP saves each box as a chunk
of the global tensor and, loading, reads whichever saved chunks overlap the boxes this rank holds, whatever mesh
wrote them (DTensor-sharded ones included). The boxes are views of the live tensors, so loading fills them in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Boxed:
    """This rank's boxes of one global tensor: (view of the live tensor, the view's offset in the global tensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[Tensor, tuple[int, ...]]]


def as_checkpoint_entries(pieces: dict[str, Boxed]) -> dict[str, Any]:
    """A `ShardedTensor` per key of `pieces`. Collective: the ranks exchange their boxes' offsets and sizes once
    (every ShardedTensor lists every rank's boxes). A rank may lack a key (under pipeline parallelism another stage
    holds that tensor): it then lists no boxes of it."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    mine = {key: [(tuple(off), tuple(v.shape), str(v.device)) for v, off in b.boxes] for key, b in pieces.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for key, b in pieces.items():
        shards_md = [ShardMetadata(list(off), list(size), f"rank:{r}/{dev}")
                     for r, theirs in enumerate(every) for off, size, dev in theirs.get(key, ())]
        local = [Shard(v, ShardMetadata(list(off), list(v.shape), f"rank:{rank}/{v.device}")) for v, off in b.boxes]
        meta = ShardedTensorMetadata(shards_md, torch.Size(b.shape), TensorProperties(dtype=b.dtype))
        out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
    return out


def is_boxed(value: Any) -> bool:
    """Whether `value` is an entry `as_checkpoint_entries` made (its boxes are loaded in place)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)
