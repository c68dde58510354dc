"""Tensor and sequence parallelism on CPU ranks (gloo, fp32) against one process: the same losses step by step,
the same gradient norms, and each rank's gradient equal to its part of the one-process gradient.

Every configuration is built by the real trainer (`core.trainer.build` on a composed config), so the parallelize
step, the plugins, the strategies' gradient synchronisation and clipping are all exercised. One spawn runs
several configurations one after another (starting ranks costs seconds)."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.utils import (assert_refused_in_one_line, assert_resumes_like, checkpoint_at_step_2, compose_cfg,
                         losses_by_step, read_metrics, read_summary, resume_test_overrides)

STEPS = 3
# GQA (2 KV heads for 4 query heads) so grouped KV heads are split too; 32 tokens so sequence parallelism splits them
COMMON = ["model=tiny", "model.n_kv_heads=2", "model.n_layers=2", "data=synthetic", "data.seq_len=32",
          "train.batch_size=4", f"train.max_steps={STEPS}", "optimizer.warmup_steps=1", "logger=none",
          "mesh.device=cpu", "mesh.timeout_s=120"]

TP2 = {  # mesh=dp1_tp2
    "megatron_sp": ["tensor_parallel=megatron"],
    "megatron_nosp": ["tensor_parallel=megatron", "tensor_parallel.sequence_parallel=false"],
    "dtensor_sp": ["tensor_parallel=dtensor"],
    "dtensor_nosp": ["tensor_parallel=dtensor", "tensor_parallel.sequence_parallel=false"],
}
DP2_TP2 = {  # mesh=dp2_tp2: 2 data-parallel groups of 2 tensor-parallel ranks
    "megatron_sp_ddp_bucketed": ["tensor_parallel=megatron", "parallelism=ddp_bucketed"],
    "megatron_nosp_zero1": ["tensor_parallel=megatron", "tensor_parallel.sequence_parallel=false",
                            "parallelism=zero1"],
    "megatron_sp_zero1_rs": ["tensor_parallel=megatron", "parallelism=zero1_rs"],
    "megatron_sp_torch_ddp": ["tensor_parallel=megatron", "parallelism=torch_ddp"],
    "megatron_sp_fsdp": ["tensor_parallel=megatron", "parallelism=fsdp"],  # 2D: our FSDP over dp x our TP
    "dtensor_sp_torch_fsdp2": ["tensor_parallel=dtensor", "parallelism=torch_fsdp2"],
    # HSDP x TP: FSDP2 replicated over dp_replicate, sharded over dp_shard (1 here), TP inside
    "dtensor_sp_torch_fsdp2_hsdp": ["tensor_parallel=dtensor", "parallelism=torch_fsdp2", "mesh.dp_shard=1",
                                    "mesh.dp_replicate=2"],
}


def _train(cfg, run_dir: Path) -> dict:
    """STEPS optimizer steps through the trainer: each step's global loss and grad norm, and this rank's gradients
    of the first step (after synchronisation, before clipping), by parameter name."""
    from core.trainer import all_reduce_mean, build

    run = build(cfg)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss = run.forward_backward(step)
        if step == 0:
            for name, p in run.raw_model.named_parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    grads[name] = g.detach().clone()
        norm, _ = run.optimizer_step(step, measure_norm=True)
        losses.append(all_reduce_mean(loss, run.mesh))
        norms.append(norm)
    return {"losses": losses, "norms": norms, "grads": grads, "model": run.raw_model}


def _reference(tmp: Path) -> dict:
    ref = _train(compose_cfg(COMMON + ["mesh=single"], tmp / "single"), tmp / "single")
    ref.pop("model")
    return ref


def _part(model: torch.nn.Module, pname: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full gradient of parameter `pname` (the mapping the init uses, checked by the losses:
    a wrong slice would start a rank from other weights than one process has)."""
    from core.model import part_of_full

    return part_of_full(model.get_submodule(pname.rsplit(".", 1)[0]), full)


