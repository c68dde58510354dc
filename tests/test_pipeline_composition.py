"""Pipeline parallelism composed with the sharding strategies and torch's DDP, and its checkpoints, on CPU ranks
(gloo, fp32) against one process.

dp2 x pp2 under zero1, zero1_rs, our fsdp (weights gathered once per step, gradients reduce-scattered once),
torch_fsdp2 (the same, counted at FSDP2's collectives) and torch_ddp (its reducer armed before the step's last
backward), with our and torch's schedules; our interleaved
1F1B under data parallelism and ZB-H1 under tensor parallelism; the 3D example (fsdp, dp_shard2 x tp2 x pp2, 8
ranks): every step's loss and gradient norm is one process's within 1e-4 relative. A pp2 checkpoint (each stage's
parameters and optimizer state under the whole model's names, through torch.distributed.checkpoint) resumes on pp2
and on one process with the uninterrupted run's next losses; our fsdp's dp2 x pp2 checkpoint resumes on dp2.

The training and comparison helpers are tests/test_pipeline_parallel.py's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_ranks
from tests.test_pipeline_parallel import COMMON, _reference
from tests.utils import assert_resumes_like, checkpoint_at_step_2, losses_by_step, resume_test_overrides

# mesh=dp2_pp2, train.batch_size=8: 4 sequences per dp rank, 2 micro-batches
DP2_PP2 = {
    "ours_1f1b_zero1": ["pipeline=ours", "pipeline.schedule=1f1b", "parallelism=zero1"],
    "torch_gpipe_zero1_rs": ["pipeline=torch", "pipeline.schedule=ScheduleGPipe", "parallelism=zero1_rs"],
    "ours_zb_h1_torch_ddp": ["pipeline=ours", "pipeline.schedule=zb_h1", "parallelism=torch_ddp"],
    "torch_1f1b_torch_ddp": ["pipeline=torch", "pipeline.schedule=Schedule1F1B", "parallelism=torch_ddp"],
    # interleaved (2 chunks of one block per stage) under our data parallelism: the last backward reaches one chunk
    "ours_interleaved_ddp_bucketed": ["pipeline=ours", "pipeline.schedule=interleaved_1f1b",
                                      "pipeline.virtual_stages=2", "parallelism=ddp_bucketed"],
    # ZB-H1 inside tensor parallelism (tp2 x pp2, 8 sequences per step)
    "ours_zb_h1_tp2": ["mesh.dp_shard=1", "mesh.tp=2", "pipeline=ours", "pipeline.schedule=zb_h1"],
}
# our fsdp's stages hold row shards: only their losses and norms are compared (the weights are padded shards)
FSDP = {
    "ours_1f1b_fsdp": ["pipeline=ours", "pipeline.schedule=1f1b", "parallelism=fsdp"],
    "ours_interleaved_fsdp": ["pipeline=ours", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
                              "parallelism=fsdp"],
    "torch_gpipe_fsdp": ["pipeline=torch", "pipeline.schedule=ScheduleGPipe", "parallelism=fsdp"],
}

# torch's FSDP2 on each stage over dp (its weights are DTensor shards: losses and norms compared, and each unit's
# all-gathers and reduce-scatters counted: once per step, whatever the micro-batches)
TORCH_FSDP2 = {
    "ours_1f1b_ddp_bucketed": ["pipeline=ours", "pipeline.schedule=1f1b", "parallelism=ddp_bucketed"],  # reference
    "ours_1f1b_torch_fsdp2": ["pipeline=ours", "pipeline.schedule=1f1b", "parallelism=torch_fsdp2"],
    "torch_1f1b_torch_fsdp2": ["pipeline=torch", "pipeline.schedule=Schedule1F1B", "parallelism=torch_fsdp2"],
    # the last backward reaches one chunk: FSDP2's end-of-backward reduces the other chunk's blocks
    "ours_interleaved_torch_fsdp2": ["pipeline=ours", "pipeline.schedule=interleaved_1f1b",
                                     "pipeline.virtual_stages=2", "parallelism=torch_fsdp2"],
}

# configurations whose last step is measured (activation peak, bubble): torch_fsdp2's against ddp_bucketed's
MEASURED = ("ours_1f1b_ddp_bucketed", "ours_1f1b_torch_fsdp2", "torch_1f1b_torch_fsdp2")


def _count_fsdp2_collectives() -> dict:
    """Counts, per FSDP2 parameter group, the all-gathers and gradient reductions (reduce-scatters) of the runs
    that follow in this process: {"gather": {...}, "reduce": {...}}."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    counts: dict = {"gather": {}, "reduce": {}}

    def counted(kind: str, plain):
        def call(*args, **kwargs):
            key = id(args[0][0])  # the group's first FSDPParam (both take the group's parameters first)
            counts[kind][key] = counts[kind].get(key, 0) + 1
            return plain(*args, **kwargs)
        return call

    pg.foreach_all_gather = counted("gather", pg.foreach_all_gather)
    pg.foreach_reduce = counted("reduce", pg.foreach_reduce)
    return counts


