"""Our FSDP against single-process training on the whole batch (2 and 4 gloo ranks)."""
import torch
import torch.distributed as dist

from tests.dist_utils import make_toy, run_ranks, toy_batches, toy_loss

# compute_dtype=bfloat16: the reference is single-process training under bf16 autocast (same bf16
# matmuls); the difference left is bf16 rounding of each rank's partial gradient before the fp32
# reduce-scatter. Stated tolerance after 3 SGD steps (lr 0.01, momentum 0.9):
BF16_ATOL = 1e-3


def _fsdp_vs_single(rank, world, kind, compute_dtype, accum=1, prefetch=2, separate_rs=False):
    from core.distributed.fsdp import FullyShardedDataParallel

    ref = make_toy(kind, 0)
    rs_group = dist.new_group(ranks=list(range(world))) if separate_rs else None
    model = FullyShardedDataParallel(make_toy(kind, rank), compute_dtype=compute_dtype, prefetch=prefetch,
                                     reduce_scatter_group=rs_group)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    for x, y in toy_batches(kind, steps=3, batch=8):
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            with autocast:
                out_ref = ref(xm)
            (toy_loss(out_ref.float(), ym) / accum).backward()
        opt_ref.step(); opt_ref.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            with autocast:
                out = model(xm.chunk(world)[rank])
            (toy_loss(out.float(), ym.chunk(world)[rank]) / accum).backward()
        model.finish_gradient_synchronization()
        for u in model.units:  # gradients have the master shard's shape and dtype
            if u.shard.requires_grad:
                assert u.shard.grad is not None and u.shard.grad.shape == u.shard.shape
                assert u.shard.grad.dtype == u.shard.dtype == torch.float32
        opt.step(); opt.zero_grad(set_to_none=True)
        full = model.full_parameters()
        for n, p_ref in ref.named_parameters():
            if compute_dtype is None:
                assert torch.allclose(p_ref, full[n]), (kind, n, (p_ref - full[n]).abs().max())
            else:
                assert torch.allclose(p_ref, full[n], atol=BF16_ATOL, rtol=0), (n, (p_ref - full[n]).abs().max())
    # weights really are sharded: each rank holds about 1/world of every Linear/Embedding weight
    for u in model.units:
        assert u.shard.shape[0] == -(-u.full_shape[0] // world)
    assert len(model.units) == (2 if kind == "toy" else 4)  # tied emb/head is one unit


def _all2(rank, world):
    _fsdp_vs_single(rank, world, "toy", None)
    _fsdp_vs_single(rank, world, "tied", None, accum=2)
    _fsdp_vs_single(rank, world, "tied", None, prefetch=0)
    _fsdp_vs_single(rank, world, "tied", "bfloat16")
    _fsdp_vs_single(rank, world, "tied", None, accum=2, separate_rs=True)  # reduce-scatters in a group of their own


def test_fsdp_2ranks():
    run_ranks(_all2, world_size=2)


def _all4(rank, world):
    _fsdp_vs_single(rank, world, "tied", None)  # 37-row vocab: uneven shards with padding


def test_fsdp_4ranks():
    run_ranks(_all4, world_size=4)


def _transformer_vs_single(rank, world):
    """The real transformer: gathers grouped per block (one coalesced all-gather per block and pass) train
    like single-process training, as do per-weight gathers, with and without prefetch and accumulation."""
    from unittest import mock

    import core.distributed.fsdp as fsdp_mod
    from core.model import ModelConfig, TransformerLM

    cfg = ModelConfig(d_model=16, d_ff=24, n_layers=3, n_heads=2, vocab_size=37, context_length=8)

    def lm():
        m = TransformerLM(cfg)
        m.init_weights(seed=0)
        return m

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 37, (4, 8), generator=g) for _ in range(3)]
    cases = (("block", 2, 1, None), ("block", 1, 2, None), ("block", 0, 1, None), ("weight", 2, 1, None),
             ("block", 2, 1, "bfloat16"))
    for group_by, prefetch, accum, compute_dtype in cases:
        ref = lm()
        model = fsdp_mod.FullyShardedDataParallel(lm(), prefetch=prefetch, group_by=group_by,
                                                  compute_dtype=compute_dtype)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        launches = []
        coalesced = fsdp_mod.all_gather_coalesced
        for step, tokens in enumerate(batches):
            for t in tokens.chunk(accum):
                with autocast:
                    logits = ref(t[:, :-1])
                (toy_loss(logits.float(), t[:, 1:]) / accum).backward()
            opt_ref.step(); opt_ref.zero_grad(set_to_none=True)
            with mock.patch.object(fsdp_mod, "all_gather_coalesced",
                                   side_effect=lambda o, i, group=None: launches.append(len(o)) or coalesced(o, i, group)):
                for t in tokens.chunk(accum):
                    mine = t.chunk(world)[rank]
                    with autocast:
                        logits = model(mine[:, :-1])
                    (toy_loss(logits.float(), mine[:, 1:]) / accum).backward()
            model.finish_gradient_synchronization()
            opt.step(); opt.zero_grad(set_to_none=True)
            full = model.full_parameters()
            for n, p_ref in ref.named_parameters():
                atol = 1e-6 if compute_dtype is None else BF16_ATOL
                assert torch.allclose(p_ref, full[n], atol=atol, rtol=0), (group_by, step, n, (p_ref - full[n]).abs().max())
            if step == 2 and group_by == "block":
                # each pass: one coalesced gather of the 5 Linear weights of each of the 3 blocks (forward and
                # backward); embedding and head are groups of one and gather on their own
                assert launches == [5] * 6 * accum, launches
            if group_by == "weight":
                assert launches == [], launches
            launches.clear()


def test_fsdp_transformer_block_gathers():
    run_ranks(_transformer_vs_single, world_size=2)
