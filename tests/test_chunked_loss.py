"""The chunked LM head + cross-entropy (core/loss.py, `train.loss_chunk_tokens`) against float64 references: the
loss and the gradients of the hidden states and the head weight; the whole model's loss and every parameter's
gradient against the plain head (fp32 and CPU bf16 autocast); our vocabulary-parallel tensor parallelism (tp2,
gloo) against one process; the planner's saved bytes against autograd's; the refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.errors import ConfigError
from core.loss import chunked_linear_cross_entropy, validate
from core.model import ModelConfig, TransformerLM
from tests.dist_utils import run_ranks
from tests.utils import compose_cfg


def _reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    """loss, dL/dh, dL/dw of mean cross_entropy(h @ w^T) in float64, written out (softmax - one-hot)."""
    h64, w64 = h.detach().double(), w.detach().double()
    logits = h64.reshape(-1, h64.shape[-1]) @ w64.t()
    lse = torch.logsumexp(logits, dim=-1)
    flat_t = t.reshape(-1)
    loss = (lse - logits.gather(-1, flat_t[:, None]).squeeze(-1)).mean()
    p = torch.softmax(logits, dim=-1)
    p[torch.arange(flat_t.numel()), flat_t] -= 1
    p /= flat_t.numel()
    return loss, (p @ w64).reshape(h.shape), p.t() @ h64.reshape(-1, h64.shape[-1])


@pytest.mark.parametrize("chunk", [1, 7, 16, 0])  # 0: one chunk of every token
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_and_gradients_equal_float64_reference(chunk, dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 13, 24, generator=g, dtype=dtype, requires_grad=True)  # 39 tokens: chunks do not divide
    w = (torch.randn(50, 24, generator=g, dtype=dtype) * 0.3).requires_grad_()
    t = torch.randint(0, 50, (3, 13), generator=g)
    loss = chunked_linear_cross_entropy(h, w, t, chunk or t.numel())
    loss.backward()
    ref_loss, ref_h, ref_w = _reference(h, w, t)
    assert loss.dtype == torch.float32  # the softmax statistics are fp32 whatever the inputs
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    torch.testing.assert_close(h.grad.double(), ref_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), ref_w, rtol=1e-5, atol=1e-7)


def test_vocabulary_shards_combine_to_the_whole_loss():
    """Two vocabulary shards through a stand-in for the tp group's all-reduce (both shards' statistics, computed
    by running the shards in lockstep threads) give the whole-vocabulary loss and each shard's weight gradient."""
    import threading

    import torch.distributed as dist

    class _PairComm:
        def __init__(self) -> None:
            self.barrier, self.slots = threading.Barrier(2), {}

        def bind(self, rank: int) -> "_PairComm":
            c = _PairComm.__new__(_PairComm)
            c.barrier, c.slots, c.rank = self.barrier, self.slots, rank
            return c

        def all_reduce(self, x, op=dist.ReduceOp.SUM):
            self.slots[self.rank] = x.clone()
            self.barrier.wait()
            a, b = self.slots[0], self.slots[1]
            out = torch.maximum(a, b) if op == dist.ReduceOp.MAX else a + b
            self.barrier.wait()
            return out

    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 11, 16, generator=g)
    w = torch.randn(40, 16, generator=g) * 0.5
    t = torch.randint(0, 40, (2, 11), generator=g)
    ref_loss, ref_h, ref_w = _reference(h, w, t)
    pair, out = _PairComm(), {}

    def shard(rank: int) -> None:
        hr = h.clone().requires_grad_()
        wr = w[rank * 20:(rank + 1) * 20].clone().requires_grad_()
        loss = chunked_linear_cross_entropy(hr, wr, t, 5, rank * 20, pair.bind(rank))
        loss.backward()
        out[rank] = (loss.item(), hr.grad, wr.grad)

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    for r in range(2):
        assert abs(out[r][0] - ref_loss.item()) <= 1e-5 * ref_loss.item()
        torch.testing.assert_close(out[r][2].double(), ref_w[r * 20:(r + 1) * 20], rtol=1e-5, atol=1e-7)
    # each rank's hidden-state gradient is its shard's part: the region entry sums them over tp
    torch.testing.assert_close((out[0][1] + out[1][1]).double(), ref_h, rtol=1e-5, atol=1e-7)