def _count_fsdp_collectives() -> dict:
    """Counts, per (FullyShardedDataParallel, unit index), the all-gathers launched and the reduce-scatters of the
    runs that follow in this process: {"gather": {...}, "reduce": {...}}."""
    from core.distributed import fsdp

    counts: dict = {"gather": {}, "reduce": {}}
    launch, reduce = fsdp.FullyShardedDataParallel._launch_gather, fsdp.FullyShardedDataParallel._launch_reduce_scatter

    def counted_launch(self, units, for_backward=False):
        before = {id(u): u.pending for u in units}
        launch(self, units, for_backward)
        for u in units:
            if u.pending is not None and u.pending is not before[id(u)]:
                key = (id(self), u.index)
                counts["gather"][key] = counts["gather"].get(key, 0) + 1

    def counted_reduce(self, unit, grad):
        key = (id(self), unit.index)
        counts["reduce"][key] = counts["reduce"].get(key, 0) + 1
        reduce(self, unit, grad)

    fsdp.FullyShardedDataParallel._launch_gather = counted_launch
    fsdp.FullyShardedDataParallel._launch_reduce_scatter = counted_reduce
    return counts


def _compare_worker(rank: int, world: int, configs: dict, extra: list, ref_path: str, tmp: str) -> None:
    """Each configuration's losses and gradient norms against one process's; with whole parameters (not our
    fsdp's row shards) also this stage's initial weights and the synchronised gradients it keeps (ZeRO-1 drops
    those of parameters another rank owns); under our fsdp, each weight gathered once and reduce-scattered once per
    step, whatever the number of micro-batches."""
    import torch

    from tests.test_pipeline_parallel import STEPS, _part, _train
    from tests.utils import compose_cfg

    ref = torch.load(ref_path)
    counts = _count_fsdp_collectives()
    counts2 = _count_fsdp2_collectives()
    measured = {n: {} for n in configs if n in MEASURED}
    for name, overrides in configs.items():
        for c in (*counts.values(), *counts2.values()):
            c.clear()
        out = _train(compose_cfg(COMMON + extra + overrides, Path(tmp) / name), measure_last=name in measured)
        measured[name] = out["measured"]
        for key in ("losses", "norms"):
            for step, (a, b) in enumerate(zip(out[key], ref[key])):
                assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} {key[:-1]} {a} != one process's {b}"
        if "parallelism=torch_fsdp2" in overrides + extra:
            # gathered at the step's first use and kept (reshard_after_forward off), reduced after the last backward
            assert counts2["reduce"] and set(counts2["reduce"].values()) == {STEPS}, f"{name}: {counts2['reduce']}"
            assert counts2["gather"].keys() == counts2["reduce"].keys() and \
                set(counts2["gather"].values()) == {STEPS}, f"{name}: all-gathers per group {counts2['gather']}"
            if name in MEASURED:
                # the activations the stage saved are the same stage's under ddp_bucketed (the weights FSDP2
                # gathers are parameters, not activations), and the measured step has its bubble
                want = measured["ours_1f1b_ddp_bucketed"]["pp_activation_peak_mib"]
                got = out["measured"]["pp_activation_peak_mib"]
                assert abs(got - want) <= 1e-3 * want, f"{name}: activations {got} MiB, ddp_bucketed's {want} MiB"
                assert 0 <= out["measured"]["pp_bubble_fraction"] < 1, out["measured"]
            continue
        if "parallelism=fsdp" in overrides + extra:
            assert counts["reduce"] and set(counts["reduce"].values()) == {STEPS}, f"{name}: {counts['reduce']}"
            assert counts["gather"].keys() == counts["reduce"].keys() and set(counts["gather"].values()) == {STEPS}, \
                f"{name}: all-gathers per weight {counts['gather']}"
            continue
        assert 0 < len(out["init"]) < len(ref["init"]), f"{name}: stage holds {len(out['init'])} parameters"
        assert out["grads"], f"{name}: no gradient kept"
        for pname, w in out["init"].items():
            assert torch.equal(w, _part(out["model"], pname, ref["init"][pname])), f"{name} {pname}: initial weight"
            if pname in out["grads"]:
                want = _part(out["model"], pname, ref["grads"][pname])
                assert torch.allclose(out["grads"][pname], want, rtol=1e-4, atol=1e-6), \
                    f"{name} {pname}: gradient max error {(out['grads'][pname] - want).abs().max():.3e}"


