"""Stop signals: SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 ask a run to checkpoint and end at the next step boundary.

One path for every process layout. Each process that trains (a single-process run, every torchrun or
Slurm rank, every worker the local launcher spawned) runs inside `handling_stop_signals()`: a signal is
recorded, never acted on in the handler. The training loop reads `requested()` at step boundaries where
the ranks synchronise anyway, the ranks agree on the stop step (the highest signal number any of them
received wins), save a checkpoint and end with status "stopped" (SIGTERM, SIGINT: asked to end) or
"preempted" (SIGUSR1, SIGUSR2: a scheduler's warning; under Slurm the job requeues itself). A parent that
spawned workers (launchers/local.py) records the signal too and forwards it to its workers.

Repeated signals are ignored: a Ctrl-C reaches a spawned worker twice (from the terminal and forwarded
by its parent). SIGQUIT (Ctrl-\\) or SIGKILL ends a run at once, without a checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

_received: signal.Signals | None = None
_depth = 0  # nesting of handling_stop_signals() (a Slurm task's launcher wraps the job, which wraps itself)


class RunStopped(SystemExit):
    """A run ended early on a stop signal, after its checkpoint; exits with 128 + the signal's number.

    A SystemExit, not an Exception: a sweep must not go on to its next point, and Hydra reports an
    Exception as a failed job. `summary` is the run's summary (None when it stopped before training),
    `run_dir` its run directory (checkpoints and summary.json)."""

    def __init__(self, sig: signal.Signals, summary: dict[str, Any] | None, run_dir: Path) -> None:
        super().__init__(128 + int(sig))
        self.signal = sig
        self.summary = summary
        self.run_dir = run_dir


def requested() -> signal.Signals | None:
    """The first stop signal this process received inside `handling_stop_signals()`, if any."""
    return _received


def request(sig: int) -> None:
    """Record a stop request as if `sig` had arrived (the first one wins; signal-handler safe)."""
    global _received
    if _received is None:
        _received = signal.Signals(sig)


def agreed(mesh: Any, device: Any) -> signal.Signals | None:
    """The stop signal any rank received, the same on every rank (the highest signal number wins); None to go
    on. A collective on more than one rank: call it where every rank calls it, at steps that synchronise
    anyway, so a signal landing between two ranks' checks cannot leave them a step apart."""
    received = requested()
    if mesh.world_size == 1:
        return received
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(received or 0)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return signal.Signals(int(flag.item())) if flag.item() else None


def status_for(sig: int) -> str:
    """Summary status of a run that a signal stopped: "preempted" for USR1/USR2, else "stopped"."""
    return "preempted" if signal.Signals(sig) in PREEMPT_SIGNALS else "stopped"


def _handle(signum: int, frame: Any) -> None:
    first = _received is None
    request(signum)
    if first:
        print(f"[scalelab] rank {os.environ.get('RANK', '0')}: caught {signal.Signals(signum).name}: "
              "saving a checkpoint at the next step boundary, then stopping (SIGKILL ends it without one)",
              file=sys.stderr, flush=True)


@contextmanager
def handling_stop_signals() -> Iterator[None]:
    """Record STOP_SIGNALS while the block runs, then restore the previous handlers.

    The outermost block starts with no request recorded; `requested()` keeps its value after the block.
    Python runs signal handlers in the main thread only: elsewhere this is a no-op.
    """
    global _depth, _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        _received = None
    previous = {sig: signal.signal(sig, _handle) for sig in STOP_SIGNALS}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)
