"""Which rank stopped making progress: every rank's heartbeat in the process group's store.

A rank that hangs (stopped, swapped out, its host frozen) leaves its peers waiting in a collective
until `mesh.timeout_s`, and the peer that times out is the one that raises: on its own, the job's
error would blame a healthy rank. So every rank runs a daemon thread that bumps a counter in the c10d
store every `interval_s`, and a rank whose collective timed out reads all counters twice, a few
intervals apart (`stalled_ranks`): the ranks whose counter did not move have stopped (every thread of
a stopped or dead process stops). Counters, not clocks, so hosts need no synchronised time.
"""
from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist

_PREFIX = "scalelab/heartbeat/"


class Heartbeat:
    """This rank's heartbeat thread, and the check of every rank's heartbeat after a timeout."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval_s: float = 0.5) -> None:
        # clients of their own: the thread never waits behind the main thread's store calls, and a store host
        # that stopped answers within the short timeout instead of the rendezvous'
        self._store, self._reader = store.clone(), store.clone()
        for s in (self._store, self._reader):
            s.set_timeout(datetime.timedelta(seconds=max(5.0, 10 * interval_s)))
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="scalelab-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self._store.set(f"{_PREFIX}{self.rank}", f"{os.getpid()}:{count}")
            except Exception:  # noqa: BLE001 - the store is gone (job ending): nothing left to report to
                return
            self._stop.wait(self.interval_s)

    def _read(self) -> dict[int, tuple[str, str]]:
        out = {}
        for r in range(self.world_size):
            pid, _, count = self._reader.get(f"{_PREFIX}{r}").decode().partition(":")
            out[r] = (pid, count)
        return out

    def stalled_ranks(self, wait_s: float | None = None) -> dict[int, str] | None:
        """{rank: pid} of the ranks whose heartbeat did not move in `wait_s` (6 intervals); None if the
        store did not answer (its host, rank 0 under env:// without an agent, may be the stalled one)."""
        try:
            before = self._read()
            time.sleep(wait_s if wait_s is not None else 6 * self.interval_s)
            after = self._read()
        except Exception:  # noqa: BLE001 - a store timeout or a closed connection
            return None
        return {r: pid for r, (pid, count) in after.items() if before[r][1] == count and r != self.rank}


class RankStalledError(RuntimeError):
    """A collective timed out because other ranks stopped making progress; the message names them first."""
