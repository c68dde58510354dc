"""The four DDP wrappers against single-process training on the whole batch (2 gloo ranks)."""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import make_toy, run_ranks, toy_batches, toy_loss


def _train_and_compare(rank, world, wrapper_name, kind, accum, kwargs):
    from core.distributed import ddp

    cls = getattr(ddp, wrapper_name)
    ref = make_toy(kind, seed=0)                         # the single-process reference
    local = make_toy(kind, seed=rank)                    # ranks start different: the wrapper broadcasts rank 0
    model = cls(local, process_group=None, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.module.parameters()))
    # SGD+momentum: linear in the gradient, so summation-order rounding stays at float32 level
    # (Adam's normalisation would magnify it for near-zero gradients).
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    for x, y in toy_batches(kind, steps=4, batch=8):
        # reference: whole batch, `accum` micro-steps
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            (toy_loss(ref(xm), ym) / accum).backward()
        opt_ref.step(); opt_ref.zero_grad(set_to_none=True)
        # distributed: this rank's half of every micro-batch
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            xl, yl = xm.chunk(world)[rank], ym.chunk(world)[rank]
            last = i == accum - 1
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                (toy_loss(model(xl), yl) / accum).backward()
            if not last:  # no communication yet: gradients still differ between ranks
                g = next(p for p in model.parameters() if p.grad is not None).grad.clone()
                gathered = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(gathered, g)
                assert not torch.allclose(gathered[0], gathered[1])
        model.finish_gradient_synchronization()
        opt.step(); opt.zero_grad(set_to_none=True)
        for (n, p_ref), p in zip(ref.named_parameters(), model.module.parameters()):
            assert torch.allclose(p_ref, p), (wrapper_name, kind, accum, n, (p_ref - p).abs().max())
    assert model.module.head.weight is model.module.emb.weight if kind == "tied" else True


def _all_wrappers(rank, world):
    for name, kw in [("NaiveDDP", {}), ("FlatDDP", {}), ("OverlapDDP", {}),
                     ("BucketedDDP", {"bucket_size_mb": 0.0005}),          # several params per bucket
                     ("BucketedDDP", {"bucket_size_mb": 1e-4, "first_bucket_size_mb": 0})]:
        for kind in ("toy", "tied"):
            for accum in (1, 2):
                _train_and_compare(rank, world, name, kind, accum, kw)


def test_ddp_family_matches_single_process_2ranks():
    run_ranks(_all_wrappers, world_size=2)


def _bucketed_4(rank, world):
    _train_and_compare(rank, world, "BucketedDDP", "tied", 2, {"bucket_size_mb": 0.0005})
    _train_and_compare(rank, world, "FlatDDP", "toy", 1, {})


def test_ddp_bucketed_4ranks():
    run_ranks(_bucketed_4, world_size=4)


