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


# two of the tiny model's four blocks: every attention call of a step runs under the interpreter
TRAIN = FAST + SMALL + ["model.n_layers=2", "train.max_steps=4", "train.log_every=1", "train.eval_every=0",
                        "optimizer.warmup_steps=1"]


@pytest.fixture(scope="module")
def sdpa_rows(tmp_path_factory) -> list[dict]:
    """The logged training rows of `python train.py attention_impl=sdpa` (one run for both kernels' tests: they
    share an xdist group, so one worker runs both)."""
    run_dir = tmp_path_factory.mktemp("sdpa")
    run_train(TRAIN + ["attention_impl=sdpa"], run_dir, timeout=600)
    assert read_summary(run_dir)["attention"] == "sdpa"
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
@pytest.mark.xdist_group("train_py_vs_sdpa")
def test_train_py_losses_match_sdpa(impl, sdpa_rows, tmp_path):
    """`python train.py attention_impl=...` for 4 steps: the logged losses and gradient norms follow SDPA's."""
    run_train(TRAIN + [f"attention_impl={impl}"], tmp_path, timeout=600)
    assert read_summary(tmp_path)["attention"] == impl  # the implementation, not its wrapper class
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for ref, got in zip(sdpa_rows, rows, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ref["step"], ref["loss"], got["loss"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), ref["step"]
