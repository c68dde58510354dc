"""The tiny model trains the same whichever attention kernel runs it: flash_triton (the Triton interpreter on the
CPU) and flash_torch against SDPA, gradient for gradient at the first step and loss for loss over the first steps
of a real `train.py` run. The model hands the kernels q, k, v as non-dense views of its fused projection, the
layout whose gradients a kernel can get wrong while the loss still falls."""
from __future__ import annotations

import pytest
import torch

from core.kernels.flash_triton import common as ftc
from tests.test_flash_attention import TRITON_OK
from tests.utils import FAST, compose_cfg, read_metrics, read_summary, run_train

# fp32 on the CPU, where SDPA and the kernels agree to rounding (a GPU's TF32 dots would not); flash_triton there
# runs under the Triton interpreter (its GPU path is checked against float64 in tests/test_flash_attention.py)
IMPLS = [pytest.param("flash_torch", id="flash_torch"),
         pytest.param("flash_triton", id="flash_triton",
                      marks=pytest.mark.skipif(not (TRITON_OK and ftc.INTERPRET), reason="needs the Triton interpreter "
                                               "(TRITON_INTERPRET=1, set by tests/conftest.py on machines without CUDA)"))]
SMALL = ["train.batch_size=2", "data.max_bytes=100000", "model.context_length=64", "mesh.device=cpu"]


def _first_step_grads(impl: str, tmp_path, extra: tuple[str, ...] = ()) -> tuple[float, dict[str, torch.Tensor]]:
    from core.trainer import build

    run = build(compose_cfg(FAST + SMALL + [f"attention_impl={impl}", *extra], tmp_path / impl))
    loss = run.forward_backward(0)
    return float(loss), {n: p.grad.clone() for n, p in run.raw_model.named_parameters()}


@pytest.mark.parametrize("kv", [(), ("model.n_kv_heads=2",)], ids=["mha", "gqa"])
@pytest.mark.parametrize("impl", IMPLS)
def test_first_step_gradients_match_sdpa(impl, kv, tmp_path):
    """gqa: 2 KV heads, which flash_triton takes as they are (`native_gqa`) and flash_torch expanded."""
    loss_ref, ref = _first_step_grads("sdpa", tmp_path, kv)
    loss, got = _first_step_grads(impl, tmp_path, kv)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    for name, g in ref.items():
        # every attention projection's gradient, the value projection's slice of qkv_proj included
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_train_py_losses_match_sdpa(impl, tmp_path):
    """`python train.py attention_impl=...` for 4 steps: the logged losses and gradient norms follow SDPA's."""
    common = FAST + SMALL + ["train.max_steps=4", "train.log_every=1", "train.eval_every=0",
                             "optimizer.warmup_steps=1"]
    rows = {}
    for name in ("sdpa", impl):
        run_train(common + [f"attention_impl={name}"], tmp_path / name, timeout=600)
        rows[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        assert read_summary(tmp_path / name)["attention"] == name  # the implementation, not its wrapper class
    assert [r["step"] for r in rows[impl]] == [1, 2, 3, 4]
    for ref, got in zip(rows["sdpa"], rows[impl]):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ref["step"], ref["loss"], got["loss"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), ref["step"]
