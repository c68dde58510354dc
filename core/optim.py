"""Optimizer construction and the learning-rate schedule (linear warm-up, cosine decay)."""
from __future__ import annotations

import math
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from core.distributed.strategy import OptimizerFactory
from core.errors import require


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (linears, embeddings); leave vectors (norm weights) undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer_factory(cfg: DictConfig, device: torch.device) -> OptimizerFactory:
    """A callable mapping param groups to the configured optimizer (fused kernel on CUDA when unset)."""
    factory_cfg = OmegaConf.to_container(cfg.factory, resolve=True)
    if "fused" in factory_cfg and factory_cfg["fused"] is None:
        factory_cfg["fused"] = device.type == "cuda"
    factory_cfg["lr"] = cfg.lr
    partial = instantiate(factory_cfg)
    return lambda groups: partial(groups)


class WarmupCosine:
    """lr(step): linear warm-up to `lr` over `warmup` steps, cosine to `min_lr` at `total` steps."""

    def __init__(self, lr: float, min_lr: float, warmup: int, total: int) -> None:
        require(lr > 0, "optimizer.lr", f"must be positive, got {lr}", "set optimizer.lr > 0")
        require(0 <= min_lr <= lr, "optimizer.min_lr", f"{min_lr} is not within [0, lr={lr}]", "set 0 <= min_lr <= lr")
        self.lr, self.min_lr, self.warmup, self.total = lr, min_lr, max(warmup, 0), max(total, 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if step >= self.total:
            return self.min_lr
        progress = (step - self.warmup) / max(self.total - self.warmup, 1)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    @staticmethod
    def apply(optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr
