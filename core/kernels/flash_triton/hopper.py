"""Hopper-specific (sm_90) kernels in Gluon: the warp-specialised one-pass FlashAttention-2 backward, with dQ
reduced through the TMA engine, and the host code that decides where it applies and launches it.

Gluon is Triton's lower-level dialect: the same compiler and runtime, with layouts, shared memory, TMA copies,
mbarriers, asynchronous wgmma and warp specialisation spelled out. The kernel walks, for a tile of keys, the query
tiles that see it, from the (base-2 logsumexp, delta) pairs of the delta kernel (`backward._bwd_delta_kernel`),
with what Triton 3.6 does not do for that loop:

- K and V stay on chip as the wgmma A operands of S^T = K Q^T and dP^T = V dO^T (in registers at head dim 64,
  in shared memory at 80-128);
- the Q and dO tiles and the (lse2, delta) pairs arrive by TMA into a ring of shared-memory buffers, one
  mbarrier each (no per-thread address arithmetic);
- the wgmmas are asynchronous and waited on where their results are needed: dP^T runs on the tensor cores while
  the exponentials of P^T are computed, and dV / dK of one step overlap the next step's first matmuls.

`_bwd_ws_kernel` is the whole backward but a small delta kernel: 5 tile matmuls per (key tile, query tile) pair
instead of the two-pass scheme's 7, each step's dQ = dS K added into an fp32 buffer by one TMA bulk reduction
(`cp.reduce.async.bulk.tensor`, fp32 adds in L2). A program holds 128 keys in two warpgroups that run
independently (`gl.warp_specialize`), each with its own 64 keys and its own chain of waits, so one computes
exponentials while the other's matmuls run, as in cuDNN's kernel. They meet only where they must: the first
warpgroup issues the TMA loads, into a ring both release, and hands its dS^T over shared memory to the second,
which computes dQ over all 128 keys in one wgmma and issues one reduction per step (its 64 x 64 block through
shared memory and the dQ buffer in the accumulator's order, `_DQ_FRAG`, as at d = 128 below). Measured at the
leaderboard shape: with 64 keys per program (one warpgroup) the reductions alone filled L2 (87% of its throughput)
and the kernel was 5% slower than the two-pass backward; 128 keys in one lockstep 8-warp program, 20% slower; two
warpgroups each computing a dQ part over its own 64 keys, summed by the second, 7-10% faster; this one, 3-6%
faster again (2.84 ms against cuDNN's 2.92 under the profiler). The default backward policy uses it for long rows
(`FlashConfig.hopper_ws`, `ws_min_rows`). Its TMA descriptors are made on the host (`launch_ws`): made in every
program they cost up to 13% of the time at 2048 rows. With grouped-query attention a program can walk the query
heads of its KV head one after the other (`HEADS`, `FlashConfig.ws_gqa_max_rows`): dK and dV add up over the group
in its accumulators and are written once per KV head, where per query head they took 4x the bytes and a reduction
afterwards (0.77-0.97x the backward's time up to 8192 rows).

Head dim 128 (`_ws_warpgroup_wide`, `_ws_steps_wide`) keeps the program shape (128 keys, 64 queries a step) but
not the register plan: per thread, dK and dV alone take 128 of the 255 registers, S^T and dP^T 64 more, so K and
V (64 more as register operands) move to shared memory, and a 64 x 128 dQ (64 more) does not fit in either
warpgroup. Both warpgroups compute dQ instead, each for its half of the head dim (dS over all 128 keys times
K[:, half], 32 registers) and each reduces its own 64 x 64 block, so both hand their dS^T halves over shared
memory and wait for the other's (ds_ready / ds_free count both). A block goes through shared memory in its
accumulator's order (`_DQ_FRAG`, `FRAG_ROWS`), and the dQ buffer keeps that order until `ws_dq_finish`. dK = dS^T Q
takes its dS^T from there too, not from registers: with a register operand (16 more registers) the ptxas of Triton
3.6 runs out and serializes every wgmma (info C7512), and the kernel took 1.08-1.11x the time at 8192-16384 rows.
Shared memory sets the ring: K and V 64 KB, dS^T 32 KB, the dQ blocks 32 KB, and 3 stages of Q, dO and pairs
(32.5 KB each), 226 KB of the 227 a program may have.

Head dims 80 and 96 take the same path with the head dim as a 64-wide main part and a tail (`common._TILE_D`:
80 = 64 + 16, 96 = 64 + 32; shared-memory and register tiles are powers of two), each with its own TMA descriptors,
shared-memory buffers and accumulators: S^T and dP^T are two wgmmas into one accumulator, dV and dK one per part,
and the first warpgroup computes and reduces dQ's main part (in the accumulator's order, like d = 128's halves), the
second its tail (row-major, after all the main parts in the dQ buffer). Run in 128-wide tiles instead (the columns
past d zeros), the kernel took 1.08-1.15x this time at d = 80 and 1.01-1.09x at 96 (the tiles did 1.6x / 1.33x the
matmul work). With fewer registers and bytes a stage than at 128, the ring has 4 stages loaded 3 ahead (179 / 207 KB
of shared memory in all).

Scope (`ws_applies`): compiled CUDA on sm_90, fp16 / bf16, head dim 64, 80, 96 or 128, 16-byte aligned Q / dO rows
and an even N_q (each head's (lse2, delta) rows must start 16-byte aligned for the TMA); everything else runs the
Triton kernels, which stay the portable version (and the ones the CPU interpreter tests).
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from core.kernels.flash_triton import common, launch
from core.kernels.flash_triton.common import LOG2E, _cdiv

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_init
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
    # Triton 3.6 calls the TMA load async_copy_global_to_shared; 3.9 renamed it async_load (same arguments)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 renamed thread_barrier
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.language.core import _unwrap_if_constexpr

    @_builtin
    def _reinterpret(buf, dtype, shape, layout, _semantic=None):
        """Shared-memory buffer `buf` seen as a `shape` tensor of `dtype` in `layout`: the memdesc reinterpret
        that Triton 3.6 names `_reinterpret` and 3.9 `reinterpret` (the same operation)."""
        return _semantic.memdesc_reinterpret(buf, _unwrap_if_constexpr(dtype),
                                             [_unwrap_if_constexpr(x) for x in shape], _unwrap_if_constexpr(layout))

    @_builtin
    def _as_fp32(buf, _semantic=None):
        """An int64 shared-memory buffer of n (lse2, delta) pairs seen as 2n fp32, the host TMA descriptor's
        element (it takes no 64-bit ones; `_reinterpret`)."""
        n = 2 * int(getattr(buf.shape[0], "value", buf.shape[0]))
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        return _reinterpret(buf, gl.float32, [n], layout, _semantic=_semantic)

    _tma_add = getattr(tma, "async_atomic_add", None)
    if _tma_add is None:  # Triton 3.6: the builder has the bulk tensor reduction, Gluon does not expose it yet
        from triton._C.libtriton import ir as _ir

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)
except ImportError:  # a Triton without Gluon (or without its Hopper ops)
    HAVE_GLUON = False

HEAD_DIMS = (64, 80, 96, 128)
# 64 queries per step and 64 keys per warpgroup
BLOCK_M, BLOCK_N = 64, 64
# one-pass backward: two warpgroups (128 keys) per program, both keeping 256 registers (the ws region's
# setmaxnreg). The Q / dO ring by head dim, (stages, steps loaded ahead): at 64, 6 stages loaded 3 steps ahead, so
# the first warpgroup (the lighter one: the second computes dQ) can run ahead of the second; at 128, where the
# warpgroups meet every step (both compute dQ) and K, V (64 KB) sit in shared memory, 3 stages (32.5 KB each)
# loaded 2 steps ahead: 226 KB in all, of the 227 KB a program may have; at 80 and 96 (K, V 40 / 48 KB, a stage
# 20.5 / 24.5 KB) 4 stages loaded 3 ahead, 179 / 207 KB (5 at 80 and 3 at 96 measured 0.99-1.02x)
WS_KEYS = 2 * BLOCK_N
WS_RING = {64: (6, 3), 80: (4, 3), 96: (4, 3), 128: (3, 2)}
WS_REGS = 256
# Each 64 x 64 fp32 dQ block (at 80 / 96 the main part's) goes to shared memory in its wgmma accumulator's order,
# a thread's 32 values one 128-byte row (`FRAG_ROWS` rows of 32), and into an fp32 dQ buffer laid out in that order
# (`ws_dq_buffer`, `ws_dq_finish`). Stored in the block's row-major (swizzled) order, each 8-byte store met another
# thread's in a bank (ncu at d = 128: twice the ideal wavefronts, 20% of the kernel's stall samples waiting on the
# store queue); a row a thread takes 16-byte stores that no two threads of a quarter-warp share a bank for. The
# backward took 0.92-0.95x its former time at d = 128, 0.91-0.96x at 64 (1024-16384 rows), 0.95-0.96x at 80 and
# 0.91-0.97x at 96 (2048-16384 rows).
FRAG_ROWS, FRAG_COLS = 128, 32


def ws_constexprs(d: int, heads: int = 1) -> dict:
    """The compile-time arguments of `_bwd_ws_kernel` but IS_CAUSAL, for head dim d and `heads` query heads a
    program (`launch_ws`): the head dim as a power-of-two main part and a tail (`common._TILE_D`: 80 = 64 + 16,
    96 = 64 + 32)."""
    d_main, d_tail = common._TILE_D[d]
    stages, prefetch = WS_RING[d]
    return dict(HEAD_DIM=d_main, D_TAIL=d_tail, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, PREFETCH=prefetch,
                WS_REGS=WS_REGS, HEADS=heads)


if HAVE_GLUON:
    # A thread of the accumulator (warp w, lane 4 lr + lc) holds rows 16 w + 8 h + lr and columns 8 j + 2 lc + e
    # (h, e in 0..1, j in 0..7); shared-memory float o = 32 t + 4 (j ^ t % 8) + 2 h + e, t = 32 w + 4 lr + lc, is
    # the 128-byte-swizzled (FRAG_ROWS, FRAG_COLS) box whose row t the TMA adds to row t of the dQ buffer as
    # 32 floats ordered (j, h, e). The bases: the (row, column) of each offset bit.
    _DQ_FRAG = gl.constexpr(gl.SharedLinearLayout(
        offset_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 10], [0, 20], [1, 32], [2, 0], [4, 0], [16, 0],
                      [32, 0]], alignment=1024))
    _DQ_FRAG_TMA = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    _FRAG_ROWS, _FRAG_COLS = gl.constexpr(FRAG_ROWS), gl.constexpr(FRAG_COLS)

    @gluon.jit
    def _ring(STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, D_TAIL: gl.constexpr,
              dtype: gl.constexpr):
        """Shared-memory ring buffers of Q, dO (their head dim's tail columns in buffers of their own; without a
        tail, the main ones again) and (lse2, delta) pairs, with one load mbarrier per stage."""
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=1)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], tile_layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], tile_layout)
        if D_TAIL > 0:
            tail_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_TAIL], dtype)
            qt_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_TAIL], tail_layout)
            dot_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D_TAIL], tail_layout)
        else:
            qt_smem = q_smem
            dot_smem = do_smem
        stats_smem = gl.allocate_shared_memory(gl.int64, [STAGES, BLOCK_M], stats_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        return q_smem, do_smem, qt_smem, dot_smem, stats_smem, ready

    @gluon.jit
    def _load_step(i, lo, n_h, stage, q_desc, do_desc, qt_desc, dot_desc, stats_desc, q_smem, do_smem, qt_smem,
                   dot_smem, stats_smem, ready, stats_row0, n_q, z, h0, HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
                   HEAD_DIM: gl.constexpr, D_TAIL: gl.constexpr):
        """TMA loads of the program's step i into ring buffer `stage`: its query heads' steps in turn, n_h a head,
        so step i is query rows lo + (i % n_h) * BLOCK_M ... of head (z, h0 + i // n_h). Q and dO (and their tails)
        through 4-D descriptors over (Z, H, N, d), the (lse2, delta) pairs from row stats_row0 + (i // n_h) * n_q
        + ... of all heads' (stats_row0: head h0's first)."""
        tile_bytes: gl.constexpr = 2 * BLOCK_M * (HEAD_DIM + D_TAIL) * q_smem.dtype.primitive_bitwidth // 8 \
            + 8 * BLOCK_M
        if HEADS > 1:
            g = i // n_h
            row = lo + (i - g * n_h) * BLOCK_M
            h = h0 + g
            stats_row = stats_row0 + g * n_q
        else:  # (no division where a program walks one head)
            row = lo + i * BLOCK_M
            h = h0
            stats_row = stats_row0
        bar = ready.index(stage)
        mbarrier.expect(bar, tile_bytes)
        _tma_load(q_desc, [z, h, row, 0], bar, q_smem.index(stage).reshape([1, 1, BLOCK_M, HEAD_DIM]))
        _tma_load(do_desc, [z, h, row, 0], bar, do_smem.index(stage).reshape([1, 1, BLOCK_M, HEAD_DIM]))
        if D_TAIL > 0:
            _tma_load(qt_desc, [z, h, row, 0], bar, qt_smem.index(stage).reshape([1, 1, BLOCK_M, D_TAIL]))
            _tma_load(dot_desc, [z, h, row, 0], bar, dot_smem.index(stage).reshape([1, 1, BLOCK_M, D_TAIL]))
        _tma_load(stats_desc, [2 * (stats_row + row)], bar, _as_fp32(stats_smem.index(stage)))

    @gluon.jit
    def _load_kv(K, V, off_z, off_h, start_n, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                 n_k, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr):
        """K and V rows start_n .. start_n + BLOCK_N, HEAD_DIM columns from K, V (rows past n_k read as zeros)."""
        blocked: gl.constexpr = _rows_layout(HEAD_DIM, NW)
        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blocked))
        kv_mask = gl.expand_dims(rows < n_k, 1)
        k = gl.load(K + off_z * stride_kz + off_h * stride_kh + gl.expand_dims(rows, 1) * stride_kn
                    + gl.expand_dims(cols, 0), mask=kv_mask, other=0.0)
        v = gl.load(V + off_z * stride_vz + off_h * stride_vh + gl.expand_dims(rows, 1) * stride_vn
                    + gl.expand_dims(cols, 0), mask=kv_mask, other=0.0)
        return k, v

    @gluon.jit
    def _store_dkdv(DK, DV, dk, dv, off_z, off_h, start_n, stride_dkz, stride_dkh, stride_dkn, stride_dvz,
                    stride_dvh, stride_dvn, n_k, sm_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                    mma_d: gl.constexpr):
        """dK (scaled) and dV of keys start_n ..., HEAD_DIM columns from DK, DV at the given strides; rows past
        n_k are not written."""
        dtype: gl.constexpr = DK.dtype.element_ty
        out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_d))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_d))
        out_mask = gl.expand_dims(out_rows < n_k, 1)
        gl.store(DK + off_z * stride_dkz + off_h * stride_dkh + gl.expand_dims(out_rows, 1) * stride_dkn
                 + gl.expand_dims(out_cols, 0), (dk * sm_scale).to(dtype), mask=out_mask)
        gl.store(DV + off_z * stride_dvz + off_h * stride_dvh + gl.expand_dims(out_rows, 1) * stride_dvn
                 + gl.expand_dims(out_cols, 0), dv.to(dtype), mask=out_mask)

    @gluon.constexpr_function
    def _rows_layout(width, num_warps):
        """A blocked layout of rows `width` columns wide in 16-byte pieces (8 threads a row at most)."""
        cols = min(int(width) // 8, 8)
        return gl.BlockedLayout([1, 8], [32 // cols, cols], [int(num_warps), 1], [1, 0])

    @gluon.jit
    def _query_steps(start_n, n_q, causal_off, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
        """The first query tile (lo) that sees keys start_n ... and the number of query tiles from it to the end."""
        m_pad = gl.cdiv(n_q, BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            lo = gl.minimum((gl.maximum(start_n - causal_off, 0) // BLOCK_M) * BLOCK_M, m_pad)
        else:
            lo = 0
        return lo, (m_pad - lo) // BLOCK_M

    @gluon.jit
    def _ranges(rng: gl.constexpr, lo, start_n, n_q, causal_off, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
        """Query tiles [lo, m_pad) of keys start_n ..., in three ranges: masked diagonal ones (rng 0), unmasked
        (1), the ragged end (2) (the ranges of backward._bwd_dkdv_tile: Gluon code cannot call Triton's)."""
        m_full = (n_q // BLOCK_M) * BLOCK_M
        m_pad = gl.cdiv(n_q, BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            full_lo = gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - causal_off, 0), BLOCK_M) * BLOCK_M
            full_lo = gl.minimum(gl.maximum(full_lo, lo), m_pad)
        else:
            full_lo = lo
        if rng == 0:
            start, end = lo, full_lo
        elif rng == 1:
            start, end = full_lo, m_full
        else:
            start, end = gl.maximum(full_lo, m_full), m_pad
        return start, end

    @gluon.jit
    def _ds_t(k_op, v_op, q_tile, do_tile, pair_buf, dv, offs_m, offs_n, n_q, causal_off, qk_scale,
              MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, mma_s: gl.constexpr, mma_d: gl.constexpr,
              LATE_DELTA: gl.constexpr, kt_op, vt_op, qt_tile, dot_tile, dvt, mma_t: gl.constexpr,
              D_TAIL: gl.constexpr):
        """One step for 64 keys: S^T = K Q^T and dP^T = V dO^T issued together, P^T = exp2(S^T - lse2) while dP^T
        runs, dV += P^T dO issued (left in flight), dS^T = P^T (dP^T - delta) returned in the inputs' dtype. On
        return only dV's wgmmas are in flight: the previous step's dV and dK, and any older, are done.
        K and V are register or shared-memory operands; LATE_DELTA reads delta where it is used, not with lse2
        (head dims 80-128: dK and dV take 96-128 of a thread's registers). With a tail (D_TAIL columns of the
        head dim past the main part, its own operands: kt_op, ... and accumulator dvt), S^T and dP^T take a wgmma
        more each, and dV's tail one of its own."""
        dtype: gl.constexpr = q_tile.dtype
        keys: gl.constexpr = k_op.shape[0]
        queries: gl.constexpr = q_tile.shape[0]
        parts: gl.constexpr = 2 if D_TAIL > 0 else 1  # wgmmas per product
        zero_s = gl.zeros([keys, queries], gl.float32, layout=mma_s)
        s_t = warpgroup_mma(k_op, q_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if D_TAIL > 0:
            s_t = warpgroup_mma(kt_op, qt_tile.permute((1, 0)), s_t, is_async=True)
        dp_t = warpgroup_mma(v_op, do_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if D_TAIL > 0:
            dp_t = warpgroup_mma(vt_op, dot_tile.permute((1, 0)), dp_t, is_async=True)
        # the (lse2, delta) pairs of these query rows came with the tiles (int64: split in registers; rows past
        # n_q hold the next head's pairs or zeros, masked off in S^T). Read once the wgmmas are issued: a
        # wgmma's issue waits for every register load in flight
        if LATE_DELTA:
            lse2 = pair_buf.load(gl.SliceLayout(0, mma_s)).to(gl.int32).to(gl.float32, bitcast=True)
        else:
            pair = pair_buf.load(gl.SliceLayout(0, mma_s))
            lse2 = pair.to(gl.int32).to(gl.float32, bitcast=True)
            delta = (pair >> 32).to(gl.int32).to(gl.float32, bitcast=True)
        s_t = warpgroup_mma_wait(parts, deps=[s_t])
        s_t = s_t * qk_scale
        if MASKED:
            valid = gl.expand_dims(offs_m, 0) < n_q
            if IS_CAUSAL:
                valid = valid & (gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m, 0) + causal_off)
            s_t = gl.where(valid, s_t, float("-inf"))
        p_t = gl.exp2(s_t - gl.expand_dims(lse2, 0))
        p_lo = p_t.to(dtype)
        dv = warpgroup_mma(gl.convert_layout(p_lo, gl.DotOperandLayout(0, mma_d, 2)), do_tile, dv, is_async=True)
        if D_TAIL > 0:
            dvt = warpgroup_mma(gl.convert_layout(p_lo, gl.DotOperandLayout(0, mma_t, 2)), dot_tile, dvt,
                                is_async=True)
        if LATE_DELTA:
            delta = (pair_buf.load(gl.SliceLayout(0, mma_s)) >> 32).to(gl.int32).to(gl.float32, bitcast=True)
        dp_t = warpgroup_mma_wait(parts, deps=[dp_t])
        return (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype), dv, dvt

    # ------------------------------------------------------------------ the warp-specialised one-pass backward
    @gluon.jit
    def _ws_steps(ROLE: gl.constexpr, it, lo, start, end, n_h, HEADS: gl.constexpr, dk, dv, k_op, v_op, q_desc,
                  do_desc, stats_desc, dq_desc, q_smem, do_smem, stats_smem, k_smem, ds_smem, dq_smem, ready, empty,
                  ds_ready, ds_free, stats_row, stats_row0, z, h0, offs_n, n_q, causal_off, qk_scale,
                  MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr, PREFETCH: gl.constexpr, mma_s: gl.constexpr, mma_d: gl.constexpr):
        """The query-tile steps of one of the two warpgroups over [start, end). Both store their dS^T into the
        step's shared buffer (two, by step parity); ROLE 1 then computes the step's dQ = dS K over all 128 keys
        in one wgmma and reduces it into DQ_ACC, and ROLE 0 issues the TMA loads PREFETCH steps ahead."""
        offs_m0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
        zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=mma_d)
        keys: gl.constexpr = k_op.shape[0]
        frag_row0 = (stats_row // n_q) * gl.cdiv(n_q, BLOCK_M)  # this head's first query tile in the dQ buffer
        for start_m in range(start, end, BLOCK_M):
            stage = it % STAGES
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            q_tile = q_smem.index(stage)
            do_tile = do_smem.index(stage)
            ds_t, dv, _ = _ds_t(k_op, v_op, q_tile, do_tile, stats_smem.index(stage), dv, start_m + offs_m0, offs_n,
                                n_q, causal_off, qk_scale, MASKED, IS_CAUSAL, mma_s, mma_d, False, k_op, v_op, q_tile,
                                do_tile, dv, mma_d, 0)
            # the previous step's dK, the last reader of its ring buffer in this warpgroup, is done
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > 0)
            slot = it % 2
            if ROLE == 0:  # ROLE 1's dQ two steps ago has read this buffer (a fresh mbarrier passes phase 1)
                mbarrier.wait(ds_free.index(slot), ((it // 2) & 1) ^ 1)
            else:  # this warpgroup's reduction two steps ago has read its dQ buffer (the barrier below spreads it)
                tma.store_wait(1)
            ds_smem.index(slot).slice(ROLE * keys, keys).store(ds_t)
            fence_async_shared()
            _barrier()
            dk_op = gl.convert_layout(ds_t, gl.DotOperandLayout(0, mma_d, 2))
            if ROLE == 0:
                mbarrier.arrive(ds_ready.index(slot), count=1)
                dk = warpgroup_mma(dk_op, q_tile, dk, is_async=True)
                # dV done: only dK in flight into the next step (four accumulators in flight do not fit: ptxas
                # would serialize every wgmma)
                dv = warpgroup_mma_init(warpgroup_mma_wait(1, deps=[dv]))
                # refill the ring buffer of step nxt - STAGES, once both warpgroups released it
                nxt = it + PREFETCH
                if nxt < HEADS * n_h:
                    nstage = nxt % STAGES
                    mbarrier.wait(empty.index(nstage), ((nxt // STAGES) & 1) ^ 1)
                    _load_step(nxt, lo, n_h, nstage, q_desc, do_desc, q_desc, do_desc, stats_desc, q_smem, do_smem,
                               q_smem, do_smem, stats_smem, ready, stats_row0, n_q, z, h0, HEADS, BLOCK_M, HEAD_DIM, 0)
            else:
                # dQ of the 64 queries over both warpgroups' 128 keys, from shared memory (a register A operand
                # holds the rows its warps own: keys here, not queries), issued before dK to be waited on first
                mbarrier.wait(ds_ready.index(slot), (it // 2) & 1)
                dq = warpgroup_mma(ds_smem.index(slot).permute((1, 0)), k_smem, zero_q, use_acc=False,
                                   is_async=True)
                dk = warpgroup_mma(dk_op, q_tile, dk, is_async=True)
                dq = warpgroup_mma_wait(1, deps=[dq])
                mbarrier.arrive(ds_free.index(slot), count=1)
                # in the accumulator's order (`_DQ_FRAG`), the block's FRAG_ROWS rows of the dQ buffer
                dq_buf = dq_smem.index(slot)
                _reinterpret(dq_buf, gl.float32, [BLOCK_M, HEAD_DIM], _DQ_FRAG).store(dq)
                fence_async_shared()
                _barrier()
                _tma_add(dq_desc, [(frag_row0 + start_m // BLOCK_M) * _FRAG_ROWS, 0], dq_buf)
            it += 1
        return it, dk, dv

    @gluon.jit
    def _ws_warpgroup(ROLE: gl.constexpr, K, V, DK, DV, q_desc, do_desc, stats_desc, dq_desc, q_smem, do_smem,
                      stats_smem, k_smem, ds_smem, dq_smem, ready, empty, ds_ready, ds_free, off_z, off_h, off_hk,
                      start_cta, lo, n_h, HEADS: gl.constexpr, h0, stats_row0, stride_kz, stride_kh, stride_kn,
                      stride_vz, stride_vh, stride_vn, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh,
                      stride_dvn, n_q, n_k, causal_off, qk_scale, sm_scale, IS_CAUSAL: gl.constexpr,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      PREFETCH: gl.constexpr):
        """Warpgroup ROLE of a program: keys start_cta + ROLE * BLOCK_N ... of KV head off_hk, over the program's
        query steps, n_h for each of its HEADS query heads from h0 (`_bwd_ws_kernel`); dK and dV summed over them,
        stored as head off_h of DK and DV."""
        start_n = start_cta + ROLE * BLOCK_N
        z = off_z.to(gl.int32)  # the heads' TMA coordinates
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
        k, v = _load_kv(K, V, off_z, off_hk, start_n, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh,
                        stride_vn, n_k, HEAD_DIM, BLOCK_N, 4)
        k_smem.slice(ROLE * BLOCK_N, BLOCK_N).store(k)  # dQ's B operand (fenced before the first dQ)
        k_op = gl.convert_layout(k, gl.DotOperandLayout(0, mma_s, 2))
        v_op = gl.convert_layout(v, gl.DotOperandLayout(0, mma_s, 2))
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=mma_d))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=mma_d))
        # both warpgroups walk the same steps from the program's lo (the second's first ones fully masked), so
        # the ring and the dS hand-over stay in step
        it = 0
        for g in range(HEADS):
            for rng in gl.static_range(3):
                start, end = _ranges(rng, lo, start_n, n_q, causal_off, IS_CAUSAL, BLOCK_M, BLOCK_N)
                it, dk, dv = _ws_steps(ROLE, it, lo, start, end, n_h, HEADS, dk, dv, k_op, v_op, q_desc,
                                       do_desc, stats_desc, dq_desc, q_smem, do_smem, stats_smem, k_smem, ds_smem,
                                       dq_smem, ready, empty, ds_ready, ds_free, stats_row0 + g * n_q, stats_row0, z,
                                       h0, offs_n, n_q, causal_off, qk_scale, rng != 1, IS_CAUSAL, BLOCK_M, HEAD_DIM,
                                       STAGES, PREFETCH, mma_s, mma_d)
        dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
        if ROLE == 1:
            tma.store_wait(0)
        _store_dkdv(DK, DV, dk, dv, off_z, off_h, start_n, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh,
                    stride_dvn, n_k, sm_scale, HEAD_DIM, BLOCK_N, mma_d)

    # ------------------------------------------- head dims 80-128: K and V in shared memory, dQ split by columns
    @gluon.jit
    def _ws_steps_wide(ROLE: gl.constexpr, it, lo, start, end, n_h, HEADS: gl.constexpr, dk, dv, dkt, dvt,
                       q_desc, do_desc, qt_desc, dot_desc, stats_desc, dq_desc, q_smem, do_smem, qt_smem, dot_smem,
                       stats_smem, k_smem, v_smem, kt_smem, vt_smem, ds_smem, dq_buf, ready, empty, ds_ready, ds_free,
                       stats_row, stats_row0, z, h, h0, offs_n, n_q, causal_off, qk_scale, MASKED: gl.constexpr,
                       IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, D_TAIL: gl.constexpr,
                       STAGES: gl.constexpr, PREFETCH: gl.constexpr, mma_s: gl.constexpr, mma_d: gl.constexpr,
                       mma_t: gl.constexpr, mma_q: gl.constexpr):
        """`_ws_steps` for head dims 80-128, both warpgroups alike: K and V (and their tails) are shared-memory A
        operands, and each warpgroup computes the step's dQ over all 128 keys for its part of the head dim (a whole
        64 x d dQ does not fit beside dK, dV, S^T and dP^T: at 128 each takes half, at 80 / 96 the first the main
        64 columns and the second the tail) and reduces it from its own buffer. So both halves of dS^T are needed
        before either dQ (ds_ready), and both dQs read a buffer before either warpgroup overwrites it (ds_free)."""
        offs_m0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
        dq_cols: gl.constexpr = dq_buf.shape[1]
        zero_q = gl.zeros([BLOCK_M, dq_cols], gl.float32, layout=mma_q)
        # this head's first query tile in the dQ buffer's blocks in the accumulators' order (`_DQ_FRAG`), a tile's
        # blocks FRAG_ROWS rows each: at 128 both warpgroups' halves, at 80 / 96 the first warpgroup's main part
        frag_row0 = (stats_row // n_q) * gl.cdiv(n_q, BLOCK_M)
        blocks: gl.constexpr = 2 if D_TAIL == 0 else 1
        keys: gl.constexpr = k_smem.shape[1]
        parts: gl.constexpr = 2 if D_TAIL > 0 else 1  # wgmmas per product over the head dim
        for start_m in range(start, end, BLOCK_M):
            stage = it % STAGES
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            q_tile = q_smem.index(stage)
            qt_tile = qt_smem.index(stage)
            # K and V buffer indices the compiler cannot see are constant (it < 2^30): their wgmma descriptors are
            # then computed in the loop (a few integer adds) instead of hoisted, 48 registers held across it
            own = ROLE + (it >> 30)
            first = it >> 30  # 0: the first warpgroup's keys
            ds_t, dv, dvt = _ds_t(k_smem.index(own), v_smem.index(own), q_tile, do_smem.index(stage),
                                  stats_smem.index(stage), dv, start_m + offs_m0, offs_n, n_q, causal_off, qk_scale,
                                  MASKED, IS_CAUSAL, mma_s, mma_d, True, kt_smem.index(own), vt_smem.index(own),
                                  qt_tile, dot_smem.index(stage), dvt, mma_t, D_TAIL)
            # the previous step's dK, the last reader of its ring buffer in this warpgroup, is done
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > 0)
            slot = it % 2
            # both warpgroups' dQs of step it - 2 have read this dS^T buffer (a fresh mbarrier passes phase 1),
            # and this warpgroup's last reduction has read its dQ buffer (the barrier below spreads the wait)
            mbarrier.wait(ds_free.index(slot), ((it // 2) & 1) ^ 1)
            tma.store_wait(0)
            ds_smem.index(slot).slice(ROLE * keys, keys).store(ds_t)
            fence_async_shared()
            _barrier()
            mbarrier.arrive(ds_ready.index(slot), count=1)
            mbarrier.wait(ds_ready.index(slot), (it // 2) & 1)
            # dQ issued before dK, to be waited on first (a register A operand holds the rows its warps own:
            # keys here, not queries, so dS comes from shared memory): dS K[:, this warpgroup's columns] over both
            # key blocks
            if D_TAIL == 0:
                kq0 = k_smem.index(first).slice(ROLE * dq_cols, dq_cols, dim=1)
                kq1 = k_smem.index(first + 1).slice(ROLE * dq_cols, dq_cols, dim=1)
            elif ROLE == 0:
                kq0 = k_smem.index(first)
                kq1 = k_smem.index(first + 1)
            else:
                kq0 = kt_smem.index(first)
                kq1 = kt_smem.index(first + 1)
            ds_all = ds_smem.index(slot)
            dq = warpgroup_mma(ds_all.slice(0, keys).permute((1, 0)), kq0, zero_q, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_all.slice(keys, keys).permute((1, 0)), kq1, dq, is_async=True)
            # dK = dS^T Q with this warpgroup's dS^T from shared memory (a register operand's 16 registers make
            # ptxas serialize every wgmma); its rows are rewritten two steps on, after this dK is waited on
            ds_own = ds_all.slice(ROLE * keys, keys)
            dk = warpgroup_mma(ds_own, q_tile, dk, is_async=True)
            if D_TAIL > 0:
                dkt = warpgroup_mma(ds_own, qt_tile, dkt, is_async=True)
            if ROLE == 0:
                # refill the ring buffer of step nxt - STAGES (it - 1 at the default rings): both warpgroups
                # released it before handing over this step's dS^T, so this does not wait
                nxt = it + PREFETCH
                if nxt < HEADS * n_h:
                    nstage = nxt % STAGES
                    mbarrier.wait(empty.index(nstage), ((nxt // STAGES) & 1) ^ 1)
                    _load_step(nxt, lo, n_h, nstage, q_desc, do_desc, qt_desc, dot_desc, stats_desc, q_smem,
                               do_smem, qt_smem, dot_smem, stats_smem, ready, stats_row0, n_q, z, h0, HEADS,
                               BLOCK_M, HEAD_DIM, D_TAIL)
            # dV and dQ done: only dK in flight into the next step
            if D_TAIL > 0:
                dq, dv, dvt = warpgroup_mma_wait(parts, deps=[dq, dv, dvt])
                dvt = warpgroup_mma_init(dvt)
            else:
                dq, dv = warpgroup_mma_wait(parts, deps=[dq, dv])
            dv = warpgroup_mma_init(dv)
            mbarrier.arrive(ds_free.index(slot), count=1)
            dq_buf.store(dq)
            fence_async_shared()
            _barrier()
            if D_TAIL == 0 or ROLE == 0:  # a 64-column block in the accumulator's order (128: halves; 80 / 96: main)
                _tma_add(dq_desc, [((frag_row0 + start_m // BLOCK_M) * blocks + ROLE) * _FRAG_ROWS, 0],
                         _reinterpret(dq_buf, gl.float32, [_FRAG_ROWS, _FRAG_COLS], _DQ_FRAG_TMA))
            else:  # the tail, row-major
                _tma_add(dq_desc, [z, h, start_m, 0], dq_buf.reshape([1, 1, BLOCK_M, dq_cols]))
            it += 1
        return it, dk, dv, dkt, dvt

    @gluon.jit
    def _stage_out(DK, DV, dk, dv, out_smem, off_z, off_h, start_n, stride_dkz, stride_dkh, stride_dkn, stride_dvz,
                   stride_dvh, stride_dvn, n_k, sm_scale, WIDTH: gl.constexpr, BLOCK_N: gl.constexpr):
        """dK (scaled) and dV, WIDTH columns from DK, DV, through out_smem (a buffer no other warpgroup reads), to be
        stored in 16-byte pieces: from the wgmma layout, 64-bit addresses of 2-byte pieces of both do not fit in
        registers."""
        dtype: gl.constexpr = DK.dtype.element_ty
        rows_layout: gl.constexpr = _rows_layout(WIDTH, 4)
        out_smem.store(dv.to(dtype))
        _barrier()
        dv_out = out_smem.load(rows_layout)
        _barrier()
        out_smem.store((dk * sm_scale).to(dtype))
        _barrier()
        dk_out = out_smem.load(rows_layout)
        _store_dkdv(DK, DV, dk_out, dv_out, off_z, off_h, start_n, stride_dkz, stride_dkh, stride_dkn, stride_dvz,
                    stride_dvh, stride_dvn, n_k, 1.0, WIDTH, BLOCK_N, rows_layout)

    @gluon.jit
    def _ws_warpgroup_wide(ROLE: gl.constexpr, K, V, DK, DV, q_desc, do_desc, qt_desc, dot_desc, stats_desc, dq_desc,
                           q_smem, do_smem, qt_smem, dot_smem, stats_smem, k_smem, v_smem, kt_smem, vt_smem, ds_smem,
                           dq_buf, ready, empty, ds_ready, ds_free, off_z, off_h, off_hk, start_cta, lo, n_h,
                           HEADS: gl.constexpr, h0, stats_row0, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh,
                           stride_vn, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, n_q, n_k,
                           causal_off, qk_scale, sm_scale, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                           D_TAIL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           PREFETCH: gl.constexpr):
        """`_ws_warpgroup` for head dims 80-128 (`_ws_steps_wide`): HEAD_DIM main columns and D_TAIL more."""
        start_n = start_cta + ROLE * BLOCK_N
        z = off_z.to(gl.int32)  # the heads' TMA coordinates
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
        # the tail's accumulators (without a tail: the main layout, never used)
        mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D_TAIL if D_TAIL > 0 else HEAD_DIM, 16])
        mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, dq_buf.shape[1], 16])
        k, v = _load_kv(K, V, off_z, off_hk, start_n, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh,
                        stride_vn, n_k, HEAD_DIM, BLOCK_N, 4)
        k_smem.index(ROLE).store(k)  # also dQ's B operand, with the other warpgroup's keys
        v_smem.index(ROLE).store(v)
        if D_TAIL > 0:
            kt, vt = _load_kv(K + HEAD_DIM, V + HEAD_DIM, off_z, off_hk, start_n, stride_kz, stride_kh, stride_kn,
                              stride_vz, stride_vh, stride_vn, n_k, D_TAIL, BLOCK_N, 4)
            kt_smem.index(ROLE).store(kt)
            vt_smem.index(ROLE).store(vt)
        fence_async_shared()
        _barrier()
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=mma_d))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=mma_d))
        if D_TAIL > 0:
            dkt = warpgroup_mma_init(gl.zeros([BLOCK_N, D_TAIL], gl.float32, layout=mma_t))
            dvt = warpgroup_mma_init(gl.zeros([BLOCK_N, D_TAIL], gl.float32, layout=mma_t))
        else:  # never used (a register each)
            dkt = gl.zeros([128], gl.float32, layout=gl.BlockedLayout([1], [32], [4], [0]))
            dvt = dkt
        it = 0
        for g in range(HEADS):
            for rng in gl.static_range(3):
                start, end = _ranges(rng, lo, start_n, n_q, causal_off, IS_CAUSAL, BLOCK_M, BLOCK_N)
                it, dk, dv, dkt, dvt = _ws_steps_wide(ROLE, it, lo, start, end, n_h, HEADS, dk, dv, dkt, dvt,
                                                      q_desc, do_desc, qt_desc, dot_desc, stats_desc, dq_desc, q_smem,
                                                      do_smem, qt_smem, dot_smem, stats_smem, k_smem, v_smem, kt_smem,
                                                      vt_smem, ds_smem, dq_buf, ready, empty, ds_ready, ds_free,
                                                      stats_row0 + g * n_q, stats_row0, z, h0 + g, h0, offs_n, n_q,
                                                      causal_off, qk_scale, rng != 1, IS_CAUSAL, BLOCK_M, HEAD_DIM,
                                                      D_TAIL, STAGES, PREFETCH, mma_s, mma_d, mma_t, mma_q)
        dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
        tma.store_wait(0)
        # through this warpgroup's V buffers (their last readers are done)
        _stage_out(DK, DV, dk, dv, v_smem.index(ROLE), off_z, off_h, start_n, stride_dkz, stride_dkh, stride_dkn,
                   stride_dvz, stride_dvh, stride_dvn, n_k, sm_scale, HEAD_DIM, BLOCK_N)
        if D_TAIL > 0:
            dkt, dvt = warpgroup_mma_wait(0, deps=[dkt, dvt])
            _stage_out(DK + HEAD_DIM, DV + HEAD_DIM, dkt, dvt, vt_smem.index(ROLE), off_z, off_h, start_n, stride_dkz,
                       stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, n_k, sm_scale, D_TAIL, BLOCK_N)

    @gluon.jit
    def _bwd_ws_kernel(q_desc, do_desc, qt_desc, dot_desc, stats_desc, dq_desc, dqt_desc,  # TMA descriptors
                       K, V, DK, DV, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                       stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                       n_heads, kv_group, n_q, n_k, causal_off, qk_scale, sm_scale,
                       IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PREFETCH: gl.constexpr, WS_REGS: gl.constexpr,
                       HEADS: gl.constexpr):
        # HEAD_DIM: the head dim's main part; D_TAIL: its tail (qt_desc, dot_desc: Q's and dO's tail columns;
        # dqt_desc: the dQ buffer's columns the second warpgroup reduces into, from HEAD_DIM // 2 at 128).
        # HEADS: query heads a program walks (1, or with grouped-query attention up to kv_group, which it divides),
        # their steps one head after the other, with dK and dV summed over them in the accumulators: DK and DV have
        # n_heads // HEADS heads (`launch_ws`)
        gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
        gl.static_assert(PREFETCH < STAGES)
        gl.static_assert((HEAD_DIM == 64) | (HEAD_DIM == 128), "main parts 64 or 128 wide")
        gl.static_assert((D_TAIL == 0) | (HEAD_DIM == 64), "tails after a 64-wide main part")
        # head-major 1-D grid (launch._grid): the resident programs share one head's Q, dO and dQ rows in L2
        n_blocks = gl.cdiv(n_k, 2 * BLOCK_N)
        pid = gl.program_id(0)
        pid_zh = pid // n_blocks  # (batch, head of DK and DV)
        start_cta = (pid % n_blocks) * (2 * BLOCK_N)
        n_out_heads = n_heads // HEADS
        off_z = (pid_zh // n_out_heads).to(gl.int64)
        off_h = (pid_zh % n_out_heads).to(gl.int64)
        h0 = (off_h * HEADS).to(gl.int32)  # the first query head
        dtype: gl.constexpr = q_desc.dtype
        # head dims 80-128: K and V in shared memory, each warpgroup reduces dQ for its columns (`_ws_steps_wide`)
        WIDE: gl.constexpr = (HEAD_DIM > 64) | (D_TAIL > 0)
        stats_row0 = (off_z.to(gl.int32) * n_heads + h0) * n_q
        lo, n_h = _query_steps(start_cta, n_q, causal_off, IS_CAUSAL, BLOCK_M)
        n_steps = HEADS * n_h
        q_smem, do_smem, qt_smem, dot_smem, stats_smem, ready = _ring(STAGES, BLOCK_M, HEAD_DIM, D_TAIL, dtype)
        # dS^T of both warpgroups, two buffers (by step parity)
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_N, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_M], dtype))
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=2)  # released by both warpgroups
        for i in gl.static_range(2):
            # wide: both warpgroups write dS^T before either dQ reads it, and both dQs read it
            mbarrier.init(ds_ready.index(i), count=2 if WIDE else 1)
            mbarrier.init(ds_free.index(i), count=2 if WIDE else 1)
        for i in gl.static_range(PREFETCH):
            if i < n_steps:
                _load_step(i, lo, n_h, i, q_desc, do_desc, qt_desc, dot_desc, stats_desc, q_smem, do_smem, qt_smem,
                           dot_smem, stats_smem, ready, stats_row0, n_q, off_z.to(gl.int32), h0, HEADS, BLOCK_M,
                           HEAD_DIM, D_TAIL)
        # (the argument tuples are spelled out: a tuple built in Gluon code drops its constexprs)
        if WIDE:
            # K and V of each warpgroup (their tails in buffers of their own); a dQ buffer per warpgroup, for its
            # columns: half the head dim each at 128, the main part and the tail at 80 / 96
            kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
            k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_layout)
            v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_layout)
            if D_TAIL > 0:
                kvt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_TAIL], dtype)
                kt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_TAIL], kvt_layout)
                vt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_TAIL], kvt_layout)
            else:  # never read
                kt_smem = k_smem
                vt_smem = v_smem
            DQ0: gl.constexpr = HEAD_DIM if D_TAIL > 0 else HEAD_DIM // 2
            DQ1: gl.constexpr = D_TAIL if D_TAIL > 0 else HEAD_DIM // 2
            # 64-column blocks in the accumulator's order (`_DQ_FRAG`); a tail row-major
            dq0_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, DQ0], _DQ_FRAG)
            if D_TAIL > 0:
                dq1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, DQ1],
                                                     gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ1], gl.float32))
            else:
                dq1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, DQ1], _DQ_FRAG)
            gl.warp_specialize([
                (_ws_warpgroup_wide, (0, K, V, DK, DV, q_desc, do_desc, qt_desc, dot_desc, stats_desc, dq_desc,
                                      q_smem, do_smem, qt_smem, dot_smem, stats_smem, k_smem, v_smem, kt_smem, vt_smem,
                                      ds_smem, dq0_smem, ready, empty, ds_ready, ds_free, off_z, off_h, h0 // kv_group,
                                      start_cta, lo, n_h, HEADS, h0, stats_row0, stride_kz, stride_kh,
                                      stride_kn, stride_vz, stride_vh, stride_vn, stride_dkz, stride_dkh, stride_dkn,
                                      stride_dvz, stride_dvh, stride_dvn, n_q, n_k, causal_off, qk_scale, sm_scale,
                                      IS_CAUSAL, HEAD_DIM, D_TAIL, BLOCK_M, BLOCK_N, STAGES, PREFETCH)),
                (_ws_warpgroup_wide, (1, K, V, DK, DV, q_desc, do_desc, qt_desc, dot_desc, stats_desc, dqt_desc,
                                      q_smem, do_smem, qt_smem, dot_smem, stats_smem, k_smem, v_smem, kt_smem, vt_smem,
                                      ds_smem, dq1_smem, ready, empty, ds_ready, ds_free, off_z, off_h, h0 // kv_group,
                                      start_cta, lo, n_h, HEADS, h0, stats_row0, stride_kz, stride_kh,
                                      stride_kn, stride_vz, stride_vh, stride_vn, stride_dkz, stride_dkh, stride_dkn,
                                      stride_dvz, stride_dvh, stride_dvn, n_q, n_k, causal_off, qk_scale, sm_scale,
                                      IS_CAUSAL, HEAD_DIM, D_TAIL, BLOCK_M, BLOCK_N, STAGES, PREFETCH)),
            ], [4], [WS_REGS])
        else:
            # K of both warpgroups (dQ's B operand); the second warpgroup's dQ tiles, two (by step parity)
            k_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_N, HEAD_DIM],
                                               gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, HEAD_DIM], dtype))
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, _FRAG_ROWS, _FRAG_COLS], _DQ_FRAG_TMA)
            gl.warp_specialize([
                (_ws_warpgroup, (0, K, V, DK, DV, q_desc, do_desc, stats_desc, dq_desc, q_smem, do_smem, stats_smem,
                                 k_smem, ds_smem, dq_smem, ready, empty, ds_ready, ds_free, off_z, off_h,
                                 h0 // kv_group, start_cta, lo, n_h, HEADS, h0, stats_row0, stride_kz,
                                 stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                                 stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, n_q, n_k,
                                 causal_off, qk_scale, sm_scale, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                                 PREFETCH)),
                (_ws_warpgroup, (1, K, V, DK, DV, q_desc, do_desc, stats_desc, dq_desc, q_smem, do_smem, stats_smem,
                                 k_smem, ds_smem, dq_smem, ready, empty, ds_ready, ds_free, off_z, off_h,
                                 h0 // kv_group, start_cta, lo, n_h, HEADS, h0, stats_row0, stride_kz,
                                 stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                                 stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, n_q, n_k,
                                 causal_off, qk_scale, sm_scale, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                                 PREFETCH)),
            ], [4], [WS_REGS])


