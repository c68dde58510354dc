"""The leaderboard preset and its one-GPU slice experiment on the CPU: the preset's plan fits an H200 with margin
with the chunked head and activation checkpointing, and `experiments/leaderboard_slice.py --tiny` runs end to end
(measures, plans, extrapolates, writes its JSON) so the script the GPU run needs cannot rot."""
from __future__ import annotations

import json
import math

from core.planner import plan
from tests.utils import compose_cfg


def test_the_preset_plans_the_8b_step_within_an_h200_with_margin():
    cfg = compose_cfg(["experiment=leaderboard_8b"])
    assert cfg.model.context_length == 32768 and cfg.data.seq_len == 32768 and cfg.train.batch_size == 2
    assert cfg.parallelism._target_.endswith("TorchFSDP2Strategy") and cfg.activation_checkpointing == 1
    p = plan(cfg)
    d, f, v = 4096, 11008, 151936  # 34 blocks (attention 4 d^2, SwiGLU 3 d f, 2 norms), final norm, embedding, head
    assert p.params == 34 * (4 * d * d + 3 * d * f + 2 * d) + d + 2 * v * d  # 8.13B
    assert p.tokens_per_step == 65_536 and p.micro_batch == 1
    assert p.device == "NVIDIA H200" or "h200" in p.device_note
    assert p.peak_gib < 0.75 * p.device_memory_gib  # margin: a quarter of the card free
    # 16 bytes per parameter (fp32 weights, gradients, AdamW moments), halved by FSDP2 over 2 GPUs
    states = p.memory["parameters"] + p.memory["gradients"] + p.memory["optimizer_state"]
    assert abs(states - 8 * p.params) <= 64
    assert p.step_time_ms is not None and p.step_time_ms < 10_000  # the bar, as predicted
    # without the chunked head the fp32 logits of 32,768 x 151,936 tokens alone would be 18.5 GiB more
    plain = plan(compose_cfg(["experiment=leaderboard_8b", "train.loss_chunk_tokens=0"]))
    assert plain.peak_gib - p.peak_gib > 18


def test_slice_experiment_runs_tiny_on_the_cpu(tmp_path):
    from experiments.leaderboard_slice import main

    out = tmp_path / "slice.json"
    result = main(["--tiny", "--layers", "1,2", "--warmup", "1", "--steps", "1", "--out", str(out),
                   "model.context_length=32"])
    saved = json.loads(out.read_text())
    assert saved["seq_len"] == 32 and [s["layers"] for s in saved["slices"]] == [1, 2]
    for s in saved["slices"]:
        assert s["median_ms"] > 0 and len(s["times_ms"]) == 1 and s["predicted_ms"] > 0
        assert s["peak_gib"] is None  # no allocator peak on the CPU
    # the slice's plan is one GPU's, no embedding or head to speak of; the full step is the preset's own plan
    assert saved["full_step"]["planned_ms"] > 0 and math.isfinite(saved["full_step"]["extrapolated_ms"])
    assert saved["per_layer_ms"]["measured"] == result["per_layer_ms"]["measured"]
