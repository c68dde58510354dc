"""The mixture-of-experts feed-forward (core/moe.py) against a per-token float64 reference, its parameter and FLOP
counts, its load-balancing loss in training, a 2-rank run against one process, and what it refuses."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from core.attention import NaiveAttention
from core.model import ModelConfig, SwiGLU, TransformerLM
from core.moe import MoEFeedForward
from core.planner import activation_bytes, matmul_flops
from tests.utils import compose_cfg, train_py

D, FF, E, N = 8, 12, 5, 7  # 7 tokens: 5 experts divide neither the tokens nor the token copies


def _moe(top_k: int, capacity_factor=None, shared: bool = False) -> tuple[MoEFeedForward, torch.Tensor]:
    """A float64 MoE whose last expert no token can reach (positive inputs, a negative router row)."""
    gen = torch.Generator().manual_seed(top_k * 10 + int(shared))
    moe = MoEFeedForward(D, FF, E, top_k, capacity_factor, SwiGLU(D, FF) if shared else None).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        moe.router.weight[-1] = -moe.router.weight[-1].abs() - 1.0
    x = torch.randn(N, D, generator=gen, dtype=torch.float64).abs().requires_grad_()
    return moe, x


def _reference(moe: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token by token: router probabilities, top-k, renormalised weights, the chosen experts' SwiGLU (skipping an
    assignment its expert has no room for, counting in token order), plus the shared expert; and the closed-form
    aux loss. Returns (outputs, aux, dropped assignments)."""
    k = moe.top_k
    cap = math.inf if moe.capacity_factor is None else math.ceil(moe.capacity_factor * N * k / E)
    used, dropped, routed = [0] * E, 0, [0] * E
    probs_sum = torch.zeros(E, dtype=torch.float64)
    rows = []
    for n in range(x.shape[0]):
        p = torch.softmax(moe.router.weight @ x[n], dim=0)
        probs_sum = probs_sum + p
        chosen = sorted(range(E), key=lambda e: -float(p[e].detach()))[:k]
        total = sum(p[e] for e in chosen)
        y = torch.zeros(D, dtype=torch.float64)
        for e in chosen:
            routed[e] += 1
            if used[e] >= cap:
                dropped += 1
                continue
            used[e] += 1
            h = F.silu(moe.w1[e] @ x[n]) * (moe.w3[e] @ x[n])
            y = y + p[e] / total * (moe.w2[e] @ h)
        if moe.shared is not None:
            y = y + moe.shared(x[n])
        rows.append(y)
    f = torch.tensor(routed, dtype=torch.float64) / (N * k)
    aux = E * (f * (probs_sum / N)).sum()
    return torch.stack(rows), aux, dropped


@pytest.mark.parametrize("top_k,capacity_factor,shared", [(1, None, False), (2, None, True), (2, 0.5, False),
                                                          (1, 0.8, True)])
def test_moe_equals_the_per_token_reference(top_k, capacity_factor, shared):
    moe, x = _moe(top_k, capacity_factor, shared)
    out = moe(x)
    aux = moe.aux_loss
    ref, ref_aux, dropped = _reference(moe, x)
    assert (dropped > 0) == (capacity_factor is not None)  # the capacity cases really drop something
    assert float(moe.stats["moe_dropped_fraction"]) == pytest.approx(dropped / (N * top_k))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-10, atol=1e-12)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [x] + list(moe.parameters())
    got = torch.autograd.grad((out * upstream).sum() + aux, params)
    want = torch.autograd.grad((ref * upstream).sum() + ref_aux, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    assert got[1][-1].abs().sum() == 0  # w1 of the expert no token reached: a zero gradient, not None


def _cfg(**kw) -> ModelConfig:
    base = dict(d_model=32, d_ff=48, n_layers=2, n_heads=4, vocab_size=64, context_length=16, n_experts=4, top_k=2)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [{}, {"shared_expert": True, "moe_d_ff": 24, "top_k": 1}, {"n_experts": 0}])
