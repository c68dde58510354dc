"""Checkpoints: atomic, keep-last-k, resumable exactly.

A checkpoint is a directory `step_000123/` holding `trainer.pt` (step, RNG states,
scheduler and scaler state, the config fingerprint) and the model/optimizer state in
the strategy's format: `state.pt` (rank 0 writes the full state) or `dcp/`
(torch.distributed.checkpoint, every rank writes its shards). It is written under a
temporary name and renamed into place, so a crash while saving never damages the last
good checkpoint; only then are old ones pruned. Loading uses `weights_only=True`.
"""
from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from core.distributed.strategy import Strategy
from core.errors import ConfigError, require

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # numpy's key array as a tensor: weights_only loading accepts tensors, not ndarrays
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                   cached), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly where it stopped."""

    def __init__(self, directory: str | Path, keep_last: int = 3, fingerprint: dict[str, Any] | None = None) -> None:
        require(keep_last >= 1, "checkpoint.keep_last", f"must be at least 1, got {keep_last}", "set keep_last >= 1")
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.fingerprint = fingerprint or {}

    # ---- discovery ----------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
                 and (p / "trainer.pt").is_file()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve(self, resume: str | None) -> Path | None:
        """`resume` = None (fresh), 'auto' (newest here, if any) or a checkpoint directory."""
        if resume is None or resume is False:
            return None
        if resume == "auto":
            return self.latest()
        path = Path(str(resume))
        if path.is_dir() and not (path / "trainer.pt").is_file():
            inner = Checkpointer(path, self.keep_last).latest()
            path = inner or path
        require((path / "trainer.pt").is_file(), "resume", f"{path} is not a checkpoint (no trainer.pt)",
                "use resume=auto or the path of a step_NNNNNN checkpoint directory")
        return path

    # ---- save -------------------------------------------------------------------------
    def save(self, step: int, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any]) -> Path:
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f".tmp_step_{step:06d}"
        if _is_main():
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        state = strategy.state_dict(model, optimizer)
        if strategy.checkpoint_format == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=str(tmp / "dcp"))
        elif _is_main():
            torch.save(state, tmp / "state.pt")
        if _is_main():
            torch.save({**trainer_state, "step": step, "rng": rng_state(), "fingerprint": self.fingerprint,
                        "format": strategy.checkpoint_format}, tmp / "trainer.pt")
            if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
                shutil.rmtree(final)
            tmp.rename(final)  # atomic on one filesystem: the checkpoint appears whole or not at all
            for old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    # ---- load -------------------------------------------------------------------------
    def load(self, path: Path, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model, optimizer and RNG from `path`; return the trainer state (step, scheduler, scaler...)."""
        try:
            trainer_state = torch.load(path / "trainer.pt", weights_only=True)
        except Exception as e:
            raise ConfigError("resume", f"{path}/trainer.pt cannot be read ({type(e).__name__}: {e})",
                              "point resume at an intact checkpoint or start fresh (resume=null)") from None
        saved = trainer_state.get("fingerprint", {})
        diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in self.fingerprint.items()
                 if k in saved and saved[k] != v]
        require(not diffs, "resume", f"checkpoint {path} comes from an incompatible config ({'; '.join(diffs)})",
                "resume with the config that wrote it, or start a fresh run (resume=null)")
        require(trainer_state.get("format") == strategy.checkpoint_format, "resume",
                f"checkpoint {path} was written in {trainer_state.get('format')!r} format, but parallelism "
                f"{strategy.name!r} uses {strategy.checkpoint_format!r}", "resume under the strategy that wrote it")
        state = strategy.state_dict(model, optimizer)
        if strategy.checkpoint_format == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.load(state, checkpoint_id=str(path / "dcp"))
        else:
            state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
        try:
            strategy.load_state_dict(model, optimizer, state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise ConfigError("resume", f"checkpoint {path} does not fit this model ({str(e).splitlines()[0]})",
                              "resume with the model config that wrote it") from None
        set_rng_state(trainer_state["rng"])
        return trainer_state
