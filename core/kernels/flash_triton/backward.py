"""Backward kernels: two passes (`_bwd_dq_kernel`, then `_bwd_dkdv_kernel`), the atomic-dQ dK/dV pass
(`_bwd_dkdv_kernel` with ATOMIC_DQ, after `_bwd_delta_kernel`), and the fused one-launch backward
(`_bwd_fused_kernel`). Which one runs: `dispatch.flash_bwd_impl` and `FlashConfig.backward`.

- two passes (no atomics): `_bwd_dq_kernel` computes delta = rowsum(dO * O) for its query tile, stores it with the
  base-2 logsumexp, and accumulates dQ over key tiles; `_bwd_dkdv_kernel` then holds one key tile and accumulates
  dK and dV over the query tiles that see it. At d <= 64 both issue dP before the exponentials, which then overlap
  that matmul.
- atomic dQ: one dK/dV pass that also adds dS K into an fp32 dQ buffer (5 tile matmuls, not 7); on Hopper each dQ
  tile goes in one bulk tensor reduction (TMA engine), elsewhere per-element atomics.
- fused: grid (tiles, batch x heads), program i doing dK/dV of key tile i AND dQ of query tile i (causal:
  n - i + i + 1 tile steps each, so the critical path is ~n steps in one launch instead of ~2n in two); delta
  recomputed from O in place.
"""
from __future__ import annotations

from core.kernels.flash_triton.common import (HAVE_TRITON, _head_major, _key_range, _load_parts,  # noqa: F401
                                              _load_rows, _lse_to_base2, _mask_scores, _mm, _mm_parts, _mma,
                                              _row_dot, _store_parts, _store_rows, _store_stats, _tail_cols, tl,
                                              triton)

