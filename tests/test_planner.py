"""The planner's figures against exact counts: a real model's tensors, autograd's saved tensors,
FlopCounterMode and the CS336 accounting answers; how it picks its device, refuses what does not fit,
and compares itself with a run. (Per-strategy state and communication bytes against real runs:
tests/test_planner_counts.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.utils.flop_counter import FlopCounterMode

from core import activation_checkpointing
from core.attention import NaiveAttention
from core.errors import ConfigError
from core.model import ModelConfig, TransformerLM
import core.planner as planner
from core.planner import (GIB, activation_bytes, format_comparison, head_activation_bytes, matmul_flops, plan,
                          predicted_vs_measured)

import pathlib

from tests.utils import train_py

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
SMALL = dict(d_model=64, d_ff=160, n_layers=3, n_heads=4, vocab_size=300, context_length=48)


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        over = list(overrides)
        if not any(o.startswith("planner.device=") for o in over):
            over.append("planner.device=cpu")
        return compose("config", overrides=[("++" + o if o.startswith("planner.") else o) for o in over])


def _small_overrides(**extra) -> list[str]:
    kw = {**SMALL, **extra}
    return [f"model.{k}={v}" for k, v in kw.items()] + ["model.n_kv_heads=" + str(extra.get("n_kv_heads", "null"))]


def _model(**extra) -> tuple[ModelConfig, TransformerLM]:
    mcfg = ModelConfig(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = TransformerLM(mcfg)
    model.init_weights(0)
    return mcfg, model


def test_parameter_count_matches_the_module():
    mcfg, model = _model(n_kv_heads=2)
    real = [(n, p.numel()) for n, p in model.named_parameters()]
    p = plan(_cfg(*_small_overrides(n_kv_heads=2), "train.batch_size=2", "data.seq_len=48"))
    assert p.params == sum(n for _, n in real)


def test_parameter_gradient_and_adamw_state_bytes_after_one_step():
    mcfg, model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, mcfg.vocab_size, (2, 48))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    params = nbytes(model.parameters())
    grads = nbytes(p.grad for p in model.parameters())
    state = nbytes(v for s in opt.state.values() for k, v in s.items() if k != "step")
    p = plan(_cfg(*_small_overrides(), "train.batch_size=2", "data.seq_len=48"))
    assert p.memory["parameters"] == params
    assert p.memory["gradients"] == grads
    assert p.memory["optimizer_state"] == state


def _saved_bytes(model: TransformerLM, x: torch.Tensor, autocast: bool) -> int:
    """Bytes of every distinct storage autograd saves (parameters and autocast weight copies excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        is_weight_copy = t.dtype == torch.bfloat16 and t.dim() == 2 and tuple(t.shape) in weight_shapes \
            and t.shape[0] != x.numel()
        if ptr not in params and not is_weight_copy:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
    return sum(seen.values())


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("every", [0, 1, 2])
@pytest.mark.parametrize("kv", [None, 2])
def test_activation_bytes_equal_what_autograd_saves(autocast, every, kv):
    mcfg, model = _model(n_kv_heads=kv)
    n_ck = activation_checkpointing.apply(model, every)
    x = torch.randint(0, mcfg.vocab_size, (3, 40))  # B*T=120 differs from every weight dimension
    measured = _saved_bytes(model, x, autocast)
    assert activation_bytes(mcfg, 3, 40, autocast, n_ck) == measured


def test_matmul_flops_equal_flop_counter():
    # naive attention: its score matmuls are aten bmm, which FlopCounterMode counts (CPU flash SDPA it does not)
    mcfg = ModelConfig(**SMALL, n_kv_heads=2)
    model = TransformerLM(mcfg, NaiveAttention())
    model.init_weights(0)
    x = torch.randint(0, mcfg.vocab_size, (2, 48))
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    counted = fc.get_total_flops()
    fl = matmul_flops(mcfg, 2, 48)
    assert fl["forward"] + fl["backward"] == counted
    p = plan(_cfg(*_small_overrides(n_kv_heads=2), "train.batch_size=4", "train.grad_accum_steps=2",
                  "data.seq_len=48"))
    assert p.matmul_flops_per_step == 2 * counted  # two micro-steps of 2 sequences


def test_cs336_gpt2_xl_accounting():
    """CS336 assignment 1: GPT-2 XL (d 1600, 48 layers, 25 heads, d_ff 6400, V 50257, T 1024)
    has 2,127,057,600 parameters, 4.513 TFLOPs of forward matmuls per sequence, and AdamW training
    holds 16 bytes per parameter; its residual stream is 4 B T d bytes per layer in fp32."""
    xl = dict(d_model=1600, d_ff=6400, n_layers=48, n_heads=25, vocab_size=50257, context_length=1024)
    over = [f"model.{k}={v}" for k, v in xl.items()] + ["train.batch_size=1", "data.seq_len=1024"]
    p = plan(_cfg(*over))
    assert p.params == 2_127_057_600
    assert matmul_flops(ModelConfig(**xl), 1, 1024)["forward"] == pytest.approx(4.513e12, rel=1e-3)
    assert p.memory["parameters"] + p.memory["gradients"] + p.memory["optimizer_state"] == 16 * 2_127_057_600
    assert p.memory["optimizer_state"] == 8 * 2_127_057_600
    # with every block checkpointed only the residual stream stays: 4 B T d bytes per layer (fp32)
    m = ModelConfig(**xl)
    assert activation_bytes(m, 1, 1024, False, 48) - head_activation_bytes(m, 1, 1024, False) == \
        48 * 4 * 1024 * 1600 + 8 * 1024  # + the int64 positions the checkpoints share


def test_refuses_what_does_not_fit_with_the_overflowing_number():
    p = plan(_cfg("model=xl", "precision=bf16", "train.batch_size=16", "data.seq_len=512",
                  "planner.device=h100_sxm"))
    with pytest.raises(ConfigError) as e:
        p.check_fits()
    assert f"{p.peak_gib:.1f} GiB" in str(e.value) and "79.1 GiB" in str(e.value)
    ok = plan(_cfg("model=xl", "precision=bf16", "train.batch_size=16", "data.seq_len=512",
                   "planner.device=h100_sxm", "activation_checkpointing=1", "mesh.dp_shard=8",
                   "parallelism=torch_fsdp2", "parallelism.compute_dtype=bfloat16"))
    ok.check_fits()
    assert ok.peak_gib < p.peak_gib / 4


def test_sharding_and_communication_volumes():
    base = ["model=small", "precision=bf16", "train.batch_size=8", "data.seq_len=256", "mesh.dp_shard=4"]
    ddp = plan(_cfg(*base, "parallelism=ddp_flat"))
    zero = plan(_cfg(*base, "parallelism=zero1"))
    fsdp = plan(_cfg(*base, "parallelism=fsdp"))
    N = ddp.params
    assert [(c.name, c.bytes_per_step) for c in ddp.collectives] == [("all_reduce", 4 * N)]
    assert zero.memory["optimizer_state"] == 8 * -(-N // 4) and zero.memory["parameters"] == 4 * N
    assert fsdp.memory["parameters"] == 4 * -(-N // 4) == fsdp.memory["gradients"]
    # gathers and reduce-scatters of the sharded weights; the replicated norm weights' gradients all-reduced
    assert {c.name for c in fsdp.collectives} == {"all_gather", "reduce_scatter", "all_reduce"}
    d = fsdp.to_dict()
    assert d["peak_mem_gib"] == pytest.approx(fsdp.peak_bytes / GIB) and "plan:" in fsdp.format()




def test_refuses_a_run_larger_than_the_cpu_memory_and_can_be_forced():
    over = ["model=small", "train.batch_size=8", "data.seq_len=256", "mesh.device=cpu", "mesh=dp2",
            "parallelism=ddp_bucketed", "planner.device=cpu"]
    p = plan(_cfg(*over))
    assert p.device == "cpu" and p.ranks_per_memory == 2  # the ranks of a CPU job share the machine
    tight = plan(_cfg(*over, f"++planner.device_overrides.memory_gib={1.5 * p.peak_gib}"))
    with pytest.raises(ConfigError) as e:
        tight.check_fits()
    msg = str(e.value)
    assert msg.startswith("model/precision/mesh: model=small precision=fp32 parallelism=ddp_bucketed mesh=dp2")
    assert f"{p.peak_gib:.1f} GiB per rank x 2 ranks" in msg and "planner.check_fit=false" in msg
    plan(_cfg(*over, f"++planner.device_overrides.memory_gib={2.5 * p.peak_gib}")).check_fits()
    forced = _cfg(*over, f"++planner.device_overrides.memory_gib={1.5 * p.peak_gib}", "++planner.check_fit=false")
    plan(forced).check_fits(forced)


def test_a_run_that_does_not_fit_is_refused_before_it_starts(tmp_path):
    r = train_py(["model=tiny", "mesh.device=cpu", "train.max_steps=1", "++planner.device_overrides.memory_gib=0.0001",
                  f"paths.output_root={tmp_path}"], timeout=180)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "needs a predicted" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_auto_device_without_a_gpu_says_what_it_assumed(monkeypatch):
    monkeypatch.setattr(planner, "visible_gpus", lambda: [])
    p = plan(_cfg("model=tiny", "train.batch_size=8", "mesh=dp8", "planner.device=auto"))
    assert p.device == "cpu" and "no GPU" in p.device_note and "planner.device=h200" in p.device_note
    assert p.format().splitlines()[1] == f"  device: {p.device_note}"


def test_auto_device_with_fewer_gpus_than_ranks_plans_for_that_gpu(monkeypatch):
    monkeypatch.setattr(planner, "visible_gpus", lambda: ["NVIDIA H100 80GB HBM3"])
    p = plan(_cfg("model=tiny", "train.batch_size=8", "mesh=dp8", "planner.device=auto"))
    assert p.device == "NVIDIA H100 80GB HBM3" and p.device_memory_gib == 79.1
    assert "8 ranks and this machine 1 GPUs" in p.device_note and p.step_time_ms is not None
    monkeypatch.setattr(planner, "visible_gpus", lambda: ["Some Future GPU"])
    unknown = plan(_cfg("model=tiny", "train.batch_size=8", "planner.device=auto"))
    assert unknown.step_time_ms is None and unknown.device is None and "not in the device table" in unknown.notes[0]


def test_prediction_error_has_one_sign_and_no_cpu_memory_comparison():
    predicted = {"step_time_ms": 110.0, "peak_mem_gib": 9.0}
    gpu = {"device": "NVIDIA H200", "step_time_ms": 100.0, "peak_mem_gib": 10.0, "gpu_peak_allocated_gib": 10.0}
    cmp = predicted_vs_measured(predicted, gpu)
    assert cmp["step_time_ms"]["error"] == pytest.approx(0.10)  # (predicted - measured) / measured
    assert cmp["peak_mem_gib"]["error"] == pytest.approx(-0.10)
    assert "(+10%)" in format_comparison(predicted, gpu) and "(-10%)" in format_comparison(predicted, gpu)
    cpu = {"device": "cpu", "step_time_ms": 100.0, "peak_mem_gib": 0.7, "cpu_rss_peak_gib": 0.7}
    cmp = predicted_vs_measured(predicted, cpu)
    assert cmp["peak_mem_gib"] == {"predicted": 9.0, "measured": None, "error": None}
    assert "not measured on the CPU" in format_comparison(predicted, cpu)