# ---------------------------------------------------------------------- host side
def ws_applies(q: Tensor, do: Tensor, d: int) -> bool:
    """Whether `_bwd_ws_kernel` can run this backward: compiled CUDA on sm_90 (wgmma is sm_90 only; Blackwell has
    other tensor-core instructions), fp16 / bf16, d in HEAD_DIMS, and for the TMA 16-byte aligned bases and row
    strides, and an even N_q (each head's (lse2, delta) rows start 16-byte aligned)."""
    if common.INTERPRET or q.dtype == torch.float32 or q.device.type != "cuda" or d not in HEAD_DIMS:
        return False
    return HAVE_GLUON and launch._capability(q.device) == (9, 0) and q.shape[2] % 2 == 0 \
        and all(common._tma_aligned(t) and all(s % 8 == 0 for s in t.stride()[:3]) for t in (q, do))


@lru_cache(maxsize=None)
def _box_layout(box: tuple[int, ...], dtype: torch.dtype, swizzled: bool):
    """The shared-memory layout of a TMA box (kept: computing it is most of a host descriptor's cost, about 20 us;
    a forward builds 4 to 8 descriptors a call)."""
    if not swizzled:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.itemsize * 8, rank=len(box))
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)


# a descriptor's fields but its base, by (shape, strides, dtype, box, swizzled): validated once, when first built
_DESC_FIELDS: dict[tuple, dict] = {}
_MAX_DESC_FIELDS = 1024  # distinct geometries kept; the cache restarts beyond that