def _bf16_comm(rank, world):
    """comm_dtype=bfloat16: the averaged gradient is within bf16 rounding of the exact fp32 mean.

    Tolerance (stated in BucketedDDP's docstring): bf16 keeps 8 significant bits, so each rank's gradient
    is rounded with relative error <= 2^-8 and the sum rounds once more; for 2 ranks
    |g - mean_r g_r| <= 2^-7 * mean_r |g_r| (x1.01, +1e-7 for fp32 noise) element-wise. Exercises multi-parameter buckets, single-parameter buckets (which in fp32 are
    reduced in place) and gradient accumulation under no_sync.
    """
    from core.distributed.ddp import BucketedDDP

    for kind, accum, kw in [("tied", 1, {"bucket_size_mb": 0.0005}), ("toy", 2, {"bucket_size_mb": 0}),
                            ("tied", 2, {"bucket_size_mb": 1e-4, "first_bucket_size_mb": 0})]:
        local = make_toy(kind, seed=0)
        plain = copy.deepcopy(local)  # this rank's un-reduced gradients, for the reference
        model = BucketedDDP(local, process_group=None, comm_dtype="bfloat16", **kw)
        rounded = False
        for step, (x, y) in enumerate(toy_batches(kind, steps=3, batch=8)):
            xl, yl = x.chunk(world)[rank], y.chunk(world)[rank]
            for i, (xm, ym) in enumerate(zip(xl.chunk(accum), yl.chunk(accum))):
                (toy_loss(plain(xm), ym) / accum).backward()
                ctx = model.no_sync() if i < accum - 1 else torch.enable_grad()
                with ctx:
                    (toy_loss(model(xm), ym) / accum).backward()
            model.finish_gradient_synchronization()
            for p_plain, p in zip(plain.parameters(), model.module.parameters()):
                if not p.requires_grad:
                    continue
                assert p.grad.dtype == torch.float32
                gathered = [torch.empty_like(p_plain.grad) for _ in range(world)]
                dist.all_gather(gathered, p_plain.grad)
                mean = torch.stack(gathered).mean(0)
                tol = 1.01 * 2.0**-7 * torch.stack(gathered).abs().mean(0) + 1e-7
                err = (p.grad - mean).abs()
                assert (err <= tol).all(), (kind, accum, step, (err - tol).max())
                rounded |= not torch.equal(p.grad, mean)
            for p in list(plain.parameters()) + list(model.module.parameters()):
                p.grad = None
        assert rounded, kind  # the gradients really went through bf16


def test_ddp_bucketed_bf16_comm_2ranks():
    run_ranks(_bf16_comm, world_size=2)


def _broadcast_in_small_chunks(rank, world):
    from core.distributed.comm import broadcast_module

    ref = make_toy("tied", seed=0)
    local = make_toy("tied", seed=rank)
    local.register_buffer("steps", torch.tensor([rank, rank + 1], dtype=torch.int64))  # a second dtype
    # 64-byte chunks: small tensors flush mid-way, larger ones go in place; every path is taken
    broadcast_module(local, None, chunk_bytes=64)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), local.parameters()))
    assert local.steps.tolist() == [0, 1]


def test_broadcast_module_chunks_match_rank0():
    run_ranks(_broadcast_in_small_chunks, world_size=2)


# ---- compute_dtype=bfloat16: the wrapper's own bf16 Linear parameters, gradients reduced in bf16 ----------
def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _local_grads(model, batches, accum):
    """This rank's gradients under plain bf16 autocast: per micro-step (fp32, widened from bf16) and their
    fp32 sum, accumulated as AccumulateGrad does."""
    per_micro, total = [], {}
    for xm, ym in batches:
        model.zero_grad(set_to_none=True)
        with _autocast():
            loss = toy_loss(model(xm), ym) / accum
        loss.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        per_micro.append(g)
        for n, t in g.items():
            total[n] = t.clone() if n not in total else total[n].add_(t)
    model.zero_grad(set_to_none=True)
    return per_micro, total


def _gather(t, world):
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return out


def _expected_bf16_mean(local, world):
    """What the cast parameters' .grad must be: each rank's local fp32 gradient rounded to bf16, the two added
    in bf16 (gloo rounds float(a) + float(b)), halved in fp32 (exact for 2 ranks)."""
    l0, l1 = _gather(local, world)
    return (l0.bfloat16().float() + l1.bfloat16().float()).bfloat16().float() / world


