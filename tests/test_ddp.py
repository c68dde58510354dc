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