def tma_desc(t: Tensor, box: tuple[int, ...], swizzled: bool = True):
    """A TMA descriptor over t at its strides, for `box`-shaped loads and stores: made on the host, not in every
    program (costly where a program's work is short). Parts of a box past t's edges read as zeros, and stores
    and reductions there are dropped.

    A geometry seen before reuses its validated fields and checks only t's alignment: a call then takes about a
    quarter of the 4.5 us a validated TensorDescriptor takes on the H100 host, and a forward makes 4 to 8 of them
    while the GPU may be waiting for it (the first attention call of a train step)."""
    key = (t.shape, t.stride(), t.dtype, box, swizzled)
    fields = _DESC_FIELDS.get(key)
    if fields is None:
        desc = TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), _box_layout(box, t.dtype, swizzled))
        common._remember(_DESC_FIELDS, key, desc_fields(desc), _MAX_DESC_FIELDS)
        return desc
    if not common._tma_aligned(t):
        raise ValueError("a TMA descriptor's base must be 16-byte aligned")
    return desc_over(fields, t)


def desc_fields(desc) -> dict:
    """A descriptor's fields but its base: `desc_over` makes the same descriptor over another tensor of its
    geometry."""
    return {name: value for name, value in vars(desc).items() if name != "base"}


def desc_over(fields: dict, t: Tensor):
    """The descriptor with these fields (`desc_fields`) over t, which has their geometry and a 16-byte aligned
    base (the caller's checks; __post_init__'s are skipped)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(fields)
    desc.base = t
    return desc


def part_descs(t: Tensor, rows: int, main: int, tail: int) -> tuple:
    """4-D TMA descriptors over (Z, H, N, d) t's first `main` columns and its `tail` columns after them, loading or
    storing (1, 1, rows, width) boxes (without a tail: the main one twice, the second never read)."""
    if not tail:
        desc = tma_desc(t, (1, 1, rows, main))
        return desc, desc
    return tma_desc(t[..., :main], (1, 1, rows, main)), tma_desc(t[..., main:], (1, 1, rows, tail))


def ws_descs(q: Tensor, do: Tensor, stats: Tensor, dq_acc: Tensor) -> list:
    """`_bwd_ws_kernel`'s TMA descriptors: Q and dO in their main part and tail (`part_descs`); the (lse2, delta)
    pairs as fp32 over all heads' rows (in the kernel: int64, a pair each); the dQ buffer (`ws_dq_buffer`): its
    64-column blocks in rows of FRAG_COLS floats (the accumulator's order), at 80 / 96 also the row-major tail."""
    main, tail = common._TILE_D[q.shape[3]]
    q_desc, qt_desc = part_descs(q, BLOCK_M, main, tail)
    do_desc, dot_desc = part_descs(do, BLOCK_M, main, tail)
    stats_desc = tma_desc(stats.view(-1), (2 * BLOCK_M,), swizzled=False)
    blocks, tail_acc = ws_dq_parts(dq_acc)
    dq_desc = tma_desc(blocks.view(-1, FRAG_COLS), (FRAG_ROWS, FRAG_COLS))
    dqt_desc = tma_desc(tail_acc, (1, 1, BLOCK_M, tail)) if tail else dq_desc
    return [q_desc, do_desc, qt_desc, dot_desc, stats_desc, dq_desc, dqt_desc]


def ws_dq_buffer(q: Tensor) -> Tensor:
    """The fp32 buffer `_bwd_ws_kernel` adds the unscaled dQ into, for 4-D q (Z, H, N_q, d), zeroed by the delta
    kernel: (Z, H, P, d) floats, P = N_q padded to whole 64-row query tiles (then zeroed here: the delta kernel
    zeroes N_q rows' worth), holding each query tile's 64-column blocks in their wgmma accumulators' order
    (`_DQ_FRAG`), and at d = 80 / 96 after all of them the tails, (Z, H, P, d - 64) row-major (`ws_dq_parts`)."""
    z, h, n_q, d = q.shape
    if n_q % BLOCK_M == 0:
        return torch.empty((z, h, n_q, d), device=q.device, dtype=torch.float32)
    return torch.zeros((z, h, _cdiv(n_q, BLOCK_M) * BLOCK_M, d), device=q.device, dtype=torch.float32)


def ws_dq_parts(dq_acc: Tensor) -> tuple[Tensor, Tensor | None]:
    """`ws_dq_buffer`'s two regions: the blocks in the accumulators' order, (Z * H * P / 64, d // 64 * 4096), and
    the tails, (Z, H, P, d - 64) (None without a tail)."""
    z, h, p, d = dq_acc.shape
    main, tail = common._TILE_D[d]
    flat = dq_acc.view(-1)
    blocks = flat[:z * h * p * main].view(-1, main // 64 * 4096)
    return blocks, flat[z * h * p * main:].view(z, h, p, tail) if tail else None


def ws_dq_finish(dq_acc: Tensor, dq: Tensor, sm_scale: float) -> None:
    """dq = sm_scale * the dQ in `ws_dq_buffer`'s dq_acc, written in dq's own layout."""
    from core.kernels.flash_triton.backward import _ws_dq_finish_kernel
    z, h, n_q, d = dq.shape
    main, tail = common._TILE_D[d]
    blocks, tail_acc = ws_dq_parts(dq_acc)
    launch._run(_ws_dq_finish_kernel, (blocks.shape[0],),
                (blocks, blocks if tail_acc is None else tail_acc, dq, *dq.stride()[:3], h, n_q,
                 dq_acc.shape[2] // BLOCK_M, sm_scale), 3, BLOCKS=main // 64, TAIL=tail, num_warps=8 if d == 128 else 4)


def launch_ws(q, k, v, do, dk, dv, stats, dq_acc, h, n_q, n_k, causal_off, sm_scale, is_causal,
              heads: int = 1) -> None:
    """dK, dV, and the unscaled dQ = dS K added into the zeroed fp32 `dq_acc` ((Z, H, N_q, d), contiguous), from
    the delta kernel's `stats` ((Z, H, N_q, 2) fp32, contiguous). Each program walks `heads` query heads, one after
    the other, and dk, dv have H / heads heads: with heads = 1 one per query head, with the GQA group size
    (`FlashConfig.ws_gqa_heads`) one per KV head, dK and dV summed over the group in the program's accumulators."""
    z, _, _, d = q.shape
    strides = tuple(s for t in (k, v, dk, dv) for s in t.stride()[:3])
    scalars = (h, h // k.shape[1], n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale)
    # two warpgroups of 64 keys per program, head by head
    launch._run(_bwd_ws_kernel, (z * (h // heads) * _cdiv(n_k, WS_KEYS),),
                (*ws_descs(q, do, stats, dq_acc), k, v, dk, dv, *strides, *scalars), 11, IS_CAUSAL=is_causal,
                **ws_constexprs(d, heads), num_warps=4)
