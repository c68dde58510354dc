"""Expert parallelism (core/distributed/expert_parallel.py) against one process: per-step training losses through
train.py (ddp_bucketed and zero1, ep2 on dp_shard2), an ep2 checkpoint resumed on ep2 and on one process, each rank's
gradients against a float64 single-process reference on 2 and 4 gloo ranks (ep = dp_shard, and ep2 on dp_shard4 where
two ranks hold the same experts), the refusals, and the planner's all-to-all bytes against what a real step sent."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from core.errors import ConfigError
from tests.dist_utils import run_ranks
from tests.utils import compose_cfg, train_py

B, T = 2, 8  # sequences per rank, tokens per sequence (the gradient checks)


def _model_cfg(capacity_factor=None, shared=False):
    from core.model import ModelConfig

    return ModelConfig(d_model=32, d_ff=48, n_layers=2, n_heads=2, vocab_size=64, context_length=16, name="t",
                       n_experts=4, top_k=2, capacity_factor=capacity_factor, shared_expert=shared,
                       aux_loss_coef=0.1)


def _reference_grads(cfg, x, y, world: int) -> dict[str, torch.Tensor]:
    """One process in float64: the ranks' rows as `world` accumulated micro-batches (what dp averages)."""
    from core.model import TransformerLM

    ref = TransformerLM(cfg)
    ref.init_weights(seed=0)
    ref.double()
    for r in range(world):
        rows = slice(r * B, (r + 1) * B)
        loss = F.cross_entropy(ref(x[rows]).flatten(0, 1), y[rows].flatten()) + cfg.aux_loss_coef * ref.aux_loss()
        (loss / world).backward()
    named = list(ref.named_parameters())
    return {n: p.grad for n, p in named} | {f"weight:{n}": p.detach() for n, p in named}


