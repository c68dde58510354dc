"""Launching the Triton kernels: tiles (pinned, the interpreter's, or the autotuner's), grids, and direct launches
through the compiled kernel's own launcher; device lookups kept off the per-call path; the split-KV forward's
arrival counts.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from core.kernels.flash_triton import common, tuning
from core.kernels.flash_triton.common import _cdiv, triton

_MAX_GRID_Y = 65535  # CUDA's limit on grid dims 1 and 2


def _grid(kind: str, zh: int, n_rows: int, n_k: int, bm: int, bn: int) -> tuple[int, ...]:
    """fwd / dq / dkdv: one dimension of batch x heads x tiles, head-major (`common._head_major`); fused:
    (tiles, batch x heads) with tiles = max(query tiles, key tiles), so that both phases cover their tiles
    (grid dim 1 caps batch x heads at _MAX_GRID_Y there: flash_bwd_impl runs the two-pass backward beyond it).

    Head-major, because the programs resident at one time then share one head's K and V (forward, dQ) or Q and
    dO (dK/dV) in L2. Heads first (program id 0 = batch x head) put a different head on every SM: at
    (4, 16, 16384, 64) each program streamed its own head's keys from DRAM (64 heads, 256 MB of K and V against
    a 50 MB L2), and the long-row batched shapes ran at 1.4-1.7x cuDNN's time."""
    if kind == "fused":
        return (max(_cdiv(n_rows, bm), _cdiv(n_k, bn)), zh)
    return (zh * _cdiv(n_rows, bn if kind == "dkdv" else bm),)


def _launch(name: str, tuned, raw, zh: int, n_rows: int, args: tuple,
            is_causal: bool, d: int, block_d: int, seq_class: int, dtype, n_k: int = 0,
            tiles: tuple[int, ...] | None = None, **constexprs) -> None:
    """Launch with pinned tiles (`FlashConfig.tiles`), the interpreter's tiles, or the autotuner's choice for this
    key.

    After the first call for a key the raw kernel is launched with the chosen config: that skips
    the autotuner's per-call bookkeeping, which matters at short sequences (launch-bound).
    n_rows: query rows (fwd, dq, fused) or keys (dkdv); n_k: keys, read by the fused grid only.
    """
    kind = "dkdv" if name.startswith("dkdv") else name
    if tiles is not None:
        cfg = tiles
    elif common.INTERPRET:
        cfg = (*tuning._INTERPRET_TILES[kind], 4, 1)
    else:
        key = (name, seq_class, is_causal, d, dtype)
        cfg = tuning._CHOSEN.get(key)
        if cfg is None:
            def grid(meta):
                return _grid(kind, zh, n_rows, n_k, meta["BLOCK_M"], meta["BLOCK_N"])
            tuned[grid](*args, IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d, **constexprs)
            best = tuned.best_config
            tuning._CHOSEN[key] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
            return
    bm, bn, warps, stages, *maxnreg = cfg  # a pinned 5th number caps registers per thread (ptxas maxnreg)
    if maxnreg:
        constexprs["maxnreg"] = maxnreg[0]
    grid = _grid(kind, zh, n_rows, n_k, bm, bn)
    _run(raw, grid, args, _N_TENSOR_ARGS[kind], IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d,
         BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **constexprs)


# Direct launches. `JITFunction.run` binds and specializes every argument, builds a cache key and looks the
# compiled kernel up on every call: 27 us of host time per launch on the H100 VM's CPU, against 8.5 us for the
# compiled kernel's own launcher, and a forward+backward makes 2-4 launches. `_run`
# keeps the compiled kernel per launch signature and calls its launcher directly. Triton specializes a kernel
# on its constexprs and options, on the value class of each integer (1, multiple of 16, int32 or int64), on
# each pointer's dtype and 16-byte alignment and on each TMA descriptor's dtype, box and shared-memory layout;
# the key holds the integers' values themselves and those of each pointer and descriptor (`_arg_key`), so a hit
# launches the kernel JITFunction.run would have picked.
# A Triton whose launcher takes other arguments makes the first direct launch fail: from then on this process
# launches through JITFunction.run (`_direct_ok`, a capability found at run time, not a setting).
_direct_ok = True
_LAUNCHERS: dict[tuple, tuple] = {}
_N_TENSOR_ARGS = {"fwd": 5, "dq": 8, "dkdv": 8, "fused": 9}  # leading pointer arguments of each kernel
_MAX_LAUNCHERS = 1024  # distinct shapes / layouts kept; the cache restarts beyond that


