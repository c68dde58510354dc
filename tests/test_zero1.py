"""ShardedOptimizer (ZeRO-1) against the unsharded optimizer and single-process training (gloo)."""
import torch

from tests.dist_utils import make_toy, run_ranks, toy_batches, toy_loss


def _groups(model):
    named = dict(model.named_parameters())
    return [
        {"params": [named["fc1.weight"], named["fc2.weight"]], "weight_decay": 0.1},
        {"params": [named["ln.weight"]], "weight_decay": 0.0, "lr": 3e-3},
    ], [named["ln.bias"]]


def _fake_grads(params, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g) for p in params]


def _bitwise_against_adamw(rank, world, grad_reduction):
    from core.distributed.zero1 import ShardedOptimizer

    ref, mine = make_toy("toy", 0), make_toy("toy", 0)
    g_ref, late_ref = _groups(ref)
    g_mine, late_mine = _groups(mine)
    opt_ref = torch.optim.AdamW(g_ref, lr=1e-2, betas=(0.9, 0.95))
    opt = ShardedOptimizer(g_mine, torch.optim.AdamW, grad_reduction=grad_reduction, lr=1e-2, betas=(0.9, 0.95))
    assert isinstance(opt, torch.optim.Optimizer)
    p_ref = [p for g in opt_ref.param_groups for p in g["params"]]
    p_mine = [p for g in opt.param_groups for p in g["params"]]
    for step in range(5):
        if step == 2:  # a group added later is sharded too
            opt_ref.add_param_group({"params": late_ref, "lr": 5e-3})
            opt.add_param_group({"params": late_mine, "lr": 5e-3})
            p_ref, p_mine = p_ref + late_ref, p_mine + late_mine
        if step == 3:  # hyperparameter changes (LR schedules) reach the shards
            for g in opt_ref.param_groups + opt.param_groups:
                g["lr"] *= 0.5
        if grad_reduction == "reduce_scatter":  # ranks see different gradients; the reference their mean
            per_rank = [_fake_grads(p_ref, step, r) for r in range(world)]
            mean = [sum(gs[i] for gs in per_rank) / world for i in range(len(p_ref))]
            for p, g in zip(p_ref, mean):
                p.grad = g
            for p, g in zip(p_mine, per_rank[rank]):
                p.grad = g.clone()
        else:
            for a, b, g in zip(p_ref, p_mine, _fake_grads(p_ref, step, 0)):
                a.grad, b.grad = g.clone(), g.clone()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        for a, b in zip(p_ref, p_mine):
            assert torch.equal(a, b), (grad_reduction, step, (a - b).abs().max())
    # state is sharded: this rank holds state only for its own parameters, about half of it
    owned = sum(p.numel() for p in opt.owned_params())
    total = sum(p.numel() for p in p_mine)
    assert len(opt.state) == len(opt.owned_params()) and owned < total
    # state_dict round trip into a fresh sharded optimizer continues identically
    sd = opt.state_dict()
    fresh = ShardedOptimizer([{"params": g["params"]} for g in opt.param_groups], torch.optim.AdamW,
                             grad_reduction=grad_reduction, lr=1.0, betas=(0.9, 0.95))
    fresh.load_state_dict(sd)
    for step in range(5, 7):
        gs = _fake_grads(p_ref, step, 0)
        for a, b, g in zip(p_ref, p_mine, gs):
            a.grad, b.grad = g.clone(), g.clone()
        opt_ref.step()
        fresh.step()
        opt_ref.zero_grad(set_to_none=True)
        fresh.zero_grad(set_to_none=True)
    for a, b in zip(p_ref, p_mine):
        assert torch.equal(a, b), ("after reload", (a - b).abs().max())


