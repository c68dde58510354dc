"""Pipeline parallelism on CPU ranks (gloo, fp32) against one process: each stage starts from one process's
weights, and every schedule (ours: GPipe, 1F1B, interleaved 1F1B, ZB-H1; torch.distributed.pipelining's:
ScheduleGPipe, Schedule1F1B) trains to the same losses and gradient norms step by step, alone (pp2) and under data
parallelism (dp2 x pp2). Our schedules' recorded timelines follow their definitions, torch's hold every
micro-batch's forward and backward on every rank; impossible configurations are refused in one line.

Every configuration is built by the real trainer (`core.trainer.build` on a composed config); one spawn runs
several configurations one after another (starting ranks costs seconds)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.distributed.pipeline import schedule_ops, stage_layers
from core.errors import ConfigError
from tests.dist_utils import run_ranks
from tests.utils import assert_refused_in_one_line, compose_cfg

STEPS = 3
# 4 blocks: each of 2 stages keeps 2, so dropped blocks sit before and after the kept ones
COMMON = ["model=tiny", "model.n_layers=4", "data=synthetic", "data.seq_len=32", f"train.max_steps={STEPS}",
          "optimizer.warmup_steps=1", "logger=none", "mesh.device=cpu", "mesh.timeout_s=120"]
PP2 = {  # mesh=dp1_pp2, train.batch_size=4: 4 micro-batches of one sequence
    "ours_gpipe": ["pipeline=ours", "pipeline.schedule=gpipe"],
    "ours_1f1b": ["pipeline=ours", "pipeline.schedule=1f1b"],
    "torch_gpipe": ["pipeline=torch", "pipeline.schedule=ScheduleGPipe"],
    "torch_1f1b": ["pipeline=torch", "pipeline.schedule=Schedule1F1B"],
}
PP2_SPLIT = {  # as PP2; interleaved: 2 chunks of one block per stage (stage 0 blocks 0 and 2, stage 1 1 and 3)
    "ours_interleaved_1f1b": ["pipeline=ours", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
    "ours_zb_h1": ["pipeline=ours", "pipeline.schedule=zb_h1"],
}
# configurations whose recorded order is checked against `schedule_ops`: (schedule, virtual stages)
ORDERED = {"ours_1f1b": ("1f1b", 1), "ours_interleaved_1f1b": ("interleaved_1f1b", 2), "ours_zb_h1": ("zb_h1", 1)}
FOUR_RANKS = {  # mesh=dp2_pp2, train.batch_size=8: 4 sequences per dp rank, 2 micro-batches; or tp2 x pp2
    "ours_1f1b_ddp_bucketed": ["pipeline=ours", "pipeline.schedule=1f1b", "parallelism=ddp_bucketed"],
    "torch_gpipe_ddp_bucketed": ["pipeline=torch", "pipeline.schedule=ScheduleGPipe", "parallelism=ddp_bucketed"],
    # our Megatron TP (sequence parallelism on: stages pass sequence shards) inside each stage, 8 sequences
    "ours_gpipe_tp2": ["mesh.dp_shard=1", "mesh.tp=2", "pipeline=ours", "pipeline.schedule=gpipe"],
    "torch_1f1b_tp2": ["mesh.dp_shard=1", "mesh.tp=2", "pipeline=torch", "pipeline.schedule=Schedule1F1B"],
}


def _train(cfg, measure_last: bool = False) -> dict:
    """STEPS optimizer steps through the trainer: each step's loss and grad norm, this rank's initial weights and
    its gradients of the first step (synchronised, before clipping), by parameter name, and the first step's
    timeline; with `measure_last`, the pipeline's measurements of the last step (`step_metrics`)."""
    from core.trainer import all_reduce_mean, build

    run = build(cfg)
    init = {n: p.detach().clone() for n, p in run.raw_model.named_parameters()}
    losses, norms, grads, timeline, saved, step_s = [], [], {}, None, None, 0.0
    measured: dict = {}
    for step in range(STEPS):
        run.pipeline.measure_communication(measure_last and step == STEPS - 1)
        loss = run.forward_backward(step)
        if measure_last and step == STEPS - 1:
            measured = run.pipeline.step_metrics()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in run.raw_model.named_parameters() if p.grad is not None}
            timeline, step_s = list(run.pipeline.timeline), run.pipeline.step_seconds
        norm, _ = run.optimizer_step(step, measure_norm=True)
        losses.append(all_reduce_mean(loss, run.mesh))
        norms.append(norm)
    if run.mesh.pp > 1:
        saved = run.pipeline.save_timeline(run)  # collective: every rank's last step, written by rank 0
    return {"losses": losses, "norms": norms, "grads": grads, "init": init, "timeline": timeline,
            "stage": getattr(run.pipeline, "stage", 0), "saved": saved, "model": run.raw_model,
            "step_s": step_s, "measured": measured}