class _Counter:
    """Sums the bytes each kind of collective is handed (all_to_all_single's input, all_reduce's tensor) by wrapping
    torch.distributed's functions, which our code looks up at each call."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.on = False
        for name, payload in (("all_to_all_single", lambda out, inp, *a, **k: inp),
                              ("all_reduce", lambda t, *a, **k: t)):
            self._wrap(name, payload)

    def _wrap(self, name, payload) -> None:
        import torch.distributed as dist

        fn = getattr(dist, name)

        def call(*args, **kwargs):
            t = payload(*args, **kwargs)
            if self.on and t.numel() > 1:
                key = f"{name}:{'float' if t.is_floating_point() else 'int'}"
                self.bytes[key] = self.bytes.get(key, 0) + t.numel() * t.element_size()
            return fn(*args, **kwargs)
        setattr(dist, name, call)


def _check_case(rank: int, world: int, ep: int, capacity_factor, shared: bool, strategy_name: str,
                out_dir: str | None = None) -> None:
    from core.distributed.ddp import DDPBucketedStrategy, DDPNaiveStrategy
    from core.distributed.expert_parallel import ExpertParallel
    from core.distributed.mesh import ParallelMesh
    from core.model import TransformerLM
    from core.moe import MoEFeedForward

    cfg = _model_cfg(capacity_factor, shared)
    mesh = ParallelMesh(dp_shard=world, ep=ep, device="cpu").init()
    with torch.device("meta"):
        model = TransformerLM(cfg)
    plugin = ExpertParallel()
    plugin.apply(model, mesh)
    strategy = {"ddp_bucketed": DDPBucketedStrategy, "ddp_naive": DDPNaiveStrategy}[strategy_name]()
    wrapped = strategy.setup(model, mesh, functools.partial(TransformerLM.init_weights_each, seed=0))
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (world * B, T + 1), generator=gen)  # the global batch, every rank
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = slice(rank * B, (rank + 1) * B)
    counter = _Counter() if out_dir else None
    if counter:
        counter.on = True
    loss = F.cross_entropy(wrapped(x[rows]).flatten(0, 1), y[rows].flatten()) + cfg.aux_loss_coef * model.aux_loss()
    loss.backward()
    strategy.finish_gradient_synchronization()
    plugin.finish_gradients(model)
    if counter:
        counter.on = False
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({**counter.bytes, "param_bytes": params}, f)
    ref = _reference_grads(cfg, x, y, world)
    slices = {f"{n}.{w}": m.expert_slice for n, m in model.named_modules() if isinstance(m, MoEFeedForward)
              for w in ("w1", "w3", "w2")}
    position = rank % ep  # ep groups are ep consecutive ranks
    for name, p in model.named_parameters():
        g_ref, w_ref = ref[name], ref[f"weight:{name}"]
        if name in slices:  # this rank's experts: its slice of one process's
            per = cfg.n_experts // ep
            assert slices[name] == slice(position * per, (position + 1) * per), (name, slices[name])
            g_ref, w_ref = g_ref[slices[name]], w_ref[slices[name]]
        assert p.shape == w_ref.shape, name
        torch.testing.assert_close(p.detach().double(), w_ref, rtol=0, atol=0, msg=f"{name}: initial weights")
        scale = float(g_ref.abs().max()) or 1.0
        torch.testing.assert_close(p.grad.double(), g_ref, rtol=1e-4, atol=1e-4 * scale,
                                   msg=lambda m, name=name: f"ep={ep} rank {rank} {name}: {m}")
    del wrapped, strategy, plugin, model


def _idle_rank_case(rank: int, world: int) -> None:
    """Every token picks expert 0 (rank 0's): rank 1 receives no copy, yet must join the backward's all-to-alls (it
    hung before); its experts' gradient is zero, rank 0's equals one process's over both ranks' tokens."""
    from core.distributed.expert_parallel import ExpertParallel
    from core.distributed.mesh import ParallelMesh
    from core.moe import MoEFeedForward

    def forced(moe: MoEFeedForward) -> None:
        torch.manual_seed(0)
        for p in moe.parameters():
            torch.nn.init.normal_(p)
        with torch.no_grad():
            moe.router.weight[0], moe.router.weight[1] = 1.0, -1.0  # positive inputs all choose expert 0

    mesh = ParallelMesh(dp_shard=world, ep=world, device="cpu").init()
    full = MoEFeedForward(8, 16, world, 1)
    forced(full)
    holder = torch.nn.Module()
    with torch.device("meta"):
        holder.moe = MoEFeedForward(8, 16, world, 1)
    plugin = ExpertParallel()
    plugin.apply(holder, mesh)
    holder.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(holder.moe.parameters(), full.parameters()):
            p.copy_(q[holder.moe.expert_slice] if p.shape != q.shape else q)
    xs = [torch.rand(5, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    holder.moe(xs[rank]).sum().backward()
    plugin.finish_gradients(holder)
    for x in xs:  # one process: the ranks' tokens as accumulated micro-batches, averaged
        (full(x).sum() / world).backward()
    for p, q in zip(holder.moe.expert_parameters(), full.expert_parameters()):
        torch.testing.assert_close(p.grad, q.grad[holder.moe.expert_slice], rtol=1e-5, atol=1e-6)
    assert rank == 0 or all(float(p.grad.abs().sum()) == 0 for p in holder.moe.expert_parameters())
    del plugin, holder


def _grads_ranks(rank: int, world: int, cases: list[tuple], idle_rank: bool = False) -> None:
    for case in cases:
        _check_case(rank, world, *case)
    if idle_rank:
        _idle_rank_case(rank, world)


def test_ep2_gradients_equal_one_process_slices_and_the_planner_counts_their_bytes(tmp_path):
    # dropless with the shared expert (overlapped dispatch; its bytes counted), a capacity that drops copies, and a
    # rank no copy reaches
    run_ranks(_grads_ranks, world_size=2, args=([(2, None, True, "ddp_bucketed", str(tmp_path)),
                                                 (2, 1.0, False, "ddp_naive")], True), timeout_s=60)
    from core.planner import plan

    counted = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cfg = compose_cfg(["model=tiny_moe", "model.d_model=32", "model.d_ff=48", "model.n_layers=2", "model.n_heads=2",
                       "model.vocab_size=64", "model.context_length=16", "model.shared_expert=true",
                       f"data.seq_len={T}", f"train.batch_size={2 * B}", "parallelism=ddp_bucketed",
                       "mesh.dp_shard=2", "mesh.ep=2", "mesh.device=cpu", "++planner.device=cpu"])
    prediction = plan(cfg)
    predicted = {(c.name, c.what): c.bytes_per_step for c in prediction.collectives}
    # the combine hands back what the rank received: equal per rank only on average over the ep group
    tokens = predicted["all_to_all", "dispatched tokens"] + predicted["all_to_all", "expert outputs"]
    assert tokens == sum(c["all_to_all_single:float"] for c in counted) / 2
    for c in counted:
        assert predicted["all_to_all", "expert counts"] == c["all_to_all_single:int"]
        assert predicted["all_reduce", "gradients"] == c["all_reduce:float"]  # the dense parameters only
        assert prediction.memory["parameters"] == c["param_bytes"]  # half of the experts
    assert ("all_reduce", "expert gradients") not in predicted  # ep = dp: no two ranks hold the same experts


def test_ep4_and_ep2_on_four_ranks_gradients_equal_one_process_slices():
    # ep = dp_shard = 4: every rank one expert; ep2 on dp_shard4: two ranks hold each half, summed over them
    run_ranks(_grads_ranks, world_size=4, args=([(4, None, False, "ddp_bucketed"), (2, None, True, "ddp_bucketed")],),
              timeout_s=60)


# ---- whole runs through train.py -------------------------------------------------------------------------------
def _train(run_dir, *overrides: str) -> list[dict]:
    argv = ["model=tiny_moe", "model.shared_expert=true", "data=synthetic", "data.seq_len=32", "train.max_steps=3",
            "train.batch_size=4", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "logger=none",
            "mesh.timeout_s=60", f"paths.output_root={run_dir}", f"hydra.run.dir={run_dir}/run", *overrides]
    proc = train_py(argv, timeout=240, env={"PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]  # the training steps (not the final evaluation)


@pytest.mark.slow
def test_ep2_trains_to_one_process_losses(tmp_path):
    # two ranks of 2 sequences each = one process accumulating two micro-batches of 2 (aux loss per micro-batch);
    # ZeRO-1: the dense optimizer state sharded over dp, each rank stepping its own experts; our FSDP: the dense
    # Linears sharded over dp, the experts whole on their ep rank (the DDP family's gradients are checked above)
    one = _train(tmp_path / "one", "train.grad_accum_steps=2")
    for strategy in ("zero1", "fsdp"):
        ep = _train(tmp_path / strategy, f"parallelism={strategy}", "mesh.dp_shard=2", "mesh.ep=2", "mesh.device=cpu")
        assert len(one) == len(ep) == 3 and all(math.isfinite(r["loss"]) for r in one)
        for a, b in zip(one, ep, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (strategy, one, ep)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (strategy, one, ep)  # clipped
        assert all(r["ep_comm_ms"] > 0 for r in ep), ep  # the all-to-alls were timed on the logged steps


@pytest.mark.slow
def test_ep2_checkpoint_resumes_on_ep2_and_on_one_process(tmp_path):
    """An ep2 run saves each rank's experts (and their AdamW state) as their slice of the whole layer's tensor, under
    the whole model's names (DCP): resumed at step 2 on ep2 it continues bit for bit, and on one process
    (resume_allow_changes=[mesh,world_size]) with the uninterrupted run's step-3 loss."""
    import torch.distributed.checkpoint as dcp

    common = ["parallelism=ddp_bucketed", "mesh.device=cpu", "model.shared_expert=false", "model.n_layers=2",
              "optimizer.warmup_steps=1"]
    whole = _train(tmp_path / "ep2", *common, "mesh=dp2_ep2", "checkpoint.every=2")
    step2 = tmp_path / "ep2" / "run" / "checkpoints" / "step_000002"
    meta = dcp.FileSystemReader(str(step2 / "dcp")).read_metadata().state_dict_metadata
    # the whole model's 4 experts, written in two halves (one per ep rank), moments alike
    for key in ("model.blocks.0.ffn.w1", "optimizer.blocks.1.ffn.w2.exp_avg_sq"):
        assert tuple(meta[key].size) == ((4, 128, 384) if "w2" in key else (4, 384, 128)), (key, meta[key].size)
        assert sorted(c.offsets[0] for c in meta[key].chunks) == [0, 2], meta[key].chunks
    for name, mesh in (("same", "mesh=dp2_ep2"), ("single", "mesh=single")):
        # one process accumulates the two ranks' rows as two micro-batches (the aux loss is per micro-batch)
        single = ["train.grad_accum_steps=2", "resume_allow_changes=[mesh,world_size,train.grad_accum_steps]"]
        resumed = _train(tmp_path / name, *common, mesh, f"resume={step2}",
                         *(single if name == "single" else ["resume_allow_changes=[mesh,world_size]"]))
        assert [r["step"] for r in resumed] == [3], resumed
        got, want = resumed[0]["loss"], whole[2]["loss"]
        if name == "same":  # the same ranks doing the same arithmetic
            assert got == want, (got, want)
        else:
            assert abs(got - want) <= 1e-4 * want, (got, want)


# ---- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key, words", [
    (["model=tiny_moe", "mesh.dp_shard=3", "mesh.ep=3", "train.batch_size=3"], "mesh.ep", "model.n_experts=4"),
    (["model=tiny_moe", "mesh.dp_shard=2", "mesh.ep=4"], "mesh.ep", "does not divide dp_shard x cp"),
    (["model=tiny", "mesh.dp_shard=2", "mesh.ep=2"], "mesh.ep", "is dense"),
    (["model=tiny_moe", "mesh.dp_shard=2", "mesh.ep=2", "parallelism=torch_fsdp2"], "parallelism",
     "parallelism=torch_fsdp2"),
])
def test_refused_before_start(overrides, key, words):
    from launchers.job import config_error_in, validate

    cfg = compose_cfg(["parallelism=ddp_bucketed", "mesh.device=cpu", *overrides])
    with pytest.raises(Exception) as e:  # noqa: PT011 - the mesh's own check reaches us wrapped by instantiate
        validate(cfg, check_devices=False)
    err = config_error_in(e.value)
    assert isinstance(err, ConfigError) and err.key == key and words in str(err), str(e.value)


def test_refusal_is_one_line_exit_2(tmp_path):
    proc = train_py(["model=tiny", "mesh.dp_shard=2", "mesh.ep=2", "parallelism=ddp_bucketed", "mesh.device=cpu",
                     f"hydra.run.dir={tmp_path}/run"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mesh.ep" in lines[0] and "dense" in lines[0], lines
