"""Mixed precision through the trainer: fp16's dynamic loss scaling skips (and counts) the steps whose gradients
overflow, without touching the weights; bf16 and fp32 never skip."""
from __future__ import annotations

import pytest
import torch

from tests.utils import FAST, compose_cfg

gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 loss scaling needs a CUDA GPU")
def test_fp16_overflowing_steps_are_skipped_and_counted(tmp_path):
    from core.trainer import build

    # a loss scale of 2^40 overflows fp16 gradients: the first steps are skipped, each halving the scale, until
    # the scaled gradients fit (2^16 is GradScaler's own start)
    run = build(compose_cfg(FAST + ["precision=fp16", "precision.init_scale=1099511627776", "train.batch_size=2",
                                    "data.max_bytes=100000", "mesh.device=cuda"], tmp_path))
    before = [p.detach().clone() for p in run.raw_model.parameters()]
    run.train_step(0)
    assert run.precision.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, run.raw_model.parameters()))  # weights untouched
    for step in range(1, 40):
        run.train_step(step)
        if run.precision.skipped_steps < step + 1:  # a step went through
            break
    skipped = run.precision.skipped_steps
    assert 1 < skipped < 40 and run.precision.scaler.get_scale() == 2.0 ** (40 - skipped)
    assert any(not torch.equal(a, p) for a, p in zip(before, run.raw_model.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_loss_scaling_outside_fp16(precision, tmp_path):
    from core.trainer import build

    run = build(compose_cfg(FAST + [f"precision={precision}", "train.batch_size=2", "data.max_bytes=100000"],
                            tmp_path))
    before = [p.detach().clone() for p in run.raw_model.parameters()]
    run.train_step(0)
    assert run.precision.scaler is None and run.precision.skipped_steps == 0
    assert any(not torch.equal(a, p) for a, p in zip(before, run.raw_model.parameters()))
