"""Slurm job states for the sweep's wait, on clusters with or without accounting.

submitit waits for a job's result file and, to learn that a job ended without one, asks `sacct`.
On a cluster without accounting (`AccountingStorageType=accounting_storage/none`, common on small
clusters) every `sacct` call fails, every state reads UNKNOWN, and a job that ended without a result
(cancelled, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY) is waited for forever. `QueueStateWatcher` asks `sacct`
while it answers and `squeue --states=all` once it does not. The controller keeps listing an ended
job, with its final state, for MinJobAge seconds (300 by default); a job no longer listed at all has
ended too, and reads `LEFT_QUEUE` (its last state seen is kept under `LastState`).
"""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Any, Iterable

from submitit.slurm.slurm import SlurmInfoWatcher

LEFT_QUEUE = "LEFT_QUEUE"

# States of a job that may still write its result. submitit's own list, plus the transient and held
# states `squeue` shows where `sacct` would say PENDING or RUNNING (a CONFIGURING job is about to start).
ACTIVE_STATES = frozenset({
    "READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED",
    "CONFIGURING", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
    "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
})

_SQUEUE_FIELDS = "JobID|State|NodeList"  # the columns submitit's read_info expects (as from sacct)


class QueueStateWatcher(SlurmInfoWatcher):
    """submitit's Slurm state watcher that falls back to `squeue` when `sacct` fails (no accounting).

    Give it to jobs with `watch(jobs, watcher)`; `job.results()` then returns or raises
    `UncompletedJobError` once the job has ended, accounting or not.
    """

    def __init__(self, delay_s: int = 60) -> None:
        super().__init__(delay_s=delay_s)
        self.accounting: bool | None = None  # None until the first sacct call answers or fails

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        state = self.get_state(job_id, mode=mode).split()  # sacct writes e.g. "CANCELLED by 1000"
        return bool(state) and state[0].upper() not in ACTIVE_STATES

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        if self.accounting is not False:
            answer = _run(command)
            if answer.returncode == 0:
                self.accounting = True
                self._info_dict.update(self.read_info(answer.stdout))
            elif self.accounting is None:  # never answered: this cluster keeps no accounting
                self.accounting = False
                reason = (answer.stderr or "").strip().splitlines()[-1:] or ["no output"]
                print(f"[scalelab] sacct failed ({reason[0]}): following Slurm jobs with squeue",
                      file=sys.stderr, flush=True)
        if self.accounting is False:
            self._update_from_queue({j.split("_")[0] for j in self._registered - self._finished})
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _update_from_queue(self, queried: set[str]) -> None:
        answer = _run(["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T|%N",
                       "--jobs=" + ",".join(sorted(queried))])
        if answer.returncode != 0 and "Invalid job id" not in (answer.stderr or ""):
            return  # the controller did not answer: keep the states known so far
        # squeue names one job id it no longer knows "Invalid job id"; of several, it lists those it knows
        listed = self.read_info(f"{_SQUEUE_FIELDS}\n{answer.stdout}") if answer.returncode == 0 else {}
        self._info_dict.update(listed)
        for job_id in self._registered - self._finished:
            if job_id.split("_")[0] in queried and job_id not in listed:
                last = self._info_dict.get(job_id, {})
                if last.get("State") != LEFT_QUEUE:
                    self._info_dict[job_id] = {**last, "State": LEFT_QUEUE, "LastState": last.get("State", "UNKNOWN")}


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(command, 1, "", f"{type(e).__name__}: {e}")


def watch(jobs: Iterable[Any], watcher: QueueStateWatcher) -> None:
    """Make `watcher` follow these submitit jobs (and their per-task sub-jobs) instead of the class-wide one."""
    for job in jobs:
        job.watcher = watcher
        for k in range(job.num_tasks):
            job.task(k).watcher = watcher
        watcher.register_job(job.job_id)


def describe_end(watcher: QueueStateWatcher, job_id: str) -> str:
    """How a job that left no result ended, e.g. 'ended TIMEOUT' or 'left the queue while RUNNING'."""
    info = watcher.get_info(job_id, mode="cache")
    state = info.get("State") or "UNKNOWN"
    if state == LEFT_QUEUE:
        return f"left the queue while {info.get('LastState', 'UNKNOWN')}"
    return f"ended {state}"
