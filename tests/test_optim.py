"""The learning-rate schedule against its closed form: linear warm-up, then cosine to min_lr."""
from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError
from core.optim import WarmupCosine


def closed_form(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    t = (step - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize("warmup,total", [(10, 100), (0, 50), (1, 2)])
def test_schedule_matches_the_closed_form(warmup, total):
    s = WarmupCosine(lr=3e-4, min_lr=3e-5, warmup=warmup, total=total)
    for step in range(total + 5):
        assert s(step) == pytest.approx(closed_form(step, 3e-4, 3e-5, warmup, total), rel=1e-12, abs=0), step


def test_landmarks():
    s = WarmupCosine(lr=1.0, min_lr=0.1, warmup=4, total=14)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]  # reaches lr on the last warm-up step
    assert s(4) == 1.0 and s(9) == pytest.approx(0.55) and s(14) == s(1000) == 0.1  # peak, midpoint, floor
    assert all(s(i) >= s(i + 1) for i in range(4, 20))  # never rises after warm-up


def test_apply_sets_every_group():
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p1]}, {"params": [p2], "lr": 5.0}], lr=1.0)
    WarmupCosine.apply(opt, 0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]


def test_bad_rates_are_config_errors():
    with pytest.raises(ConfigError, match="optimizer.lr"):
        WarmupCosine(lr=0.0, min_lr=0.0, warmup=1, total=10)
    with pytest.raises(ConfigError, match="optimizer.min_lr"):
        WarmupCosine(lr=1e-3, min_lr=1e-2, warmup=1, total=10)
