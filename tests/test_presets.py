"""Every experiment preset (conf/experiment/*.yaml) composes and runs a step or two on the CPU, with only the sizes
shrunk (tiny model, short run, no torch.compile): a preset that names a missing option or key, or whose settings
no longer fit together, fails here rather than on a user's GPU."""
from __future__ import annotations

import pytest

from launchers.job import run_job
from tests.utils import CONF, compose_cfg, read_summary

PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
SHRINK = ["model=tiny", "compile=false", "mesh.device=cpu", "train.max_steps=2", "train.batch_size=4",
          "train.eval_batches=1",
          "benchmark.warmup=1", "benchmark.steps=2", "checkpoint.every=0"]

# what a GPU-only preset changes on the CPU besides the sizes: the Triton kernel runs on CUDA only (flash_torch is
# the same algorithm in PyTorch), gloo has no reduce-scatter for FSDP2 over 2 ranks
ON_CPU = {"leaderboard_8b": ["model.context_length=64", "attention_impl=flash_torch", "mesh=single"]}


def test_presets_are_found():
    assert {"dp_sweep_xl", "small_corpus_gpu", "xl_bf16_compiled_benchmark", "leaderboard_8b"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_on_the_cpu(preset, tmp_path):
    cfg = compose_cfg([f"experiment={preset}", *SHRINK, *ON_CPU.get(preset, [])], tmp_path)
    if "max_bytes" in cfg.data:  # the embedded corpus: a slice of it (synthetic data has none to cut)
        cfg.data.max_bytes = 100000
    result = run_job(cfg)
    summary = read_summary(tmp_path)
    assert summary["status"] == "ok", summary
    if cfg.benchmark.enabled:
        assert len(result["times_ms"]) == 2 and all(t > 0 for t in result["times_ms"])
    else:
        assert summary["steps"] == 2 and summary["final_loss"] == summary["final_loss"]  # a number, not NaN
        assert summary["model"] == "tiny" and summary["precision"] == cfg.precision.dtype