def _worker(rank: int, world: int, configs: dict, mesh: str, ref_path: str, tmp: str) -> None:
    ref = torch.load(ref_path)
    for name, overrides in configs.items():
        cfg = compose_cfg(COMMON + [f"mesh={mesh}"] + overrides, Path(tmp) / name)
        out = _train(cfg, Path(tmp) / name)
        for step, (a, b) in enumerate(zip(out["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} loss {a} != one process's {b}"
        for step, (a, b) in enumerate(zip(out["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} grad norm {a} != one process's {b}"
        strategy = name.split("_", 2)[-1] if name.count("_") >= 2 else "none"
        if strategy.startswith(("zero1_rs", "fsdp", "torch_fsdp2")):
            continue  # gradients sharded over dp too (owned / FSDP2's strided shards): the norms cover them
        checked = 0
        for pname, full in ref["grads"].items():
            if pname not in out["grads"]:
                continue
            local = out["grads"][pname]
            want = _part(out["model"], pname, full)
            assert local.shape == want.shape, f"{name} {pname}: shape {tuple(local.shape)} != {tuple(want.shape)}"
            assert torch.allclose(local, want, rtol=1e-4, atol=1e-6), \
                f"{name} ({strategy}) {pname}: max error {(local - want).abs().max():.3e}"
            checked += 1
        assert checked >= len(ref["grads"]) // 2, f"{name}: only {checked} gradients compared"


def _count_worker(rank: int, world: int, tmp: str) -> None:
    """The planner's tensor-parallel terms against one real step: the bytes and calls of every collective the
    ranks issue (counted at torch.distributed), and each rank's parameter bytes."""
    import torch.distributed as dist

    import core.distributed.tensor_parallel as tp_mod
    from core.planner import plan, read_job, tensor_parallel_collectives
    from core.trainer import build

    counted: dict[str, list[int]] = {}

    def counting(name, fn, which):
        def wrapper(*args, **kwargs):
            t = args[which]
            calls, nbytes = counted.setdefault(name, [0, 0])
            counted[name] = [calls + 1, nbytes + t.numel() * t.element_size()]
            return fn(*args, **kwargs)
        return wrapper

    for sp in (True, False):
        cfg = compose_cfg(COMMON + ["mesh=dp1_tp2", f"tensor_parallel.sequence_parallel={sp}",
                                    "train.grad_accum_steps=2", "activation_checkpointing=2"], Path(tmp) / str(sp))
        run = build(cfg)
        counted.clear()
        originals = (dist.all_reduce, tp_mod.all_gather_flat, tp_mod.reduce_scatter_flat)
        dist.all_reduce = counting("all_reduce", dist.all_reduce, 0)
        tp_mod.all_gather_flat = counting("all_gather", tp_mod.all_gather_flat, 0)  # the gathered (full) size
        tp_mod.reduce_scatter_flat = counting("reduce_scatter", tp_mod.reduce_scatter_flat, 1)  # the full input
        try:
            run.forward_backward(0)
        finally:
            dist.all_reduce, tp_mod.all_gather_flat, tp_mod.reduce_scatter_flat = originals
        predicted: dict[str, list[int]] = {}
        for c in tensor_parallel_collectives(read_job(cfg)):
            calls, nbytes = predicted.setdefault(c.name, [0, 0])
            predicted[c.name] = [calls + c.calls, nbytes + c.bytes_per_step]
        assert predicted == counted, f"sequence_parallel={sp}: planned {predicted}, ran {counted}"
        param_bytes = sum(p.numel() * p.element_size() for p in run.raw_model.parameters())
        assert plan(cfg).memory["parameters"] == param_bytes


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_ref")
    ref = _reference(tmp)
    path = tmp / "ref.pt"
    torch.save(ref, path)
    return str(path), ref


def test_reference_is_a_real_run(reference):
    _, ref = reference
    assert len(ref["losses"]) == STEPS and all(math.isfinite(x) for x in ref["losses"])
    assert all(g.abs().max() > 0 for g in ref["grads"].values())  # every weight gets a gradient to compare
    assert len(ref["grads"]) == 2 * 5 + 2 * 2 + 3  # per block 5 Linears (qkv, out, w1-3) + 2 norms; emb, norm, head


def test_tp2_matches_one_process(reference, tmp_path):
    run_ranks(_worker, world_size=2, args=(TP2, "dp1_tp2", reference[0], str(tmp_path)), timeout_s=120)


@pytest.mark.slow
def test_dp2_tp2_matches_one_process(reference, tmp_path):
    run_ranks(_worker, world_size=4, args=(DP2_TP2, "dp2_tp2", reference[0], str(tmp_path)), timeout_s=120)


def test_planner_tensor_parallel_terms_match_a_real_step(tmp_path):
    run_ranks(_count_worker, world_size=2, args=(str(tmp_path),), timeout_s=120)


@pytest.mark.parametrize("overrides, key, words", [
    (["mesh.tp=3"], "mesh.tp", "does not divide model.n_heads=4"),
    (["mesh.tp=2", "data.seq_len=31"], "tensor_parallel.sequence_parallel", "does not divide"),
    (["mesh.tp=2", "parallelism=torch_fsdp2", "mesh.dp_shard=2"], "parallelism", "does not compose"),
    (["mesh.tp=2", "tensor_parallel=dtensor", "parallelism=ddp_bucketed", "mesh.dp_shard=2"], "parallelism",
     "does not compose"),
    (["mesh.tp=2", "tensor_parallel=dtensor", "checkpoint.every=2"], "checkpoint", "not implemented yet"),
])
def test_impossible_tensor_parallel_configs_are_one_line(overrides, key, words, tmp_path):
    assert_refused_in_one_line(overrides, tmp_path, f"error: {key}:", words)


def _boxes_with_a_stage_only_key(rank, world, directory):
    import torch.distributed.checkpoint as dcp

    from core.distributed.checkpoint_boxes import Boxed, as_checkpoint_entries

    full = torch.arange(12.0).reshape(4, 3)
    head = torch.arange(6.0).reshape(2, 3) + 100
    pieces = {"shared": Boxed((4, 3), torch.float32, [(full[2 * rank:2 * rank + 2].clone(), (2 * rank, 0))])}
    if rank == 0:  # a tensor only this "stage" holds: rank 1 has no such key
        pieces["stage0_only"] = Boxed((2, 3), torch.float32, [(head[:1].clone(), (0, 0)), (head[1:].clone(), (1, 0))])
    dcp.save(as_checkpoint_entries(pieces), checkpoint_id=directory)
    torch.distributed.barrier()
    if rank == 0:  # read back whole, as one process would
        whole = {"shared": torch.zeros(4, 3), "stage0_only": torch.zeros(2, 3)}
        dcp.load(whole, checkpoint_id=directory, no_dist=True)
        assert torch.equal(whole["shared"], full) and torch.equal(whole["stage0_only"], head)


def test_boxes_of_a_tensor_only_some_ranks_hold_save_and_read_back_whole(tmp_path):
    """Under pipeline parallelism a stage's tensors exist on its ranks only: the box exchange must not expect every
    key on every rank (it did: the 3D fsdp x tp x pp save failed with a KeyError)."""
    run_ranks(_boxes_with_a_stage_only_key, 2, args=(str(tmp_path / "ckpt"),))


def test_rows_in_full_name_the_full_weight_rows_of_every_fsdp_shard():
    """Our FSDP's checkpoint boxes: rows [lo, hi) of a rank's tensor-parallel part, for every dp shard (here 3 of
    7, 7 and 6 rows, two of them straddling the fused qkv's q/k and k/v segments), are the full weight's pieces
    the boxes name, compared with `shard_of_full` (the split the one-process comparisons above check)."""
    from torch import nn

    from core.distributed.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                  rows_in_full)

    world, dp = 2, 3
    for rank in range(world):
        modules = [ColumnParallelLinear(nn.Linear(6, 40, bias=False), rank, world, (24, 8, 8)),
                   RowParallelLinear(nn.Linear(40, 6, bias=False), rank, world),
                   VocabParallelEmbedding(nn.Embedding(40, 6), rank, world, lambda x: x), nn.Linear(6, 20, bias=False)]
        for module in modules:
            full = torch.randn(getattr(module, "full_weight_shape", None) or module.weight.shape)
            part = module.shard_of_full(full) if hasattr(module, "shard_of_full") else full
            rows = -(-part.shape[0] // dp)
            for d in range(dp):
                lo, hi = d * rows, min(part.shape[0], (d + 1) * rows)
                boxes = rows_in_full(module, lo, hi)
                assert [a for a, _, _ in boxes] == list(itertools.accumulate([lo] + [n for _, n, _ in boxes[:-1]]))
                got = torch.cat([full[r:r + n, c:c + part.shape[1]] for _, n, (r, c) in boxes])
                assert torch.equal(got, part[lo:hi]), (type(module).__name__, rank, d, boxes)
            assert len(rows_in_full(module, 7, 14)) == (2 if isinstance(module, ColumnParallelLinear) else 1)


@pytest.mark.parametrize("strategy, source, targets", [("ddp_bucketed", "dp1_tp2", ("same", "dp2", "single")),
                                                       ("zero1", "dp1_tp2", ("dp2",)),
                                                       ("fsdp", "dp2_tp2", ("dp4", "dp2"))])
@pytest.mark.slow
def test_checkpoint_resumes_on_another_mesh_shape(strategy, source, targets, tmp_path):
    """A tensor-parallel run's checkpoint (DCP, tp-sharded DTensors, qkv by segment; ZeRO-1: each rank's owned
    optimizer state; our FSDP: each rank's rows of its tp part as boxes of the one-process tensors) resumes
    exactly on its own mesh, and on other shapes with the next steps' losses of the uninterrupted run (the step
    after the resume checks the weights, the one after it the AdamW moments): dp1 x tp2 -> dp2 (2 ranks, no tp)
    and -> one process; fsdp dp2 x tp2 -> dp4 and -> dp2 (tp2 -> tp1)."""
    common = resume_test_overrides(tmp_path, "model.n_kv_heads=2", "model.n_layers=2", "train.batch_size=4",
                                   "train.max_steps=4", f"parallelism={strategy}")
    first = tmp_path / "tp2"
    step2 = checkpoint_at_step_2(common + [f"mesh={source}"], first)
    whole = losses_by_step(first)
    # the logged steps time each mesh axis's communication: tp's collectives run inline, all of them exposed
    rows = [r for r in read_metrics(first) if "loss" in r]
    for r in rows:
        assert r["tp_comm_ms"] > 0 and r["tp_exposed_comm_ms"] == r["tp_comm_ms"], r
        assert r["comm_ms"] == r["dp_comm_ms"] + r["tp_comm_ms"], r
    assert read_summary(first)["tp_comm_ms"] > 0
    meshes = {"same": [f"mesh={source}"], "dp2": ["mesh=dp2"], "dp4": ["mesh=dp4"], "single": ["mesh=single"]}
    assert_resumes_like(whole, step2, common, {name: meshes[name] for name in targets}, tmp_path, steps=(3, 4),
                        rtol=1e-5)


@pytest.mark.slow
def test_mesh_change_is_refused_for_a_checkpoint_that_cannot_reshard(tmp_path):
    """Without tensor parallelism a whole-tensor checkpoint (state.pt) does not resume on another mesh shape,
    even when the run allows it: one line naming the keys."""
    from tests.utils import run_train

    common = ["model=tiny", "model.n_layers=1", "data=synthetic", "data.seq_len=32", "train.batch_size=4",
              "train.max_steps=2", "train.eval_every=0", "train.eval_batches=1", "logger=none", "mesh.device=cpu",
              "parallelism=ddp_bucketed", f"paths.output_root={tmp_path}"]
    run_train(common + ["mesh=single", "checkpoint.every=2"], tmp_path / "a")
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    proc = run_train(common + ["mesh=dp2", f"resume={step2}", "resume_allow_changes=[mesh,world_size]"],
                     tmp_path / "b", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot be changed on resume" in proc.stderr and "mesh.dp_shard" in proc.stderr, proc.stderr[-2000:]
