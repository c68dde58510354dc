"""Every config option composes and builds its plugin."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate

from launchers.job import run_job
from tests.utils import CONF, FAST, ROOT, compose_cfg, read_metrics, read_summary, train_py

GROUPS = ["model", "precision", "attention_impl", "parallelism", "mesh", "data", "optimizer", "logger",
          "experiment", "debug"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option, tmp_path):
    """Each option composes, and its plugin is built as the class its `_target_` names and does its job:
    attention options compute attention (against float64), loggers are the classes named, ..."""
    import torch
    from hydra.utils import get_class

    cfg = compose_cfg([f"{group}={option}"] + (["data.path=/dev/null"] if option == "tokens" else []), tmp_path)
    assert cfg.paths.run_dir == str(tmp_path)
    assert cfg.get(group) is not None or group in ("experiment", "debug", "logger")
    node = cfg.get(group)
    if group in ("model", "precision", "mesh", "parallelism", "data"):
        assert type(instantiate(node)) is get_class(node._target_)
    elif group == "attention_impl" and option != "compiled":  # compiled: torch.compile takes ~20 s on a CPU
        from core.kernels._flash_common import reference_attention

        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
        ref, _ = reference_attention(q, k, v, True)
        assert (instantiate(node)(q, k, v, is_causal=True).double() - ref).abs().max() < 1e-4
    elif group == "logger":
        built = [instantiate(sub) for sub in (node or {}).values()]
        assert [type(lg) for lg in built] == [get_class(sub._target_) for sub in (node or {}).values()]


def test_defaults_list_names_every_group_and_an_existing_option():
    """conf/config.yaml's defaults list is the table of contents: every group folder is in it, and each
    default option it names is a file of that group."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["defaults"]
    chosen = {}
    for entry in defaults:
        if isinstance(entry, dict):
            (key, value), = entry.items()
            chosen[key.removeprefix("optional ").removeprefix("override ")] = value
    for group in GROUPS:
        assert group in chosen, f"conf/{group}/ is not in config.yaml's defaults list"
        if chosen[group] is not None:
            assert chosen[group] in options(group), f"{group}: default {chosen[group]!r} has no file"


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


def _train_args(*overrides: str) -> list[str]:
    """train.py's arguments for a two-step run of the tiny model with `overrides`."""
    return [*FAST, "train.max_steps=2", "train.log_every=1", "train.eval_every=0", "train.batch_size=2",
            "data.max_bytes=100000", *overrides]


def _train_command(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args]


def test_run_directory_is_named_after_what_ran(tmp_path):
    proc = train_py(_train_args(f"paths.output_root={tmp_path}", "parallelism=ddp_flat"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    assert re.fullmatch(r"\d\d-\d\d-\d\d_tiny_ddp_flat_single", run_dir.name), run_dir
    assert read_summary(run_dir)["status"] == "ok"


def test_two_runs_started_at_once_get_two_directories(tmp_path):
    """Both ask for the same directory (as two runs started in the same second do): each gets its own."""
    command = _train_command(*_train_args(f"hydra.run.dir=${{unique_dir:{tmp_path / 'run'}}}"))
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(d.name for d in tmp_path.iterdir()) == ["run", "run_2"]
    for run_dir in (tmp_path / "run", tmp_path / "run_2"):
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]  # one run's metrics each
        assert read_summary(run_dir)["status"] == "ok"


@pytest.mark.slow
def test_two_sweeps_started_at_once_get_two_directories(tmp_path):
    """Two sweeps asking for the same directory at once (the default's clock has one-second resolution): each
    gets its own, and each sweep's points write under the directory it claimed."""
    command = _train_command("-m", *_train_args("seed=1,2", f"hydra.sweep.dir=${{unique_dir:{tmp_path / 'sweep'}}}"))
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(d.name for d in tmp_path.iterdir()) == ["sweep", "sweep_2"]
    for sweep in (tmp_path / "sweep", tmp_path / "sweep_2"):
        jobs = sorted(d.name for d in sweep.iterdir() if d.is_dir() and not d.name.startswith("."))
        assert len(jobs) == 2 and jobs[0].startswith("0_") and "seed=1," in jobs[0] and "seed=2," in jobs[1], jobs
        for job in jobs:
            assert [r["step"] for r in read_metrics(sweep / job) if "loss" in r] == [1, 2]
            assert read_summary(sweep / job)["status"] == "ok"


def test_the_default_sweep_directory_holds_its_points(tmp_path):
    """The default sweep directory is claimed once: its points, resolving it again, land in it (not in `_2`),
    each in one directory even where the swept value is a path."""
    command = _train_command("-m", *_train_args(f"paths.output_root={tmp_path / 'out'}",
                                                f"checkpoint.dir={tmp_path / 'ck1'},{tmp_path / 'ck2'}"))
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (sweep,) = (tmp_path / "out" / "sweeps").glob("*/*")
    assert re.fullmatch(r"\d\d-\d\d-\d\d", sweep.name), sweep
    jobs = sorted(p.parent.name for p in sweep.glob("*/summary.json"))
    assert len(jobs) == 2 and "ck1" in jobs[0] and "ck2" in jobs[1] and "paths.output_root" not in jobs[0], jobs
    assert not (tmp_path / "out" / "runs").exists()  # a sweep makes no run directory


def test_debug_overfit_memorises_its_batch(tmp_path):
    """debug=overfit trains on one fixed batch: the loss must fall from ~5.5 (uniform over 256 bytes) under 0.5."""
    run_job(compose_cfg(["debug=overfit", "logger=none", "train.eval_batches=1"], tmp_path))
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert losses[0] > 5.0 and losses[-1] < 0.5, losses