def test_num_params_and_active_params(kw):
    cfg = _cfg(**kw)
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    idle = (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.expert_d_ff * cfg.n_layers if cfg.n_experts else 0
    assert cfg.active_params() == cfg.num_params() - idle


def test_init_is_seeded_and_scaled_and_flops_count_top_k_experts():
    cfg = _cfg(d_model=64, d_ff=128, n_layers=2, shared_expert=True)
    a, b = TransformerLM(cfg, NaiveAttention()), TransformerLM(cfg, NaiveAttention())
    a.init_weights(3)
    b.init_weights(3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    ffn = a.blocks[0].ffn
    assert abs(float(ffn.w1.std()) - 0.02) < 0.002 and abs(float(ffn.w2.std()) - 0.01) < 0.001  # 0.02 / sqrt(2 L)
    # FlopCounterMode's count of a forward and backward equals the planner's: router + top_k experts per token
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(a(x).flatten(0, 1), x.flatten()).backward()
    fl = matmul_flops(cfg, 2, 16)
    assert fl["forward"] + fl["backward"] == fc.get_total_flops()


def test_activation_estimate_is_within_ten_percent_of_what_autograd_saves():
    cfg = _cfg(d_model=64, d_ff=96, n_layers=2, vocab_size=100, context_length=40)
    model = TransformerLM(cfg)
    model.init_weights(0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    x = torch.randint(0, cfg.vocab_size, (3, 40))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    predicted = activation_bytes(cfg, 3, 40, False)
    assert abs(predicted - sum(seen.values())) < 0.1 * sum(seen.values()), (predicted, sum(seen.values()))


def test_training_loss_adds_the_weighted_aux_loss(tmp_path):
    from core.trainer import build

    run = build(compose_cfg(["logger=none", "model=tiny_moe", "model.n_layers=1", "data=synthetic",
                             "data.seq_len=16", "train.batch_size=2", "model.aux_loss_coef=0.5"], tmp_path))
    x, y = run.micro_batch("train", 0, 0)
    loss = run._loss(x, y)
    ce = F.cross_entropy(run.raw_model(x).flatten(0, 1), y.flatten())
    assert float(loss) == pytest.approx(float(ce + 0.5 * run.raw_model.aux_loss()), rel=1e-6)
    with torch.no_grad():  # evaluation: cross-entropy alone
        assert float(run._loss(x, y)) == pytest.approx(float(ce), rel=1e-6)


def _train(run_dir, *overrides: str) -> list[float]:
    argv = ["model=tiny_moe", "data=synthetic", "data.seq_len=32", "train.max_steps=3", "train.batch_size=4",
            "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "logger=none", "mesh.timeout_s=60",
            f"paths.output_root={run_dir}", f"hydra.run.dir={run_dir}/run", *overrides]
    proc = train_py(argv, timeout=240, env={"PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_tiny_moe_trains_and_dp2_matches_one_process(tmp_path):
    # the aux loss is per micro-batch: one process accumulating two micro-batches of 2 sequences is what two
    # ranks of 2 sequences each compute
    one = _train(tmp_path / "one", "train.grad_accum_steps=2")
    two = _train(tmp_path / "two", "parallelism=ddp_bucketed", "mesh=dp2", "mesh.device=cpu")
    assert len(one) == 3 and all(math.isfinite(v) for v in one)
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) < 1e-4, (one, two)


def test_tensor_parallel_with_experts_is_refused_in_one_line(tmp_path):
    proc = train_py(["model=tiny_moe", "mesh.tp=2", "mesh.device=cpu", f"hydra.run.dir={tmp_path}/run"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_experts" in lines[0] and "mesh.tp=2" in lines[0], lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the grouped-matmul experts need a Hopper-or-newer CUDA GPU")
def test_grouped_matmul_experts_equal_the_per_expert_loop(monkeypatch):
    """On CUDA under bf16 autocast the experts run as torch._grouped_mm; the per-expert loop (the CPU path, checked
    against float64 above) is the reference: same outputs and parameter gradients to bf16 rounding."""
    import core.moe as moe_mod

    torch.manual_seed(0)
    moe = MoEFeedForward(256, 512, 8, 2, None, None).cuda()
    x = torch.randn(4, 64, 256, device="cuda")

    def run(grouped: bool):
        monkeypatch.setattr(moe_mod, "_grouped_mm_applies", lambda xs, w: grouped and xs.is_cuda)
        moe.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.float().square().mean().backward()
        return out.float(), {n: p.grad.clone() for n, p in moe.named_parameters()}

    out_loop, grads_loop = run(False)
    out_grouped, grads_grouped = run(True)
    assert torch.allclose(out_grouped, out_loop, rtol=2e-2, atol=2e-3), (out_grouped - out_loop).abs().max()
    for name, g in grads_loop.items():
        err = (grads_grouped[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err < 2e-2, (name, float(err))