SMALL = dict(d_model=32, d_ff=64, n_layers=2, n_heads=4, vocab_size=97, context_length=24)


@pytest.mark.parametrize("autocast", [False, True])
def test_model_loss_and_every_gradient_equal_the_plain_head(autocast):
    cfg = ModelConfig(**SMALL)
    plain, chunked = TransformerLM(cfg), TransformerLM(cfg)
    plain.init_weights(0)
    chunked.init_weights(0)
    chunked.loss_chunk_tokens = 10
    x = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    y = torch.roll(x, -1, dims=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = plain(x)
    ref = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    ref.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = chunked(x, targets=y)
    loss.backward()
    # bf16: the same bf16 logits chunk by chunk; only summation order differs
    rtol = 2e-2 if autocast else 1e-5
    assert abs(loss.item() - ref.item()) <= rtol * ref.item()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=1e-6 if not autocast else 2e-3, msg=name)


def test_planner_head_bytes_equal_what_autograd_saves():
    from core.planner import head_activation_bytes

    cfg = ModelConfig(**SMALL)
    model = TransformerLM(cfg)
    model.init_weights(0)
    model.loss_chunk_tokens = 8
    x = torch.randint(0, cfg.vocab_size, (3, 20))  # the planner counts token ids once (inputs and targets share
    h = torch.randn(3, 20, cfg.d_model, requires_grad=True)  # one draw in a run); h: the last block's output
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    # what the head saves beyond the blocks: token ids, final norm, head input, per-token log-sum-exp
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.token_embeddings(x)
        model.lm_head(model.final_norm(h), x, model.loss_chunk_tokens)
    assert head_activation_bytes(cfg, 3, 20, False, loss_chunk=8) == sum(seen.values())
    assert head_activation_bytes(cfg, 3, 20, False, loss_chunk=8) < head_activation_bytes(cfg, 3, 20, False)


def test_planner_counts_one_chunk_of_logits():
    from core.planner import plan

    from core.planner import block_activation_bytes

    base = ["model=leaderboard_8b", "model.context_length=32768", "precision=bf16", "parallelism=torch_fsdp2",
            "mesh=dp2", "train.batch_size=2", "++planner.device=h200"]
    plain = plan(compose_cfg(base))
    chunked = plan(compose_cfg(base + ["train.loss_chunk_tokens=4096"]))
    V, tokens = 151936, 32768
    # the plain head keeps fp32 log-probabilities of every token; the chunked one one fp32 log-sum-exp per token
    assert plain.memory["activations"] - chunked.memory["activations"] == 4 * tokens * V + 4 - 4 * tokens
    # bf16 and fp32 logits: of every token, or of one chunk (and in its backward the head's fp32 weight-gradient
    # sum and a bf16 chunk's contribution to it)
    assert plain.memory["transients"] == 6 * tokens * V
    assert chunked.memory["transients"] == 6 * 4096 * V + 6 * V * 4096
    # with checkpointing, a block's recomputed activations are the larger transient of the backward
    ck = plan(compose_cfg(base + ["train.loss_chunk_tokens=4096", "activation_checkpointing=1"]))
    m = ModelConfig(d_model=4096, d_ff=11008, n_layers=34, n_heads=32, vocab_size=V, context_length=tokens)
    assert ck.memory["transients"] == block_activation_bytes(m, 1, tokens, True)
    assert ck.moments["end_of_forward"] - ck.memory["activations"] - ck.memory["transients"] == \
        sum(ck.memory[k] for k in ("parameters", "optimizer_state", "gathered_parameters"))


@pytest.mark.parametrize("value, tp_name, tp, pp_name, pp, words", [
    (-1, "megatron", 1, "ours", 1, "positive number"),
    (512, "dtensor", 2, "ours", 1, "tensor_parallel=dtensor"),
    (512, "megatron", 1, "torch", 2, "pipeline=torch"),
])
def test_unsupported_settings_are_refused_in_one_line(value, tp_name, tp, pp_name, pp, words):
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens") as e:
        validate(value, tp_name, tp, pp_name, pp)
    assert words in str(e.value)
    assert validate(512, "megatron", 2, "ours", 2) == 512 and validate(0, "dtensor", 2, "torch", 2) == 0