def _reference(tmp: Path, batch: int) -> str:
    ref = _train(compose_cfg(COMMON + ["mesh=single", f"train.batch_size={batch}"], tmp / "single"))
    ref.pop("model")
    path = tmp / f"ref{batch}.pt"
    torch.save(ref, path)
    return str(path)


def _part(model: torch.nn.Module, pname: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a one-process tensor of parameter `pname` (all of it without tensor parallelism)."""
    from core.model import part_of_full

    return part_of_full(model.get_submodule(pname.rsplit(".", 1)[0]), full)


def _worker(rank: int, world: int, configs: dict, extra: list, ref_path: str, tmp: str) -> None:
    ref = torch.load(ref_path)
    for name, overrides in configs.items():
        out = _train(compose_cfg(COMMON + extra + overrides, Path(tmp) / name))
        for step, (a, b) in enumerate(zip(out["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} loss {a} != one process's {b}"
        for step, (a, b) in enumerate(zip(out["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} grad norm {a} != one process's {b}"
        # this stage holds its own parameters only, each initialised and differentiated as in one process
        assert 0 < len(out["init"]) < len(ref["init"]), f"{name}: stage holds {len(out['init'])} parameters"
        for pname, w in out["init"].items():
            want_w, want_g = (_part(out["model"], pname, ref[k][pname]) for k in ("init", "grads"))
            assert torch.equal(w, want_w), f"{name} {pname}: initial weight differs from one process's"
            assert torch.allclose(out["grads"][pname], want_g, rtol=1e-4, atol=1e-6), \
                f"{name} {pname}: gradient max error {(out['grads'][pname] - want_g).abs().max():.3e}"
        if name in ORDERED and "mesh=dp1_pp2" in extra:
            # the recorded order is the definition's (1F1B: pp-1-r warm-up forwards, then alternating, then
            # cool-down; the others as `schedule_ops` defines them, checked in the tests below)
            schedule, virtual = ORDERED[name]
            order = [(op, i) for op, i, _, _ in out["timeline"]]
            assert order == schedule_ops(schedule, out["stage"], 2, 4, virtual), f"{name} stage {out['stage']}: {order}"
            assert all(start <= end for _, _, start, end in out["timeline"])
            if rank == 0 and name == "ours_1f1b":  # the run directory gets every rank's timeline (and its picture)
                import json

                written = json.loads(out["saved"].read_text())
                assert [r["stage"] for r in written["ranks"]] == [0, 1]
                assert [tuple(e[:2]) for e in written["ranks"][1]["events"]] == \
                    [tuple(o) for o in schedule_ops("1f1b", 1, 2, 4)]
                assert out["saved"].with_suffix(".png").is_file()
        if name.startswith("torch_") and "mesh=dp1_pp2" in extra:
            # torch's schedules are recorded too: on each rank, every micro-batch's forward and backward of each
            # chunk once, the backward after its forward, a weight-gradient part (where a backward was split) after
            # its backward, all inside the step (so its bubble is measured)
            order = [(op, i) for op, i, _, _ in out["timeline"]]
            chunks = [""] if "pipeline.virtual_stages=2" not in overrides else ["0", "1"]
            for c in chunks:
                for kind in "FB":
                    assert sorted(i for op, i in order if op == kind + c) == list(range(4)), f"{name}: {order}"
                assert all(order.index(("F" + c, i)) < order.index(("B" + c, i)) for i in range(4)), order
                split = [i for op, i in order if op == "W" + c]
                assert len(set(split)) == len(split), order
                assert all(order.index(("B" + c, i)) < order.index(("W" + c, i)) for i in split), order
            assert len(order) == sum(1 for op, _ in order if op[1:] in chunks), order
            assert all(0 <= start <= end <= out["step_s"] for _, _, start, end in out["timeline"])
            if rank == 0 and name == "torch_1f1b":
                import json

                written = json.loads(out["saved"].read_text())
                assert [r["stage"] for r in written["ranks"]] == [0, 1]
                for r in written["ranks"]:
                    assert sorted(tuple(e[:2]) for e in r["events"]) == [(op, i) for op in "BF" for i in range(4)]
                assert out["saved"].with_suffix(".png").is_file()


def test_1f1b_order_is_warm_up_then_alternating():
    """The schedule's definition, per stage, before any run: stage r of p does p-1-r warm-up forwards."""
    assert schedule_ops("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                             ("B", 2), ("B", 3)]
    assert schedule_ops("1f1b", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                             ("F", 3), ("B", 3)]
    assert schedule_ops("1f1b", 0, 4, 6)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert schedule_ops("gpipe", 1, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_zb_h1_order_defers_each_weight_gradient_after_its_backward():
    """ZB-H1 is 1F1B's order of F and B; stage r runs W(i) right after B(i + r), so every W follows its own B and
    exactly W(m-1-r) .. W(m-1) run after the stage's last B (its tail bubble); at most p micro-batches in flight."""
    p, m = 4, 8
    for r in range(p):
        ops = schedule_ops("zb_h1", r, p, m)
        assert [o for o in ops if o[0] != "W"] == schedule_ops("1f1b", r, p, m)
        assert sorted(i for op, i in ops if op == "W") == list(range(m))
        for i in range(m):
            assert ops.index(("B", i)) < ops.index(("W", i)), f"stage {r}: W{i} before B{i}"
        last_b = max(n for n, (op, _) in enumerate(ops) if op == "B")
        assert ops[last_b + 1:] == [("W", i) for i in range(m - 1 - r, m)], f"stage {r}: {ops[last_b:]}"
        held, most = set(), 0  # micro-batches whose graph is alive: from F until W
        for op, i in ops:
            held = held | {i} if op == "F" else held - {i} if op == "W" else held
            most = max(most, len(held))
        assert most <= p, f"stage {r} holds {most} micro-batches"
    assert schedule_ops("zb_h1", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2),
                                              ("W", 1), ("F", 3), ("B", 3), ("W", 2), ("W", 3)]


def test_interleaved_order_is_megatrons_and_needs_no_matching():
    """Megatron's interleaved 1F1B on pp2 x v2 with 4 micro-batches: stage r warms up with 2(p-1-r) + (v-1)p
    forwards over (micro-batch, chunk) units taken in groups of p; backwards take the chunks in reverse. Chunk c of
    stage r holds block c*p + r. Every stage's receives, in its own order, meet its neighbours' sends in the order
    they were sent (so neither tags nor shape exchange are needed) and the schedules cannot deadlock."""
    assert stage_layers(4, 2, 0, 2) == [0, 2] and stage_layers(4, 2, 1, 2) == [1, 3]
    assert stage_layers(8, 2, 1, 2) == [2, 3, 6, 7]
    assert schedule_ops("interleaved_1f1b", 0, 2, 4, 2) == [
        ("F0", 0), ("F0", 1), ("F1", 0), ("F1", 1), ("F0", 2), ("B1", 0), ("F0", 3), ("B1", 1), ("F1", 2),
        ("B0", 0), ("F1", 3), ("B0", 1), ("B1", 2), ("B1", 3), ("B0", 2), ("B0", 3)]
    assert schedule_ops("interleaved_1f1b", 1, 2, 4, 2)[:4] == [("F0", 0), ("F0", 1), ("F1", 0), ("B1", 0)]
    for p, v, m in [(2, 2, 4), (2, 3, 2), (4, 2, 8), (4, 3, 4), (3, 2, 6)]:
        ops = {r: schedule_ops("interleaved_1f1b", r, p, m, v) for r in range(p)}
        for r in range(p):
            assert sorted(ops[r]) == sorted((f"{k}{c}", i) for k in "FB" for c in range(v) for i in range(m))
        links: dict = {}  # (sender, receiver) -> messages in flight, oldest first
        done = {r: 0 for r in range(p)}
        moved = True
        while moved:
            moved = False
            for r in range(p):
                while done[r] < len(ops[r]):
                    op, i = ops[r][done[r]]
                    s = int(op[1:]) * p + r  # the virtual stage
                    fwd = op[0] == "F"
                    if (s > 0 if fwd else s < p * v - 1):  # receives first: the activation or its gradient
                        queue = links.get(((r - 1) % p if fwd else (r + 1) % p, r), [])
                        if not queue:
                            break
                        assert queue.pop(0) == (op[0], i, s), f"p{p} v{v} m{m} stage {r}: {op}{i} got another"
                    if (s < p * v - 1 if fwd else s > 0):
                        dest = (r + 1) % p if fwd else (r - 1) % p
                        links.setdefault((r, dest), []).append((op[0], i, s + 1 if fwd else s - 1))
                    done[r] += 1
                    moved = True
        assert all(done[r] == len(ops[r]) for r in range(p)), f"p{p} v{v} m{m}: deadlock at {done}"


def test_planner_bubble_of_interleaved_and_zb_h1():
    """Interleaved: (p-1)/(v m + p-1) (Megatron); ZB-H1 with equal F, B, W parts: (p-1)/(3m + p-1)."""
    from core.planner import plan

    base = ["model=small", "precision=bf16", "planner.device=h100_sxm", "mesh=dp1_pp2", "train.batch_size=16",
            "pipeline.microbatches=8"]
    inter = plan(compose_cfg(base + ["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"])).to_dict()
    zb = plan(compose_cfg(base + ["pipeline.schedule=zb_h1"])).to_dict()
    ofob = plan(compose_cfg(base + ["pipeline.schedule=1f1b"])).to_dict()
    assert inter["pp_bubble_fraction"] == pytest.approx(1 / 17)
    assert zb["pp_bubble_fraction"] == pytest.approx(1 / 25)
    assert zb["memory"]["activations"] == ofob["memory"]["activations"]  # the same p micro-batches in flight


def test_pp2_schedules_match_one_process(tmp_path):
    ref = _reference(tmp_path, 4)
    run_ranks(_worker, world_size=2, timeout_s=120,
              args=(PP2, ["mesh=dp1_pp2", "train.batch_size=4", "pipeline.microbatches=4"], ref, str(tmp_path)))


def test_pp2_interleaved_and_zb_h1_match_one_process(tmp_path):
    ref = _reference(tmp_path, 4)
    run_ranks(_worker, world_size=2, timeout_s=120,
              args=(PP2_SPLIT, ["mesh=dp1_pp2", "train.batch_size=4", "pipeline.microbatches=4"], ref,
                    str(tmp_path)))


def test_dp2_pp2_and_tp2_pp2_match_one_process(tmp_path):
    ref = _reference(tmp_path, 8)
    run_ranks(_worker, world_size=4, timeout_s=120,
              args=(FOUR_RANKS, ["mesh=dp2_pp2", "train.batch_size=8", "pipeline.microbatches=2"], ref,
                    str(tmp_path)))


REFUSED = [  # (overrides beyond mesh=dp1_pp2, the key named)
    (["model.n_layers=3"], "mesh.pp"),
    (["pipeline.microbatches=3"], "pipeline.microbatches"),
    (["train.grad_accum_steps=2"], "train.grad_accum_steps"),
    (["pipeline.schedule=interleaved"], "pipeline.schedule"),
    (["pipeline.virtual_stages=2"], "pipeline.virtual_stages"),  # chunks without the interleaved schedule
    (["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "model.n_layers=6"],
     "pipeline.virtual_stages"),  # 2 stages x 2 chunks do not split 6 blocks
    (["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "pipeline.microbatches=1"],
     "pipeline.microbatches"),  # not a multiple of pp
    (["pipeline=torch", "pipeline.schedule=ScheduleInterleaved1F1B"], "pipeline.virtual_stages"),  # needs v >= 2
    (["pipeline=torch", "pipeline.schedule=ScheduleGPipe", "pipeline.virtual_stages=2"], "pipeline.virtual_stages"),
    (["pipeline=torch", "pipeline.schedule=ScheduleZBVZeroBubble", "pipeline.virtual_stages=4",
      "model.n_layers=8"], "pipeline.virtual_stages"),  # a V is two chunks
    (["pipeline=torch", "pipeline.schedule=ScheduleDualPipeV", "pipeline.virtual_stages=2",
      "pipeline.microbatches=2"], "pipeline.microbatches"),  # fewer micro-batches than its 4 stages
    (["pipeline=torch", "pipeline.schedule=Schedule1F1B", "pipeline.microbatches=1"], "pipeline.microbatches"),
    (["pipeline=torch", "pipeline.schedule=ScheduleLoopedBFS"], "pipeline.schedule"),  # not offered
    (["pipeline.balance=layers"], "pipeline.balance"),
    (["pipeline.balance=cost", "model.n_layers=1"], "mesh.pp"),  # fewer blocks than stages
    # FSDP2 reduces in the step's last backward: a whole one (not ZB-H1's B) through the FSDP2 module (not
    # torch's multi-chunk schedules, which run our chunk wrappers)
    (["mesh=dp2_pp2", "parallelism=torch_fsdp2", "pipeline.schedule=zb_h1", "pipeline.microbatches=2"],
     "parallelism"),
    (["mesh=dp2_pp2", "parallelism=torch_fsdp2", "pipeline=torch", "pipeline.schedule=ScheduleInterleaved1F1B",
      "pipeline.virtual_stages=2", "pipeline.microbatches=2"], "parallelism"),
    (["mesh=dp2_pp2", "parallelism=torch_ddp", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
      "pipeline.microbatches=2"], "parallelism"),  # the last backward reaches one chunk: torch's reducer would hang
    (["mesh.tp=2", "tensor_parallel=dtensor"], "tensor_parallel"),
    (["compile=true"], "compile"),
]


@pytest.mark.parametrize("overrides,key", REFUSED)
def test_unsupported_pipeline_configs_are_refused(overrides, key, tmp_path):
    from launchers.job import validate

    cfg = compose_cfg(["model=tiny", "data=synthetic", "mesh.device=cpu", "mesh=dp1_pp2", "train.batch_size=8",
                       *overrides], tmp_path)
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_devices=False)
    assert e.value.key == key, str(e.value)


def test_refusal_is_one_line_with_exit_code_2(tmp_path):
    assert_refused_in_one_line(["mesh=dp1_pp2", "model.n_layers=3"], tmp_path, "error: mesh.pp:", "n_layers=3")


def test_planner_counts_one_stage_the_bubble_and_the_schedules_activations():
    """Parameters of the last stage (its blocks, norm and head), activations of m (GPipe) or p (1F1B) micro-batches
    in flight, the bubble (p-1)/(m+p-1), and the stages' point-to-point bytes."""
    from core.planner import plan

    base = ["model=small", "precision=bf16", "planner.device=h100_sxm", "mesh=dp1_pp2", "train.batch_size=16",
            "pipeline.microbatches=8"]
    gpipe = plan(compose_cfg(base + ["pipeline.schedule=gpipe"])).to_dict()
    ofob = plan(compose_cfg(base + ["pipeline.schedule=1f1b"])).to_dict()
    one = plan(compose_cfg(["model=small", "precision=bf16", "planner.device=h100_sxm", "train.batch_size=16"]))
    m = compose_cfg(["model=small"]).model
    d, v, layers = m.d_model, m.vocab_size, m.n_layers
    block = (one.params - 2 * v * d - d) // layers
    assert gpipe["params"] == layers // 2 * block + v * d + d
    assert gpipe["memory"]["activations"] == 4 * ofob["memory"]["activations"]  # 8 micro-batches in flight vs 2
    assert gpipe["time_ms"]["pp_bubble_fraction"] == gpipe["pp_bubble_fraction"] == pytest.approx(1 / 9)
    p2p = [c for c in gpipe["collectives"] if c["name"] == "send_recv"]
    # each stage of two sends (or receives) every micro-batch's activation and receives (or sends) its gradient
    assert sum(c["bytes_per_step"] for c in p2p) == 2 * 8 * (16 // 8) * 512 * d * 4
