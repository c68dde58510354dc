"""The planner's figures against exact counts: a real model's tensors, autograd's saved tensors,
FlopCounterMode, the CS336 accounting answers, and the 2x H200 xl measurements it was calibrated on."""
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
from core.planner import GIB, activation_bytes, head_activation_bytes, matmul_flops, param_tensors, plan

import pathlib

CONF = str(pathlib.Path(__file__).resolve().parents[1] / "conf")
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


def test_parameter_tensors_match_the_module():
    mcfg, model = _model(n_kv_heads=2)
    real = [(n, p.numel()) for n, p in model.named_parameters()]
    assert param_tensors(mcfg) == real
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


# 2x H200, xl, 4 sequences x 512 per GPU, bf16 autocast, fused AdamW, eager (the calibration runs)
REFERENCE = {("none", 1): (54.2, 138.5), ("torch_ddp", 2): (66.9, 174.4), ("torch_fsdp2", 2): (28.6, 160.9)}
EXTRA = {"torch_fsdp2": ["parallelism.compute_dtype=bfloat16"]}  # the reference's MixedPrecisionPolicy


@pytest.mark.parametrize("point", list(REFERENCE))
def test_xl_reference_measurements(point):
    name, n = point
    mem, ms = REFERENCE[point]
    p = plan(_cfg("model=xl", "precision=bf16", f"train.batch_size={4 * n}", "data.seq_len=512",
                  f"mesh.dp_shard={n}", f"parallelism={name}", *EXTRA.get(name, []), "planner.device=h200"))
    assert p.peak_gib == pytest.approx(mem, rel=0.10)
    assert p.step_time_ms == pytest.approx(ms, rel=0.25)


# our strategies on 2x H200, xl, 4 x 512 per GPU, bf16 autocast, fused AdamW (docs/results/dp_bench_xl_2xh200.md)
DP_BENCH_MS = {"ddp_naive": 187.8, "ddp_flat": 187.4, "ddp_overlap": 159.6, "ddp_bucketed": 158.5, "zero1": 179.9,
               "zero1_rs": 199.1, "fsdp": 164.8, "torch_ddp": 168.0, "torch_fsdp2": 171.2}
# parameters, gradients, optimizer state per rank after the step, GiB (same file)
DP_BENCH_STATE = {"zero1": (12.69, 12.69, 12.69), "zero1_rs": (12.69, 6.35, 12.69), "fsdp": (6.35, 6.35, 12.69)}


@pytest.mark.parametrize("name", list(DP_BENCH_MS))
def test_step_time_of_every_strategy_within_25_percent_of_the_2xh200_benchmark(name):
    p = plan(_cfg("model=xl", "precision=bf16", "train.batch_size=8", "data.seq_len=512", "mesh=dp2",
                  f"parallelism={name}", "planner.device=h200"))
    assert p.step_time_ms == pytest.approx(DP_BENCH_MS[name], rel=0.25)
    if name in DP_BENCH_STATE:
        got = tuple(round(p.memory[k] / GIB, 2) for k in ("parameters", "gradients", "optimizer_state"))
        assert got == pytest.approx(DP_BENCH_STATE[name], abs=0.01)


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
    assert {c.name for c in fsdp.collectives} == {"all_gather", "reduce_scatter"}
    d = fsdp.to_dict()
    assert d["peak_mem_gib"] == pytest.approx(fsdp.peak_bytes / GIB) and "plan:" in fsdp.format()


# compute_dtype=bfloat16 rows of docs/results/dp_bench_xl_2xh200_session6.md: ms/step, peak GiB after the step
DP_BENCH_BF16_GRADS = {"ddp_bucketed": (142.6, 57.30), "zero1": (141.6, 44.74)}


@pytest.mark.parametrize("name", list(DP_BENCH_BF16_GRADS))
def test_bf16_gradient_rows_against_the_2xh200_benchmark(name):
    """compute_dtype=bfloat16: half the all-reduce bytes, the persistent bf16 Linear copies in memory."""
    args = ("model=xl", "precision=bf16", "train.batch_size=8", "data.seq_len=512", "mesh=dp2",
            f"parallelism={name}", "planner.device=h200")
    fp32, bf16 = plan(_cfg(*args)), plan(_cfg(*args, "parallelism.compute_dtype=bfloat16"))
    ms, gib = DP_BENCH_BF16_GRADS[name]
    assert bf16.step_time_ms == pytest.approx(ms, rel=0.25) and bf16.step_time_ms < fp32.step_time_ms
    assert bf16.moments["optimizer_step"] / GIB == pytest.approx(gib, rel=0.10)
    grads = lambda p: next(c.bytes_per_step for c in p.collectives if c.what == "gradients")  # noqa: E731
    assert grads(bf16) == pytest.approx(grads(fp32) / 2, rel=1e-6)