def _bf16_compute_train(rank, world, kind, accum, kw, steps=3, lr=0.05):
    """compute_dtype=bfloat16 on 2 ranks with plain SGD, each step against (a) this rank's own autocast
    gradients, exactly, and (b) single-process autocast training on the whole batch, within bf16 rounding.

    (a) Each rank's local gradient L_r (its micro-steps' autocast gradients, summed in fp32) is rounded to bf16
    once (a no-op without accumulation: autocast's gradient is bf16), gloo adds the ranks' in bf16
    (R(float(a) + float(b))) and the wrapper halves the sum in fp32: p.grad == R(R(L_0) + R(L_1)) / 2 bitwise
    for the cast parameters; the others get the fp32 mean.
    (b) The reference restarts each step from the wrapper's parameters and takes one SGD step on the whole
    batch: G = sum_i R(a_i) over micro-steps i. (Over several steps the two would drift apart by more than
    rounding: a one-ulp bf16 flip of a weight moves a logit by 2^-8 of its size.) A cast parameter's gradient
    goes through at most four roundings to bf16 (each rank's micro-step gradient, R(L_r), the bf16 addition,
    the reference's own), each within 2^-8 of what it rounds, so per element |p - p_ref| <= lr * 4 * 2^-8 * U,
    U = sum_i mean_r |g_r,i| (+1e-6: fp32). fp32-path parameters get 16 * 2^-8: CPU autocast runs LayerNorm
    in bf16 and its parameter gradients round in a row-count-dependent order (8 rows against two halves of 4:
    up to 6 * 2^-8 * U measured). Measured worst: 0.52 of the bound. A reduction that skipped the average or a
    bucket is off by about lr * |g|: 2^8 / 4 times the bound (checked by breaking either: 62-64x).
    """
    from core.distributed.ddp import BucketedDDP

    model = BucketedDDP(make_toy(kind, seed=rank), process_group=None, compute_dtype="bfloat16", **kw)
    ref = make_toy(kind, seed=0)
    cast = {n for n, p in model.module.named_parameters() if id(p) in model._leaf}
    expect_cast = {"fc1.weight", "fc2.weight"} | ({"fc1.bias"} if kind == "tied" else set())
    assert cast == expect_cast, cast  # not the frozen Linear, nor the head weight tied to the embedding
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for x, y in toy_batches(kind, steps=steps, batch=8):
        micro = list(zip(x.chunk(accum), y.chunk(accum)))
        halves = [(xm.chunk(world)[rank], ym.chunk(world)[rank]) for xm, ym in micro]
        ref.load_state_dict(model.module.state_dict())
        per_micro, local = _local_grads(ref, halves, accum)  # (a): this rank's own autocast gradients
        _, whole = _local_grads(ref, micro, accum)           # (b): the single-process step
        for n, p in ref.named_parameters():
            p.grad = whole.get(n)
        opt_ref.step()
        for i, (xl, yl) in enumerate(halves):
            with model.no_sync() if i < accum - 1 else contextlib.nullcontext():
                with _autocast():
                    loss = toy_loss(model(xl), yl) / accum
                loss.backward()
        assert all(s.grad is not None for s in model._leaves)  # the bf16 gradients went to the leaves
        model.finish_gradient_synchronization()
        for n, p in model.module.named_parameters():
            if not p.requires_grad:
                assert p.grad is None
                continue
            assert p.grad.dtype == torch.float32 and p.grad.shape == p.shape, n
            if n in cast:
                expected = _expected_bf16_mean(local[n], world)
                assert torch.equal(p.grad, expected), (kind, accum, n, (p.grad - expected).abs().max())
            else:
                assert torch.allclose(p.grad, sum(_gather(local[n], world)) / world), (kind, accum, n)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for (n, p_ref), p in zip(ref.named_parameters(), model.module.parameters()):
            u = sum(torch.stack(_gather(g[n], world)).abs().mean(0) for g in per_micro) if n in local else 0
            tol = lr * (4 if n in cast else 16) * 2.0**-8 * u + 1e-6
            err = (p - p_ref).abs()
            assert (err <= tol).all(), (kind, accum, n, (err / tol).max())
    assert model.module.head.weight is model.module.emb.weight if kind == "tied" else True