if HAVE_TRITON:
    @triton.jit
    def _bwd_dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                      offs_m, offs_n0, offs_d, offs_t, lo, hi, n_k, causal_off, qk_scale,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k, k1 = _load_parts(k_base, offs_n, stride_kn, n_k, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D, MASKED)
            v, v1 = _load_parts(v_base, offs_n, stride_vn, n_k, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D, MASKED)
            s = _mm_parts(q, tl.trans(k), q1, tl.trans(k1), TAIL_D) * qk_scale
            if BLOCK_D + TAIL_D <= 64:
                # dP issued before the exponentials, which ptxas then schedules while it runs on the tensor
                # cores (3% faster on an H100 at d = 64; at d = 128 the extra live tile spills: 3-8% slower)
                dp = _mm_parts(do, tl.trans(v), do1, tl.trans(v1), TAIL_D)
            if MASKED:
                s = _mask_scores(s, offs_m, offs_n, n_k, causal_off, IS_CAUSAL)
            p = tl.math.exp2(s - lse2[:, None])
            if BLOCK_D + TAIL_D > 64:
                dp = _mm_parts(do, tl.trans(v), do1, tl.trans(v1), TAIL_D)
            ds = p * (dp - delta[:, None])
            dq = _mma(ds.to(k.dtype), k, dq)
            if TAIL_D > 0:
                dq1 = _mma(ds.to(k1.dtype), k1, dq1)
        return dq, dq1

    @triton.jit
    def _bwd_dq_tile(Q, K, V, O, DO, DQ, LSE, STATS, pid_zh, off_z, off_h, off_hk, start_m,
                     stride_qz, stride_qh, stride_qm,
                     stride_kz, stride_kh, stride_kn,
                     stride_vz, stride_vh, stride_vn,
                     stride_oz, stride_oh, stride_om,
                     stride_doz, stride_doh, stride_dom,
                     stride_dqz, stride_dqh, stride_dqm,
                     n_q, n_k, causal_off, qk_scale, sm_scale,
                     IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_STATS: tl.constexpr):
        """dQ of the BLOCK_M query rows from start_m: one walk over the key tiles they see.

        delta = rowsum(dO * O) of these rows is computed here from the O and dO tiles; with STORE_STATS
        it is stored for the dK/dV pass with the base-2 logsumexp (+inf for rows that see no key, which
        that pass would otherwise rederive for every tile it visits): STATS[row] = (lse2, delta)."""
        k_base = K + off_z * stride_kz + off_hk * stride_kh  # off_hk: the query head's KV head (GQA)
        v_base = V + off_z * stride_vz + off_hk * stride_vh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = _tail_cols(offs_d, BLOCK_D, TAIL_D)
        q, q1 = _load_parts(Q + off_z * stride_qz + off_h * stride_qh, offs_m, stride_qm, n_q, offs_d, offs_t,
                            HEAD_DIM, BLOCK_D, TAIL_D, True)
        do, do1 = _load_parts(DO + off_z * stride_doz + off_h * stride_doh, offs_m, stride_dom, n_q, offs_d, offs_t,
                              HEAD_DIM, BLOCK_D, TAIL_D, True)
        o, o1 = _load_parts(O + off_z * stride_oz + off_h * stride_oh, offs_m, stride_om, n_q, offs_d, offs_t,
                            HEAD_DIM, BLOCK_D, TAIL_D, True)
        delta = _row_dot(do, o, do1, o1, TAIL_D)                         # D_i = rowsum(dO * O)
        row = pid_zh.to(tl.int64) * n_q + offs_m
        lse = tl.load(LSE + row, mask=offs_m < n_q, other=float("inf"))
        lse2 = _lse_to_base2(lse)
        if STORE_STATS:
            _store_stats(STATS, row, lse2, delta, offs_m < n_q)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq1 = tl.zeros_like(q1).to(tl.float32)
        full_hi, hi = _key_range(start_m, n_k, causal_off, IS_CAUSAL, BLOCK_M, BLOCK_N)
        dq, dq1 = _bwd_dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                                offs_m, offs_n0, offs_d, offs_t, 0, full_hi, n_k, causal_off, qk_scale,
                                False, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, TAIL_D)
        dq, dq1 = _bwd_dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                                offs_m, offs_n0, offs_d, offs_t, full_hi, hi, n_k, causal_off, qk_scale,
                                True, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, TAIL_D)
        _store_parts(DQ + off_z * stride_dqz + off_h * stride_dqh, offs_m, stride_dqm, n_q, offs_d, offs_t,
                     (dq * sm_scale).to(DQ.dtype.element_ty), (dq1 * sm_scale).to(DQ.dtype.element_ty),
                     HEAD_DIM, BLOCK_D, TAIL_D)

    # SEQ_CLASS is a tuning key only and n_heads only divides program ids: neither is specialized, so a
    # new sequence class or head count (1 vs 16) reuses the compiled kernel
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _bwd_dq_kernel(Q, K, V, O, DO, DQ, LSE, STATS,  # STATS (Z*H, N_q, 2)
                       stride_qz, stride_qh, stride_qm,
                       stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn,
                       stride_doz, stride_doh, stride_dom,
                       stride_oz, stride_oh, stride_om,
                       stride_dqz, stride_dqh, stride_dqm,
                       n_heads, kv_group, n_q, n_k, causal_off, qk_scale, sm_scale, SEQ_CLASS,
                       IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        n_tiles = tl.cdiv(n_q, BLOCK_M)
        pid_zh, tile = _head_major(n_tiles)
        pid_m = n_tiles - 1 - tile  # heavy-first
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        _bwd_dq_tile(Q, K, V, O, DO, DQ, LSE, STATS, pid_zh, off_z, off_h, off_h // kv_group, pid_m * BLOCK_M,
                     stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                     stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                     stride_doz, stride_doh, stride_dom, stride_dqz, stride_dqh, stride_dqm,
                     n_q, n_k, causal_off, qk_scale, sm_scale,
                     IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N, True)

    @triton.jit
    def _bwd_dkdv_inner(dk, dk1, dv, dv1, k, k1, v, v1, q_base, do_base, o_base, stride_qm, stride_dom, stride_om,
                        stats_base, dq_base, stride_dqm, sm_scale,
                        offs_n, offs_m0, offs_d, offs_t, lo, hi, n_q, causal_off, qk_scale,
                        MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                        DELTA_FROM_O: tl.constexpr, dq_desc, dq_desc1, DQ_TMA: tl.constexpr):
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            q, q1 = _load_parts(q_base, offs_m, stride_qm, n_q, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D, MASKED)
            do, do1 = _load_parts(do_base, offs_m, stride_dom, n_q, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D,
                                  MASKED)
            if DELTA_FROM_O:
                # fused backward: stats_base is the natural-log logsumexp, and delta = rowsum(dO * O) of
                # this query tile is recomputed from its O tile (one more tile load per step instead of a
                # preprocessing launch); rows >= n_q give 0
                if MASKED:
                    lse = tl.load(stats_base + offs_m, mask=offs_m < n_q, other=float("inf"))
                else:
                    lse = tl.load(stats_base + offs_m)
                lse2 = _lse_to_base2(lse)
                o, o1 = _load_parts(o_base, offs_m, stride_om, n_q, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D,
                                    MASKED)
                delta = _row_dot(do, o, do1, o1, TAIL_D)
            else:
                # (base-2 logsumexp, delta) pairs from the first launch: one 8-byte load per row, where two
                # separate vectors cost twice the loads and shared-memory round trips per tile (each thread
                # holds 16 query columns of S^T); rows >= n_q (masked off in S^T) read as (0, 0)
                stats_ptrs = stats_base + 2 * offs_m[:, None] + tl.arange(0, 2)[None, :]
                if MASKED:
                    stats = tl.load(stats_ptrs, mask=offs_m[:, None] < n_q, other=0.0)
                else:
                    stats = tl.load(stats_ptrs)
                lse2, delta = tl.split(stats)
            s_t = _mm_parts(k, tl.trans(q), k1, tl.trans(q1), TAIL_D) * qk_scale   # (BLOCK_N, BLOCK_M) = S^T
            if BLOCK_D + TAIL_D <= 64:  # dP^T overlaps the exponentials (as in the dQ pass)
                dp_t = _mm_parts(v, tl.trans(do), v1, tl.trans(do1), TAIL_D)
            if MASKED:
                valid = offs_m[None, :] < n_q
                if IS_CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_off)
                s_t = tl.where(valid, s_t, float("-inf"))
            p_t = tl.math.exp2(s_t - lse2[None, :])
            dv = _mma(p_t.to(do.dtype), do, dv)
            if TAIL_D > 0:
                dv1 = _mma(p_t.to(do1.dtype), do1, dv1)
            if BLOCK_D + TAIL_D > 64:
                dp_t = _mm_parts(v, tl.trans(do), v1, tl.trans(do1), TAIL_D)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = _mma(ds_t.to(q.dtype), q, dk)
            if TAIL_D > 0:
                dk1 = _mma(ds_t.to(q1.dtype), q1, dk1)
            if ATOMIC_DQ:
                # this key tile's share of dQ = dS K, added into an fp32 buffer: 5 matmuls per tile
                # instead of the two-pass scheme's 7 (it recomputes S and dP for dQ)
                dq_part = _mm(tl.trans(ds_t.to(k.dtype)), k) * sm_scale
                dq_ptrs = dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :]
                if DQ_TMA:
                    # Hopper: one bulk tensor reduction (TMA engine, fp32 add in L2) per tile instead of
                    # BLOCK_M x d per-element atomics; rows >= n_q and columns >= d are clipped by the
                    # descriptor's shape
                    dq_desc.atomic_add([start_m, 0], dq_part)
                elif MASKED or BLOCK_D != HEAD_DIM:
                    tl.atomic_add(dq_ptrs, dq_part, mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM),
                                  sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq_part, sem="relaxed")
                if TAIL_D > 0:
                    dq_part1 = _mm(tl.trans(ds_t.to(k1.dtype)), k1) * sm_scale
                    if DQ_TMA:
                        dq_desc1.atomic_add([start_m, BLOCK_D], dq_part1)
                    else:
                        tl.atomic_add(dq_base + offs_m[:, None] * stride_dqm + offs_t[None, :], dq_part1,
                                      mask=(offs_m[:, None] < n_q) & (offs_t[None, :] < HEAD_DIM), sem="relaxed")
        return dk, dk1, dv, dv1

    @triton.jit
    def _bwd_dkdv_tile(Q, K, V, O, DO, DK, DV, STATS, DQ_ACC, pid_zh, off_z, off_h, off_hk, start_n,
                       stride_qz, stride_qh, stride_qm,
                       stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn,
                       stride_oz, stride_oh, stride_om,
                       stride_doz, stride_doh, stride_dom,
                       stride_dkz, stride_dkh, stride_dkn,
                       stride_dvz, stride_dvh, stride_dvn,
                       n_q, n_k, causal_off, qk_scale, sm_scale,
                       IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                       DELTA_FROM_O: tl.constexpr, DQ_TMA: tl.constexpr):
        """dK, dV of the BLOCK_N keys from start_n: one walk over the query tiles that see them, in three
        ranges (masked diagonal, unmasked, masked ragged end). STATS holds (base-2 logsumexp, delta) per
        row, or, with DELTA_FROM_O, the natural-log logsumexp, delta then recomputed from O per query tile;
        O / DQ_ACC are only read when used."""
        q_base = Q + off_z * stride_qz + off_h * stride_qh
        do_base = DO + off_z * stride_doz + off_h * stride_doh
        o_base = O + off_z * stride_oz + off_h * stride_oh
        if DELTA_FROM_O:
            stats_base = STATS + pid_zh.to(tl.int64) * n_q
        else:
            stats_base = STATS + pid_zh.to(tl.int64) * (2 * n_q)
        dq_base = DQ_ACC + pid_zh.to(tl.int64) * n_q * HEAD_DIM  # contiguous (Z*H, N_q, d) fp32
        if ATOMIC_DQ and DQ_TMA:  # this head's (N_q, d) slice of the fp32 dQ buffer, for bulk reductions
            dq_desc = tl.make_tensor_descriptor(dq_base, shape=[n_q, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                block_shape=[BLOCK_M, BLOCK_D])
            dq_desc1 = dq_desc
            if TAIL_D > 0:  # the tail columns' tiles
                dq_desc1 = tl.make_tensor_descriptor(dq_base, shape=[n_q, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                     block_shape=[BLOCK_M, TAIL_D])
        else:
            dq_desc = dq_base  # unused
            dq_desc1 = dq_base
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = _tail_cols(offs_d, BLOCK_D, TAIL_D)
        k, k1 = _load_parts(K + off_z * stride_kz + off_hk * stride_kh, offs_n, stride_kn, n_k, offs_d, offs_t,
                            HEAD_DIM, BLOCK_D, TAIL_D, True)
        v, v1 = _load_parts(V + off_z * stride_vz + off_hk * stride_vh, offs_n, stride_vn, n_k, offs_d, offs_t,
                            HEAD_DIM, BLOCK_D, TAIL_D, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dk1 = tl.zeros_like(k1).to(tl.float32)
        dv1 = tl.zeros_like(v1).to(tl.float32)

        m_full = (n_q // BLOCK_M) * BLOCK_M  # query tiles with no ragged end
        m_pad = tl.cdiv(n_q, BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            # first query that sees key start_n is start_n - causal_off
            lo = (tl.maximum(start_n - causal_off, 0) // BLOCK_M) * BLOCK_M
            # from full_lo on, every query of a tile sees every key of this tile
            full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_off, 0), BLOCK_M) * BLOCK_M
            full_lo = tl.minimum(full_lo, m_pad)
        else:
            lo = 0
            full_lo = 0
        # three ranges: the masked diagonal tiles, the unmasked ones, the masked ragged end
        for rng in tl.static_range(3):
            if rng == 0:
                start, end = lo, full_lo
            elif rng == 1:
                start, end = full_lo, m_full
            else:
                start, end = tl.maximum(full_lo, m_full), m_pad
            dk, dk1, dv, dv1 = _bwd_dkdv_inner(dk, dk1, dv, dv1, k, k1, v, v1, q_base, do_base, o_base, stride_qm,
                                               stride_dom, stride_om, stats_base, dq_base, HEAD_DIM, sm_scale,
                                               offs_n, offs_m0, offs_d, offs_t, start, end, n_q, causal_off,
                                               qk_scale, rng != 1, IS_CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, TAIL_D,
                                               ATOMIC_DQ, DELTA_FROM_O, dq_desc, dq_desc1, DQ_TMA)
        _store_parts(DK + off_z * stride_dkz + off_h * stride_dkh, offs_n, stride_dkn, n_k, offs_d, offs_t,
                     (dk * sm_scale).to(DK.dtype.element_ty), (dk1 * sm_scale).to(DK.dtype.element_ty),
                     HEAD_DIM, BLOCK_D, TAIL_D)
        _store_parts(DV + off_z * stride_dvz + off_h * stride_dvh, offs_n, stride_dvn, n_k, offs_d, offs_t,
                     dv.to(DV.dtype.element_ty), dv1.to(DV.dtype.element_ty), HEAD_DIM, BLOCK_D, TAIL_D)

    # SEQ_CLASS is a tuning key only and n_heads only divides program ids: neither is specialized, so a
    # new sequence class or head count (1 vs 16) reuses the compiled kernel
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, STATS, DQ_ACC,
                         stride_qz, stride_qh, stride_qm,
                         stride_kz, stride_kh, stride_kn,
                         stride_vz, stride_vh, stride_vn,
                         stride_doz, stride_doh, stride_dom,
                         stride_dkz, stride_dkh, stride_dkn,
                         stride_dvz, stride_dvh, stride_dvn,
                         n_heads, kv_group, n_q, n_k, causal_off, qk_scale, sm_scale, SEQ_CLASS,
                         IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                         DQ_TMA: tl.constexpr):
        pid_zh, pid_n = _head_major(tl.cdiv(n_k, BLOCK_N))  # causal: early key tiles (the most queries) first
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        # the (base-2 logsumexp, delta) pairs come from the first backward launch (STATS); O is not read
        # (STATS stands in for it, zero strides)
        _bwd_dkdv_tile(Q, K, V, STATS, DO, DK, DV, STATS, DQ_ACC, pid_zh, off_z, off_h, off_h // kv_group, pid_n * BLOCK_N,
                       stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn, 0, 0, 0,
                       stride_doz, stride_doh, stride_dom, stride_dkz, stride_dkh, stride_dkn,
                       stride_dvz, stride_dvh, stride_dvn,
                       n_q, n_k, causal_off, qk_scale, sm_scale,
                       IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N, ATOMIC_DQ, False, DQ_TMA)

    # Fused backward: ONE launch, grid (tiles, batch x heads). Program i does
    #   (a) dK, dV of key tile i (BLOCK_N keys), walking the query tiles that see it, and
    #   (b) dQ of query tile i (BLOCK_M rows), walking the key tiles it sees.
    # Causal with N_q == N_k and BLOCK_M == BLOCK_N: (a) takes n - i tile steps and (b) i + 1, so every
    # program takes n + 1 (a bottom-right offset shifts both by the same amount: the sum stays constant),
    # where the two-pass backward's critical path is ~2n steps in two launches. The grid covers
    # max(query tiles, key tiles); a phase whose tile index is out of range is skipped, so every key
    # tile and every query tile is done exactly once for any BLOCK_M, BLOCK_N (balance is best when
    # they are equal, which the config list keeps). delta = rowsum(dO * O) is recomputed from the O
    # and dO tiles wherever it is needed (no preprocessing launch, no delta buffer): fwd + bwd = 2 launches.
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _bwd_fused_kernel(Q, K, V, O, DO, DQ, DK, DV, LSE,
                          stride_qz, stride_qh, stride_qm,
                          stride_kz, stride_kh, stride_kn,
                          stride_vz, stride_vh, stride_vn,
                          stride_doz, stride_doh, stride_dom,
                          stride_oz, stride_oh, stride_om,
                          stride_dqz, stride_dqh, stride_dqm,
                          stride_dkz, stride_dkh, stride_dkn,
                          stride_dvz, stride_dvh, stride_dvn,
                          n_heads, kv_group, n_q, n_k, causal_off, qk_scale, sm_scale, SEQ_CLASS,
                          IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        pid_zh = tl.program_id(1)
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        start_n = pid * BLOCK_N
        if start_n < n_k:  # (a) key tile pid (natural-log LSE as its STATS); LSE stands in for the unused DQ_ACC
            _bwd_dkdv_tile(Q, K, V, O, DO, DK, DV, LSE, LSE, pid_zh, off_z, off_h, off_h // kv_group, start_n,
                           stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                           stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                           stride_doz, stride_doh, stride_dom, stride_dkz, stride_dkh, stride_dkn,
                           stride_dvz, stride_dvh, stride_dvn,
                           n_q, n_k, causal_off, qk_scale, sm_scale,
                           IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N, False, True, False)
        start_m = pid * BLOCK_M
        if start_m < n_q:  # (b) query tile pid (its delta computed in place, not stored)
            _bwd_dq_tile(Q, K, V, O, DO, DQ, LSE, LSE, pid_zh, off_z, off_h, off_h // kv_group, start_m,
                         stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                         stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                         stride_doz, stride_doh, stride_dom, stride_dqz, stride_dqh, stride_dqm,
                         n_q, n_k, causal_off, qk_scale, sm_scale,
                         IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N, False)

    @triton.jit
    def _ws_dq_finish_kernel(ACC, TAIL_ACC, DQ, stride_dqz, stride_dqh, stride_dqm, n_heads, n_q, tiles, sm_scale,
                             BLOCKS: tl.constexpr, TAIL: tl.constexpr):
        """dQ = sm_scale * the Gluon backward's fp32 dQ buffer at d = 64 BLOCKS + TAIL (`hopper.ws_dq_buffer`): a
        program per 64-row query tile, whose BLOCKS x 4096 floats the buffer holds as (block, w, lr, lc, j, h, e) for
        the tile's row 16 w + 8 h + lr and column 64 block + 8 j + 2 lc + e, and whose TAIL columns TAIL_ACC holds
        row-major (64 rows a tile); read in that order, written row-major (rows past n_q not). In PyTorch the same
        permutation as one strided multiply took about twice a plain multiply's time."""
        pid = tl.program_id(0)
        pid_zh = pid // tiles
        tile = pid % tiles
        x = tl.load(ACC + pid.to(tl.int64) * (BLOCKS * 4096) + tl.arange(0, BLOCKS * 4096))
        x = tl.reshape(tl.permute(tl.reshape(x, [BLOCKS, 4, 8, 4, 8, 2, 2]), [1, 5, 2, 0, 4, 3, 6]),
                       [64, BLOCKS * 64])
        rows = tile * 64 + tl.arange(0, 64)
        cols = tl.arange(0, BLOCKS * 64)
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        dq_rows = DQ + off_z * stride_dqz + off_h * stride_dqh + rows[:, None] * stride_dqm
        tl.store(dq_rows + cols[None, :], (x * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < n_q)
        if TAIL > 0:
            tail_cols = tl.arange(0, TAIL)
            t = tl.load(TAIL_ACC + (pid.to(tl.int64) * 64 + tl.arange(0, 64))[:, None] * TAIL + tail_cols[None, :])
            tl.store(dq_rows + BLOCKS * 64 + tail_cols[None, :], (t * sm_scale).to(DQ.dtype.element_ty),
                     mask=rows[:, None] < n_q)

    @triton.jit
    def _bwd_delta_kernel(O, DO, LSE, STATS, DQ_ACC, stride_oz, stride_oh, stride_om, stride_doz, stride_doh,
                          stride_dom, n_heads, n_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr):
        """STATS[i] = (base-2 logsumexp, delta_i = rowsum(dO_i * O_i)), for the atomic-dQ backward (the two-pass
        dQ kernel computes both itself); also zeroes the rows of the fp32 dQ buffer (Z*H, N_q, d) (no memset
        launch)."""
        pid_zh = tl.program_id(0)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        o = _load_rows(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                       offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(DO + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                        + offs_d[None, :], offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        row = pid_zh.to(tl.int64) * n_q + offs_m
        lse = tl.load(LSE + row, mask=offs_m < n_q, other=0.0)
        _store_stats(STATS, row, _lse_to_base2(lse), delta, offs_m < n_q)
        _store_rows(DQ_ACC + row[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                    offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)