def _tp_worker(rank: int, world: int, ref_path: str, tmp: str) -> None:
    from tests.test_tensor_parallel import _worker

    configs = {"chunked": ["tensor_parallel=megatron", "train.loss_chunk_tokens=24"],
               "chunked nosp": ["tensor_parallel=megatron", "tensor_parallel.sequence_parallel=false",
                                "train.loss_chunk_tokens=40"]}
    _worker(rank, world, configs, "dp1_tp2", ref_path, tmp)
    # our FSDP gathers the head's weight around the head module's call: the chunked loss saves it through FSDP's
    # saved-tensor hook like any Linear (the name's last part tells the worker to compare norms, not shards)
    _worker(rank, world, {"chunked_dp2_fsdp": ["parallelism=fsdp", "train.loss_chunk_tokens=24"]}, "dp2", ref_path,
            tmp)
    # our pipeline's last stage asks the model for the loss; ZB-H1 runs its backward twice over one graph
    _worker(rank, world, {"chunked 1f1b": ["train.loss_chunk_tokens=24"],
                          "chunked zb_h1": ["pipeline.schedule=zb_h1", "train.loss_chunk_tokens=16"]}, "dp1_pp2",
            ref_path, tmp)


def test_chunked_loss_under_tp_fsdp_and_pipelines_matches_one_process_plain_loss(tmp_path):
    """tp2 (ours, with and without sequence parallelism), our fsdp over dp2 and our pipeline over pp2 (1F1B, ZB-H1)
    with the chunked head: 3 steps' losses, gradient norms and (but fsdp) each rank's gradients against one process
    with the plain head."""
    from tests.test_tensor_parallel import _reference as tp_reference

    ref = tp_reference(tmp_path)
    path = tmp_path / "ref.pt"
    torch.save(ref, path)
    run_ranks(_tp_worker, world_size=2, args=(str(path), str(tmp_path)), timeout_s=240)


def test_trainer_uses_the_chunked_head(tmp_path: Path):
    """One process through the trainer: the chunked run's losses equal the plain run's."""
    from core.trainer import build

    common = ["model=tiny", "model.n_layers=2", "data=synthetic", "data.seq_len=32", "train.batch_size=2",
              "logger=none", "mesh.device=cpu"]
    losses = {}
    for chunk in (0, 24):
        run = build(compose_cfg(common + [f"train.loss_chunk_tokens={chunk}"], tmp_path / str(chunk)))
        assert run.raw_model.loss_chunk_tokens == chunk
        losses[chunk] = [float(run.train_step(s)[0]) for s in range(2)]
    assert losses[24] == pytest.approx(losses[0], rel=1e-5)


def test_fsdp2_over_two_ranks_runs_the_chunked_head_on_a_fake_group(monkeypatch, tmp_path):
    """FSDP2 (bf16 all-gathers, every block checkpointed, as the leaderboard preset) with the chunked head through
    one training step on torch's fake 2-rank group: collectives are no-ops, so only that it runs and that the head's
    gradient lands in this rank's fp32 shard is checked (gloo has no reduce-scatter for a real 2-rank run)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from core.trainer import build

    cfg = compose_cfg(["model=tiny", "model.n_layers=2", "data=synthetic", "data.seq_len=32", "train.batch_size=2",
                       "logger=none", "mesh=dp2", "mesh.device=cpu", "parallelism=torch_fsdp2", "precision=bf16",
                       "activation_checkpointing=1", "train.loss_chunk_tokens=24"], tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = None
    try:
        from hydra.utils import instantiate

        mesh = instantiate(cfg.mesh).init()
        run = build(cfg, mesh)
        assert run.raw_model.loss_chunk_tokens == 24
        loss = run.forward_backward(0)
        grad = run.raw_model.lm_head.weight.grad
        assert loss.ndim == 0 and grad is not None and grad.dtype == torch.float32
        assert grad.to_local().shape[0] == cfg.model.vocab_size // 2  # this rank's rows of the head
        run.optimizer_step(0, measure_norm=False)
    finally:
        if mesh is not None:
            mesh.destroy()
        elif dist.is_initialized():
            dist.destroy_process_group()
