"""Helpers for composing configs and running train.py in tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import core.config  # noqa: F401 - the resolvers train.py registers

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# small, fast defaults for test runs (quiet logger, synthetic-free corpus stays the default)
FAST = ["logger=none", "train.eval_batches=1"]


def compose_cfg(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    """The composed config for `overrides` (no Hydra run: paths point at `run_dir`)."""
    extra = [f"paths.run_dir={run_dir}", f"paths.output_root={run_dir}"] if run_dir is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides) + extra)


def run_train(overrides: list[str], run_dir: Path, timeout: float = 300, env: dict | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """`python train.py overrides... hydra.run.dir=run_dir` as a user would run it."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
