"""Metric sinks: the `logger` plugins. Rank 0 only; the trainer never logs from other ranks.

`JsonlLogger` (metrics.jsonl in the run directory) is always on: it is what sweep
reports read. The `logger` config group adds others as a dict of `_target_` entries.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


class Logger:
    """Interface: `start(config, run_dir)`, `log(metrics, step)`, `summary(metrics)`, `finish()`."""

    def start(self, config: dict[str, Any], run_dir: Path, total_steps: int) -> None: ...

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def summary(self, metrics: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe: drop None, turn NaN/inf into null-free strings."""
    out = {}
    for k, v in metrics.items():
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        out[k] = v
    return out


class JsonlLogger(Logger):
    """One JSON object per logged step, appended to `metrics.jsonl` (flushed every line)."""

    filename = "metrics.jsonl"

    def start(self, config: dict[str, Any], run_dir: Path, total_steps: int) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / self.filename
        self._fh = open(self.path, "a", encoding="utf-8")  # append: a resumed run continues the file

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._fh.write(json.dumps({"step": step, **_clean(metrics)}) + "\n")
        self._fh.flush()

    def finish(self) -> None:
        if getattr(self, "_fh", None):
            self._fh.close()
            self._fh = None


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60:d}:{seconds % 60:02d}"


class ConsoleLogger(Logger):
    """A live progress line: step, loss, tokens/s, MFU, ETA (one line per log on non-terminals)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout

    def start(self, config: dict[str, Any], run_dir: Path, total_steps: int) -> None:
        self.total = total_steps
        self.t0 = time.perf_counter()
        self.first_step: int | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if "loss" not in metrics:
            if "val_loss" in metrics:
                print(f"step {step:>6d} | val_loss {metrics['val_loss']:.4f}", file=self.stream, flush=True)
            return
        if self.first_step is None:
            self.first_step, self.t0 = step, time.perf_counter()
        done = step - self.first_step
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        parts = [f"step {step:>6d}/{self.total}", f"loss {metrics['loss']:.4f}",
                 f"lr {metrics.get('lr', 0):.2e}", f"{metrics.get('tokens_per_s', 0):,.0f} tok/s",
                 f"{metrics.get('step_time_ms', 0):.0f} ms/step"]
        if metrics.get("mfu") is not None:
            parts.append(f"MFU {metrics['mfu']:.1%}")
        parts.append(f"ETA {_fmt_eta(eta) if math.isfinite(eta) else '?'}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def summary(self, metrics: dict[str, Any]) -> None:
        print("-" * 72, file=self.stream)
        for k, v in metrics.items():
            if isinstance(v, float):
                v = f"{v:.4g}"
            if not isinstance(v, (dict, list)):
                print(f"{k:>28s}: {v}", file=self.stream)
        print("-" * 72, file=self.stream, flush=True)


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class WandbLogger(Logger):
    """Weights & Biases through the real `wandb` library; offline unless the user is logged in.

    The resolved config is logged; in a multirun, runs share `group` (the sweep directory)
    so the W&B UI compares them; `finish()` closes the run so the next job starts a new one.
    """

    def __init__(self, project: str = "scalelab", entity: str | None = None, mode: str = "auto",
                 group: str | None = None, job_type: str | None = None, dir: str | None = None,
                 name: str | None = None, tags: list[str] | None = None) -> None:
        self.project, self.entity, self.mode = project, entity, mode
        self.group, self.job_type, self.dir, self.name, self.tags = group, job_type, dir, name, tags
        self.run = None

    def start(self, config: dict[str, Any], run_dir: Path, total_steps: int) -> None:
        import wandb

        mode = self.mode
        if mode == "auto":
            mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
        sweep = config.get("_sweep", {})
        self.run = wandb.init(
            project=self.project, entity=self.entity, mode=mode, dir=str(self.dir or run_dir),
            group=self.group or sweep.get("group"), job_type=self.job_type or sweep.get("job_type", "run"),
            name=self.name or sweep.get("name") or run_dir.name, tags=self.tags,
            config={k: v for k, v in config.items() if k != "_sweep"}, reinit="finish_previous",
            # wandb >= 0.19 always uses its service process; start_method="thread" is gone
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("loss", summary="min")
        self.run.define_metric("val_loss", summary="min")
        self.run.define_metric("tokens_per_s", summary="max")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}, step=step)

    def summary(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float, str)) and v is not None:
                self.run.summary[f"final/{k}"] = v

    def finish(self) -> None:
        if self.run is not None:
            offline_dir = self.run.settings.sync_dir if self.run.settings.mode == "offline" else None
            self.run.finish()
            self.run = None
            if offline_dir:  # nothing was uploaded: say where the run is and how to upload it
                print(f"W&B offline run saved in {offline_dir}; upload it with: wandb sync {offline_dir}", flush=True)


class LoggerGroup(Logger):
    """Fans every call out to several loggers."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def start(self, config, run_dir, total_steps):
        for lg in self.loggers:
            lg.start(config, run_dir, total_steps)

    def log(self, metrics, step):
        for lg in self.loggers:
            lg.log(metrics, step)

    def summary(self, metrics):
        for lg in self.loggers:
            lg.summary(metrics)

    def finish(self):
        for lg in self.loggers:
            lg.finish()
