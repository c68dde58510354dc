"""CommTimer bookkeeping: NCCL works are released as soon as they finish (they hold their tensors).

NCCL is not available on the CPU, so a minimal stand-in for `torch.distributed.Work` exposes the two
calls the timer uses (`is_completed`, `_get_duration`); the timer's own logic is what is under test.
"""
import gc
import weakref

import torch

from core.distributed.comm import CommTimer


class _FinishedLater:
    """A collective's work: holds its tensor (as NCCL's WorkNCCL does) until dropped."""

    def __init__(self, tensor: torch.Tensor, ms: float) -> None:
        self.tensor, self.ms, self.done = tensor, ms, False

    def is_completed(self) -> bool:
        return self.done

    def _get_duration(self) -> float:
        assert self.done, "duration read before the collective finished"
        return self.ms

    def wait(self) -> None:
        pass


def _cuda_like_timer() -> CommTimer:
    timer = CommTimer(device=None)
    timer.cuda, timer.nccl_timing = True, True  # the CUDA path minus events: no waits are timed here
    return timer


def test_finished_works_are_released_before_metrics():
    timer = _cuda_like_timer()
    grads = torch.ones(1000)
    first = _FinishedLater(grads, 2.0)
    timer.launched(first)
    ref = weakref.ref(grads)
    del grads
    first.done = True
    timer.launched(_FinishedLater(torch.zeros(1), 3.0))  # the next launch polls and lets go of `first`
    del first
    gc.collect()
    assert ref() is None, "a finished work (and its gradient buffer) was kept alive by the timer"
    assert timer.pending_works() == 1 and timer._nccl_ms == 2.0


def test_unfinished_works_are_kept_and_all_counted():
    timer = _cuda_like_timer()
    works = [_FinishedLater(torch.zeros(1), ms) for ms in (1.0, 2.0, 4.0)]
    for w in works:
        timer.launched(w)
    assert timer.pending_works() == 3  # none finished: all pending, none read early
    works[0].done = True
    timer._harvest()
    assert timer.pending_works() == 2 and timer._nccl_ms == 1.0
    for w in works:
        w.done = True
    timer._harvest(all_done=True)
    assert timer.pending_works() == 0 and timer._nccl_ms == 7.0


class _Counted(_FinishedLater):
    polls = 0

    def is_completed(self) -> bool:
        _Counted.polls += 1
        return super().is_completed()


def test_polling_cost_per_launch_is_constant():
    """One stream runs its collectives in launch order, so the timer polls only the oldest pending work.
    Rescanning all of them on every launch made FSDP's ~500 collectives a step host-bound when timed."""
    timer = _cuda_like_timer()
    _Counted.polls = 0
    n = 500
    works = [_Counted(torch.zeros(1), 1.0) for _ in range(n)]
    for i, w in enumerate(works):
        timer.launched(w)
        if i >= 100:  # the GPU runs 100 collectives behind the host
            works[i - 100].done = True
    assert _Counted.polls <= 3 * n, f"{_Counted.polls} polls for {n} launches"
    assert timer.pending_works() == 101  # the finished ones (all but the last 100, polled once more) are released
    for w in works:
        w.done = True
    timer._harvest(all_done=True)
    assert timer.pending_works() == 0 and timer._nccl_ms == float(n)  # every duration counted once


def test_disabled_timer_keeps_nothing():
    timer = _cuda_like_timer()
    timer.enabled = False
    timer.launched(_FinishedLater(torch.zeros(1), 1.0))
    assert timer.pending_works() == 0 and timer.metrics() == {}


def test_groups_are_polled_separately():
    """Two process groups run on two NCCL streams: a slow collective on one must not hold back the release of
    finished ones on the other (FSDP's reduce-scatters hold full-size gradients)."""
    timer = _cuda_like_timer()
    slow_gather = _FinishedLater(torch.zeros(1), 1.0)
    timer.launched(slow_gather, group="gather")
    grads = torch.ones(1000)
    ref = weakref.ref(grads)
    rs = _FinishedLater(grads, 2.0)
    timer.launched(rs, group="reduce")
    del grads
    rs.done = True
    timer.launched(_FinishedLater(torch.zeros(1), 4.0), group="reduce")
    del rs
    gc.collect()
    assert ref() is None and timer.pending_works() == 2 and timer._nccl_ms == 2.0