def _bf16_compute_checkpointed(rank, world):
    """Activation checkpointing (core.model, non-reentrant): the recomputed forward runs on the fp32
    parameters (autocast casts them again), yet the gradients reach the bf16 leaves, unchanged."""
    from core import activation_checkpointing
    from core.distributed.ddp import BucketedDDP
    from core.model import ModelConfig, TransformerLM

    cfg = ModelConfig(d_model=16, d_ff=32, n_layers=2, n_heads=2, vocab_size=37, context_length=8)
    models = []
    for every in (1, 0):
        lm = TransformerLM(cfg)
        lm.init_weights(seed=rank)  # ranks differ; the wrapper broadcasts rank 0's
        assert activation_checkpointing.apply(lm, every) == 2 * every
        models.append(BucketedDDP(lm, process_group=None, compute_dtype="bfloat16", bucket_size_mb=0.002))
    plain = TransformerLM(cfg)
    cast = {n for n, p in models[0].module.named_parameters() if id(p) in models[0]._leaf}
    assert cast == {n for n, _ in plain.named_parameters() if n.endswith(("proj.weight", "w1.weight", "w2.weight",
                                                                          "w3.weight", "lm_head.weight"))}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for x, y in toy_batches("tied", steps=2, batch=4):
        xl, yl = x.chunk(world)[rank], y.chunk(world)[rank]
        plain.load_state_dict(models[0].module.state_dict())
        _, local = _local_grads(plain, [(xl, yl)], 1)
        for m in models:
            with _autocast():
                loss = toy_loss(m(xl), yl)
            loss.backward()
            for s in m._leaves:  # before the reduction: bf16 gradients on the leaves, none on the parameters
                assert s.grad is not None and s.grad.dtype == torch.bfloat16 and m._master[id(s)].grad is None
            m.finish_gradient_synchronization()
        for (n, p_ck), p in zip(models[0].module.named_parameters(), models[1].module.parameters()):
            assert torch.equal(p_ck.grad, p.grad), n
            if n in cast:
                assert torch.equal(p_ck.grad, _expected_bf16_mean(local[n], world)), n
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)


