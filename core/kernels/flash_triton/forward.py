"""Forward kernels (FlashAttention-2, one program per (batch x head, query tile)).

- `_fwd_kernel`: one loop over key tiles with a base-2 online softmax (log2(e) folded into the scale), fp32
  accumulators, output cast on store. Causal: key tiles above the diagonal are never visited; tiles wholly below it
  run in a loop without masks, the diagonal (and ragged-end) tiles in a second loop with masks. Heavy causal tiles
  (late queries) are launched first. The running max is kept in scaled units, so the scale folds into the
  exponent's FMA.
- split-KV, for grids that leave SMs idle (`dispatch._fwd_split_len`): `_fwd_split_merge_kernel` (one program per
  query tile and key split; the split of a query tile that finishes last merges the partials: one launch), or
  `_fwd_split_kernel` + `_fwd_merge_kernel` (`FlashConfig.split_merge = "separate"`: the same sums in two launches).
"""
from __future__ import annotations

from core.kernels.flash_triton.common import (HAVE_TRITON, _head_major, _key_range, _load_parts,  # noqa: F401
                                              _mask_scores, _mm, _mma, _store_parts, _tail_cols, tl, triton)

if HAVE_TRITON:
    @triton.jit
    def _fwd_inner(acc, acc1, m_i, l_i, q, q1, k_base, v_base, stride_kn, stride_vn,
                   offs_m, offs_n0, offs_d, offs_t, lo, hi, n_k, causal_off, qk_scale,
                   MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k, k1 = _load_parts(k_base, offs_n, stride_kn, n_k, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D, MASKED)
            s = _mm(q, tl.trans(k))                                # (BLOCK_M, BLOCK_N), unscaled
            if TAIL_D > 0:
                s = _mma(q1, tl.trans(k1), s)
            if MASKED:
                s = _mask_scores(s, offs_m, offs_n, n_k, causal_off, IS_CAUSAL)
            # the running max is kept in scaled (base-2) units; max(s) * scale == max(s * scale) exactly
            # (rounding is monotonic, scale > 0), and the scale then folds into the exponent's FMA:
            # one instruction per score instead of a multiply and a subtract
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if MASKED:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            else:
                m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v, v1 = _load_parts(v_base, offs_n, stride_vn, n_k, offs_d, offs_t, HEAD_DIM, BLOCK_D, TAIL_D, MASKED)
            acc = _mma(p.to(v.dtype), v, acc * alpha[:, None])
            if TAIL_D > 0:
                acc1 = _mma(p.to(v1.dtype), v1, acc1 * alpha[:, None])
            m_i = m_new
        return acc, acc1, m_i, l_i

    @triton.jit
    def _fwd_rows(Q, K, V, pid_zh, start_m, key_lo, key_hi,
                  stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                  n_heads, kv_group, n_q, n_k, causal_off, qk_scale,
                  IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_LOOP: tl.constexpr = False):
        """Online softmax of the BLOCK_M query rows from start_m over the keys in [key_lo, key_hi) that they
        see (key_lo a multiple of BLOCK_N): (acc, acc of the tail columns, m, l), unnormalised, base 2. Causal:
        key tiles above the diagonal are never visited; tiles wholly below it run without masks, the diagonal
        tiles and the ragged last tile with masks."""
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        off_hk = off_h // kv_group  # the query head's KV head (grouped-query attention; 1: one each)
        k_base = K + off_z * stride_kz + off_hk * stride_kh
        v_base = V + off_z * stride_vz + off_hk * stride_vh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = _tail_cols(offs_d, BLOCK_D, TAIL_D)
        q, q1 = _load_parts(Q + off_z * stride_qz + off_h * stride_qh, offs_m, stride_qm, n_q, offs_d, offs_t,
                            HEAD_DIM, BLOCK_D, TAIL_D, True)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc1 = tl.zeros_like(q1).to(tl.float32)

        full_hi, hi = _key_range(start_m, n_k, causal_off, IS_CAUSAL, BLOCK_M, BLOCK_N)
        hi = tl.minimum(hi, key_hi)
        if ONE_LOOP:
            acc, acc1, m_i, l_i = _fwd_inner(acc, acc1, m_i, l_i, q, q1, k_base, v_base, stride_kn, stride_vn,
                                             offs_m, offs_n0, offs_d, offs_t, key_lo, hi, n_k, causal_off,
                                             qk_scale, True, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, TAIL_D)
            return acc, acc1, m_i, l_i
        acc, acc1, m_i, l_i = _fwd_inner(acc, acc1, m_i, l_i, q, q1, k_base, v_base, stride_kn, stride_vn,
                                         offs_m, offs_n0, offs_d, offs_t, key_lo, tl.minimum(full_hi, hi), n_k,
                                         causal_off, qk_scale, False, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, TAIL_D)
        acc, acc1, m_i, l_i = _fwd_inner(acc, acc1, m_i, l_i, q, q1, k_base, v_base, stride_kn, stride_vn,
                                         offs_m, offs_n0, offs_d, offs_t, tl.maximum(full_hi, key_lo), hi, n_k,
                                         causal_off, qk_scale, True, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, TAIL_D)
        return acc, acc1, m_i, l_i

    @triton.jit
    def _store_output(O, LSE, pid_zh, n_heads, stride_oz, stride_oh, stride_om, offs_m, offs_d, offs_t, n_q,
                      acc, acc1, m_i, l_i, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr):
        """O = acc / l in O's dtype, and the natural-log logsumexp (-inf where a row saw no key), for the rows
        offs_m of batch x head pid_zh; (acc, acc1, m, l) unnormalised, base 2 (acc1: the tail columns)."""
        o_base = O + (pid_zh // n_heads).to(tl.int64) * stride_oz + (pid_zh % n_heads).to(tl.int64) * stride_oh
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
        out1 = (acc1 / l_safe[:, None]).to(O.dtype.element_ty)
        _store_parts(o_base, offs_m, stride_om, n_q, offs_d, offs_t, out, out1, HEAD_DIM, BLOCK_D, TAIL_D)
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + pid_zh.to(tl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)

    @triton.jit
    def _store_partial(OP, LP, row, offs_d, offs_t, rows_ok, acc, acc1, m_i, l_i, BLOCK_D: tl.constexpr,
                       TAIL_D: tl.constexpr):
        """One split's normalised fp32 partial output (rows of BLOCK_D + TAIL_D columns) and base-2 logsumexp, at
        partial rows `row` (output 0 and logsumexp -inf for rows that saw none of the split's keys)."""
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        op_row = OP + row[:, None] * (BLOCK_D + TAIL_D)
        tl.store(op_row + offs_d[None, :], acc / l_safe[:, None], mask=rows_ok[:, None])
        if TAIL_D > 0:
            tl.store(op_row + offs_t[None, :], acc1 / l_safe[:, None], mask=rows_ok[:, None])
        tl.store(LP + row, m_i + tl.math.log2(l_i), mask=rows_ok)

    @triton.jit
    def _load_partial(OP, row, offs_d, offs_t, rows_ok, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                      CACHE: tl.constexpr):
        """One split's partial output rows, both parts (`_store_partial`); rows not ok read as 0."""
        op_row = OP + row[:, None] * (BLOCK_D + TAIL_D)
        o_s = tl.load(op_row + offs_d[None, :], mask=rows_ok[:, None], other=0.0, cache_modifier=CACHE)
        if TAIL_D > 0:
            o_s1 = tl.load(op_row + offs_t[None, :], mask=rows_ok[:, None], other=0.0, cache_modifier=CACHE)
        else:
            o_s1 = o_s
        return o_s, o_s1

    # SEQ_CLASS is a tuning key only and n_heads only divides program ids: neither is specialized, so a
    # new sequence class or head count (1 vs 16) reuses the compiled kernel
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _fwd_kernel(Q, K, V, O, LSE,
                    stride_qz, stride_qh, stride_qm,
                    stride_kz, stride_kh, stride_kn,
                    stride_vz, stride_vh, stride_vn,
                    stride_oz, stride_oh, stride_om,
                    n_heads, kv_group, n_q, n_k, causal_off, qk_scale, SEQ_CLASS,
                    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        n_tiles = tl.cdiv(n_q, BLOCK_M)
        pid_zh, tile = _head_major(n_tiles)
        # heavy-first: the last query tiles (most keys under a causal mask) are launched first
        start_m = (n_tiles - 1 - tile) * BLOCK_M
        acc, acc1, m_i, l_i = _fwd_rows(Q, K, V, pid_zh, start_m, 0, n_k,
                                        stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                        stride_vz, stride_vh, stride_vn, n_heads, kv_group, n_q, n_k, causal_off, qk_scale,
                                        IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        _store_output(O, LSE, pid_zh, n_heads, stride_oz, stride_oh, stride_om, start_m + tl.arange(0, BLOCK_M),
                      offs_d, _tail_cols(offs_d, BLOCK_D, TAIL_D), n_q, acc, acc1, m_i, l_i, HEAD_DIM, BLOCK_D,
                      TAIL_D)

    # Split-KV forward for small grids (few batch x heads, few query tiles): the key range of every query
    # tile is cut into splits of `split_len` keys, one program per (query tile, split), each writing its
    # normalised partial output and base-2 logsumexp; `_fwd_merge_kernel` then combines them. The critical
    # path falls from all key tiles of the last query tile to one split's, when the grid alone would leave
    # most SMs idle. Same tiles and the same `_fwd_rows` as `_fwd_kernel`.
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _fwd_split_kernel(Q, K, V, OP, LP,  # OP: (Z*H, splits, N_q, BLOCK_D + TAIL_D) fp32; LP: (Z*H, splits, N_q)
                          stride_qz, stride_qh, stride_qm,
                          stride_kz, stride_kh, stride_kn,
                          stride_vz, stride_vh, stride_vn,
                          n_heads, kv_group, n_q, n_k, causal_off, qk_scale, split_len, SEQ_CLASS,
                          IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_zh = tl.program_id(0)
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        split = tl.program_id(2)
        key_lo = split * split_len  # a multiple of BLOCK_N: the masked / unmasked split stays tile-aligned
        acc, acc1, m_i, l_i = _fwd_rows(Q, K, V, pid_zh, start_m, key_lo, key_lo + split_len,
                                        stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                        stride_vz, stride_vh, stride_vn, n_heads, kv_group, n_q, n_k, causal_off, qk_scale,
                                        IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N)
        # a split this tile does not reach (or rows that see none of its keys): output 0, logsumexp -inf
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row = (pid_zh.to(tl.int64) * tl.num_programs(2) + split) * n_q + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        _store_partial(OP, LP, row, offs_d, _tail_cols(offs_d, BLOCK_D, TAIL_D), offs_m < n_q, acc, acc1, m_i, l_i,
                       BLOCK_D, TAIL_D)

    @triton.jit
    def _merge_step(acc, acc1, m_i, l_i, o_s, o_s1, lse_s, TAIL_D: tl.constexpr):
        """Fold one split's normalised partial output (o_s, tail o_s1) and base-2 logsumexp lse_s into
        (acc, acc1, m, l)."""
        m_new = tl.maximum(m_i, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        w = tl.math.exp2(lse_s - m_use)
        acc = acc * alpha[:, None] + o_s * w[:, None]
        if TAIL_D > 0:
            acc1 = acc1 * alpha[:, None] + o_s1 * w[:, None]
        return acc, acc1, m_new, l_i * alpha + w

    @triton.jit
    def _fwd_merge_kernel(OP, LP, O, LSE, stride_oz, stride_oh, stride_om, n_heads, n_q, n_splits,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
                          BLOCK_M: tl.constexpr):
        """out = sum_s 2^(lse_s - lse) out_s, lse = log2 sum_s 2^lse_s (stored as a natural log), over the splits
        of `_fwd_split_kernel`, with a running max so that no term overflows."""
        pid_zh = tl.program_id(0)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = _tail_cols(offs_d, BLOCK_D, TAIL_D)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc1 = acc  # the tail's accumulator (without a tail a placeholder, never updated)
        if TAIL_D > 0:
            acc1 = tl.zeros([BLOCK_M, TAIL_D], dtype=tl.float32)
        for split in range(0, n_splits):
            row = (pid_zh.to(tl.int64) * n_splits + split) * n_q + offs_m
            lse_s = tl.load(LP + row, mask=offs_m < n_q, other=float("-inf"))
            o_s, o_s1 = _load_partial(OP, row, offs_d, offs_t, offs_m < n_q, BLOCK_D, TAIL_D, "")
            acc, acc1, m_i, l_i = _merge_step(acc, acc1, m_i, l_i, o_s, o_s1, lse_s, TAIL_D)
        _store_output(O, LSE, pid_zh, n_heads, stride_oz, stride_oh, stride_om, offs_m, offs_d, offs_t, n_q, acc,
                      acc1, m_i, l_i, HEAD_DIM, BLOCK_D, TAIL_D)

    # Split-KV forward in one launch: every split of a query tile writes its partial output and base-2
    # logsumexp, then counts itself in (one arrival count per query tile); the split that arrives last merges
    # all partials in split order (the same sums as `_fwd_merge_kernel`, whichever split is last), writes O
    # and LSE, and puts the count back to 0 for the next launch on the stream (`_ArrivalCounts`). Saves the
    # merge kernel's launch, which on a short row costs about as much as the merge. The barrier before the
    # count and its acquire-release order every thread's partial before the merging program's loads (which
    # skip L1: `.cg`). ONE_LOOP: each split's keys in one masked loop (short splits: one pipeline start-up).
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _fwd_split_merge_kernel(Q, K, V, O, LSE, OP, LP, COUNTS,  # COUNTS: >= Z*H x query tiles int32, all 0
                                stride_qz, stride_qh, stride_qm,
                                stride_kz, stride_kh, stride_kn,
                                stride_vz, stride_vh, stride_vn,
                                stride_oz, stride_oh, stride_om,
                                n_heads, kv_group, n_q, n_k, causal_off, qk_scale, split_len, SEQ_CLASS,
                                IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                TAIL_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                SPLITS: tl.constexpr, ONE_LOOP: tl.constexpr):
        pid_zh = tl.program_id(0)
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        start_m = tile * BLOCK_M
        split = tl.program_id(2)
        if IS_CAUSAL:  # splits past the tile's last visible key have nothing to do and do not arrive
            reach = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_off, 0), n_k)
        else:
            reach = n_k
        arrivals = tl.maximum(tl.cdiv(reach, split_len), 1)  # a tile that sees no key: split 0 writes it
        if split < arrivals:
            key_lo = split * split_len
            acc, acc1, m_i, l_i = _fwd_rows(Q, K, V, pid_zh, start_m, key_lo, key_lo + split_len,
                                            stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                            stride_vz, stride_vh, stride_vn, n_heads, kv_group, n_q, n_k, causal_off,
                                            qk_scale, IS_CAUSAL, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_M, BLOCK_N,
                                            ONE_LOOP)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_t = _tail_cols(offs_d, BLOCK_D, TAIL_D)
            first_row = pid_zh.to(tl.int64) * SPLITS * n_q
            _store_partial(OP, LP, first_row + split * n_q + offs_m, offs_d, offs_t, offs_m < n_q, acc, acc1, m_i,
                           l_i, BLOCK_D, TAIL_D)
            tl.debug_barrier()
            count = COUNTS + pid_zh * tl.num_programs(1) + tile
            if tl.atomic_add(count, 1, sem="acq_rel") == arrivals - 1:
                # all splits in order, this one's too (reloaded): the same sums as `_fwd_merge_kernel`,
                # whichever split arrives last, so the output does not depend on timing
                m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros_like(acc)
                acc1 = tl.zeros_like(acc1)
                for s in tl.static_range(SPLITS):
                    # splits that did not arrive read as empty (a row bound, not a scalar mask: the
                    # interpreter's int1 broadcast)
                    rows_s = offs_m < tl.where(arrivals > s, n_q, 0)
                    row_s = first_row + s * n_q + offs_m
                    lse_s = tl.load(LP + row_s, mask=rows_s, other=float("-inf"), cache_modifier=".cg")
                    o_s, o_s1 = _load_partial(OP, row_s, offs_d, offs_t, rows_s, BLOCK_D, TAIL_D, ".cg")
                    acc, acc1, m_run, l_run = _merge_step(acc, acc1, m_run, l_run, o_s, o_s1, lse_s, TAIL_D)
                _store_output(O, LSE, pid_zh, n_heads, stride_oz, stride_oh, stride_om, offs_m, offs_d, offs_t, n_q,
                              acc, acc1, m_run, l_run, HEAD_DIM, BLOCK_D, TAIL_D)
                tl.store(count, 0)  # every split of this launch has arrived: ready for the next launch