"""Activation checkpointing: recompute every k-th block's activations in backward (non-reentrant)."""
from __future__ import annotations

from core.errors import require
from core.model import TransformerLM


def apply(model: TransformerLM, every: int) -> int:
    """Mark every `every`-th block (0: none, 1: all) for checkpointing; return how many were marked."""
    require(isinstance(every, int) and every >= 0, "activation_checkpointing",
            f"must be 0 (off) or a positive block interval, got {every!r}", "set activation_checkpointing=0, 1, 2, ...")
    marked = 0
    for i, block in enumerate(model.blocks):
        block.activation_checkpoint = every > 0 and i % every == 0
        marked += block.activation_checkpoint
    return marked