def _training_matches_single_process(rank, world):
    """End-to-end: our DDP gradients + sharded SGD equal single-process training on the whole batch."""
    from core.distributed.ddp import BucketedDDP
    from core.distributed.zero1 import ShardedOptimizer, _LocalGradients

    for mode in ("all_reduce", "reduce_scatter"):
        ref = make_toy("tied", 0)
        local = make_toy("tied", rank)
        model = BucketedDDP(local, bucket_size_mb=0.001) if mode == "all_reduce" else _LocalGradients(local)
        opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
        opt = ShardedOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.SGD,
                               grad_reduction=mode, lr=0.01, momentum=0.9)
        for x, y in toy_batches("tied", steps=4):
            toy_loss(ref(x), y).backward()
            opt_ref.step(); opt_ref.zero_grad(set_to_none=True)
            toy_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            model.finish_gradient_synchronization()
            opt.step(); opt.zero_grad(set_to_none=True)
            for (n, a), b in zip(ref.named_parameters(), model.module.parameters()):
                assert torch.allclose(a, b), (mode, n, (a - b).abs().max())


def _deferred_gather_bitwise(rank, world, grad_reduction):
    """The strategy's overlapped parameter gather (async after the step, waited in forward pre-hooks)
    stays bitwise equal to plain AdamW over several steps, with forward/eval, state_dict and
    full_parameters read between steps while gathers are still in flight."""
    from core.distributed.mesh import ParallelMesh
    from core.distributed.zero1 import Zero1Strategy

    mesh = ParallelMesh(dp_shard=world, device="cpu").init()
    ref = make_toy("toy", 0)
    strategy = Zero1Strategy(grad_reduction=grad_reduction, bucket_size_mb=0.0005, gather_bucket_mb=0.0002)
    assert strategy.overlap_param_gather  # the default
    wrapped = strategy.setup(make_toy("toy", rank), mesh, lambda m: None)  # ranks differ: rank 0 broadcast
    model = wrapped.module
    g_ref, late_ref = _groups(ref)
    g_mine, late_mine = _groups(model)
    opt_ref = torch.optim.AdamW(g_ref + [{"params": late_ref, "lr": 5e-3}], lr=1e-2, betas=(0.9, 0.95))
    opt = strategy.build_optimizer(wrapped, g_mine + [{"params": late_mine, "lr": 5e-3}],
                                   lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95)))
    p_ref = [p for g in opt_ref.param_groups for p in g["params"]]
    p_mine = [p for g in opt.param_groups for p in g["params"]]
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(7))
    for step in range(6):
        with torch.no_grad():  # forward reads parameters while gathers may be in flight: the hooks wait
            if step == 3:
                wrapped.eval()
            out = wrapped(x)
            wrapped.train()
            assert torch.equal(out, ref(x)), ("forward", step)
        assert not opt.has_pending_gathers  # every round holds a parameter used in forward
        if step == 2:
            sd = strategy.state_dict(wrapped, opt)["model"]
            assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
        if step == 4:
            full = strategy.full_parameters(wrapped)
            assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())
        if grad_reduction == "reduce_scatter":
            per_rank = [_fake_grads(p_ref, step, r) for r in range(world)]
            for p, g in zip(p_ref, [sum(gs[i] for gs in per_rank) / world for i in range(len(p_ref))]):
                p.grad = g
            for p, g in zip(p_mine, per_rank[rank]):
                p.grad = g.clone()
        else:
            for a, b, g in zip(p_ref, p_mine, _fake_grads(p_ref, step, 0)):
                a.grad, b.grad = g.clone(), g.clone()
        strategy.finish_gradient_synchronization() if grad_reduction == "reduce_scatter" else None
        opt_ref.step()
        opt.step()
        assert opt.has_pending_gathers  # launched, not waited: the next forward's hooks wait
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        if step in (1, 4):  # reading through the strategy waits too
            full = strategy.full_parameters(wrapped)
            assert all(torch.equal(full[n], p) for n, p in ref.named_parameters()), ("full", step)
    strategy.wait_for_parameters()  # end of training
    for a, b in zip(p_ref, p_mine):
        assert torch.equal(a, b), (grad_reduction, (a - b).abs().max())
    # parameters are views into the persistent gather buffers (in-place all-gather, no staging copies)
    bufs = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in opt._flat]
    assert len(bufs) > 1 and all(any(lo <= p.data_ptr() < hi for lo, hi in bufs) for p in p_mine)


def _all(rank, world):
    _bitwise_against_adamw(rank, world, "all_reduce")
    _bitwise_against_adamw(rank, world, "reduce_scatter")
    _training_matches_single_process(rank, world)
    _deferred_gather_bitwise(rank, world, "all_reduce")
    _deferred_gather_bitwise(rank, world, "reduce_scatter")


