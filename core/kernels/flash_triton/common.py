"""Shared pieces of the Triton kernels: the Triton import, tile helpers every kernel calls, host-side arithmetic.

Under TRITON_INTERPRET=1 (Triton's own switch: the CPU interpreter) dot operands are widened to fp32, since the
interpreter mis-multiplies bf16 tiles; everything else is the same source the GPU compiles.
"""
from __future__ import annotations

import os

from torch import Tensor

from core.kernels._flash_common import MAX_HEAD_DIM

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs without Triton: the error is raised at call time
    triton = None
    tl = None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


if HAVE_TRITON:
    # the CPU interpreter (Triton 3.9) mis-multiplies bf16 tiles in tl.dot: there, dot operands
    # are widened to fp32 first (exact for bf16/fp16 values, so the rounding matches the GPU path)
    _UPCAST_DOT = tl.constexpr(INTERPRET)

    @triton.jit
    def _mm(a, b):
        if _UPCAST_DOT:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            c = tl.dot(a, b)
        return c

    @triton.jit
    def _mma(a, b, acc):
        if _UPCAST_DOT:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            c = tl.dot(a, b, acc)
        return c

    @triton.jit
    def _load_rows(ptrs, offs_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   ROW_MASK: tl.constexpr):
        """Load a (rows, BLOCK_D) tile; rows >= n_rows and columns >= HEAD_DIM read as 0."""
        if ROW_MASK:
            if BLOCK_D == HEAD_DIM:
                x = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
            else:
                x = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            if BLOCK_D == HEAD_DIM:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        return x

    @triton.jit
    def _head_major(n_tiles):
        """(batch x head, tile) of this program in a 1-D grid ordered head by head, each head's tiles in
        program order: the programs resident together share a head's operands in L2 (`launch._grid`)."""
        pid = tl.program_id(0)
        return pid // n_tiles, pid % n_tiles

    @triton.jit
    def _lse_to_base2(lse):
        """Natural-log logsumexp to base 2 for exp2(s - lse2); rows that see no key (-inf) to +inf, so their
        masked scores (-inf) give p = 0 rather than NaN."""
        return tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634

    @triton.jit
    def _store_stats(STATS, row, lse2, delta, mask):
        """The dK/dV pass's per-row inputs as one (base-2 logsumexp, delta) pair: STATS[row] = (lse2, delta)."""
        tl.store(STATS + 2 * row, lse2, mask=mask)
        tl.store(STATS + 2 * row + 1, delta, mask=mask)

    @triton.jit
    def _store_rows(ptrs, x, offs_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        if BLOCK_D == HEAD_DIM:
            tl.store(ptrs, x, mask=offs_r[:, None] < n_rows)
        else:
            tl.store(ptrs, x, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))

# Host-side helpers in plain Python: `triton.cdiv` / `triton.next_power_of_2` are
# `constexpr_function` wrappers costing ~2.5 us per call from the host (5 calls per fwd+bwd).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# the tile width for a head dim: the next power of two from 16 (tl.dot's smallest K); columns past the head dim are
# masked on load and store
_BLOCK_D = {d: max(16, 1 << (d - 1).bit_length()) for d in range(1, MAX_HEAD_DIM + 1)}


def _to_4d(x: Tensor) -> Tensor:
    """View (..., N, d) as (Z, H, N, d), copying only if the leading dims cannot be merged."""
    nd = x.dim()
    if nd == 4:
        pass
    elif nd == 2:
        x = x[None, None]
    elif nd == 3:
        x = x[None]
    else:
        x = x.reshape(-1, *x.shape[-3:])
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x