_current_device = torch.cuda.current_device
if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # what Triton itself calls: no Stream object built
    _current_stream = torch._C._cuda_getCurrentRawStream
else:
    def _current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def _arg_key(arg) -> tuple | None:
    """What Triton specializes a kernel on for a tensor argument (its dtype, and whether its address is 16-byte
    aligned) or a host TMA descriptor (its tensor's dtype, its box and its shared-memory layout); None stays None
    (a constexpr)."""
    if isinstance(arg, Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if arg is None:
        return None
    return arg.base.dtype, tuple(arg.block_shape), arg.layout


class Replay:
    """A direct launch that `_run` made, again with new leading (tensor or descriptor) arguments and the same grid,
    scalars and constexprs: for a caller that keeps it under a key of its own, one that fixes everything the
    launch's other arguments and its compiled kernel depend on (`dispatch.flash_fwd_impl`: the inputs' shapes,
    strides, dtypes, device, mask and config). It skips `_run`'s key and the caller's policy, the host time a
    forward spends while the GPU may wait for it. Use only while `replays_ok()`."""

    __slots__ = ("kernel", "grid", "device", "rest")

    def __init__(self, kernel, grid: tuple, device: int, rest: tuple) -> None:
        self.kernel, self.device, self.rest = kernel, device, rest
        self.grid = (*grid, *(1,) * (3 - len(grid)))

    def __call__(self, *leading) -> None:
        k = self.kernel
        k.run(*self.grid, _current_stream(self.device), k.function, k.packed_metadata, None, None, None,
              *leading, *self.rest)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps a chain of hooks (none by default), older ones a hook or
    None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def _hooks() -> tuple:
    """(enter, exit) launch hooks for a direct launch: None where none is set, so the launcher calls nothing and
    no launch metadata is built (Triton 3.6 builds it and calls its empty hook chains on every launch otherwise)."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter if _hooked(enter) else None), (leave if _hooked(leave) else None)


def replays_ok() -> bool:
    """Whether a `Replay` may launch: direct launches work in this process, and no launch hook (a profiler's)
    wants the metadata that `_run` passes it."""
    return _direct_ok and _hooks() == (None, None)


def _run(raw, grid: tuple, args: tuple, n_tensors: int, replay: bool = False, **meta) -> Replay | None:
    """`raw[grid](*args, **meta)`; the first n_tensors arguments are tensors or TMA descriptors, the rest Python
    scalars. With `replay`, the launch as a `Replay` where it was direct (else None)."""
    global _direct_ok
    if not _direct_ok or common.INTERPRET:
        raw.run(*args, grid=grid, warmup=False, **meta)
        return None
    # every pointer's dtype and alignment (the split-KV merge takes fp32 partials and writes O in the inputs'
    # dtype: one dtype per launch would confuse its fp32 and bf16 variants)
    leading = tuple([_arg_key(t) for t in args[:n_tensors]])
    device = _current_device()  # where JITFunction.run launches too
    key = (raw, device, leading, args[n_tensors:], *meta.values())
    hit = _LAUNCHERS.get(key)
    if hit is None:
        kernel = raw.run(*args, grid=grid, warmup=False, **meta)  # compiles, or finds the compiled kernel
        # the launcher takes every kernel parameter, constexprs included (after the runtime ones here)
        constexprs = tuple(meta[name] for name in raw.arg_names[len(args):])
        common._remember(_LAUNCHERS, key, (kernel, constexprs), _MAX_LAUNCHERS)
        return None  # a Replay comes from a direct launch that worked: the next call's
    kernel, constexprs = hit
    full = args + constexprs
    stream = _current_stream(device)
    try:
        enter, leave = _hooks()
        # launch metadata is for the hooks (a profiler's) only
        metadata = kernel.launch_metadata(grid, stream, *full) if enter is not None or leave is not None else None
        kernel.run(*grid, *(1,) * (3 - len(grid)), stream, kernel.function, kernel.packed_metadata, metadata,
                   enter, leave, *full)
    except (TypeError, AttributeError):  # another Triton's launcher or knobs: back to JITFunction.run for good
        _direct_ok = False
        raw.run(*args, grid=grid, warmup=False, **meta)
        return None
    return Replay(kernel, grid, device, args[n_tensors:] + constexprs) if replay else None


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, looked up once per device (it sits on the launch path)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return cap


def _has_tma(device: torch.device) -> bool:
    """Whether the atomic-dQ backward reduces dQ tiles with Hopper's bulk tensor reductions (sm_90+, compiled;
    the CPU interpreter has no descriptor reductions and keeps per-element atomics)."""
    if common.INTERPRET or device.type != "cuda":
        return False
    return _capability(device) >= (9, 0)


def _torch_scratch(size: int, alignment: int, stream) -> Tensor:
    """Global scratch for kernels that build tensor descriptors on the device (128 B per program),
    from PyTorch's caching allocator (blocks are 512-byte aligned, more than TMA's 128)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Give Triton an allocator for device-side descriptors unless the caller set one. Triton keeps it in a
    ContextVar, i.e. per thread: autograd's backward runs on its own thread, so this is checked per launch."""
    try:
        from triton.runtime import _allocation
        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another Triton layout: set ours
        pass
    triton.set_allocator(_torch_scratch)


