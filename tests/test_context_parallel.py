"""Context parallelism (ring attention over mesh.cp) on CPU gloo ranks against single-device references.

The ring's output, log-sum-exp and q/k/v gradients equal float64 attention on the whole sequence (causal and not,
cp 2 and 4, multi-head and grouped-query, flash_torch and math blocks); training under mesh.cp=2 and cp2 x tp2
gives one process's per-step losses and gradient norms; a cp2 checkpoint resumes on cp2 and on one process;
impossible configurations are refused in one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.utils import (assert_refused_in_one_line, assert_resumes_like, checkpoint_at_step_2, compose_cfg,
                         losses_by_step, resume_test_overrides)


def _ring_worker(rank: int, world: int, kernels: tuple[str, ...] = ("flash_torch", "math"), device: str = "cpu",
                 head_dim: int = 8, tol: float = 2e-5) -> None:
    import torch.distributed as dist

    from core.distributed.context_parallel import (BLOCK_KERNELS, RingAttentionFunction, RingComm, ring_forward,
                                                   shard_sequence)
    from core.kernels._flash_common import reference_attention

    if device == "cuda":  # NCCL: one GPU per rank
        from core.distributed.mesh import init_process_group

        torch.cuda.set_device(rank)
        init_process_group("nccl", 60, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    comm = RingComm(dist.group.WORLD)
    seq = 4 * world  # 2*cp chunks of 2 tokens
    paths = {"flash_torch": "core.kernels.flash_torch.FlashAttentionTorch",
             "flash_triton": "core.kernels.flash_triton.FlashAttentionTriton", "math": "core.attention.SDPAAttention"}
    for kernel in (BLOCK_KERNELS[paths[k]]() for k in kernels):
        for causal in (True, False):
            for heads, kv_heads in ((2, 2), (4, 2)):
                gen = torch.Generator().manual_seed(1000 * heads + 10 * causal + world)
                q, k, v, w = (torch.randn(2, h, seq, head_dim, generator=gen, dtype=torch.float64).to(device)
                              for h in (heads, kv_heads, kv_heads, heads))
                # float64 reference on one device: the whole sequence, kv heads repeated by autograd
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                g = heads // kv_heads
                ref_out, ref_lse = reference_attention(qr, kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1),
                                                       causal)
                (ref_out * w).sum().backward()

                def mine(t: torch.Tensor) -> torch.Tensor:
                    return shard_sequence(t, world, rank, dim=2)

                ql, kl, vl = (mine(t).float().requires_grad_() for t in (q, k, v))
                out = RingAttentionFunction.apply(ql, kl, vl, causal, comm, kernel)
                (out * mine(w).float()).sum().backward()
                _, lse = ring_forward(ql.detach(), kl.detach(), vl.detach(), causal, comm, kernel)
                what = f"{kernel.name} causal={causal} heads={heads}/{kv_heads} cp={world} rank {rank}"
                for name, got, want in (("out", out, mine(ref_out)), ("lse", lse, mine(ref_lse)),
                                        ("dq", ql.grad, mine(qr.grad)), ("dk", kl.grad, mine(kr.grad)),
                                        ("dv", vl.grad, mine(vr.grad))):
                    err = (got.double() - want.detach()).abs().max().item()
                    assert err < tol, f"{what}: {name} differs from float64 by {err:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_float64_attention(world):
    run_ranks(_ring_worker, world_size=world, timeout_s=60)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL ring; flash_triton blocks)")
def test_ring_attention_with_flash_triton_blocks_on_gpus():
    # fp32 inputs run the Triton kernels' tf32 dots: agreement to ~1e-3, not fp32's 1e-5
    run_ranks(_ring_worker, world_size=2, args=(("flash_triton", "flash_torch"), "cuda", 16, 5e-3), timeout_s=120,
              join_group=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (flash_triton blocks)")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_triton_blocks_merge_like_the_ring_on_a_gpu(causal):
    """What one ring rank does with two K/V blocks, on one GPU: the Triton kernels' (out, lse) of each block merged
    by the log-sum-exp, and each block's backward from the merged output and lse, equal float64 attention over
    both blocks (the first block's keys precede the queries; the second is the diagonal one)."""
    from core.distributed.context_parallel import BLOCK_KERNELS
    from core.kernels._flash_common import reference_attention

    kernel = BLOCK_KERNELS["core.kernels.flash_triton.FlashAttentionTriton"]()
    gen = torch.Generator().manual_seed(7)
    n, e = 96, 64
    q, k, v, w = (torch.randn(2, 4, m, e, generator=gen, dtype=torch.float64).cuda() for m in (n, 2 * n, 2 * n, n))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, causal)  # bottom-right causal: block 1 whole, block 2 diagonal
    (ref_out * w).sum().backward()
    q32, k32, v32 = q.float(), k.float(), v.float()
    blocks = [(slice(0, n), False), (slice(n, 2 * n), causal)]
    parts = [kernel.forward(q32, k32[..., b, :], v32[..., b, :], c) for b, c in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).unsqueeze(-1) for o, l in parts)
    dq = torch.zeros_like(q32)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    for b, c in blocks:
        kb, vb = k32[..., b, :], v32[..., b, :]
        dq_b, dk[..., b, :], dv[..., b, :] = kernel.backward(w.float(), q32, kb, vb, out, lse, c)
        dq += dq_b
    # fp32 inputs run tf32 dots
    for name, got, want in (("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq, qr.grad), ("dk", dk, kr.grad),
                            ("dv", dv, vr.grad)):
        err = (got.double() - want.detach()).abs().max().item()
        assert err < 2e-2, f"causal={causal}: {name} differs from float64 by {err:.2e}"


def test_chunks_cover_the_sequence_once():
    from core.distributed.context_parallel import chunk_indices

    for cp in (1, 2, 3, 4):
        held = torch.cat([chunk_indices(8 * cp, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(8 * cp))
        assert chunk_indices(8 * cp, cp, 0)[-1] == 8 * cp - 1  # rank 0 holds the last chunk too


STEPS = 3
# GQA (2 KV heads for 4 query heads); 32 tokens: 2*cp = 4 chunks, and each cp rank's 16 split over tp = 2
COMMON = ["model=tiny", "model.n_kv_heads=2", "model.n_layers=2", "data=synthetic", "data.seq_len=32",
          "train.batch_size=4", f"train.max_steps={STEPS}", "optimizer.warmup_steps=1", "logger=none",
          "mesh.device=cpu", "mesh.timeout_s=120"]
CP2 = {  # 2 ranks: mesh.cp=2 alone
    "none": ["parallelism=none"],
    "flash_torch_zero1": ["parallelism=zero1", "attention_impl=flash_torch"],
}
CP2_X4 = {  # 4 ranks
    "tp2_megatron_sp_ddp": ["mesh.tp=2", "parallelism=ddp_bucketed"],  # DDP over dp x cp = 2 ranks, TP inside
    "dp2_fsdp": ["mesh.dp_shard=2", "parallelism=fsdp"],  # shards over dp_shard x cp = 4 ranks
    "pp2_1f1b": ["mesh.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],  # our pipeline: 2 stages x cp2
}


def _train(cfg) -> dict:
    """STEPS optimizer steps through the trainer: each step's global loss and grad norm, and this rank's gradients
    of the first step (after synchronisation, before clipping)."""
    from core.trainer import all_reduce_mean, build

    run = build(cfg)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss = run.forward_backward(step)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in run.raw_model.named_parameters() if p.grad is not None}
        norm, _ = run.optimizer_step(step, measure_norm=True)
        losses.append(all_reduce_mean(loss, run.mesh))
        norms.append(norm)
    return {"losses": losses, "norms": norms, "grads": grads, "model": run.raw_model,
            "tokens": run.micro_batch("train", 0, 0)[0].shape[1]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp_ref")
    ref = _train(compose_cfg(COMMON + ["mesh=single"], tmp / "single"))
    ref.pop("model")
    assert ref.pop("tokens") == 32
    path = tmp / "ref.pt"
    torch.save(ref, path)
    return str(path)


def _train_worker(rank: int, world: int, configs: dict, ref_path: str, tmp: str) -> None:
    from core.model import part_of_full

    ref = torch.load(ref_path)
    for name, overrides in configs.items():
        cfg = compose_cfg(COMMON + ["mesh=single", "mesh.cp=2"] + overrides, Path(tmp) / name)
        out = _train(cfg)
        assert out["tokens"] == 16, f"{name}: a cp rank got {out['tokens']} of 32 tokens"  # the ring really ran
        for what in ("losses", "norms"):
            for step, (a, b) in enumerate(zip(out[what], ref[what])):
                assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} {what} {a} != one process's {b}"
        if "fsdp" in name or "zero1" in name:
            continue  # gradients sharded over dp x cp: the norms cover them
        checked = 0
        for pname, full in ref["grads"].items():  # every cp rank holds the whole (tp part of the) gradient
            if pname not in out["grads"]:  # another pipeline stage's
                continue
            checked += 1
            want = part_of_full(out["model"].get_submodule(pname.rsplit(".", 1)[0]), full)
            got = out["grads"][pname]
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), \
                f"{name} {pname}: max error {(got - want).abs().max():.3e}"
        assert checked >= len(ref["grads"]) // 3, f"{name}: only {checked} gradients compared"


def _count_ring(tmp: Path) -> None:
    """The planner's ring-attention terms against one real step: every batch of sends the ring starts, its bytes
    counted as they go out (2 micro-steps, every block recomputed: all three kinds of transfer occur)."""
    from core.distributed.context_parallel import RingComm
    from core.planner import context_parallel_collectives, plan, read_job
    from core.trainer import build

    cfg = compose_cfg(COMMON + ["mesh=single", "mesh.cp=2", "train.grad_accum_steps=2", "activation_checkpointing=1"],
                      tmp / "count")
    run = build(cfg)
    counted = [0, 0]
    original = RingComm.start

    def counting(self, tensors):
        counted[0] += 1
        counted[1] += sum(t.numel() * t.element_size() for t in tensors)
        return original(self, tensors)

    RingComm.start = counting
    try:
        run.forward_backward(0)
    finally:
        RingComm.start = original
    specs = context_parallel_collectives(read_job(cfg))
    assert [sum(c.calls for c in specs), sum(c.bytes_per_step for c in specs)] == counted, (specs, counted)
    assert any("ring attention sends" in n for n in plan(cfg).notes)


def _cp2_worker(rank: int, world: int, ref_path: str, tmp: str) -> None:
    _train_worker(rank, world, CP2, ref_path, tmp)
    _count_ring(Path(tmp))


def test_cp2_trains_like_one_process_and_the_planner_counts_its_ring(reference, tmp_path):
    run_ranks(_cp2_worker, world_size=2, args=(reference, str(tmp_path)), timeout_s=120)


def test_cp2_with_tp2_or_dp2_trains_like_one_process(reference, tmp_path):
    run_ranks(_train_worker, world_size=4, args=(CP2_X4, reference, str(tmp_path)), timeout_s=120)



@pytest.mark.slow
def test_pp2_dp2_tp2_cp2_trains_like_one_process(reference, tmp_path):
    """The 4D shape: 16 gloo ranks (minutes on a 2-core machine, ~1 min on 16 cores)."""
    shape = {"pp2_dp2_tp2_cp2_ddp": ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=2", "parallelism=ddp_bucketed",
                                     "pipeline.microbatches=2"]}
    run_ranks(_train_worker, world_size=16, args=(shape, reference, str(tmp_path)), timeout_s=300, deadline_s=900)


@pytest.mark.slow
def test_cp2_checkpoint_resumes_on_cp2_and_on_one_process(tmp_path):
    """Parameters are replicated over cp as over dp, so a cp2 run's checkpoint is its strategy's own (our fsdp's,
    sharded over dp x cp, by the whole model's names): resumed at step 2 on cp2 it continues bit for bit, and on one
    process (resume_allow_changes=[mesh,world_size]) with the uninterrupted run's step-3 loss."""
    common = resume_test_overrides(tmp_path, "model.n_layers=1", "train.batch_size=2", "train.max_steps=3",
                                   "parallelism=fsdp")
    first = tmp_path / "cp2"
    step2 = checkpoint_at_step_2(common + ["mesh=dp1_cp2"], first)
    assert_resumes_like(losses_by_step(first), step2, common, {"same": ["mesh=dp1_cp2"], "single": ["mesh=single"]},
                        tmp_path, steps=(3,), rtol=1e-4)


REFUSED = [
    (["data.seq_len=30"], "data.seq_len", "2*cp=4 equal chunks"),
    (["mesh.pp=2", "model.n_layers=2", "pipeline=torch"], "pipeline", "does not compose with context parallelism"),
    (["attention_impl=compiled"], "attention_impl", "cannot run as ring-attention blocks"),
    (["parallelism=torch_ddp"], "parallelism", "does not compose with context_parallel=ring"),
    (["mesh.tp=2", "tensor_parallel=dtensor"], "tensor_parallel", "does not compose with context parallelism"),
    (["mesh.tp=4", "data.seq_len=12"], "tensor_parallel.sequence_parallel",
     "do not split over tp=4"),
]


@pytest.mark.parametrize("overrides, key, words", REFUSED)
def test_impossible_context_parallel_configs_are_refused(overrides, key, words, tmp_path):
    from core.errors import ConfigError
    from launchers.job import validate

    cfg = compose_cfg(["model=tiny", "data=synthetic", "data.seq_len=32", "mesh.device=cpu", "mesh.cp=2",
                       "train.batch_size=4", *overrides], tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_devices=False)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_refusal_is_one_line_before_any_rank_starts(tmp_path):
    assert_refused_in_one_line(["mesh.cp=2", "data.seq_len=30"], tmp_path, "error: data.seq_len:",
                               "divisible by 4 (e.g. 32)")
