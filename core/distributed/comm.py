"""Communication helpers shared by the data-parallel strategies: group facts and comm timing.

`CommTimer` measures, per optimizer step,
  comm_ms          time the collectives ran (NCCL: each work's own duration when the process was
                   started with TORCH_NCCL_ENABLE_TIMING=1, which our launcher and the benchmark set;
                   CPU/gloo: wall-clock union of [launch, completion] of every collective),
  exposed_comm_ms  the part compute could not hide: time the compute stream (CPU: the Python
                   thread) stood still waiting for communication.
Measuring costs one device synchronisation per step (in `metrics()`); `enabled=False` turns it off.
"""
from __future__ import annotations

import collections
import contextlib
import os
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager  # private, but c10d's only coalescing API


# ---- process-group facts ---------------------------------------------------------------------
def group_size(pg: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(pg) if dist.is_available() and dist.is_initialized() else 1


def group_rank(pg: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(pg) if dist.is_available() and dist.is_initialized() else 0


def global_rank(pg: Optional[dist.ProcessGroup], rank_in_group: int) -> int:
    """Global rank of `rank_in_group` (collectives take global ranks as src/dst)."""
    return rank_in_group if pg is None else dist.get_global_rank(pg, rank_in_group)


def supports_avg(pg: Optional[dist.ProcessGroup]) -> bool:
    """NCCL averages inside the reduction (no extra pass over the buffer); gloo does not."""
    try:
        return dist.get_backend(pg) == "nccl"
    except Exception:  # noqa: BLE001
        return False


def broadcast_module(module: torch.nn.Module, pg: Optional[dist.ProcessGroup],
                     chunk_bytes: int = 256 * 2**20, exclude: frozenset[int] = frozenset()) -> None:
    """Copy group rank 0's parameters and buffers to every rank (except those whose id is in `exclude`: each rank
    holds its own, e.g. its experts under expert parallelism).

    Small tensors travel coalesced in flat chunks of at most `chunk_bytes` (per dtype and device); a larger
    contiguous tensor is broadcast in place. The extra memory is one chunk, not a copy of the model (a
    model-sized flat buffer would add its whole size to the run's peak)."""
    if group_size(pg) == 1:
        return
    tensors = [t for i, t in {id(t): t for t in list(module.parameters()) + list(module.buffers())}.items()
               if i not in exclude]
    # a DTensor (tensor parallelism) is broadcast as its local part: the ranks of `pg` hold the same part
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    src = global_rank(pg, 0)

    def flush(ts: list[torch.Tensor]) -> None:
        if not ts:
            return
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=pg)
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()

    pending: dict[tuple, tuple[list[torch.Tensor], int]] = {}  # (dtype, device) -> (tensors, their bytes)
    with torch.no_grad():
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes >= chunk_bytes and t.is_contiguous():
                dist.broadcast(t.detach(), src=src, group=pg)
                continue
            key = (t.dtype, t.device)
            group, held = pending.get(key, ([], 0))
            if group and held + nbytes > chunk_bytes:
                flush(group)
                group, held = [], 0
            group.append(t)
            pending[key] = (group, held + nbytes)
        for group, _ in pending.values():
            flush(group)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create lazily-initialised optimizer state (AdamW moments) without changing parameters.

    Needed so a checkpoint template (state_dict before the first step) has every state tensor:
    a step with zero gradients and lr=0 (what torch.distributed.checkpoint.state_dict does too).
    The values are overwritten by the checkpoint that is loaded next.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state
              or not optimizer.state[p]]
    if not params:
        return
    saved_grads = {p: p.grad for p in params}
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lr):
        g["lr"] = lr
    for p, grad in saved_grads.items():
        p.grad = grad