def test_zero1_2ranks():
    run_ranks(_all, world_size=2)


# ---- compute_dtype=bfloat16 (zero1's BucketedDDP runs the Linear layers on its own bf16 leaves) -----------
def _deferred_all_gather(real):
    """`all_gather_flat` whose asynchronous form delivers its data only at `wait()`: what the compute stream
    sees on NCCL before its stream wait. (A gloo gather may already be done when the forward reads the
    parameters, so a leaf refreshed before its gather wait would go unnoticed.) Until then the gathered
    buffer holds this rank's new slice and the other owners' previous values."""
    def gather(out, inp, group=None, async_op=False):
        if not async_op:
            return real(out, inp, group=group)
        landed = torch.empty_like(out)
        real(landed, inp, group=group)

        class Work:
            def wait(self):
                out.copy_(landed)
                return True
        return Work()
    return gather


def _bf16_compute_vs_ddp(rank, world, kind, overlap, optim, accum, steps=4):
    """zero1 with compute_dtype=bfloat16 under bf16 autocast against (a) ddp_bucketed with the same
    compute_dtype and the unsharded optimizer: losses, reduced gradients and parameters bitwise (ZeRO-1 is
    the unsharded optimizer given the same gradients, and both wrappers produce the same bf16 gradients);
    (b) with SGD, single-process autocast training on the whole batch, restarted each step from the
    parameters (as tests/test_ddp.py's _bf16_compute_train, whose tolerance this is: per element
    lr * 4 * 2^-8 * U for cast parameters, lr * 16 * 2^-8 * U for the fp32 path, U = sum over micro-steps
    of mean_r |g_r|, +1e-6). With `overlap` the parameter gathers land only when waited for
    (`_deferred_all_gather`), so a leaf cast before its module's gather wait holds the other owner's
    previous values and (a) fails (checked: refreshing before the wait, or the one-shot cast at the start
    of the forward, breaks the first comparison after a step)."""
    import contextlib

    import core.distributed.zero1 as zero1
    from core.distributed.ddp import BucketedDDP
    from core.distributed.mesh import ParallelMesh
    from tests.test_ddp import _autocast, _gather, _local_grads

    real_gather = zero1.all_gather_flat
    zero1.all_gather_flat = _deferred_all_gather(real_gather)
    try:
        mesh = ParallelMesh(dp_shard=world, device="cpu").init()
        kw = {"bucket_size_mb": 0.0005, "first_bucket_size_mb": 0.0002}
        strategy = zero1.Zero1Strategy(compute_dtype="bfloat16", overlap_param_gather=overlap,
                                       gather_bucket_mb=0.0002, **kw)
        wrapped = strategy.setup(make_toy(kind, rank), mesh, lambda m: None)  # ranks differ: rank 0 broadcast
        ddp = BucketedDDP(make_toy(kind, rank), compute_dtype="bfloat16", **kw)
        ref = make_toy(kind, 0)
        lr = 0.05 if optim == "sgd" else 1e-2
        make = (lambda g: torch.optim.SGD(g, lr=lr)) if optim == "sgd" else \
            (lambda g: torch.optim.AdamW(g, lr=lr, betas=(0.9, 0.95)))
        trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
        opt = strategy.build_optimizer(wrapped, [{"params": trainable(wrapped.module)}], make)
        opt_ddp, opt_ref = make(trainable(ddp.module)), make(trainable(ref))
        assert len(opt._local.param_groups[0]["params"]) < len(trainable(wrapped.module))  # really sharded
        cast = {n for n, p in wrapped.module.named_parameters() if id(p) in wrapped._leaf}
        assert cast and cast == {n for n, p in ddp.module.named_parameters() if id(p) in ddp._leaf}
        assert bool(wrapped._refresh_hooks) == overlap  # per-module refresh only behind the per-module waits
        z, d = dict(wrapped.module.named_parameters()), dict(ddp.module.named_parameters())
        expected = None  # (b): the reference's parameters after the previous step, and their tolerance

        def check_parameters(where):
            for n, p in z.items():
                assert torch.equal(p, d[n]), (kind, optim, where, n, (p - d[n]).abs().max())
            if expected is not None:
                for n, (want, tol) in expected.items():
                    err = (z[n] - want).abs()
                    assert (err <= tol).all(), (kind, where, n, (err / tol).max())

        for step, (x, y) in enumerate(toy_batches(kind, steps=steps, batch=8)):
            micro = list(zip(x.chunk(accum), y.chunk(accum)))
            halves = [(xm.chunk(world)[rank], ym.chunk(world)[rank]) for xm, ym in micro]
            if overlap and step == 2:  # evaluation with gathers in flight: the hooks wait, the leaves stay
                with torch.no_grad():
                    assert opt.has_pending_gathers
                    assert torch.equal(wrapped(halves[0][0]), ddp(halves[0][0])), step
                check_parameters(f"eval {step}")
            if optim == "sgd":  # (b) one single-process step on the whole batch from the same parameters
                ref.load_state_dict(ddp.module.state_dict())
                per_micro, _ = _local_grads(ref, halves, accum)
                _, whole = _local_grads(ref, micro, accum)
                for n, p in ref.named_parameters():
                    p.grad = whole.get(n)
                opt_ref.step()
                opt_ref.zero_grad(set_to_none=True)
            for i, (xl, yl) in enumerate(halves):
                last = i == accum - 1
                with strategy.gradient_sync(last):
                    with _autocast():
                        loss_z = toy_loss(wrapped(xl), yl) / accum
                    if i == 0 and step > 0:  # every round holds a parameter the forward used: all waited
                        assert not opt.has_pending_gathers
                        check_parameters(step)
                    loss_z.backward()
                with ddp.no_sync() if not last else contextlib.nullcontext():
                    with _autocast():
                        loss_d = toy_loss(ddp(xl), yl) / accum
                    loss_d.backward()
                assert torch.equal(loss_z, loss_d), (kind, optim, step, i)
            strategy.finish_gradient_synchronization()
            ddp.finish_gradient_synchronization()
            for n, p in z.items():
                assert (p.grad is None) == (d[n].grad is None), n
                assert p.grad is None or torch.equal(p.grad, d[n].grad), (kind, optim, step, n)
            opt.step()
            opt_ddp.step()
            opt.zero_grad(set_to_none=True)
            opt_ddp.zero_grad(set_to_none=True)
            assert opt.has_pending_gathers == overlap
            if optim == "sgd":
                expected = {}
                for n, p in ref.named_parameters():
                    if p.requires_grad:
                        u = sum(torch.stack(_gather(g[n], world)).abs().mean(0) for g in per_micro)
                        expected[n] = (p.detach().clone(), lr * (4 if n in cast else 16) * 2.0**-8 * u + 1e-6)
        strategy.wait_for_parameters()
        check_parameters("end")
    finally:
        zero1.all_gather_flat = real_gather


def _bf16_compute(rank, world):
    for kind, overlap, optim, accum in [("toy", True, "adamw", 1), ("tied", True, "sgd", 2),
                                        ("toy", True, "sgd", 1), ("tied", False, "adamw", 1)]:
        _bf16_compute_vs_ddp(rank, world, kind, overlap, optim, accum)


def test_zero1_bf16_compute_2ranks():
    run_ranks(_bf16_compute, world_size=2)


def test_zero1_rs_compute_dtype_is_a_config_error():
    import pytest

    from core.distributed.zero1 import Zero1RSStrategy, Zero1Strategy
    from core.errors import ConfigError

    for make in (lambda: Zero1RSStrategy(compute_dtype="bfloat16"),
                 lambda: Zero1Strategy(grad_reduction="reduce_scatter", compute_dtype="bfloat16")):
        with pytest.raises(ConfigError, match=r"parallelism\.compute_dtype.*Fix: set parallelism\.compute_dtype=null"
                                              r", or use parallelism=zero1"):
            make()
    assert Zero1RSStrategy().compute_dtype is None
    with pytest.raises(ConfigError, match=r"parallelism\.compute_dtype.*'float16'"):
        Zero1Strategy(compute_dtype="float16")