@pytest.mark.slow
def test_dp2_pp2_sharded_and_torch_ddp_match_one_process(tmp_path):
    ref = _reference(tmp_path, 8)
    extra = ["mesh=dp2_pp2", "train.batch_size=8", "pipeline.microbatches=2"]
    run_ranks(_compare_worker, world_size=4, timeout_s=240, args=({**DP2_PP2, **FSDP}, extra, ref, str(tmp_path)))


@pytest.mark.slow
def test_dp2_pp2_torch_fsdp2_matches_one_process(tmp_path):
    """torch's FSDP2 on each stage over dp2 x pp2 (4 ranks), under our 1F1B and interleaved 1F1B and torch's
    Schedule1F1B (which drives the FSDP2 module itself): one process's losses and gradient norms, each weight
    gathered once and its gradient reduce-scattered once per step, and the same activations as ddp_bucketed."""
    ref = _reference(tmp_path, 8)
    extra = ["mesh=dp2_pp2", "train.batch_size=8", "pipeline.microbatches=2"]
    run_ranks(_compare_worker, world_size=4, timeout_s=240, args=(TORCH_FSDP2, extra, ref, str(tmp_path)))


@pytest.mark.slow  # 8 ranks on 2 cores
def test_3d_fsdp_tp2_pp2_matches_one_process(tmp_path):
    """The README's 3D example: our fsdp over dp_shard=2, our tensor parallelism tp=2, pp=2 (8 ranks)."""
    ref = _reference(tmp_path, 8)
    extra = ["mesh=dp2_pp2", "mesh.tp=2", "train.batch_size=8", "pipeline.microbatches=2", "parallelism=fsdp"]
    run_ranks(_compare_worker, world_size=8, timeout_s=240,
              args=({"ours_1f1b_fsdp_tp2": ["pipeline=ours"]}, extra, ref, str(tmp_path)))


@pytest.mark.slow
def test_pp2_checkpoint_resumes_on_pp2_and_on_one_process(tmp_path):
    """A pp2 run saves each stage's parameters and AdamW state under the whole model's names (DCP); resumed at
    step 2 on pp2 it continues bit for bit, and on one process and on tp2 without a pipeline
    (resume_allow_changes=[mesh,world_size]) with the uninterrupted run's next losses."""
    common = resume_test_overrides(tmp_path, "model.n_layers=2", "train.batch_size=4", "train.max_steps=4",
                                   "parallelism=none")
    first = tmp_path / "pp2"
    step2 = checkpoint_at_step_2(common + ["mesh=dp1_pp2"], first)
    targets = {"same": ["mesh=dp1_pp2"], "single": ["mesh=single"], "tp2": ["mesh=dp1_tp2"]}
    assert_resumes_like(losses_by_step(first), step2, common, targets, tmp_path, steps=(3, 4), rtol=1e-4)


@pytest.mark.slow
def test_fsdp_pp2_checkpoint_resumes_without_pipeline(tmp_path):
    """Our fsdp under dp2 x pp2 saves each stage's row shards by the whole model's names; a dp2 run without a
    pipeline resumes from it with the uninterrupted run's next losses."""
    common = resume_test_overrides(tmp_path, "model.n_layers=2", "train.batch_size=4", "train.max_steps=3",
                                   "parallelism=fsdp", "pipeline.microbatches=2")
    first = tmp_path / "dp2_pp2"
    step2 = checkpoint_at_step_2(common + ["mesh=dp2_pp2"], first, require_dcp=False)
    assert_resumes_like(losses_by_step(first), step2, common, {"dp2": ["mesh=dp2"]}, tmp_path, steps=(3,),
                        rtol=1e-4)
