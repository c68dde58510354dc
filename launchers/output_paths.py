"""The directories a run writes are checked writable before anything is built or trained.

Hydra creates the run (or sweep) directory before our job starts, so `OutputDirCheck`, a Hydra
callback, checks it first; `check_output_paths` then checks the checkpoint directory inside the
job, so a read-only one is found before training, not at the first save. A path that does not
exist yet is judged by its nearest existing ancestor (it will be created there).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from core.errors import ConfigError
from core.errors import exit_on


def require_writable(path: str | Path, key: str) -> None:
    """ConfigError naming `key` unless files can be created at `path` (or where it would be created)."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    fix = f"make {existing} writable or set {key} to a writable directory"
    if not existing.is_dir():
        raise ConfigError(key, f"{path} cannot be created: {existing} is a file, not a directory", fix)
    try:
        with tempfile.TemporaryFile(dir=existing):  # a real write: permissions, read-only mounts, ACLs alike
            pass
    except OSError as e:
        raise ConfigError(key, f"{path} is not writable ({existing}: {e.strerror or e})", fix) from None


def check_output_paths(cfg: DictConfig) -> None:
    """The run directory, and the checkpoint directory of a training run (benchmark/profile runs save none)."""
    require_writable(cfg.paths.run_dir, "paths.run_dir")
    if not (cfg.benchmark.enabled or cfg.profile.enabled or cfg.plan):
        require_writable(cfg.checkpoint.dir, "checkpoint.dir")


class OutputDirCheck(Callback):
    """Hydra callback: the run or sweep directory must be writable before Hydra creates it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            require_writable(str(config.hydra.run.dir), "hydra.run.dir")
        except ConfigError as e:
            exit_on(e)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            require_writable(str(config.hydra.sweep.dir), "hydra.sweep.dir")
        except ConfigError as e:
            exit_on(e)
