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
    def _load_rows(ptrs, offs_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, END: tl.constexpr, ROW_MASK: tl.constexpr):
        """Load a (rows, width) tile of the columns offs_d, which end at column END; rows >= n_rows and columns
        >= HEAD_DIM read as 0 (no column mask where the tile ends inside the head: END <= HEAD_DIM)."""
        if ROW_MASK:
            if END <= HEAD_DIM:
                x = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
            else:
                x = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            if END <= HEAD_DIM:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        return x

    @triton.jit
    def _tail_cols(offs_d, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
        """The column offsets of the tail part (`_TILE_D`): BLOCK_D ... BLOCK_D + TAIL_D; without a tail, offs_d
        again (a placeholder the kernels never load through)."""
        if TAIL_D > 0:
            offs_t = BLOCK_D + tl.arange(0, TAIL_D)
        else:
            offs_t = offs_d
        return offs_t

    @triton.jit
    def _load_parts(base, offs_r, stride_r, n_rows, offs_d, offs_t, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    TAIL_D: tl.constexpr, ROW_MASK: tl.constexpr):
        """Rows offs_r of a head's (rows, HEAD_DIM) matrix at base, as its main part (columns offs_d) and its tail
        part (offs_t; without a tail the main part again, unused)."""
        rows = base + offs_r[:, None] * stride_r
        x = _load_rows(rows + offs_d[None, :], offs_r, n_rows, offs_d, HEAD_DIM, BLOCK_D, ROW_MASK)
        if TAIL_D > 0:
            x1 = _load_rows(rows + offs_t[None, :], offs_r, n_rows, offs_t, HEAD_DIM, BLOCK_D + TAIL_D, ROW_MASK)
        else:
            x1 = x
        return x, x1

    @triton.jit
    def _store_parts(base, offs_r, stride_r, n_rows, offs_d, offs_t, x, x1, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
        """Store the main part x (columns offs_d) and, with a tail, x1 (offs_t) of rows offs_r (< n_rows)."""
        rows = base + offs_r[:, None] * stride_r
        _store_rows(rows + offs_d[None, :], x, offs_r, n_rows, offs_d, HEAD_DIM, BLOCK_D)
        if TAIL_D > 0:
            _store_rows(rows + offs_t[None, :], x1, offs_r, n_rows, offs_t, HEAD_DIM, BLOCK_D + TAIL_D)

    @triton.jit
    def _mm_parts(a, b, a1, b1, TAIL_D: tl.constexpr):
        """a b + a1 b1: a product that contracts over the head dim, summed over its main and tail parts."""
        c = _mm(a, b)
        if TAIL_D > 0:
            c = _mma(a1, b1, c)
        return c

    @triton.jit
    def _row_dot(a, b, a1, b1, TAIL_D: tl.constexpr):
        """rowsum(a * b) in fp32 over both parts of the head (delta = rowsum(dO * O))."""
        r = tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)
        if TAIL_D > 0:
            r += tl.sum(a1.to(tl.float32) * b1.to(tl.float32), 1)
        return r

    @triton.jit
    def _head_major(n_tiles):
        """(batch x head, tile) of this program in a 1-D grid ordered head by head, each head's tiles in
        program order: the programs resident together share a head's operands in L2 (`launch._grid`)."""
        pid = tl.program_id(0)
        return pid // n_tiles, pid % n_tiles

    @triton.jit
    def _key_range(start_m, n_k, causal_off, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """(full_hi, hi) for the BLOCK_M query rows from start_m: the key tiles below full_hi are visible to every
        row (no mask), those in [full_hi, hi) need the mask (`_mask_scores`: the causal diagonal, the ragged end);
        causal keys past the last row's diagonal are never visited."""
        n_full = (n_k // BLOCK_N) * BLOCK_N  # key tiles with no ragged end
        if IS_CAUSAL:
            # keys visible to the first row of the tile: j <= start_m + causal_off
            full_hi = (tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N
            full_hi = tl.minimum(full_hi, n_full)
            hi = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_off, 0), n_k)
        else:
            full_hi = n_full
            hi = n_k
        return full_hi, hi

    @triton.jit
    def _mask_scores(s, offs_m, offs_n, n_k, causal_off, IS_CAUSAL: tl.constexpr):
        """Scores s (queries offs_m x keys offs_n) with keys past n_k, and causal keys after a query's diagonal
        (j > i + causal_off), set to -inf."""
        valid = offs_n[None, :] < n_k
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        return tl.where(valid, s, float("-inf"))

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
    def _store_rows(ptrs, x, offs_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, END: tl.constexpr):
        if END <= HEAD_DIM:
            tl.store(ptrs, x, mask=offs_r[:, None] < n_rows)
        else:
            tl.store(ptrs, x, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))

def _remember(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, the cache emptied first once it holds `limit` entries (the host-side caches of launches,
    layouts and descriptors: a process that sees ever new shapes does not grow them without bound)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


def _tma_aligned(t: Tensor) -> bool:
    """Whether t's base address is 16-byte aligned, as a TMA descriptor needs (the Gluon kernels' checks). A fake
    tensor (torch.compile tracing) has no storage: True, and the kernels' host code checks the real one."""
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:
        return True


# Host-side helpers in plain Python: `triton.cdiv` / `triton.next_power_of_2` are
# `constexpr_function` wrappers costing ~2.5 us per call from the host (5 calls per fwd+bwd).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_d(d: int) -> int:
    """One power-of-two tile over the whole head: the next power of two from 16 (tl.dot's smallest K)."""
    return max(16, 1 << (d - 1).bit_length())


def _tile_d(d: int) -> tuple[int, int]:
    """(BLOCK_D, TAIL_D): the column parts a head dim is tiled in. One power-of-two tile from 16 (tl.dot's
    smallest K; columns past d masked), unless a power-of-two part and a smaller tail cover d in fewer columns:
    80 = 64 + 16 and 96 = 64 + 32 instead of 128, so the matmuls do 0.62x and 0.75x the work of a padded
    128-wide tile (the exponentials do not change)."""
    whole = _pow2_d(d)
    main = whole // 2
    tail = max(16, 1 << (d - main - 1).bit_length()) if d > main else 0
    return (main, tail) if d > 16 and main + tail < whole else (whole, 0)


_TILE_D = {d: _tile_d(d) for d in range(1, MAX_HEAD_DIM + 1)}
# one power-of-two tile over the whole head (the streaming kernels: delta, the split forward's merge)
_POW2_D = {d: _pow2_d(d) for d in range(1, MAX_HEAD_DIM + 1)}


def _as_4d(x: Tensor) -> Tensor:
    """View (..., N, d) as (Z, H, N, d), copying only if the leading dims cannot be merged; its strides unread."""
    nd = x.dim()
    if nd == 4:
        return x
    if nd == 2:
        return x[None, None]
    if nd == 3:
        return x[None]
    return x.reshape(-1, *x.shape[-3:])


def _to_4d(x: Tensor) -> Tensor:
    """`_as_4d`, and a copy where the head dim's stride is not 1 (the kernels read rows of unit stride)."""
    x = _as_4d(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x
