"""Checkpoints: published atomically, keep-last-k, resumable exactly.

A checkpoint is a directory `step_000123/` holding `trainer.pt` (step, RNG states,
scheduler and scaler state, the resume fingerprint, see core/resume.py) and the
model/optimizer state in the strategy's format: `state.pt` (rank 0 writes the full state)
or `dcp/` (torch.distributed.checkpoint, every rank writes its shards).

Publishing is one protocol for both formats: everything is written under `.tmp_step_N/`;
then, if `step_N/` exists already (the end-of-run save of a step that was also a periodic
one), it is renamed aside to `.old_step_N/`, the new copy is renamed in, and only then is
the old copy deleted. Nothing is deleted before its replacement is in place, so a crash at
any point leaves a loadable newest checkpoint: discovery sees only `step_N/` names, and
`recover()` (run before every resume and save) puts an aside copy back if the crash came
before its replacement was renamed in, and removes leftovers. Pruning renames a checkpoint
to `.del_step_N/` before deleting it, so a half-deleted one is never taken for a checkpoint.
Loading uses `weights_only=True`. Every failure is one line naming the key and the fix.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from core.distributed.strategy import Strategy
from core.errors import ConfigError, require
from core.resume import check_resumable

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP, _ASIDE, _DISCARD = ".tmp_", ".old_", ".del_"  # prefixes of a checkpoint being written, replaced, pruned
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# Free bytes below which a failed write is put down to a full disk. DCP sends each rank's failure to the
# others pickled, which drops the OSError torch.save's RuntimeError was raised from; a write that failed
# for want of space has filled the disk to its last block.
_NEARLY_FULL = 1 << 20


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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank; a synchronisation point too."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write(obj: Any, path: Path) -> None:
    """torch.save through a Python file, so a failed write raises its OSError (errno) with it, then fsync."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _dcp_failure() -> type[BaseException]:
    """DCP's CheckpointException, a BaseException, once DCP is loaded (it cannot be raised before). DCP is
    imported where it is used: it loads torch.distributed.tensor, about 1.3 s of CPU in every process that
    imports the trainer, most of which never save or read one."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api.CheckpointException if api is not None else Exception


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: torch.save wraps it in a RuntimeError (as its context), DCP in a
    CheckpointException (per rank, in `failures`)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def _read_error(exc: BaseException) -> str:
    """One line describing why a checkpoint file could not be read."""
    os_err = _os_error(exc)
    if os_err is not None:
        return f"{type(os_err).__name__}: {os_err.strerror or os_err}"
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < _NEARLY_FULL
    except OSError:
        return False


def _discard(path: Path) -> None:
    """Delete a directory that no discovery can take for a checkpoint (a temporary, aside or pruned one)."""
    shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly where it stopped."""

    def __init__(self, directory: str | Path, keep_last: int = 3, fingerprint: dict[str, Any] | None = None) -> None:
        require(keep_last >= 1, "checkpoint.keep_last", f"must be at least 1, got {keep_last}", "set keep_last >= 1")
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.fingerprint = fingerprint or {}

    # ---- discovery ----------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Published checkpoints, oldest first (never a temporary, aside or half-deleted directory)."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
                 and (p / "trainer.pt").is_file()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def recover(self) -> None:
        """Finish what a crash interrupted (rank 0 only): an aside copy whose replacement never arrived is put
        back; temporaries, aside copies already replaced and half-pruned checkpoints are removed."""
        if not self.dir.is_dir():
            return
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(_ASIDE) and _STEP_DIR.match(name := p.name[len(_ASIDE):]):
                if (self.dir / name).exists():
                    _discard(p)
                else:
                    os.replace(p, self.dir / name)
            elif p.name.startswith((_TMP, _DISCARD)) and _STEP_DIR.match(p.name.split("_", 1)[1]):
                _discard(p)

    def resolve(self, resume: str | None) -> Path | None:
        """`resume` = None (fresh), 'auto' (newest here, if any) or a checkpoint directory. Collective."""
        if resume is None or resume is False:
            return None
        if _is_main():
            self.recover()
        _barrier()
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
        """Write checkpoint `step` and publish it atomically (collective: every rank calls it)."""
        final = self.dir / f"step_{step:06d}"
        tmp = self.dir / f"{_TMP}{final.name}"
        failure: BaseException | None = None
        if _is_main():
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self.recover()
                tmp.mkdir()
            except OSError as e:
                failure = e
        problem = self._shared_problem(failure, step, tmp)
        if problem is None:
            state = strategy.state_dict(model, optimizer)
            try:
                if strategy.checkpoint_format != "full":
                    import torch.distributed.checkpoint as dcp

                    dcp.save(state, checkpoint_id=str(tmp / "dcp"))  # collective: a failure raises on every rank
                elif _is_main():
                    _write(state, tmp / "state.pt")
                if _is_main():
                    _write({**trainer_state, "step": step, "rng": rng_state(), "fingerprint": self.fingerprint,
                            "format": strategy.checkpoint_format,
                            "reshardable": bool(getattr(strategy, "reshardable", False))}, tmp / "trainer.pt")
                    self._publish(tmp, final)
            except (Exception, _dcp_failure()) as e:
                failure = e
            problem = self._shared_problem(failure, step, tmp)
        if problem is not None:
            text, fix, io_failure = problem
            if failure is not None and not io_failure:
                raise failure  # not an I/O failure: a bug, with its traceback
            raise ConfigError("checkpoint.dir", text, fix)
        if _is_main():
            self._prune()
        _barrier()
        return final

    @staticmethod
    def _publish(tmp: Path, final: Path) -> None:
        """Make the complete `tmp` the checkpoint `final`: the old copy goes aside, the new one in, then the
        old one is deleted. Each rename is atomic on one filesystem."""
        aside = final.with_name(_ASIDE + final.name)
        replacing = final.exists()
        if replacing:
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if replacing:
            _discard(aside)

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep_last]:
            gone = old.with_name(_DISCARD + old.name)
            try:
                os.replace(old, gone)
            except OSError:  # cannot prune (permissions): keep it, the new checkpoint is safe
                continue
            _discard(gone)

    def _shared_problem(self, failure: BaseException | None, step: int, tmp: Path) -> tuple[str, str, bool] | None:
        """Rank 0's (problem, fix, whether an I/O failure) for a failed save, on every rank, once rank 0 has
        removed the partial checkpoint (and put back an old copy moved aside); None when nothing failed."""
        disk_full = False
        if failure is not None and _is_main():
            disk_full = _nearly_full(self.dir)  # measured while the partial checkpoint still fills the disk
            _discard(tmp)
            try:
                self.recover()
            except OSError:  # the message still says what failed first
                pass
        return _from_main(self._describe(failure, step, disk_full) if _is_main() else None)

    def _describe(self, failure: BaseException | None, step: int, disk_full: bool) -> tuple[str, str, bool] | None:
        """(problem, fix, whether an I/O failure) for a failed save; None when nothing failed."""
        if failure is None:
            return None
        os_err = _os_error(failure)
        newest = self.latest()
        kept = f"; the newest checkpoint, {newest.name}, is intact" if newest else ""
        if (os_err is not None and os_err.errno in _NO_SPACE) or disk_full:
            return (f"no space left on the disk holding {self.dir} while saving step {step} (the partial "
                    f"checkpoint was removed{kept})", "free disk space, lower checkpoint.keep_last or set "
                    "checkpoint.dir to a disk with room, then continue with resume=auto", True)
        reason = f"{type(os_err).__name__}: {os_err.strerror or os_err}" if os_err is not None else \
            f"{type(failure).__name__}: {(str(failure).strip().splitlines() or [''])[0]}"
        return (f"cannot write checkpoint step {step} to {self.dir} ({reason}; the partial checkpoint was "
                f"removed{kept})", "make checkpoint.dir writable or point it at another directory, then continue "
                "with resume=auto", os_err is not None)

    # ---- load -------------------------------------------------------------------------
    def load(self, path: Path, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
             allowed_changes: Iterable[str] = (), readers: Iterable[Any] = ()) -> dict[str, Any]:
        """Restore model, optimizer and RNG from `path`; return the trainer state (step, scheduler, scaler...).

        `strategy` reads its own checkpoint format; `readers` (objects with the same `checkpoint_format`,
        `state_dict` and `load_state_dict`) read others, e.g. a tensor-parallel run's checkpoint on one process.
        The fingerprint is checked before any state is loaded (core/resume.py): a checkpoint whose format can be
        resharded (`reshardable` in trainer.pt) may be resumed on another mesh shape when the run allows it.
        Optimizer hyper-parameters are this run's (so an allowed change takes effect); moments and step counts
        are the checkpoint's."""
        try:
            trainer_state = torch.load(path / "trainer.pt", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
            raise ConfigError("resume", f"{path}/trainer.pt cannot be read ({_read_error(e)})",
                              _unreadable_fix(path)) from None
        check_resumable(trainer_state.get("fingerprint", {}), self.fingerprint, allowed_changes, path,
                        reshardable=bool(trainer_state.get("reshardable", False)))
        if strategy.checkpoint_format != trainer_state.get("format"):  # the run's own view reads its own format
            strategy = next((r for r in readers if r.checkpoint_format == trainer_state.get("format")), strategy)
        require(trainer_state.get("format") == strategy.checkpoint_format, "resume",
                f"checkpoint {path} was written in {trainer_state.get('format')!r} format, but parallelism "
                f"{strategy.name!r} uses {strategy.checkpoint_format!r}", "resume under the strategy that wrote it")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state = strategy.state_dict(model, optimizer)
        stored = path / ("state.pt" if strategy.checkpoint_format == "full" else "dcp")
        try:
            if strategy.checkpoint_format != "full":
                import torch.distributed.checkpoint as dcp

                dcp.load(state, checkpoint_id=str(stored))
            else:
                state = torch.load(stored, weights_only=True, map_location="cpu")
        except (Exception, _dcp_failure()) as e:
            raise ConfigError("resume", f"{stored} cannot be read ({_read_error(e)})", _unreadable_fix(path)) from None
        try:
            strategy.load_state_dict(model, optimizer, state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise ConfigError("resume", f"checkpoint {path} does not fit this model ({str(e).splitlines()[0]})",
                              "resume with the model config that wrote it") from None
        for group, own in zip(optimizer.param_groups, hyper):
            group.update(own)
        set_rng_state(trainer_state["rng"])
        return trainer_state



def _unreadable_fix(path: Path) -> str:
    older = [p for p in Checkpointer(path.parent).checkpoints() if p.name < path.name]
    if older:
        return f"move {path} away (resume=auto then continues from {older[-1].name}), or start fresh (resume=null)"
    return f"move {path} away and start fresh (resume=null): there is no older checkpoint"


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (the directory entry), where the platform allows opening directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