class _Branchy(torch.nn.Module):
    """Two Linears, `b` only when asked: a parameter without gradient on the synced micro-step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(6, 5, bias=False)

    def forward(self, x, use_b=True):
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _bf16_compute_edges(rank, world):
    """A cast parameter used only in the no_sync micro-steps still gets its accumulated gradient reduced; a
    backward run in the other sync state than its forward still ends with the same gradients."""
    from core.distributed.ddp import BucketedDDP

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(10 + rank))
    for kw in ({"bucket_size_mb": 0}, {}):  # in place / one bucket
        torch.manual_seed(0)
        model = BucketedDDP(_Branchy(), process_group=None, compute_dtype="bfloat16", **kw)
        plain = copy.deepcopy(model.module)
        for i, use_b in enumerate((True, False)):
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                with _autocast():
                    loss = toy_loss(model(x, use_b), y) / 2
                loss.backward()
            with _autocast():
                loss = toy_loss(plain(x, use_b), y) / 2
            loss.backward()
        model.finish_gradient_synchronization()
        for n, p in model.module.named_parameters():
            assert torch.equal(p.grad, _expected_bf16_mean(dict(plain.named_parameters())[n].grad, world)), (kw, n)

    model = BucketedDDP(make_toy("toy", seed=0), process_group=None, compute_dtype="bfloat16")
    (x, y), = toy_batches("toy", steps=1, batch=4)
    _, local = _local_grads(copy.deepcopy(model.module), [(x, y)], 1)
    with _autocast():
        loss = toy_loss(model(x), y)
    with model.no_sync():
        loss.backward()
        model.finish_gradient_synchronization()
    for n, p in model.module.named_parameters():  # synced forward, backward under no_sync: kept locally
        assert (p.grad is None) if not p.requires_grad else torch.equal(p.grad, local[n]), n
    assert all(s.grad is None for s in model._leaves)
    model.zero_grad(set_to_none=True)
    with model.no_sync(), _autocast():
        loss = toy_loss(model(x), y)
    loss.backward()  # forward under no_sync (autocast's fp32 gradients), backward synced
    model.finish_gradient_synchronization()
    for n, p in model.module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, _expected_bf16_mean(local[n], world) if id(p) in model._leaf
                               else (sum(_gather(local[n], world)) / world)), n


def _bf16_compute(rank, world):
    for kind, accum, kw in [("tied", 1, {"bucket_size_mb": 0.0005}), ("toy", 2, {"bucket_size_mb": 0}),
                            ("tied", 2, {"bucket_size_mb": 1e-4, "first_bucket_size_mb": 0}),
                            ("tied", 1, {})]:
        _bf16_compute_train(rank, world, kind, accum, kw)
    _bf16_compute_checkpointed(rank, world)
    _bf16_compute_edges(rank, world)


def test_ddp_bucketed_bf16_compute_2ranks():
    run_ranks(_bf16_compute, world_size=2)


def test_ddp_bucketed_bf16_compute_one_rank_and_errors():
    """One rank: autocast's own path (bitwise), evaluation needs no autocast; misconfigurations are
    ConfigErrors naming the key."""
    from core.distributed.ddp import BucketedDDP
    from core.errors import ConfigError

    model = BucketedDDP(make_toy("tied", seed=0), compute_dtype="bfloat16")
    plain = copy.deepcopy(model.module)
    (x, y), = toy_batches("tied", steps=1, batch=4)
    _, local = _local_grads(plain, [(x, y)], 1)
    with _autocast():
        loss = toy_loss(model(x), y)
    loss.backward()
    model.finish_gradient_synchronization()
    for n, p in model.module.named_parameters():
        assert (p.grad is None) if not p.requires_grad else torch.equal(p.grad, local[n]), n
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    with pytest.raises(ConfigError, match=r"parallelism\.compute_dtype.*precision=bf16"):
        model(x)
    with pytest.raises(ConfigError, match=r"parallelism\.compute_dtype"), torch.autocast("cpu", enabled=False):
        model(x)
    with pytest.raises(ConfigError, match=r"parallelism\.comm_dtype"):
        BucketedDDP(make_toy("toy", seed=0), compute_dtype="bfloat16", comm_dtype="float32")
    with pytest.raises(ConfigError, match=r"parallelism\.compute_dtype"):
        BucketedDDP(make_toy("toy", seed=0), compute_dtype="float16")


@pytest.mark.parametrize("strategy", ["ddp_bucketed", "zero1"])
@pytest.mark.slow
def test_train_py_bf16_compute_dp2_cpu(tmp_path, strategy):
    """The trainer's path: bf16 autocast, gradient accumulation (no_sync micro-steps), checkpointed blocks (their
    recomputation runs zero1's pre-hooks again: no refresh there), evaluation with zero1's gathers in flight."""
    from tests.utils import TINY_SYNTHETIC_FIRST_LOSS, read_summary, run_train

    run_train([f"parallelism={strategy}", "parallelism.compute_dtype=bfloat16", "precision=bf16", "mesh=dp2",
               "mesh.device=cpu", "mesh.timeout_s=60", "model=tiny", "data=synthetic", "train.max_steps=4",
               "train.batch_size=4", "train.grad_accum_steps=2", "activation_checkpointing=1",
               "train.eval_every=0", "train.eval_batches=1", "logger=none", f"paths.output_root={tmp_path}"],
              tmp_path / "run", env={"PYTHONWARNINGS": "ignore"})
    s = read_summary(tmp_path / "run")
    assert s["status"] == "ok" and s["world_size"] == 2 and s["steps"] == 4 and s["precision"] == "bf16", s
    assert s["parallelism"] == strategy, s
    # the initialisation every strategy starts from (fp32 first loss 5.5708151), seen through bf16 autocast
    assert abs(s["first_loss"] - TINY_SYNTHETIC_FIRST_LOSS) < 1e-3 and s["final_loss"] != s["first_loss"], s
