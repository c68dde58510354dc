"""Pipeline schedules and their measurements on CPU ranks (gloo, fp32): torch's multi-stage schedules
(interleaved 1F1B, interleaved zero bubble, ZBV, DualPipeV) against one process; the stage split balanced by the
planner's per-layer cost (the cheapest costliest stage, and training still one process's); the measured saved
activations and point-to-point bytes of each rank against the planner's per-stage prediction; the bubble measured
from the recorded timelines of a run whose blocks cost a fixed sleep, against the planner's formula."""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch

from core.distributed.pipeline import balanced_pieces, bubble_fraction, layer_costs, piece_costs, stage_layers
from core.distributed.pipeline_torch import LOOPED, V_SHAPED, available_schedules
from tests import test_pipeline_parallel as pp_tests
from tests.dist_utils import run_ranks
from tests.utils import compose_cfg

PP2 = ["mesh=dp1_pp2", "train.batch_size=4", "pipeline.microbatches=4"]


def test_torch_multi_stage_schedules_match_one_process(tmp_path):
    """Each of torch's multi-stage schedules the installed torch has, two chunks per rank (one block each), trains
    to the one-process losses, gradient norms, initial weights and gradients (pp2, 4 micro-batches)."""
    have = [s for s in LOOPED + V_SHAPED if s in available_schedules()]
    if not have:
        pytest.skip("this torch has none of torch.distributed.pipelining's multi-stage schedules")
    configs = {f"torch_{s}": ["pipeline=torch", f"pipeline.schedule={s}", "pipeline.virtual_stages=2"] for s in have}
    ref = pp_tests._reference(tmp_path, 4)
    run_ranks(pp_tests._worker, world_size=2, timeout_s=240, args=(configs, PP2, ref, str(tmp_path)))


def _all_splits(n: int, pieces: int):
    """Every cut of n blocks into `pieces` contiguous, non-empty ranges."""
    for cuts in itertools.combinations(range(1, n), pieces - 1):
        edges = (0, *cuts, n)
        yield [range(a, b) for a, b in zip(edges, edges[1:])]


def test_layer_costs_count_the_planners_matmul_flops(monkeypatch):
    """Without the elementwise term, a block's cost is the planner's matmul FLOPs of one block per token (forward
    and backward, `core.planner.matmul_flops`), the head's its LM-head matmul, the embedding's nothing."""
    import core.distributed.pipeline as pipeline
    from core.model import ModelConfig
    from core.planner import matmul_flops

    monkeypatch.setattr(pipeline, "ELEMENTWISE_FLOPS_PER_BYTE", 0.0)
    m = ModelConfig(name="t", d_model=128, d_ff=384, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=512,
                    context_length=128)
    fl = matmul_flops(m, 1, 64)
    head = 2 * 64 * 128 * 512
    emb, block, last = pipeline.layer_costs(m, 64)
    assert block == pytest.approx((fl["forward"] + fl["backward"] - 3 * head) / 64, rel=1e-12)
    assert last == 3 * head / 64 and emb == 0


def test_cost_balance_is_the_cheapest_costliest_stage():
    """`balanced_pieces` against every possible split: its costliest piece is the cheapest any split achieves under
    the planner's layer costs (embedding on the first piece, norm + head + loss on the last), and the equal split
    is kept where it is as good. A large vocabulary makes the head cost more than a block: the last stage of two
    gets fewer blocks."""
    from core.model import ModelConfig

    for vocab, layers, pieces in [(256, 4, 2), (4096, 4, 2), (4096, 6, 3), (32768, 8, 4), (50304, 5, 2)]:
        m = ModelConfig(name="t", d_model=128, d_ff=384, n_layers=layers, n_heads=4, vocab_size=vocab,
                        context_length=128)
        costs = layer_costs(m, 32)
        got = balanced_pieces(costs, pieces)
        best = min(max(piece_costs(s, costs)) for s in _all_splits(layers, pieces))
        assert [i for r in got for i in r] == list(range(layers)) and all(len(r) for r in got)
        assert max(piece_costs(got, costs)) == pytest.approx(best, rel=1e-12), (vocab, layers, pieces, got)
    tiny = ModelConfig(name="t", d_model=128, d_ff=384, n_layers=4, n_heads=4, vocab_size=256, context_length=128)
    assert balanced_pieces(layer_costs(tiny, 32), 2) == [range(0, 2), range(2, 4)]  # the head costs < a block
    big = ModelConfig(name="t", d_model=128, d_ff=384, n_layers=4, n_heads=4, vocab_size=4096, context_length=128)
    costs = layer_costs(big, 32)
    assert costs[-1] > costs[1] > costs[0] > 0  # head + loss over 4096 words > a block > the embedding's gather
    bounds = balanced_pieces(costs, 2)
    assert bounds == [range(0, 3), range(3, 4)]
    assert stage_layers(4, 2, 1, 1, "loop", bounds) == [3]


