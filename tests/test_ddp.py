"""The four DDP wrappers against single-process training on the whole batch (2 gloo ranks)."""
import copy

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
