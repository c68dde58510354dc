"""flash_triton's C++ autograd node: the eager CUDA path without Python on the way (csrc/flash_node.cpp).

Why: at short sequences an eager forward+backward is bound by host time, not by the kernels. Through a Python
`torch.autograd.Function` it costs more host time than SDPA's whole C++ path: the Python node, the Python
backward that autograd's device thread runs, and the Python launch path.

How: `FlashAttentionTriton.apply` hands eager CUDA calls to `attention` (installed there when this module is
imported, which importing `core.kernels` does). The first call of an input signature
(sizes, strides, dtype, 16-byte alignment, aliasing, causal, device) runs flash_triton's Python forward under a
`_Recorder`, which sees every allocation (a TorchDispatchMode) and every kernel launch (flash_triton._run reports
each compiled kernel, its grid and its arguments). If the forward did nothing else, the recording becomes a plan:
the allocations' geometry, and per launch the CUfunction, grid, threads, shared memory and each parameter as a
tensor slot or a value, in the order the compiled kernel takes them. One kind of slot is neither input nor
allocation: the split-KV forward's arrival counts, which a replay takes from its own stream's buffer (and which keep
a capturing stream on the Python path, where a CUDA graph gets counts of its own). The C++ node replays the plan for every later
call of that signature, and records a backward plan per gradient signature the same way, through the Python
backward on its first call. A signature whose Python path does anything else (autotuning, Gluon kernels, a copy,
an op on the data) keeps the Python path.

The plan holds every integer the kernels get, so a replay launches the kernel `JITFunction.run` would pick: Triton
specializes on integers' values (1, multiples of 16) and pointers' alignment, and those are fixed by the signature.

Built on first use with `torch.utils.cpp_extension.load` (about 30 s, cached under TORCH_EXTENSIONS_DIR); if that
fails, a warning, and the Python path. `SCALELAB_FLASH_NATIVE=0` (or `flash_triton.NATIVE_NODE = False`) switches it
off. The kernel ABI it replays (the parameters that are not constexpr, then two scratch pointers) is that of the
Triton versions in `TESTED_TRITON`, where the GPU tests ran.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from core.kernels import flash_triton as ft
from core.kernels._flash_common import check_inputs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "flash_node.cpp"
TESTED_TRITON = ("3.6",)  # kernel parameter layout checked against JIT launches on the GPU (tests)

_ALLOC_OPS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
              torch.ops.aten.empty_strided.default}
_INT_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "u1": 8, "u8": 8, "u16": 16, "u32": 32,
             "u64": 64}

_ext: Any = None
_failed = False
_lock = threading.Lock()
_knobs: tuple | None = None
last_refusal: str | None = None  # why the last recording did not become a plan (diagnostics)
_kernels: set = set()  # compiled kernels that plans launch: kept alive, so their CUfunctions stay loaded


class NotReplayable(Exception):
    """The Python path did something a plan cannot replay."""


_platform_ok: bool | None = None  # CUDA and a tested Triton: looked up once (it sits on the call path)


def available() -> bool:
    """Whether the node can be used in this process (CUDA, a tested Triton, switched on)."""
    global _platform_ok
    if _platform_ok is None:
        _platform_ok = ft.HAVE_TRITON and not ft.INTERPRET and torch.cuda.is_available() \
            and any(ft.triton.__version__.startswith(v) for v in TESTED_TRITON)
    return ft.NATIVE_NODE and _platform_ok


def extension():
    """The compiled extension, built on first use; None where it is unavailable or did not build."""
    global _ext, _failed
    if _ext is not None or _failed:
        return _ext
    with _lock:
        if _ext is None and not _failed:
            try:
                from torch.utils.cpp_extension import load
                log.info("building flash_triton's C++ autograd node (once; cached by torch.utils.cpp_extension)")
                ext = load("scalelab_flash_node", [str(SOURCE)], extra_cflags=["-O2"], verbose=False)
                ext.set_backward_fallback(_backward_fallback)
                _ext = ext
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: the Python path still works
                _failed = True
                warnings.warn(f"flash_triton: the C++ autograd node did not build ({type(e).__name__}: "
                              f"{str(e)[-300:]}); the Python autograd path runs instead (slower at short "
                              "sequences). Set SCALELAB_FLASH_NATIVE=0 to skip the build.", RuntimeWarning)
    return _ext


def _knob_state() -> tuple:
    """What in flash_triton decides a call's launches, besides the signature: its knobs, pinned tiles and policy
    functions (tests and benchmarks replace them). Plans are dropped when any of it changes."""
    return (ft.FWD_SPLIT, ft.FWD_SPLIT_KEYS, ft.MAX_FWD_SPLITS, ft.FWD_MERGE_IN_KERNEL, ft.SHORT_ROW_TILES,
            ft._SPLIT_TILES, ft._SHORT_SPLIT_TILES, ft.GLUON_WS, ft.GLUON_DKDV, ft.WS_MIN_ROWS,
            ft.FAST_LAUNCH, ft.POISON_OUTPUTS, ft._PINNED, ft._MAX_GRID_Y, ft._default_bwd, ft._use_fused,
            ft._fwd_split_len, ft._launch, ft._run, ft._sm_count, ft._capability, ft._gluon_ws_ok)


def forget_plans() -> None:
    """Drop every plan (after changing flash_triton's knobs or pinned tiles by hand)."""
    if _ext is not None:
        _ext.clear()


def plan_counts() -> tuple[int, int, int]:
    """(forward plans, signatures kept on the Python path, backward plans)."""
    return tuple(_ext.stats()) if _ext is not None else (0, 0, 0)


def attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor | None:
    """The node's output for an eager call, or None: the caller runs the Python autograd Function."""
    global _knobs
    ext = _ext if _ext is not None else (extension() if available() else None)
    if ext is None:
        return None
    knobs = _knob_state()
    if knobs != _knobs:
        ext.clear()
        _knobs = knobs
    res = ext.apply(q, k, v, is_causal)
    if res.__class__ is not int:
        return res
    if res != ext.RECORD:
        return None
    check_inputs(q, k, v, "flash_triton")  # a signature gets a plan only once its inputs pass
    spec, never = _record(lambda: ft.flash_fwd_impl(q, k, v, is_causal), (q, k, v))
    if spec is not None or never:
        ext.store(q, k, v, is_causal, spec)
    if spec is None:
        return None
    out = ext.apply(q, k, v, is_causal)  # the recording ran outside autograd: this call goes through the node
    return out if out.__class__ is not int else None


def _backward_fallback(do, q, k, v, o, lse, is_causal, record):
    """The node's backward for a gradient signature without a plan (autograd's device thread, GIL held):
    flash_triton's Python backward, recorded into a plan if `record`. Returns (dq, dk, dv, spec, never)."""
    variant = ft._default_bwd(q, k, do)
    grads: list[tuple] = []

    def run() -> tuple:
        grads.append(ft.flash_bwd_impl(do, q, k, v, o, lse, is_causal, variant))
        return grads[0]

    if not record:
        return (*run(), None, False)
    spec, never = _record(run, (do, q, k, v, o, lse))
    return (*grads[0], spec, never)


def _record(run, inputs: tuple) -> tuple[tuple | None, bool]:
    """Run `run()` (returning the output tensors) under a recorder: (plan spec or None, never replayable)."""
    rec = _Recorder(inputs)
    ft._RECORDER.current = rec
    try:
        with torch.no_grad(), rec:  # as inside an autograd.Function (grad mode would add detach ops)
            outputs = run()
    finally:
        ft._RECORDER.current = None
    try:
        return rec.spec(outputs), False
    except NotReplayable as e:
        global last_refusal
        last_refusal = str(e)
        log.debug("flash_triton: no C++ plan for this signature: %s", e)
        return None, not rec.retry


class _Recorder(TorchDispatchMode):
    """Sees a Python forward or backward run: allocations (aten empty ops) and launches (flash_triton._run).
    Anything else, or a launch that does not go through `_run`, makes the run not replayable."""

    def __init__(self, inputs: tuple):
        super().__init__()
        self.inputs = inputs
        self.allocs: list[Tensor] = []
        self.counts: list[tuple[Tensor, int]] = []  # flash_triton's per-stream arrival counts, and how many
        self.launches: list[tuple] = []
        self.problem: str | None = None
        self.retry = False  # the run autotuned: the next one may be replayable

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOC_OPS and isinstance(out, Tensor) and out.numel() > 0:
            self.allocs.append(out)
        elif func is torch.ops.aten.detach.default and self._is_alloc(args[0]):
            pass  # CUDA factory calls under a dispatch mode detach their result: the same tensor to a launch
        elif self.problem is None:
            self.problem = f"op {func}"
        return out

    def launch(self, kernel, grid: tuple, args: tuple) -> None:
        self.launches.append((kernel, tuple(grid), args))

    def arrival_counts(self, counts: Tensor, n: int) -> None:
        """`counts` (n used) is the stream's arrival-count buffer: a replay takes its own stream's."""
        self.counts.append((counts, n))

    def unreplayable(self, why: str, retry: bool = False) -> None:
        if self.problem is None:
            self.problem = why
        self.retry = self.retry or retry

    @staticmethod
    def _geometry(t: Tensor) -> tuple:
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()

    def _is_alloc(self, t) -> bool:
        return isinstance(t, Tensor) and any(self._geometry(a) == self._geometry(t) for a in self.allocs)

    def _slot(self, t: Tensor) -> int:
        for i, x in enumerate(self.inputs):
            if t is x:
                return i
        sig = self._geometry(t)
        for i, a in enumerate(self.allocs):
            if self._geometry(a) == sig:
                return len(self.inputs) + i
        for i, (counts, _) in enumerate(self.counts):
            if t is counts:
                return len(self.inputs) + len(self.allocs) + i
        raise NotReplayable("a launch argument is neither an input nor an allocation")

    def spec(self, outputs: tuple) -> tuple:
        if self.problem is not None:
            raise NotReplayable(self.problem)
        if not self.launches:
            raise NotReplayable("no launch recorded")
        # (sizes, strides, dtype, arrival counts): the counts slots come after the allocations
        allocs = [(list(a.shape), list(a.stride()), a.dtype, 0) for a in self.allocs] + \
            [([n], [1], torch.int32, n) for _, n in self.counts]
        launches = [self._launch_spec(*launch) for launch in self.launches]
        out_slots = [self._slot(t) for t in outputs]
        if any(s < len(self.inputs) for s in out_slots):
            raise NotReplayable("an output is an input")
        return allocs, launches, out_slots

    def _launch_spec(self, kernel, grid: tuple, args: tuple) -> tuple:
        md = kernel.metadata
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) \
                or getattr(md, "launch_pdl", False) or getattr(md, "profile_scratch_size", 0):
            raise NotReplayable(f"launch options of {kernel.name}")
        signature = kernel.src.signature  # every parameter, constexprs included, in order
        if len(signature) != len(args) or kernel.function is None:
            raise NotReplayable(f"signature of {kernel.name}")
        params = []
        for ty, value in zip(signature.values(), args):
            if ty == "constexpr":
                continue
            if not isinstance(ty, str):
                raise NotReplayable(f"parameter type {ty!r}")
            if ty.startswith("*"):
                params.append((self._slot(value), 0))
            elif ty in _INT_BITS:
                params.append((-1, int(value) & ((1 << _INT_BITS[ty]) - 1)))
            elif ty in ("fp32", "f32"):
                params.append((-1, struct.unpack("<I", struct.pack("<f", float(value)))[0]))
            else:
                raise NotReplayable(f"parameter type {ty}")
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        scratch = md.global_scratch_size * gx * gy * gz if getattr(md, "global_scratch_size", 0) else 0
        _kernels.add(kernel)
        return (int(kernel.function), [gx, gy, gz], 32 * md.num_warps, md.shared, scratch, params)


ft.install_eager_path(attention, forget_plans)
