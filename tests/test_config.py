"""Every config option composes and builds its plugin."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate

from launchers.job import run_job
from tests.utils import CONF, FAST, ROOT, compose_cfg, read_metrics, read_summary

GROUPS = ["model", "precision", "attention_impl", "parallelism", "mesh", "data", "optimizer", "logger",
          "experiment", "debug"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option, tmp_path):
    cfg = compose_cfg([f"{group}={option}"] + (["data.path=/dev/null"] if option == "tokens" else []), tmp_path)
    assert cfg.paths.run_dir == str(tmp_path)
    node = cfg.get(group) if group not in ("experiment", "debug") else None
    if group in ("model", "precision", "mesh", "parallelism"):
        obj = instantiate(node)
        assert obj is not None
    elif group == "attention_impl" and option != "compiled" and option != "flash_triton":
        assert callable(instantiate(node))
    elif group == "logger":
        for sub in node.values():
            assert "_target_" in sub


def test_groups_listed_in_defaults_exist():
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"


def test_cs336_model_sizes():
    from core.model import ModelConfig

    sizes = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16), "large": (1280, 5120, 36, 20),
             "xl": (2560, 10240, 32, 32), "10b": (4608, 12288, 50, 36), "leaderboard_8b": (4096, 11008, 34, 32)}
    for name, (d, dff, layers, heads) in sizes.items():
        m: ModelConfig = instantiate(compose_cfg([f"model={name}"]).model)
        assert (m.d_model, m.d_ff, m.n_layers, m.n_heads) == (d, dff, layers, heads)
        assert m.context_length == 512
        assert m.vocab_size == (151936 if name == "leaderboard_8b" else 10000)
    xl = instantiate(compose_cfg(["model=xl"]).model)
    assert 3.39e9 < xl.num_params() < 3.42e9  # the reference's "3.4B params"


def _train_command(*overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *FAST, "train.max_steps=2", "train.log_every=1",
            "train.eval_every=0", "train.batch_size=2", "data.max_bytes=100000", *overrides]


def test_run_directory_is_named_after_what_ran(tmp_path):
    subprocess.run(_train_command(f"paths.output_root={tmp_path}", "parallelism=ddp_flat"), cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    assert re.fullmatch(r"\d\d-\d\d-\d\d_tiny_ddp_flat_single", run_dir.name), run_dir
    assert read_summary(run_dir)["status"] == "ok"


def test_two_runs_started_at_once_get_two_directories(tmp_path):
    """Both ask for the same directory (as two runs started in the same second do): each gets its own."""
    command = _train_command(f"hydra.run.dir=${{unique_dir:{tmp_path / 'run'}}}")
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(d.name for d in tmp_path.iterdir()) == ["run", "run_2"]
    for run_dir in (tmp_path / "run", tmp_path / "run_2"):
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]  # one run's metrics each
        assert read_summary(run_dir)["status"] == "ok"


def test_debug_overfit_memorises_its_batch(tmp_path):
    """debug=overfit trains on one fixed batch: the loss must fall from ~5.5 (uniform over 256 bytes) under 0.5."""
    run_job(compose_cfg(["debug=overfit", "logger=none", "train.eval_batches=1"], tmp_path))
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert losses[0] > 5.0 and losses[-1] < 0.5, losses