# ---- timing ----------------------------------------------------------------------------------
class CommTimer:
    """Per-step communication time and its exposed part (see the module docstring)."""

    def __init__(self, device: torch.device | None = None, enabled: bool = True) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.enabled = enabled
        self.nccl_timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") == "1"
        self.reset()

    def reset(self) -> None:
        # NCCL works not yet harvested, per process group (one NCCL stream each), in launch order
        self._works: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._nccl_ms = 0.0                  # summed durations of the finished ones
        self._blocking: list[tuple] = []      # (start, end) events or (t0, t1) wall clock: comm and exposed
        self._waits: list[tuple] = []         # exposed-only intervals
        self._async_cpu: list[tuple] = []     # CPU (launch, done) intervals of async collectives
        self._pending_cpu: dict[int, float] = {}

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def launched(self, work: Any, group: Any = None) -> Any:
        """Register an async collective's work at launch; returns it. `group`: its process group, when the
        caller launches on more than one (each runs its collectives in order on its own NCCL stream)."""
        if self.enabled and work is not None:
            if self.cuda:
                if self.nccl_timing:
                    self._harvest()
                    self._works[group].append(work)
            else:
                self._pending_cpu[id(work)] = time.perf_counter()
        return work

    def pending_works(self) -> int:
        """Works registered and not yet harvested (each holds its collective's tensors)."""
        return sum(len(q) for q in self._works.values())

    def wait(self, work: Any) -> None:
        """Wait for an async collective, counting the stall as exposed communication."""
        if work is None:
            return
        if not self.enabled:
            work.wait()
            return
        start = self._mark()
        work.wait()
        end = self._mark()
        self._waits.append((start, end))
        self._harvest()
        t0 = self._pending_cpu.pop(id(work), None)
        if t0 is not None:
            self._async_cpu.append((t0, end))

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a synchronous collective: all of it is communication, all of it exposed."""
        if not self.enabled:
            yield
            return
        start = self._mark()
        yield
        self._blocking.append((start, self._mark()))

    def _harvest(self, all_done: bool = False) -> None:
        """Read the duration of every work that has finished on the GPU and let go of it.

        A work holds the tensors of its collective (gradients, gathered weights): kept until the step's
        metrics are read, it would keep FSDP's gathered layers and last step's gradients alive and
        inflate the very peak memory being measured. Polling (`is_completed`, no sync) on every launch
        and wait releases each one soon after the GPU is done with it.
        The works of one process group run in launch order on its NCCL stream, so polling stops at each
        group's oldest unfinished one: O(groups) per launch. Rescanning every pending work on every launch cost
        O(collectives x in flight) host time (FSDP on xl: ~500 collectives a step, a hundred in flight),
        enough to make the timed steps host-bound and their step time meaningless."""
        for works in self._works.values():
            while works and (all_done or works[0].is_completed()):
                w = works.popleft()
                try:
                    self._nccl_ms += float(w._get_duration())
                except Exception:  # noqa: BLE001 - timing unavailable for this work
                    pass

    def _ms(self, pair: tuple) -> float:
        a, b = pair
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def metrics(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
        blocking = sum(self._ms(p) for p in self._blocking)
        exposed = blocking + sum(self._ms(p) for p in self._waits)
        comm = blocking
        if self.cuda:
            self._harvest(all_done=True)  # synchronized above: every work has finished
            comm += self._nccl_ms
        else:  # union of async intervals
            spans = sorted(self._async_cpu)
            cur_a = cur_b = None
            for a, b in spans:
                if cur_b is None or a > cur_b:
                    if cur_b is not None:
                        comm += (cur_b - cur_a) * 1e3
                    cur_a, cur_b = a, b
                else:
                    cur_b = max(cur_b, b)
            if cur_b is not None:
                comm += (cur_b - cur_a) * 1e3
        self.reset()
        return {"comm_ms": comm, "exposed_comm_ms": exposed}


# torch 2.13 renamed the flat collectives (*_single); 2.11 only has the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """out (world * n) <- concat of every rank's inp (n), along dim 0."""
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def all_gather_coalesced(outs: list[torch.Tensor], inps: list[torch.Tensor], group=None) -> Any:
    """Asynchronous all-gathers of several tensors issued as one collective: outs[i] (world * n_i) <- concat of
    every rank's inps[i] (n_i). NCCL runs them as one grouped launch, each straight into its own output (no
    copy into a flat buffer and back). Returns the one work of the coalesced call."""
    with _coalescing_manager(group, async_ops=True) as cm:
        for out, inp in zip(outs, inps):
            _ALL_GATHER(out, inp, group=group, async_op=True)
    (work,) = cm.works  # c10d's fast path: the backend's one *_coalesced call
    return work


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                        async_op: bool = False):
    """out (n) <- this rank's chunk of the sum over ranks of inp (world * n), along dim 0."""
    return _REDUCE_SCATTER(out, inp, op=op, group=group, async_op=async_op)


class AxisCommTiming:
    """For a parallel plugin whose collectives on one mesh axis a `CommTimer` in `self.timer` times (None: the axis
    has degree 1, nothing to time). The trainer turns timing on for the steps it logs and reads
    `<comm_axis>_comm_ms` / `<comm_axis>_exposed_comm_ms` from `step_metrics`."""

    comm_axis = ""
    timer: "CommTimer | None" = None

    def measure_communication(self, enabled: bool) -> None:
        """Time this axis's collectives in the steps that follow (or stop timing them)."""
        if self.timer is not None:
            if enabled and not self.timer.enabled:
                self.timer.reset()
            self.timer.enabled = enabled

    def step_metrics(self) -> dict[str, float]:
        """This axis's communication time of the measured steps and its exposed part (empty when not timed)."""
        if self.timer is None or not self.timer.enabled:
            return {}
        m = self.timer.metrics()
        return {f"{self.comm_axis}_comm_ms": m.get("comm_ms", 0.0),
                f"{self.comm_axis}_exposed_comm_ms": m.get("exposed_comm_ms", 0.0)}