class _ArrivalCounts:
    """Zeroed int32 arrival counts for `_fwd_split_merge_kernel`, which puts every count it used back to 0.

    Launches on one stream run one after another, so each (device, stream) keeps one buffer: no memset per
    call. A CUDA graph must not share counts with anything that may run beside its replays (another graph, the
    stream it was captured on), so a capture takes a buffer of its own from a reserve zeroed outside any
    capture, or, once the reserve is spent, zeroes one inside the graph (a memset node in every replay)."""

    SIZE = 1024     # counts per buffer; split grids have fewer query tiles than the GPU has SMs
    RESERVE = 32    # spare buffers per device for captures

    def __init__(self) -> None:
        self._by_stream: dict[tuple[int, int], Tensor] = {}
        self._reserve: dict[int, list[Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device, n: int) -> Tensor:
        """A buffer of at least n zeroed counts for a launch on `device`'s current stream."""
        cuda = device.type == "cuda"  # else the interpreter: one buffer, programs run one after another
        index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1
        # outside any TorchDispatchMode active around the call (a memory counter, say): the buffers outlive it
        with _disable_current_modes(), self._lock:
            if cuda and torch.cuda.is_current_stream_capturing():
                spare = self._reserve.get(index)
                if spare and n <= self.SIZE:
                    return spare.pop()
                return torch.zeros(n, device=device, dtype=torch.int32)
            key = (index, _current_stream(index) if cuda else 0)
            counts = self._by_stream.get(key)
            if counts is None or counts.numel() < n:  # zeroed in this stream's order, before the launch
                counts = self._by_stream[key] = torch.zeros(max(n, self.SIZE), device=device, dtype=torch.int32)
            if cuda and len(self._reserve.get(index, ())) < self.RESERVE // 2:
                block = torch.zeros((self.RESERVE, self.SIZE), device=device, dtype=torch.int32)
                torch.cuda.current_stream(index).synchronize()  # zero before any graph replays a capture of it
                self._reserve[index] = list(block.unbind(0)) + self._reserve.get(index, [])
            return counts


_ARRIVALS = _ArrivalCounts()
_PROPS: dict[int, tuple[int, int]] = {}


def _props(device: torch.device) -> tuple[int, int]:
    """(SMs, L2 bytes) of a CUDA device, read once (a properties call costs microseconds a launch)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = _PROPS.get(index)
    if props is None:
        p = torch.cuda.get_device_properties(index)
        props = _PROPS[index] = (p.multi_processor_count, p.L2_cache_size)
    return props


def _sm_count(device: torch.device) -> int:
    return _props(device)[0]


def _l2_bytes(device: torch.device) -> int:
    return _props(device)[1]