BIG_VOCAB = ["model.vocab_size=4096"]


def _balanced_worker(rank: int, world: int, ref_path: str, tmp: str) -> None:
    ref = torch.load(ref_path)
    configs = {"ours_1f1b_cost": ["pipeline=ours", "pipeline.schedule=1f1b", "pipeline.balance=cost"]}
    for name, overrides in configs.items():
        out = pp_tests._train(compose_cfg(pp_tests.COMMON + BIG_VOCAB + PP2 + overrides, Path(tmp) / name))
        blocks = sorted({int(n.split(".")[1]) for n in out["init"] if n.startswith("blocks.")})
        assert blocks == ([0, 1, 2] if rank == 0 else [3]), f"{name} stage {rank}: blocks {blocks}"
        for step, (a, b) in enumerate(zip(out["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {step + 1} loss {a} != one process's {b}"
        for pname, g in out["grads"].items():
            assert torch.equal(out["init"][pname], ref["init"][pname]), f"{name} {pname}: initial weight"
            assert torch.allclose(g, ref["grads"][pname], rtol=1e-4, atol=1e-6), f"{name} {pname}: gradient"


def test_cost_balanced_pp2_matches_one_process(tmp_path):
    """pipeline.balance=cost with a 4096-word head: stage 0 keeps blocks 0-2 (and the embedding), stage 1 block 3
    (and the head); our 1F1B trains to one process's losses and gradients (torch's schedules run the same split)."""
    ref = _train_reference(tmp_path, BIG_VOCAB)
    run_ranks(_balanced_worker, world_size=2, timeout_s=180, args=(ref, str(tmp_path)))


def _train_reference(tmp: Path, extra: list[str]) -> str:
    ref = pp_tests._train(compose_cfg(pp_tests.COMMON + extra + ["mesh=single", "train.batch_size=4"],
                                      tmp / "single"))
    ref.pop("model")
    path = tmp / "ref.pt"
    torch.save(ref, path)
    return str(path)


MEASURED = {  # (overrides, the planner's held micro-batches per stage: GPipe m, 1F1B p - r, interleaved 2.5 / 1.5)
    "gpipe": ["pipeline=ours", "pipeline.schedule=gpipe"],
    "1f1b": ["pipeline=ours", "pipeline.schedule=1f1b"],
    "interleaved_1f1b": ["pipeline=ours", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
    "zb_h1": ["pipeline=ours", "pipeline.schedule=zb_h1"],
    "torch_1f1b": ["pipeline=torch", "pipeline.schedule=Schedule1F1B"],
}
if "ScheduleZBVZeroBubble" in available_schedules():
    # the V: rank 1 holds virtual stages 1 and 2 and hands the one's output to the other in place (no message)
    MEASURED["torch_zbv"] = ["pipeline=torch", "pipeline.schedule=ScheduleZBVZeroBubble", "pipeline.virtual_stages=2"]


def _memory_worker(rank: int, world: int, tmp: str) -> None:
    from core.planner import plan
    from core.trainer import build

    peaks = {}
    for name, overrides in MEASURED.items():
        cfg = compose_cfg(pp_tests.COMMON + ["mesh=dp1_pp2", "train.batch_size=8", "pipeline.microbatches=4",
                                             *overrides], Path(tmp) / name)
        run = build(cfg)
        run.pipeline.measure_communication(True)
        run.forward_backward(0)
        predicted = plan(cfg).to_dict()
        want = predicted["pp_activation_gib_per_stage"][run.pipeline.stage] * 2**30
        got = peaks[name] = run.pipeline.activation_peak
        if run.pipeline.counts_p2p:  # every byte sent or received, against the busiest stage's prediction
            busiest = predicted["pp_p2p_mib"] * 2**20
            sent = run.pipeline.step_p2p_bytes
            assert sent == busiest, f"{name}: {sent} B sent and received, planner {busiest:.0f} B"
            if name == "gpipe":
                run.loss(*run.micro_batch("val", 0, 0))  # a forward-only pass: not a training step's traffic
                assert run.pipeline.step_p2p_bytes == sent
        if name == "torch_zbv":  # its activations: p micro-batches is an estimate, not checked
            continue
        # zb_h1 also keeps each deferred micro-batch's output gradient (not an activation the planner counts);
        # interleaved chunks differ (the head's is larger) where the planner takes each as 1/v of the stage
        tol = 0.002 if name in ("gpipe", "1f1b", "torch_1f1b") else 0.04
        assert abs(got - want) <= tol * want, f"{name} stage {rank}: saved {got} B, planner {want:.0f} B"
        metrics = run.pipeline.step_metrics()
        assert metrics["pp_activation_peak_mib"] == got / 2**20
    # the schedules' memory against each other: GPipe holds all 4 micro-batches, 1F1B p - r of them
    assert peaks["gpipe"] / peaks["1f1b"] == pytest.approx(4 / (2 - rank), rel=0.01)


def test_measured_activations_and_p2p_bytes_match_the_planner(tmp_path):
    """pp2, 4 micro-batches of 2 sequences: the bytes autograd saves at once on each rank (counted through saved-
    tensor hooks) are the planner's per-stage prediction (held micro-batches x one micro-batch's bytes) within
    0.2% (4% for ZB-H1 and interleaved 1F1B), so GPipe's stage 0 holds twice 1F1B's; the point-to-point bytes each
    rank sends and receives (ours, torch's 1F1B and ZB-V) are exactly the planner's busiest stage's."""
    run_ranks(_memory_worker, world_size=2, timeout_s=180, args=(str(tmp_path),))


# --- the bubble, measured ----------------------------------------------------------------------------------
FORWARD_S, BACKWARD_S = 0.1, 0.2  # each block's cost: a sleep, so ranks do not compete for the CPU


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep a fixed time: a block of deterministic cost."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad


def _bubble_worker(rank: int, world: int, tmp: str, configs: dict) -> None:
    from core.model import TransformerBlock
    from core.trainer import build

    plain = TransformerBlock.forward
    TransformerBlock.forward = lambda self, x, positions: _Sleep.apply(plain(self, x, positions))
    for name, (overrides, formula) in configs.items():
        cfg = compose_cfg(pp_tests.COMMON + ["mesh=dp1_pp2", "train.batch_size=4", "pipeline.microbatches=4",
                                             *overrides], Path(tmp) / name)
        run = build(cfg)
        run.pipeline.measure_communication(True)
        run.forward_backward(0)  # first calls (allocations, lazy set-up) stay out of the measured steps
        bubbles: dict[int, list[float]] = {}
        for step in (1, 2, 3):
            run.forward_backward(step)
            saved = run.pipeline.save_timeline(run)  # collective: every rank's timeline of the step just run
            if rank == 0:
                for stage, bubble in _bubbles(json.loads(saved.read_text())["ranks"]).items():
                    bubbles.setdefault(stage, []).append(bubble)
        for stage, measured in bubbles.items():
            # a stall of the loaded machine only ever adds idle time: the best of three steps
            assert abs(min(measured) - formula) <= 0.25 * formula, \
                f"{name} stage {stage}: bubble {measured}, formula {formula:.3f}"


def _bubbles(ranks: list[dict]) -> dict[int, float]:
    """Each stage's idle share of a step, from every rank's recorded timeline on one clock (the host's monotonic
    one): the step runs from the first forward anywhere (stage 0's) to the last op anywhere."""
    begin = min(r["t0"] + r["events"][0][2] for r in ranks)
    end = max(r["t0"] + r["events"][-1][3] for r in ranks)
    return {r["stage"]: 1 - sum(e[3] - e[2] for e in r["events"]) / (end - begin) for r in ranks}


@pytest.mark.slow
def test_measured_bubble_is_the_planners_formula(tmp_path):
    """Blocks that cost a fixed sleep (100 ms forward, 200 ms backward, far above their compute), pp2, 4 micro-
    batches: each stage's idle share of the step, from the recorded timelines, is within 25% of the formula:
    GPipe and 1F1B (p-1)/(m+p-1) = 1/5 with one block per stage (ours and torch's 1F1B), interleaved 1F1B
    (p-1)/(vm+p-1) = 1/9 with one block per chunk."""
    configs = {
        "gpipe": (["model.n_layers=2", "pipeline.schedule=gpipe"], bubble_fraction(2, 4, "gpipe")),
        "1f1b": (["model.n_layers=2", "pipeline.schedule=1f1b"], bubble_fraction(2, 4, "1f1b")),
        # torch's, timed at its stages' forward_one_chunk / backward_one_chunk
        "torch_1f1b": (["model.n_layers=2", "pipeline=torch", "pipeline.schedule=Schedule1F1B"],
                       bubble_fraction(2, 4, "Schedule1F1B")),
        "interleaved": (["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
                        bubble_fraction(2, 4, "interleaved_1f1b", 2)),
    }
    assert configs["1f1b"][1] == configs["torch_1f1b"][1] == pytest.approx(1 / 5) and configs["interleaved"][1] == pytest.approx(1 / 9)
    run_ranks(_bubble_worker, world_size=2, timeout_s=180, args=(str(tmp_path), configs))
