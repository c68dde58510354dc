"""The dK/dV pass of the FlashAttention-2 backward for Hopper (sm_90), written in Gluon.

Gluon is Triton's lower-level dialect: the same compiler and runtime, with layouts, shared memory, TMA copies,
mbarriers and asynchronous wgmma spelled out. This kernel does what `flash_triton._bwd_dkdv_kernel` does (dK and
dV of one key tile, walking the query tiles that see it, from the (base-2 logsumexp, delta) pairs of the dQ
pass) with what Triton 3.6 does not do for that loop (docs/attention.md, runs 9-11):

- K and V stay in registers as the wgmma A operands of S^T = K Q^T and dP^T = V dO^T (Triton keeps
  loop-invariant dot operands in shared memory);
- the Q and dO tiles and the (lse2, delta) pairs arrive by TMA into a ring of STAGES buffers, one mbarrier each
  (no per-thread address arithmetic);
- the wgmmas are asynchronous and waited on where their results are needed: dP^T runs on the tensor cores while
  the exponentials of P^T are computed, and dV / dK of one step overlap the next step's first matmuls.

Measured on an H100 (docs/attention.md, run 12) it computes the same dK, dV bit for bit and takes the same time
as the Triton kernel (backward 3.49-3.51 against 3.45-3.55 ms at the leaderboard shape): shared-memory traffic
fell from 70% to 48% of its peak, but one warpgroup's chain S^T -> exp -> dV, dP^T -> dS -> dK with two
warpgroups per SM is the limit, which producer/consumer warpgroups (`gl.warp_specialize`) would attack next.
So `flash_triton` runs it only when asked (`flash_triton.GLUON_DKDV = True`).

Scope: compiled CUDA on sm_90, fp16 / bf16, head dim 64, 16-byte aligned Q / dO rows and an even N_q (each
head's (lse2, delta) rows must start 16-byte aligned for the TMA); `flash_triton` sends everything else to its
Triton kernel, which stays the portable version (and the one the CPU interpreter tests).
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_init
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
    HAVE_GLUON = True
    # Triton 3.6 calls the TMA load async_copy_global_to_shared; 3.9 renamed it async_load (same arguments)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon (or without its Hopper ops)
    HAVE_GLUON = False

# tile sizes: 64 keys per program, 64 queries per step, 4 warps (one warpgroup), 3 TMA stages
BLOCK_M, BLOCK_N, NUM_WARPS, STAGES = 64, 64, 4, 3
HEAD_DIMS = (64,)

if HAVE_GLUON:
    @gluon.jit
    def _steps(it, lo, start, end, n_steps, dk, dv, k_op, v_op, q_desc, do_desc, stats_desc, q_smem, do_smem,
               stats_smem, bars, stats_row, offs_n, n_q, causal_off, qk_scale,
               MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, mma_s: gl.constexpr, mma_d: gl.constexpr):
        """Query tiles start, start + BLOCK_M, ... < end; `it` counts steps from the first (`lo`) for the ring."""
        dtype: gl.constexpr = q_desc.dtype
        tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8 + 8 * BLOCK_M
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_s)
        offs_m0 = gl.arange(0, BLOCK_M, layout=col_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_s)
        for start_m in range(start, end, BLOCK_M):
            offs_m = start_m + offs_m0
            stage = it % STAGES
            mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
            # the (lse2, delta) pairs of these query rows came with the tiles (int64: split in registers); rows
            # past n_q hold the next head's pairs or zeros, and are masked off in S^T
            pair = stats_smem.index(stage).load(col_layout)
            lse2 = pair.to(gl.int32).to(gl.float32, bitcast=True)
            delta = (pair >> 32).to(gl.int32).to(gl.float32, bitcast=True)
            q_tile = q_smem.index(stage)
            do_tile = do_smem.index(stage)
            s_t = warpgroup_mma(k_op, q_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_op, do_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            # <= 1 in flight: S^T is done, and so are the previous step's dV and dK
            s_t = warpgroup_mma_wait(1, deps=[s_t])
            s_t = s_t * qk_scale
            if MASKED:
                valid = gl.expand_dims(offs_m, 0) < n_q
                if IS_CAUSAL:
                    valid = valid & (gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m, 0) + causal_off)
                s_t = gl.where(valid, s_t, float("-inf"))
            p_t = gl.exp2(s_t - gl.expand_dims(lse2, 0))
            p_op = gl.convert_layout(p_t.to(dtype), gl.DotOperandLayout(0, mma_d, 2))
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=[dp_t])
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
            ds_op = gl.convert_layout(ds_t.to(dtype), gl.DotOperandLayout(0, mma_d, 2))
            dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
            # prefetch step it + STAGES - 1 into the ring buffer of step it - 1, whose dV and dK finished at the
            # first wait above (the copy's lowering synchronizes the warps before it is issued)
            nxt = it + STAGES - 1
            if nxt < n_steps:
                nstage = nxt % STAGES
                mbarrier.expect(bars.index(nstage), tile_bytes)
                _tma_load(q_desc, [lo + nxt * BLOCK_M, 0], bars.index(nstage), q_smem.index(nstage))
                _tma_load(do_desc, [lo + nxt * BLOCK_M, 0], bars.index(nstage), do_smem.index(nstage))
                _tma_load(stats_desc, [stats_row + lo + nxt * BLOCK_M], bars.index(nstage), stats_smem.index(nstage))
            it += 1
        return it, dk, dv

    @gluon.jit
    def _dkdv_kernel(Q, K, V, DO, DK, DV, STATS,  # DK, DV laid out like K, V; STATS (Z*H, N_q, 2) fp32
                     stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                     stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                     n_heads, n_q, n_k, n_rows_all, causal_off, qk_scale, sm_scale,
                     IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        pid_zh = gl.program_id(0)
        pid_n = gl.program_id(1)
        off_z = (pid_zh // n_heads).to(gl.int64)
        off_h = (pid_zh % n_heads).to(gl.int64)
        start_n = pid_n * BLOCK_N
        dtype: gl.constexpr = Q.dtype.element_ty
        gl.static_assert(gl.num_warps() == 4, "one warpgroup")
        # S^T / dP^T tiles are (BLOCK_N, BLOCK_M); dK / dV (BLOCK_N, HEAD_DIM)
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

        # per-head TMA descriptors for Q and dO: rows past n_q read as zeros
        q_desc = tma.make_tensor_descriptor(Q + off_z * stride_qz + off_h * stride_qh, shape=[n_q, HEAD_DIM],
                                            strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM],
                                            layout=tile_layout)
        do_desc = tma.make_tensor_descriptor(DO + off_z * stride_doz + off_h * stride_doh, shape=[n_q, HEAD_DIM],
                                             strides=[stride_dom, 1], block_shape=[BLOCK_M, HEAD_DIM],
                                             layout=tile_layout)
        # the (lse2, delta) pairs as int64, one descriptor over all heads' rows (a head's own base is 16-byte
        # aligned only for even n_q): this head's rows start at stats_row
        stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=1)
        stats_desc = tma.make_tensor_descriptor(STATS.to(gl.pointer_type(gl.int64), bitcast=True),
                                                shape=[n_rows_all], strides=[1], block_shape=[BLOCK_M],
                                                layout=stats_layout)
        stats_row = pid_zh * n_q
        # K and V of this tile, once, into the registers of the A operand
        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blocked))
        kv_mask = gl.expand_dims(rows < n_k, 1)
        k = gl.load(K + off_z * stride_kz + off_h * stride_kh + gl.expand_dims(rows, 1) * stride_kn
                    + gl.expand_dims(cols, 0), mask=kv_mask, other=0.0)
        v = gl.load(V + off_z * stride_vz + off_h * stride_vh + gl.expand_dims(rows, 1) * stride_vn
                    + gl.expand_dims(cols, 0), mask=kv_mask, other=0.0)
        # (converted before the ring buffers exist: the conversion's scratch shared memory is reused)
        k_op = gl.convert_layout(k, gl.DotOperandLayout(0, mma_s, 2))
        v_op = gl.convert_layout(v, gl.DotOperandLayout(0, mma_s, 2))

        # query tiles [lo, m_pad): masked diagonal ones [lo, full_lo), unmasked [full_lo, m_full), ragged end (the
        # ranges of flash_triton._bwd_dkdv_tile: Gluon code cannot call that Triton function)
        m_full = (n_q // BLOCK_M) * BLOCK_M
        m_pad = gl.cdiv(n_q, BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            lo = (gl.maximum(start_n - causal_off, 0) // BLOCK_M) * BLOCK_M
            full_lo = gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - causal_off, 0), BLOCK_M) * BLOCK_M
            full_lo = gl.minimum(full_lo, m_pad)
        else:
            lo = 0
            full_lo = 0
        n_steps = (m_pad - lo) // BLOCK_M

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], tile_layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], tile_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        stats_smem = gl.allocate_shared_memory(gl.int64, [STAGES, BLOCK_M], stats_layout)
        tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8 + 8 * BLOCK_M
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES - 1):
            if i < n_steps:
                mbarrier.expect(bars.index(i), tile_bytes)
                _tma_load(q_desc, [lo + i * BLOCK_M, 0], bars.index(i), q_smem.index(i))
                _tma_load(do_desc, [lo + i * BLOCK_M, 0], bars.index(i), do_smem.index(i))
                _tma_load(stats_desc, [stats_row + lo + i * BLOCK_M], bars.index(i), stats_smem.index(i))

        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=mma_d))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=mma_d))
        # one ring of tiles across the three ranges: `it` numbers the steps from lo
        it = 0
        for rng in gl.static_range(3):
            if rng == 0:
                start, end = lo, full_lo
            elif rng == 1:
                start, end = full_lo, m_full
            else:
                start, end = gl.maximum(full_lo, m_full), m_pad
            it, dk, dv = _steps(it, lo, start, end, n_steps, dk, dv, k_op, v_op, q_desc, do_desc, stats_desc,
                                q_smem, do_smem, stats_smem, bars, stats_row, offs_n, n_q, causal_off, qk_scale,
                                rng != 1, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, mma_s, mma_d)
        dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        dk = dk * sm_scale
        out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_d))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_d))
        out_mask = gl.expand_dims(out_rows < n_k, 1)
        gl.store(DK + off_z * stride_kz + off_h * stride_kh + gl.expand_dims(out_rows, 1) * stride_kn
                 + gl.expand_dims(out_cols, 0), dk.to(dtype), mask=out_mask)
        gl.store(DV + off_z * stride_vz + off_h * stride_vh + gl.expand_dims(out_rows, 1) * stride_vn
                 + gl.expand_dims(out_cols, 0), dv.to(dtype), mask=out_mask)
