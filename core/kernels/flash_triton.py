"""FlashAttention-2 forward and backward in Triton (CS336 section 4.2).

    from core.kernels.flash_triton import FlashAttentionTriton
    out = FlashAttentionTriton.apply(q, k, v, is_causal)   # q (..., N_q, d), k/v (..., N_k, d)

Kernels (plain pointer arithmetic, so the same source runs on Triton 3.6 and 3.9):
- forward: one program per (batch x head, query tile); one loop over key tiles with an
  online softmax in base 2 (log2(e) folded into the scale), fp32 accumulators, output
  cast on store. Causal: key tiles above the diagonal are never visited; the tiles that
  need no mask run in a loop without masks, the diagonal (and ragged-end) tiles in a
  second loop with masks. Heavy causal tiles (late queries) are launched first. The running
  max is kept in scaled units, so the softmax scale folds into the exponent's FMA.
- forward on small grids (batch x heads x query tiles < SMs, long rows): split-KV,
  `_fwd_split_merge_kernel` (one program per query tile and key split, partial output + base-2
  logsumexp in fp32; the split of a query tile that finishes last merges them), so the critical
  path is one split, not a row, in one launch. `_fwd_split_kernel` + `_fwd_merge_kernel` do the
  same in two launches (FWD_MERGE_IN_KERNEL = False: the baseline).
- backward, two passes (no atomics): `_bwd_dq_kernel` computes delta = rowsum(dO * O)
  for its query tile, stores it with the base-2 logsumexp, and accumulates dQ over key tiles;
  `_bwd_dkdv_kernel` then holds one key tile and accumulates dK and dV over the query tiles
  that see it. At d <= 64 both issue dP before the exponentials, which then overlap that matmul.
  `FlashAttentionTritonAtomicDQ`: one dK/dV pass that also adds dS K into an fp32 dQ buffer
  (5 tile matmuls, not 7); on Hopper each dQ tile goes in one bulk tensor reduction (TMA engine),
  elsewhere per-element atomics (level with two-pass on an H100). On Hopper (fp16/bf16, d = 64) it runs
  `flash_gluon._bwd_ws_kernel` instead, a warp-specialised Gluon kernel that beats two-pass on long rows,
  so the default class also picks it from WS_MIN_ROWS query rows on (`_default_bwd`).
  `FlashAttentionTritonFusedBwd`: one fused kernel `_bwd_fused_kernel`, grid (tiles, batch x heads),
  program i doing dK/dV of key tile i AND dQ of query tile i (causal: n - i + i + 1 tile steps each,
  so the critical path is ~n steps in one launch instead of ~2n in two); delta recomputed from O in
  place. The default class uses it on small grids (`_use_fused`, from the H100 measurements).
- tile sizes, warps and pipeline stages are autotuned per (head dim, dtype, causal,
  sequence-length class) over a short list, so a first call stays within seconds.

Causal with N_q != N_k is bottom-right aligned: query i sees keys j <= i + N_k - N_q.
Rows that see no key give output 0 and logsumexp -inf.
Inside `torch.compile` the work goes through the opaque custom ops
``scalelab::flash_attn_fwd`` / ``scalelab::flash_attn_bwd`` (one node each, no graph break).
Eager CUDA calls of `FlashAttentionTriton` go through `flash_native`'s C++ autograd node, which replays the
allocations and launches this module's Python path made for the same input signature (at short sequences host
time, not the kernels, bounds a call); `NATIVE_NODE = False` or SCALELAB_FLASH_NATIVE=0 keeps the Python Function.
flash_native builds on this module, so it installs itself here (`install_eager_path`, when `core.kernels` is
imported): this module never imports it.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from core.errors import ConfigError
from core.kernels._flash_common import MAX_HEAD_DIM, autocast_dtype, check_inputs

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

# debug: fill outputs with NaN before the kernels run, so an unwritten element shows up
POISON_OUTPUTS = os.environ.get("SCALELAB_FLASH_POISON", "0") == "1"
# eager CUDA calls of FlashAttentionTriton go through the C++ autograd node of flash_native where it has a plan
NATIVE_NODE = os.environ.get("SCALELAB_FLASH_NATIVE", "1") == "1"


class _RecorderSlot(threading.local):
    """flash_native's recorder of the launches this thread makes, while it records a plan."""
    current = None


_RECORDER = _RecorderSlot()

# The eager CUDA path ahead of the Python Function, and what to call when pinned tiles change the launches:
# flash_native's C++ node and its plan reset, installed by `install_eager_path`; None: the Python Function only.
_eager_call: Callable[[Tensor, Tensor, Tensor, bool], Optional[Tensor]] | None = None
_eager_forget: Callable[[], None] | None = None


def install_eager_path(call: Callable[[Tensor, Tensor, Tensor, bool], Optional[Tensor]],
                       forget_plans: Callable[[], None]) -> None:
    """Route eager CUDA calls of `FlashAttentionTriton` through `call(q, k, v, is_causal)` first (it returns the
    output, or None for the Python Function); `forget_plans()` runs when `pin_configs` changes the tiles."""
    global _eager_call, _eager_forget
    _eager_call, _eager_forget = call, forget_plans


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

    # ------------------------------------------------------------------ forward
    @triton.jit
    def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                   offs_m, offs_n0, offs_d, lo, hi, n_k, causal_off, qk_scale,
                   MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k = _load_rows(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n, n_k, offs_d,
                           HEAD_DIM, BLOCK_D, MASKED)
            s = _mm(q, tl.trans(k))                                # (BLOCK_M, BLOCK_N), unscaled
            if MASKED:
                valid = offs_n[None, :] < n_k
                if IS_CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
                s = tl.where(valid, s, float("-inf"))
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
            v = _load_rows(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, n_k, offs_d,
                           HEAD_DIM, BLOCK_D, MASKED)
            acc = _mma(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _fwd_rows(Q, K, V, pid_zh, start_m, key_lo, key_hi,
                  stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                  n_heads, n_q, n_k, causal_off, qk_scale,
                  IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_LOOP: tl.constexpr = False):
        """Online softmax of the BLOCK_M query rows from start_m over the keys in [key_lo, key_hi) that they
        see (key_lo a multiple of BLOCK_N): (acc, m, l), unnormalised, base 2. Causal: key tiles above the
        diagonal are never visited; tiles wholly below it run without masks, the diagonal tiles and the
        ragged last tile with masks."""
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        k_base = K + off_z * stride_kz + off_h * stride_kh
        v_base = V + off_z * stride_vz + off_h * stride_vh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                       offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        n_full = (n_k // BLOCK_N) * BLOCK_N  # key tiles with no ragged end
        if IS_CAUSAL:
            # keys visible to the first row of the tile: j <= start_m + causal_off
            full_hi = (tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N
            full_hi = tl.minimum(full_hi, n_full)
            hi = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_off, 0), n_k)
        else:
            full_hi = n_full
            hi = n_k
        hi = tl.minimum(hi, key_hi)
        if ONE_LOOP:
            acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                       offs_m, offs_n0, offs_d, key_lo, hi, n_k, causal_off,
                                       qk_scale, True, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D)
            return acc, m_i, l_i
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                   offs_m, offs_n0, offs_d, key_lo, tl.minimum(full_hi, hi), n_k, causal_off,
                                   qk_scale, False, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                                   offs_m, offs_n0, offs_d, tl.maximum(full_hi, key_lo), hi, n_k, causal_off,
                                   qk_scale, True, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D)
        return acc, m_i, l_i

    @triton.jit
    def _store_output(O, LSE, pid_zh, n_heads, stride_oz, stride_oh, stride_om, offs_m, offs_d, n_q, acc, m_i, l_i,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """O = acc / l in O's dtype, and the natural-log logsumexp (-inf where a row saw no key), for the rows
        offs_m of batch x head pid_zh; (acc, m, l) unnormalised, base 2."""
        o_base = O + (pid_zh // n_heads).to(tl.int64) * stride_oz + (pid_zh % n_heads).to(tl.int64) * stride_oh
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
        _store_rows(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + pid_zh.to(tl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)

    @triton.jit
    def _store_partial(OP, LP, row, offs_d, rows_ok, acc, m_i, l_i, BLOCK_D: tl.constexpr):
        """One split's normalised fp32 partial output and base-2 logsumexp, at partial rows `row` (output 0 and
        logsumexp -inf for rows that saw none of the split's keys)."""
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(OP + row[:, None] * BLOCK_D + offs_d[None, :], acc / l_safe[:, None], mask=rows_ok[:, None])
        tl.store(LP + row, m_i + tl.math.log2(l_i), mask=rows_ok)

    # SEQ_CLASS is a tuning key only and n_heads only divides program ids: neither is specialized, so a
    # new sequence class or head count (1 vs 16) reuses the compiled kernel
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _fwd_kernel(Q, K, V, O, LSE,  # O is laid out like Q (same strides: fewer arguments per launch)
                    stride_qz, stride_qh, stride_qm,
                    stride_kz, stride_kh, stride_kn,
                    stride_vz, stride_vh, stride_vn,
                    n_heads, n_q, n_k, causal_off, qk_scale, SEQ_CLASS,
                    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_zh = tl.program_id(0)
        # heavy-first: the last query tiles (most keys under a causal mask) are launched first
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        acc, m_i, l_i = _fwd_rows(Q, K, V, pid_zh, start_m, 0, n_k,
                                  stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                  stride_vz, stride_vh, stride_vn, n_heads, n_q, n_k, causal_off, qk_scale,
                                  IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
        _store_output(O, LSE, pid_zh, n_heads, stride_qz, stride_qh, stride_qm, start_m + tl.arange(0, BLOCK_M),
                      tl.arange(0, BLOCK_D), n_q, acc, m_i, l_i, HEAD_DIM, BLOCK_D)

    # Split-KV forward for small grids (few batch x heads, few query tiles): the key range of every query
    # tile is cut into splits of `split_len` keys, one program per (query tile, split), each writing its
    # normalised partial output and base-2 logsumexp; `_fwd_merge_kernel` then combines them. The critical
    # path falls from all key tiles of the last query tile to one split's, when the grid alone would leave
    # most SMs idle. Same tiles and the same `_fwd_rows` as `_fwd_kernel`.
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _fwd_split_kernel(Q, K, V, OP, LP,  # OP: (Z*H, splits, N_q, BLOCK_D) fp32; LP: (Z*H, splits, N_q) fp32
                          stride_qz, stride_qh, stride_qm,
                          stride_kz, stride_kh, stride_kn,
                          stride_vz, stride_vh, stride_vn,
                          n_heads, n_q, n_k, causal_off, qk_scale, split_len, SEQ_CLASS,
                          IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_zh = tl.program_id(0)
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        split = tl.program_id(2)
        key_lo = split * split_len  # a multiple of BLOCK_N: the masked / unmasked split stays tile-aligned
        acc, m_i, l_i = _fwd_rows(Q, K, V, pid_zh, start_m, key_lo, key_lo + split_len,
                                  stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                  stride_vz, stride_vh, stride_vn, n_heads, n_q, n_k, causal_off, qk_scale,
                                  IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
        # a split this tile does not reach (or rows that see none of its keys): output 0, logsumexp -inf
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row = (pid_zh.to(tl.int64) * tl.num_programs(2) + split) * n_q + offs_m
        _store_partial(OP, LP, row, tl.arange(0, BLOCK_D), offs_m < n_q, acc, m_i, l_i, BLOCK_D)

    @triton.jit
    def _merge_step(acc, m_i, l_i, o_s, lse_s):
        """Fold one split's normalised partial output o_s and base-2 logsumexp lse_s into (acc, m, l)."""
        m_new = tl.maximum(m_i, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        w = tl.math.exp2(lse_s - m_use)
        return acc * alpha[:, None] + o_s * w[:, None], m_new, l_i * alpha + w

    @triton.jit
    def _fwd_merge_kernel(OP, LP, O, LSE, stride_oz, stride_oh, stride_om, n_heads, n_q, n_splits,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """out = sum_s 2^(lse_s - lse) out_s, lse = log2 sum_s 2^lse_s (stored as a natural log), over the splits
        of `_fwd_split_kernel`, with a running max so that no term overflows."""
        pid_zh = tl.program_id(0)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for split in range(0, n_splits):
            row = (pid_zh.to(tl.int64) * n_splits + split) * n_q + offs_m
            lse_s = tl.load(LP + row, mask=offs_m < n_q, other=float("-inf"))
            o_s = tl.load(OP + row[:, None] * BLOCK_D + offs_d[None, :], mask=offs_m[:, None] < n_q, other=0.0)
            acc, m_i, l_i = _merge_step(acc, m_i, l_i, o_s, lse_s)
        _store_output(O, LSE, pid_zh, n_heads, stride_oz, stride_oh, stride_om, offs_m, offs_d, n_q, acc, m_i, l_i,
                      HEAD_DIM, BLOCK_D)

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
                                n_heads, n_q, n_k, causal_off, qk_scale, split_len, SEQ_CLASS,
                                IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                                ONE_LOOP: tl.constexpr):
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
            acc, m_i, l_i = _fwd_rows(Q, K, V, pid_zh, start_m, key_lo, key_lo + split_len,
                                      stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                                      stride_vz, stride_vh, stride_vn, n_heads, n_q, n_k, causal_off, qk_scale,
                                      IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, ONE_LOOP)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            first_row = pid_zh.to(tl.int64) * SPLITS * n_q
            _store_partial(OP, LP, first_row + split * n_q + offs_m, offs_d, offs_m < n_q, acc, m_i, l_i, BLOCK_D)
            tl.debug_barrier()
            count = COUNTS + pid_zh * tl.num_programs(1) + tile
            if tl.atomic_add(count, 1, sem="acq_rel") == arrivals - 1:
                # all splits in order, this one's too (reloaded): the same sums as `_fwd_merge_kernel`,
                # whichever split arrives last, so the output does not depend on timing
                m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    # splits that did not arrive read as empty (a row bound, not a scalar mask: the
                    # interpreter's int1 broadcast)
                    rows_s = offs_m < tl.where(arrivals > s, n_q, 0)
                    row_s = first_row + s * n_q + offs_m
                    lse_s = tl.load(LP + row_s, mask=rows_s, other=float("-inf"), cache_modifier=".cg")
                    o_s = tl.load(OP + row_s[:, None] * BLOCK_D + offs_d[None, :], mask=rows_s[:, None],
                                  other=0.0, cache_modifier=".cg")
                    acc, m_run, l_run = _merge_step(acc, m_run, l_run, o_s, lse_s)
                _store_output(O, LSE, pid_zh, n_heads, stride_qz, stride_qh, stride_qm, offs_m, offs_d, n_q, acc,
                              m_run, l_run, HEAD_DIM, BLOCK_D)
                tl.store(count, 0)  # every split of this launch has arrived: ready for the next launch

    # ----------------------------------------------------------------- backward
    @triton.jit
    def _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                      offs_m, offs_n0, offs_d, lo, hi, n_k, causal_off, qk_scale,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k = _load_rows(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n, n_k, offs_d,
                           HEAD_DIM, BLOCK_D, MASKED)
            v = _load_rows(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, n_k, offs_d,
                           HEAD_DIM, BLOCK_D, MASKED)
            s = _mm(q, tl.trans(k)) * qk_scale
            if BLOCK_D <= 64:
                # dP issued before the exponentials, which ptxas then schedules while it runs on the tensor
                # cores (3% faster on an H100 at d = 64; at d = 128 the extra live tile spills: 3-8% slower)
                dp = _mm(do, tl.trans(v))
            if MASKED:
                valid = offs_n[None, :] < n_k
                if IS_CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
                s = tl.where(valid, s, float("-inf"))
            p = tl.math.exp2(s - lse2[:, None])
            if BLOCK_D > 64:
                dp = _mm(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq = _mma(ds.to(k.dtype), k, dq)
        return dq

    @triton.jit
    def _bwd_dq_tile(Q, K, V, O, DO, DQ, LSE, STATS, pid_zh, off_z, off_h, start_m,
                     stride_qz, stride_qh, stride_qm,
                     stride_kz, stride_kh, stride_kn,
                     stride_vz, stride_vh, stride_vn,
                     stride_oz, stride_oh, stride_om,
                     stride_doz, stride_doh, stride_dom,
                     stride_dqz, stride_dqh, stride_dqm,
                     n_q, n_k, causal_off, qk_scale, sm_scale,
                     IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_STATS: tl.constexpr):
        """dQ of the BLOCK_M query rows from start_m: one walk over the key tiles they see.

        delta = rowsum(dO * O) of these rows is computed here from the O and dO tiles; with STORE_STATS
        it is stored for the dK/dV pass with the base-2 logsumexp (+inf for rows that see no key, which
        that pass would otherwise rederive for every tile it visits): STATS[row] = (lse2, delta)."""
        k_base = K + off_z * stride_kz + off_h * stride_kh
        v_base = V + off_z * stride_vz + off_h * stride_vh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                       offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(DO + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                        + offs_d[None, :], offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
        o = _load_rows(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                       offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)          # D_i = rowsum(dO * O)
        row = pid_zh.to(tl.int64) * n_q + offs_m
        lse = tl.load(LSE + row, mask=offs_m < n_q, other=float("inf"))
        lse2 = _lse_to_base2(lse)
        if STORE_STATS:
            _store_stats(STATS, row, lse2, delta, offs_m < n_q)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        n_full = (n_k // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            full_hi = (tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N
            full_hi = tl.minimum(full_hi, n_full)
            hi = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_off, 0), n_k)
        else:
            full_hi = n_full
            hi = n_k
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n0, offs_d, 0, full_hi, n_k, causal_off, qk_scale,
                           False, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n0, offs_d, full_hi, hi, n_k, causal_off, qk_scale,
                           True, IS_CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D)
        dq = dq * sm_scale
        _store_rows(DQ + off_z * stride_dqz + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
                    dq.to(DQ.dtype.element_ty), offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)

    # SEQ_CLASS is a tuning key only and n_heads only divides program ids: neither is specialized, so a
    # new sequence class or head count (1 vs 16) reuses the compiled kernel
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _bwd_dq_kernel(Q, K, V, O, DO, DQ, LSE, STATS,  # O and DQ are laid out like Q; STATS (Z*H, N_q, 2)
                       stride_qz, stride_qh, stride_qm,
                       stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn,
                       stride_doz, stride_doh, stride_dom,
                       n_heads, n_q, n_k, causal_off, qk_scale, sm_scale, SEQ_CLASS,
                       IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_zh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        _bwd_dq_tile(Q, K, V, O, DO, DQ, LSE, STATS, pid_zh, off_z, off_h, pid_m * BLOCK_M,
                     stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                     stride_vz, stride_vh, stride_vn, stride_qz, stride_qh, stride_qm,
                     stride_doz, stride_doh, stride_dom, stride_qz, stride_qh, stride_qm,
                     n_q, n_k, causal_off, qk_scale, sm_scale,
                     IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True)

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, o_base, stride_qm, stride_dom, stride_om,
                        stats_base, dq_base, stride_dqm, sm_scale,
                        offs_n, offs_m0, offs_d, lo, hi, n_q, causal_off, qk_scale,
                        MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                        DELTA_FROM_O: tl.constexpr, dq_desc, DQ_TMA: tl.constexpr):
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            q = _load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, n_q, offs_d,
                           HEAD_DIM, BLOCK_D, MASKED)
            do = _load_rows(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], offs_m, n_q, offs_d,
                            HEAD_DIM, BLOCK_D, MASKED)
            if DELTA_FROM_O:
                # fused backward: stats_base is the natural-log logsumexp, and delta = rowsum(dO * O) of
                # this query tile is recomputed from its O tile (one more tile load per step instead of a
                # preprocessing launch); rows >= n_q give 0
                if MASKED:
                    lse = tl.load(stats_base + offs_m, mask=offs_m < n_q, other=float("inf"))
                else:
                    lse = tl.load(stats_base + offs_m)
                lse2 = _lse_to_base2(lse)
                o = _load_rows(o_base + offs_m[:, None] * stride_om + offs_d[None, :], offs_m, n_q, offs_d,
                               HEAD_DIM, BLOCK_D, MASKED)
                delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
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
            s_t = _mm(k, tl.trans(q)) * qk_scale                   # (BLOCK_N, BLOCK_M) = S^T
            if BLOCK_D <= 64:  # dP^T overlaps the exponentials (as in the dQ pass)
                dp_t = _mm(v, tl.trans(do))
            if MASKED:
                valid = offs_m[None, :] < n_q
                if IS_CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_off)
                s_t = tl.where(valid, s_t, float("-inf"))
            p_t = tl.math.exp2(s_t - lse2[None, :])
            dv = _mma(p_t.to(do.dtype), do, dv)
            if BLOCK_D > 64:
                dp_t = _mm(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            dk = _mma(ds_t.to(q.dtype), q, dk)
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
        return dk, dv

    @triton.jit
    def _bwd_dkdv_tile(Q, K, V, O, DO, DK, DV, STATS, DQ_ACC, pid_zh, off_z, off_h, start_n,
                       stride_qz, stride_qh, stride_qm,
                       stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn,
                       stride_oz, stride_oh, stride_om,
                       stride_doz, stride_doh, stride_dom,
                       stride_dkz, stride_dkh, stride_dkn,
                       stride_dvz, stride_dvh, stride_dvn,
                       n_q, n_k, causal_off, qk_scale, sm_scale,
                       IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
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
        else:
            dq_desc = dq_base  # unused
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        k = _load_rows(K + off_z * stride_kz + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                       offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
        v = _load_rows(V + off_z * stride_vz + off_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                       offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

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
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, o_base, stride_qm, stride_dom, stride_om,
                                 stats_base, dq_base, HEAD_DIM, sm_scale,
                                 offs_n, offs_m0, offs_d, lo, full_lo, n_q, causal_off, qk_scale,
                                 True, IS_CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, ATOMIC_DQ, DELTA_FROM_O, dq_desc, DQ_TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, o_base, stride_qm, stride_dom, stride_om,
                                 stats_base, dq_base, HEAD_DIM, sm_scale,
                                 offs_n, offs_m0, offs_d, full_lo, m_full, n_q, causal_off, qk_scale,
                                 False, IS_CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, ATOMIC_DQ, DELTA_FROM_O, dq_desc, DQ_TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, o_base, stride_qm, stride_dom, stride_om,
                                 stats_base, dq_base, HEAD_DIM, sm_scale,
                                 offs_n, offs_m0, offs_d, tl.maximum(full_lo, m_full), m_pad, n_q, causal_off,
                                 qk_scale, True, IS_CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, ATOMIC_DQ, DELTA_FROM_O,
                                 dq_desc, DQ_TMA)
        dk = dk * sm_scale
        _store_rows(DK + off_z * stride_dkz + off_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
                    dk.to(DK.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
        _store_rows(DV + off_z * stride_dvz + off_h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
                    dv.to(DV.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)

    # SEQ_CLASS is a tuning key only and n_heads only divides program ids: neither is specialized, so a
    # new sequence class or head count (1 vs 16) reuses the compiled kernel
    @triton.jit(do_not_specialize=["n_heads", "SEQ_CLASS"])
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, STATS, DQ_ACC,  # DK, DV are laid out like K, V
                         stride_qz, stride_qh, stride_qm,
                         stride_kz, stride_kh, stride_kn,
                         stride_vz, stride_vh, stride_vn,
                         stride_doz, stride_doh, stride_dom,
                         n_heads, n_q, n_k, causal_off, qk_scale, sm_scale, SEQ_CLASS,
                         IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                         DQ_TMA: tl.constexpr):
        pid_zh = tl.program_id(0)
        pid_n = tl.program_id(1)  # causal: early key tiles are seen by the most queries: first
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        # the (base-2 logsumexp, delta) pairs come from the first backward launch (STATS); O is not read
        # (STATS stands in for it, zero strides)
        _bwd_dkdv_tile(Q, K, V, STATS, DO, DK, DV, STATS, DQ_ACC, pid_zh, off_z, off_h, pid_n * BLOCK_N,
                       stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn, 0, 0, 0,
                       stride_doz, stride_doh, stride_dom, stride_kz, stride_kh, stride_kn,
                       stride_vz, stride_vh, stride_vn,
                       n_q, n_k, causal_off, qk_scale, sm_scale,
                       IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, ATOMIC_DQ, False, DQ_TMA)

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
    def _bwd_fused_kernel(Q, K, V, O, DO, DQ, DK, DV, LSE,  # O, DQ laid out like Q; DK like K; DV like V
                          stride_qz, stride_qh, stride_qm,
                          stride_kz, stride_kh, stride_kn,
                          stride_vz, stride_vh, stride_vn,
                          stride_doz, stride_doh, stride_dom,
                          n_heads, n_q, n_k, causal_off, qk_scale, sm_scale, SEQ_CLASS,
                          IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        pid_zh = tl.program_id(1)
        off_z = (pid_zh // n_heads).to(tl.int64)
        off_h = (pid_zh % n_heads).to(tl.int64)
        start_n = pid * BLOCK_N
        if start_n < n_k:  # (a) key tile pid (natural-log LSE as its STATS); LSE stands in for the unused DQ_ACC
            _bwd_dkdv_tile(Q, K, V, O, DO, DK, DV, LSE, LSE, pid_zh, off_z, off_h, start_n,
                           stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                           stride_vz, stride_vh, stride_vn, stride_qz, stride_qh, stride_qm,
                           stride_doz, stride_doh, stride_dom, stride_kz, stride_kh, stride_kn,
                           stride_vz, stride_vh, stride_vn,
                           n_q, n_k, causal_off, qk_scale, sm_scale,
                           IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, True, False)
        start_m = pid * BLOCK_M
        if start_m < n_q:  # (b) query tile pid (its delta computed in place, not stored)
            _bwd_dq_tile(Q, K, V, O, DO, DQ, LSE, LSE, pid_zh, off_z, off_h, start_m,
                         stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                         stride_vz, stride_vh, stride_vn, stride_qz, stride_qh, stride_qm,
                         stride_doz, stride_doh, stride_dom, stride_qz, stride_qh, stride_qm,
                         n_q, n_k, causal_off, qk_scale, sm_scale,
                         IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False)

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

    # --------------------------------------------------------------- autotuning
    def _cfg(bm, bn, warps, stages):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)

    # short lists: a new (head dim, dtype, causal, seq class) key costs one compile per config
    # 32-row / 32-key tiles double the programs when batch x heads is small and the grid does not fill the
    # SMs; 64x128 (128-key tiles) halves the key steps on the critical path of long rows on small grids, and
    # loses where the grid is already full (the autotuner picks per sequence class)
    _FWD_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3),
                    _cfg(64, 128, 4, 3)]
    _DQ_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3), _cfg(64, 32, 4, 2)]
    _DKDV_CONFIGS = [_cfg(32, 128, 8, 2), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(32, 64, 4, 2)]
    # atomic dQ: every (key tile, query tile) pair adds a BLOCK_M x d fp32 tile into dQ, so 128-key tiles
    # halve the reduction traffic of 64-key ones
    _DKDV_ATOMIC_CONFIGS = [_cfg(64, 128, 8, 2), _cfg(32, 128, 4, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 2)]
    # fused backward: square tiles only (program i owns key tile i and query tile i: equal sizes keep
    # the causal work per program constant); 32x32 doubles the programs when batch x heads is small.
    # No 128x128: compiled offline for sm_90 (Triton 3.9) it spills at d=64 already (255 registers +
    # 432 B stack); 64x64 uses 227-254 registers at d=64, spills a little at d=128 (as the two-pass
    # dK/dV kernel's 64x64 does), 32x32 130-203. Not yet timed on the GPU.
    _FUSED_CONFIGS = [_cfg(64, 64, 4, 3), _cfg(64, 64, 8, 2), _cfg(32, 32, 4, 3), _cfg(32, 32, 4, 2)]

    def _prune(configs, named_args, **kwargs):
        """Drop tiles that cannot fit (fp32 / d=128 at large tiles, 256-wide tiles past 32 x 64) or that dwarf
        the sequence; where nothing is left, a 32 x 32 tile in one stage, which fits at every head dim."""
        d = named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs.get("BLOCK_D", 64)
        fp32 = named_args["Q"].dtype == torch.float32
        n_min = min(named_args["n_q"], named_args["n_k"])
        kept = []
        for c in configs:
            bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
            if (fp32 or d >= 128) and bm * bn > 128 * 64:
                continue
            if fp32 and d >= 128 and c.num_stages > 2:
                continue
            if d >= 256 and (bm * bn > (32 * 32 if fp32 else 32 * 64) or c.num_stages > 2):
                continue
            if n_min <= 256 and bm * bn > 64 * 64:
                continue
            kept.append(c)
        return kept or [_cfg(32, 32, 4, 1)]

    if os.environ.get("SCALELAB_FLASH_WIDE_TUNE", "0") == "1":  # exploration only: many more compiles
        _FWD_CONFIGS += [_cfg(128, 128, 8, 4), _cfg(128, 32, 4, 4), _cfg(128, 128, 8, 2), _cfg(128, 64, 4, 4)]
        _DQ_CONFIGS += [_cfg(128, 128, 8, 2), _cfg(128, 64, 4, 3), _cfg(128, 32, 4, 3), _cfg(64, 64, 4, 4),
                        _cfg(128, 64, 8, 4)]
        _DKDV_CONFIGS += [_cfg(32, 128, 4, 3), _cfg(64, 128, 4, 3), _cfg(128, 128, 8, 2), _cfg(64, 64, 8, 3),
                          _cfg(32, 128, 8, 3), _cfg(64, 128, 8, 4)]
        _FUSED_CONFIGS += [_cfg(32, 32, 2, 2), _cfg(64, 64, 4, 2), _cfg(64, 64, 8, 3), _cfg(128, 128, 8, 2)]

    def _tune_bench(fn, quantiles=None):
        """Short timings for the autotuner: a first call over all configs stays within seconds."""
        return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)

    def _autotune(configs, kernel, reset_to_zero=None):
        kw = dict(key=["SEQ_CLASS", "IS_CAUSAL", "HEAD_DIM", "BLOCK_D"],
                  prune_configs_by={"early_config_prune": _prune}, reset_to_zero=reset_to_zero)
        try:
            return triton.autotune(configs, do_bench=_tune_bench, **kw)(kernel)
        except TypeError:  # a Triton without the do_bench argument
            return triton.autotune(configs, warmup=5, rep=25, **kw)(kernel)

    _fwd_tuned = _autotune(_FWD_CONFIGS, _fwd_kernel)
    _dq_tuned = _autotune(_DQ_CONFIGS, _bwd_dq_kernel)
    _dkdv_tuned = _autotune(_DKDV_CONFIGS, _bwd_dkdv_kernel)
    # its own tuner (own cache): atomics make every timed trial add into dQ, so the buffer is re-zeroed
    _dkdv_atomic_tuned = _autotune(_DKDV_ATOMIC_CONFIGS, _bwd_dkdv_kernel, reset_to_zero=["DQ_ACC"])
    # every trial overwrites all of dQ, dK, dV (no accumulation across launches): nothing to reset
    _fused_tuned = _autotune(_FUSED_CONFIGS, _bwd_fused_kernel)


def tuned_configs() -> dict[tuple, tuple[int, int, int, int]]:
    """The autotuner's choices so far: (kernel, seq class, causal, d, dtype) -> (BM, BN, warps, stages)."""
    return dict(_CHOSEN)


# Fixed tiles under TRITON_INTERPRET=1 (the CPU interpreter: autotuning would only cost time);
# pin_configs() fixes them on the GPU for experiments (the benchmark's flash_triton@... variants).
# ("fused": BLOCK_M != BLOCK_N on purpose, so the CPU tests cover unequal query / key tile counts and
# the fused kernel's skipped phases.)
_INTERPRET_TILES = {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 32), "fused": (32, 16)}
_PINNED: dict[str, tuple[int, int, int, int]] = {}


def pin_configs(fwd=None, dq=None, dkdv=None, fused=None) -> None:
    """Bypass autotuning with fixed (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) per kernel (benchmarks).

    `dkdv` pins both the two-pass and the atomic-dQ dK/dV kernel; `fused` the fused backward kernel."""
    _PINNED.clear()
    for name, c in (("fwd", fwd), ("dq", dq), ("dkdv", dkdv), ("fused", fused)):
        if c is not None:
            _PINNED[name] = tuple(c)
    if _eager_forget is not None:  # the C++ node's plans hold the tiles they were recorded with
        _eager_forget()


def _seq_class(n: int, zh: int = 1 << 30) -> int:
    """Autotuning bucket: sequence length <=256, <=1024, <=4096, longer (0-3), plus 4 when the
    grid is small (batch x heads x 64-row tiles < 264, two per H100 SM), where smaller tiles win."""
    c = 0 if n <= 256 else 1 if n <= 1024 else 2 if n <= 4096 else 3
    return c + 4 if zh * ((n + 63) >> 6) < 264 else c


# Host-side helpers in plain Python: `triton.cdiv` / `triton.next_power_of_2` are
# `constexpr_function` wrappers costing ~2.5 us per call from the host (5 calls per fwd+bwd).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# the tile width for a head dim: the next power of two from 16 (tl.dot's smallest K); columns past the head dim are
# masked on load and store
_BLOCK_D = {d: max(16, 1 << (d - 1).bit_length()) for d in range(1, MAX_HEAD_DIM + 1)}


_CHOSEN: dict[tuple, tuple[int, int, int, int]] = {}  # autotuner's pick per key, launched directly


_MAX_GRID_Y = 65535  # CUDA's limit on grid dims 1 and 2


def _grid(kind: str, zh: int, n_rows: int, n_k: int, bm: int, bn: int) -> tuple[int, int]:
    """fwd / dq: (batch x heads, query tiles); dkdv: (batch x heads, key tiles); fused: (tiles, batch x heads)
    with tiles = max(query tiles, key tiles), so that both phases cover their tiles (grid dim 1 caps
    batch x heads at _MAX_GRID_Y there: flash_bwd_impl runs the two-pass backward beyond it)."""
    if kind == "fused":
        return (max(_cdiv(n_rows, bm), _cdiv(n_k, bn)), zh)
    return (zh, _cdiv(n_rows, bn if kind == "dkdv" else bm))


def _launch(name: str, tuned, raw, zh: int, n_rows: int, args: tuple,
            is_causal: bool, d: int, block_d: int, seq_class: int, dtype, n_k: int = 0, **constexprs) -> None:
    """Launch with pinned tiles, the interpreter's tiles, or the autotuner's choice for this key.

    After the first call for a key the raw kernel is launched with the chosen config: that skips
    the autotuner's per-call bookkeeping, which matters at short sequences (launch-bound).
    n_rows: query rows (fwd, dq, fused) or keys (dkdv); n_k: keys, read by the fused grid only.
    """
    kind = "dkdv" if name.startswith("dkdv") else name
    if _PINNED and kind in _PINNED:
        cfg = _PINNED[kind]
    elif INTERPRET:
        cfg = (*_INTERPRET_TILES[kind], 4, 1)
    else:
        key = (name, seq_class, is_causal, d, dtype)
        cfg = _CHOSEN.get(key)
        if cfg is None:
            if _RECORDER.current is not None:
                _RECORDER.current.unreplayable("autotuning", retry=True)
            def grid(meta):
                return _grid(kind, zh, n_rows, n_k, meta["BLOCK_M"], meta["BLOCK_N"])
            tuned[grid](*args, IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d, **constexprs)
            best = tuned.best_config
            _CHOSEN[key] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
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
# on its constexprs and options, on the value class of each integer (1, multiple of 16, int32 or int64) and
# on each pointer's dtype and 16-byte alignment; the key holds the integers' values themselves and each
# pointer's dtype and alignment, so a hit launches the kernel JITFunction.run would have picked.
FAST_LAUNCH = True
_LAUNCHERS: dict[tuple, tuple] = {}
_N_TENSOR_ARGS = {"fwd": 5, "dq": 8, "dkdv": 8, "fused": 9}  # leading pointer arguments of each kernel
_MAX_LAUNCHERS = 1024  # distinct shapes / layouts kept; the cache restarts beyond that


_current_device = torch.cuda.current_device
if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # what Triton itself calls: no Stream object built
    _current_stream = torch._C._cuda_getCurrentRawStream
else:
    def _current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def _run(raw, grid: tuple, args: tuple, n_tensors: int, **meta) -> None:
    """`raw[grid](*args, **meta)`; the first n_tensors arguments are tensors, the rest Python scalars."""
    global FAST_LAUNCH
    recorder = _RECORDER.current
    if not FAST_LAUNCH or INTERPRET:
        if recorder is not None:
            recorder.unreplayable("launched through JITFunction.run")
        raw.run(*args, grid=grid, warmup=False, **meta)
        return
    # every pointer's dtype and alignment (the split-KV merge takes fp32 partials and writes O in the inputs'
    # dtype: one dtype per launch would confuse its fp32 and bf16 variants)
    pointers = tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in args[:n_tensors]])
    device = _current_device()  # where JITFunction.run launches too
    key = (raw, device, pointers, args[n_tensors:], *meta.values())
    hit = _LAUNCHERS.get(key)
    if hit is None:
        kernel = raw.run(*args, grid=grid, warmup=False, **meta)  # compiles, or finds the compiled kernel
        if len(_LAUNCHERS) >= _MAX_LAUNCHERS:
            _LAUNCHERS.clear()
        # the launcher takes every kernel parameter, constexprs included (after the runtime ones here)
        constexprs = tuple(meta[name] for name in raw.arg_names[len(args):])
        _LAUNCHERS[key] = (kernel, constexprs)
        if recorder is not None:
            recorder.launch(kernel, grid, args + constexprs)
        return
    kernel, constexprs = hit
    full = args + constexprs
    if recorder is not None:
        recorder.launch(kernel, grid, full)
    stream = _current_stream(device)
    try:
        enter, leave = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
        kernel.run(grid[0], grid[1], grid[2] if len(grid) > 2 else 1, stream, kernel.function,
                   kernel.packed_metadata, kernel.launch_metadata(grid, stream, *full), enter, leave, *full)
    except (TypeError, AttributeError):  # another Triton's launcher or knobs: back to JITFunction.run for good
        FAST_LAUNCH = False
        if recorder is not None:
            recorder.unreplayable("launched through JITFunction.run")
        raw.run(*args, grid=grid, warmup=False, **meta)


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
    if INTERPRET or device.type != "cuda":
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


def _check_runtime(q: Tensor) -> None:
    if not HAVE_TRITON:
        raise ConfigError("attention_impl.kernel", "Triton is not installed",
                          "pip install triton, or use attention_impl=flash_torch")
    if not INTERPRET and not q.is_cuda:
        raise ConfigError("attention_impl.kernel", f"flash_triton got {q.device.type} tensors and Triton "
                          "runs on CUDA only", "move the model to a GPU, set TRITON_INTERPRET=1 before "
                          "importing triton (slow), or use attention_impl=flash_torch")


def _alloc_like(x: Tensor, dtype=None) -> Tensor:
    if POISON_OUTPUTS:
        return torch.full_like(x, float("nan"), dtype=dtype)
    return torch.empty_like(x, dtype=dtype)


def _operand_and_output(x: Tensor) -> tuple[Tensor, Tensor]:
    """(operand, output) that share one layout: the kernels address an output (O, dQ, dK, dV) with its operand's
    strides. `empty_like` keeps the strides of a dense operand only; a view with gaps (q, k, v sliced from a fused
    qkv projection) or one that overlaps itself (an expanded GQA key) gets dense strides of its own, so such an
    operand is copied to those same strides first (not to `.contiguous()`, whose layout can differ again)."""
    out = _alloc_like(x)
    if out.stride() != x.stride():
        x = torch.empty_like(out).copy_(x)
    return x, out


# Split-KV forward on small grids: `_fwd_split_merge_kernel` (the last split of a query tile merges), or with
# FWD_MERGE_IN_KERNEL off `_fwd_split_kernel` + `_fwd_merge_kernel` (two launches; the A/B baseline). FWD_SPLIT
# switches splitting off; FWD_SPLIT_KEYS forces a split length in keys (tests: the interpreter never splits).
FWD_SPLIT = True
FWD_SPLIT_KEYS: int | None = None
FWD_MERGE_IN_KERNEL = True
# the autotuner's pick for the one-kernel forward at S <= 4096, B = H = 1 on an H100
_SPLIT_TILES = (64, 64, 4, 3)
# rows of fewer than 32 key tiles (S = 1024): 32-row query tiles, twice the programs, and each split's keys in
# one masked loop rather than an unmasked and a masked one (one pipeline start-up, not two); the 64-row tiles
# spill registers at d = 128
_SHORT_SPLIT_TILES = (32, 64, 4, 3)
SHORT_ROW_TILES = 32
# more splits cost more in the merge (fp32 partial rows) than they gain in parallelism
MAX_FWD_SPLITS = 4


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
        # outside any TorchDispatchMode (flash_native's recorder): the buffers outlive the call
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
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _fwd_split_len(device: torch.device, zh: int, n_q: int, n_k: int, bm: int, bn: int) -> int:
    """Keys per split for the split-KV forward (a multiple of bn), or 0 for the one-kernel forward.

    Splits only when the one-kernel grid (batch x heads x query tiles) has fewer programs than the GPU has
    SMs and rows span at least 32 key tiles; then about two programs per SM, each with 4 key tiles or more,
    in at most MAX_FWD_SPLITS splits. Why: on a grid that leaves SMs idle a query tile's whole row is the
    critical path, and splitting it costs one merge of fp32 partial rows. Measured on an H100 at B = H = 1, the
    split pays from S = 2048 on every head dim, and at S = 1024 (16-31 key tiles) only on the tiniest grids
    (at most a quarter as many programs as SMs, B x H <= 2), once the C++ node made a launch cost about 2 µs of
    host time; more than 4 splits lost to the merge's extra traffic (docs/attention.md, dispatch policy)."""
    if FWD_SPLIT_KEYS is not None:
        return _cdiv(FWD_SPLIT_KEYS, bn) * bn
    if not FWD_SPLIT or INTERPRET:
        return 0
    programs, k_tiles = zh * _cdiv(n_q, bm), _cdiv(n_k, bn)
    sms = _sm_count(device)
    # rows of 16-31 key tiles split only on the tiniest grids, where it was measured (B = H = 1, S = 1024)
    if programs >= sms or k_tiles < (16 if 4 * programs <= sms else 32):
        return 0
    splits = min(k_tiles // 4, _cdiv(2 * sms, programs), MAX_FWD_SPLITS)
    return _cdiv(k_tiles, splits) * bn if splits >= 2 else 0


def flash_fwd_impl(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    """Forward on 4-D (Z, H, N, d) inputs with unit last stride: (out like q, lse (Z, H, N_q) fp32)."""
    _check_runtime(q)
    z, h, n_q, d = q.shape
    n_k = k.shape[2]
    q, o = _operand_and_output(q)
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    lse = torch.full((z, h, n_q), float("nan"), device=q.device, dtype=torch.float32) if POISON_OUTPUTS \
        else torch.empty((z, h, n_q), device=q.device, dtype=torch.float32)
    causal_off = n_k - n_q if is_causal else 0
    seq_class = _seq_class(max(n_q, n_k), z * h)
    bm, bn, warps, stages = _PINNED.get("fwd") or ((32, 16, 4, 1) if INTERPRET else _SPLIT_TILES)
    # the split forward's fixed tiles are sized for head dims up to 128
    split_len = _fwd_split_len(q.device, z * h, n_q, n_k, bm, bn) if _BLOCK_D[d] <= 128 else 0
    if split_len:  # small grid: split-KV
        short = _cdiv(n_k, bn) < SHORT_ROW_TILES
        if short and "fwd" not in _PINNED and not INTERPRET:
            bm, bn, warps, stages = _SHORT_SPLIT_TILES
        splits = _cdiv(n_k, split_len)
        block_d = _BLOCK_D[d]
        o_part = torch.empty((z * h, splits, n_q, block_d), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((z * h, splits, n_q), device=q.device, dtype=torch.float32)
        if FWD_MERGE_IN_KERNEL:
            n_counts = z * h * _cdiv(n_q, bm)  # one per query tile
            arrivals = _ARRIVALS.get(q.device, n_counts)
            if _RECORDER.current is not None:
                _RECORDER.current.arrival_counts(arrivals, n_counts)
            _run(_fwd_split_merge_kernel, (z * h, _cdiv(n_q, bm), splits),
                 (q, k, v, o, lse, o_part, lse_part, arrivals, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
                  sv[0], sv[1], sv[2], h, n_q, n_k, causal_off, LOG2E / math.sqrt(d), split_len, seq_class), 8,
                 IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, SPLITS=splits,
                 ONE_LOOP=short, num_warps=warps, num_stages=stages)
            return o, lse
        _run(_fwd_split_kernel, (z * h, _cdiv(n_q, bm), splits),
             (q, k, v, o_part, lse_part, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
              h, n_q, n_k, causal_off, LOG2E / math.sqrt(d), split_len, seq_class), 5,
             IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
             num_warps=warps, num_stages=stages)
        # 32-row merge tiles: 96 registers at d = 128 (64 rows: 230), and twice the programs on a small grid
        _run(_fwd_merge_kernel, (z * h, _cdiv(n_q, 32)),
             (o_part, lse_part, o, lse, sq[0], sq[1], sq[2], h, n_q, splits), 4,
             HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=32)
        return o, lse
    args = (q, k, v, o, lse, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
            h, n_q, n_k, causal_off, LOG2E / math.sqrt(d), seq_class)
    _launch("fwd", _fwd_tuned if not INTERPRET else None, _fwd_kernel, z * h, n_q, args,
            is_causal, d, _BLOCK_D[d], seq_class, q.dtype)
    return o, lse


# Backward variants (the int `bwd_variant` of flash_bwd_impl and of the op `scalelab::flash_attn_bwd`;
# 0 and 1 are what the op's former `bool atomic_dq` passed, so old callers keep their meaning).
BWD_TWO_PASS, BWD_ATOMIC_DQ, BWD_FUSED = 0, 1, 2
_BWD_NAMES = {"two_pass": BWD_TWO_PASS, "atomic_dq": BWD_ATOMIC_DQ, "fused": BWD_FUSED}


def _bwd_code(variant) -> int:
    """0/1/2, a name from _BWD_NAMES, or a bool (the old atomic_dq flag: True = atomic dQ)."""
    code = _BWD_NAMES.get(variant, -1) if isinstance(variant, str) else int(variant)
    if code not in (BWD_TWO_PASS, BWD_ATOMIC_DQ, BWD_FUSED):
        raise ConfigError("flash_triton bwd_variant", f"unknown backward variant {variant!r}",
                          "use 0 / 'two_pass', 1 / 'atomic_dq' or 2 / 'fused'")
    return code


def _use_fused(zh: int, n_q: int, n_k: int, d: int, dtype) -> bool:
    """Policy for `FlashAttentionTriton`'s default backward: True sends it to the fused one-launch kernel.

    Measured on the H100 (B = H = 1, bf16, causal): the fused backward beat the
    two-pass one wherever the grid was small, d = 64 up to 256 64-row tiles (S = 16384: 0.340 vs 0.404 ms)
    and d = 128 up to 128 tiles (S = 8192: 0.293 vs 0.406 ms), and lost where it was large: d = 128 at 256
    tiles (0.774 vs 0.500 ms; its 64x64 tiles spill registers at d = 128) and the leaderboard shape, 4096
    tiles (4.50 vs 3.80 ms), where the two-pass grid already fills the GPU. So: fused only up to the
    measured tile counts. `FlashAttentionTritonFusedBwd` / `FlashAttentionTritonAtomicDQ` ignore this."""
    tiles = zh * _cdiv(max(n_q, n_k), 64)
    return tiles <= (256 if d <= 64 else 128)


def flash_bwd_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   is_causal: bool, bwd_variant: int | str = BWD_TWO_PASS) -> tuple[Tensor, Tensor, Tensor]:
    """Backward on 4-D inputs: dq, dk, dv shaped and strided like q, k, v.

    bwd_variant 0 / "two_pass": two passes (dQ kernel, then dK/dV kernel), 7 tile matmuls, no atomics.
    1 / "atomic_dq" (or True, the old atomic_dq flag): one dK/dV pass that also adds each key tile's
    dS K into an fp32 dQ buffer (5 matmuls; a small kernel computes rowsum(dO * O) first): one TMA bulk
    reduction per tile on sm_90+, per-element atomics elsewhere; dQ is cast from the buffer.
    2 / "fused": one kernel, program i doing dK/dV of key tile i and dQ of query tile i (7 matmuls,
    delta recomputed from O in place, no atomics, one launch, critical path ~n tile steps, not ~2n)."""
    _check_runtime(q)
    variant = _bwd_code(bwd_variant)
    if do.stride(-1) != 1:
        do = do.contiguous()
    z, h, n_q, d = q.shape
    n_k = k.shape[2]
    if variant == BWD_FUSED and z * h > _MAX_GRID_Y:  # the fused grid's dim 1 is batch x heads
        variant = BWD_TWO_PASS
    # the kernels address O and dQ with Q's strides, dK with K's and dV with V's (fewer launch arguments)
    q, dq = _operand_and_output(q)
    k, dk = _operand_and_output(k)
    v, dv = _operand_and_output(v)
    if o.stride() != q.stride():  # O saved by a forward on another layout of q
        o = torch.empty_like(q).copy_(o)
    sq, sk, sv, sdo = q.stride(), k.stride(), v.stride(), do.stride()
    block_d = _BLOCK_D[d]
    causal_off = n_k - n_q if is_causal else 0
    sm_scale = 1.0 / math.sqrt(d)
    seq_class = _seq_class(max(n_q, n_k), z * h)
    if variant == BWD_FUSED:  # one launch, no delta buffer
        args = (q, k, v, o, do, dq, dk, dv, lse,
                sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
                h, n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale, seq_class)
        _launch("fused", _fused_tuned if not INTERPRET else None, _bwd_fused_kernel, z * h, n_q, args,
                is_causal, d, block_d, seq_class, q.dtype, n_k=n_k)
        return dq, dk, dv
    atomic_dq = variant == BWD_ATOMIC_DQ
    dq_tma = atomic_dq and _has_tma(q.device) and d % 4 == 0  # TMA: 16-byte rows of the fp32 dQ buffer
    if dq_tma:
        _ensure_scratch_allocator()
    # per row, (base-2 logsumexp, delta = rowsum(dO * O)), written by the first launch for the dK/dV pass
    stats = torch.empty((z, h, n_q, 2), device=q.device, dtype=torch.float32)
    if atomic_dq:  # the row stats first; the dK/dV pass then adds dS K into an fp32 buffer
        dq_acc = torch.empty((z, h, n_q, d), device=q.device, dtype=torch.float32)  # zeroed by the delta kernel
        _run(_bwd_delta_kernel, (z * h, _cdiv(n_q, 64)),
             (o, do, lse, stats, dq_acc, sq[0], sq[1], sq[2], sdo[0], sdo[1], sdo[2], h, n_q), 5,
             HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=64)
    else:  # the dQ pass (it also computes and stores the row stats)
        dq_args = (q, k, v, o, do, dq, lse, stats,
                   sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
                   h, n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale, seq_class)
        _launch("dq", _dq_tuned if not INTERPRET else None, _bwd_dq_kernel, z * h, n_q, dq_args,
                is_causal, d, block_d, seq_class, q.dtype)
        dq_acc = stats  # DQ_ACC is not touched without atomics
    if atomic_dq and _gluon_ws_ok(q, do, d):
        # the warp-specialised Gluon kernel adds unscaled dS K tiles
        _launch_gluon(fg_kernel="ws", q=q, k=k, v=v, do=do, dk=dk, dv=dv, stats=stats, dq_acc=dq_acc, sq=sq,
                      sk=sk, sv=sv, sdo=sdo, h=h, n_q=n_q, n_k=n_k, causal_off=causal_off, sm_scale=sm_scale,
                      is_causal=is_causal)
        torch.mul(dq_acc, sm_scale, out=dq)
        return dq, dk, dv
    if not atomic_dq and _gluon_dkdv_ok(q, do, d, "dkdv" in _PINNED):
        _launch_gluon(fg_kernel="dkdv", q=q, k=k, v=v, do=do, dk=dk, dv=dv, stats=stats, dq_acc=None, sq=sq,
                      sk=sk, sv=sv, sdo=sdo, h=h, n_q=n_q, n_k=n_k, causal_off=causal_off, sm_scale=sm_scale,
                      is_causal=is_causal)
        return dq, dk, dv
    dkdv_args = (q, k, v, do, dk, dv, stats, dq_acc,
                 sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
                 h, n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale, seq_class)
    name, tuned = ("dkdv_atomic", _dkdv_atomic_tuned) if atomic_dq else ("dkdv", _dkdv_tuned)
    _launch(name, tuned if not INTERPRET else None, _bwd_dkdv_kernel, z * h, n_k, dkdv_args,
            is_causal, d, block_d, seq_class, q.dtype, ATOMIC_DQ=atomic_dq, DQ_TMA=dq_tma)
    if atomic_dq:
        dq.copy_(dq_acc)
    return dq, dk, dv


# The Hopper backward kernels in Gluon (`flash_gluon`), used where they apply: sm_90, fp16 / bf16, d = 64, an even
# N_q, 16-byte aligned Q and dO rows.
# - GLUON_WS (on): the atomic-dQ backward runs the warp-specialised one-pass kernel (about 10% faster than the
#   two-pass backward at the leaderboard shape), and the default class picks it from WS_MIN_ROWS query
#   rows on (`_default_bwd`), unless torch.use_deterministic_algorithms is on (fp32 dQ reductions in L2 add in
#   any order).
# - GLUON_DKDV (off): the two-pass backward's dK/dV pass in Gluon (level with the Triton kernel), unless
#   the dK/dV tiles are pinned (pins select the Triton kernel's tiles).
GLUON_WS = True
GLUON_DKDV = False
WS_MIN_ROWS = 8192


def _aligned(t: Tensor) -> bool:
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:  # a fake tensor (torch.compile tracing) has no storage: flash_bwd_impl checks again
        return True


def _gluon_ok(q: Tensor, do: Tensor, d: int) -> bool:
    if INTERPRET or q.dtype == torch.float32 or q.device.type != "cuda":
        return False
    from core.kernels import flash_gluon
    if d not in flash_gluon.HEAD_DIMS:
        return False
    # wgmma is sm_90 only (Blackwell has other tensor-core instructions); TMA: 16-byte aligned bases and row
    # strides, and an even N_q keeps each head's (lse2, delta) rows 16-byte aligned
    return flash_gluon.HAVE_GLUON and _capability(q.device) == (9, 0) and q.shape[2] % 2 == 0 \
        and _aligned(q) and _aligned(do) and all(s % 8 == 0 for s in q.stride()[:3] + do.stride()[:3])


def _gluon_ws_ok(q: Tensor, do: Tensor, d: int) -> bool:
    return GLUON_WS and _gluon_ok(q, do, d)


def _gluon_dkdv_ok(q: Tensor, do: Tensor, d: int, pinned: bool) -> bool:
    return GLUON_DKDV and not pinned and _gluon_ok(q, do, d)


def _launch_gluon(fg_kernel, q, k, v, do, dk, dv, stats, dq_acc, sq, sk, sv, sdo, h, n_q, n_k, causal_off,
                  sm_scale, is_causal) -> None:
    from core.kernels import flash_gluon as fg
    if _RECORDER.current is not None:
        _RECORDER.current.unreplayable("Gluon kernel")
    _ensure_scratch_allocator()  # the kernels build their TMA descriptors on the device
    z = q.shape[0]
    strides = (sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2])
    scalars = (h, n_q, n_k, z * h * n_q, causal_off, sm_scale * LOG2E, sm_scale)
    if fg_kernel == "ws":  # two warpgroups of 64 keys per program
        fg._bwd_ws_kernel[(z * h, _cdiv(n_k, fg.WS_KEYS))](
            q, k, v, do, dk, dv, stats, dq_acc, *strides, *scalars, IS_CAUSAL=is_causal, HEAD_DIM=q.shape[3],
            BLOCK_M=fg.BLOCK_M, BLOCK_N=fg.BLOCK_N, STAGES=fg.WS_STAGES, PREFETCH=fg.WS_PREFETCH,
            WS_REGS=fg.WS_REGS, num_warps=4)
    else:
        fg._dkdv_kernel[(z * h, _cdiv(n_k, fg.BLOCK_N))](
            q, k, v, do, dk, dv, stats, *strides, *scalars, IS_CAUSAL=is_causal, HEAD_DIM=q.shape[3],
            BLOCK_M=fg.BLOCK_M, BLOCK_N=fg.BLOCK_N, STAGES=fg.STAGES, num_warps=fg.NUM_WARPS)


# ------------------------------------------------------- torch.library registration
@torch.library.custom_op("scalelab::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    """FlashAttention forward as one opaque op: (out, logsumexp) for 4-D (Z, H, N, d) inputs."""
    return flash_fwd_impl(q, k, v, is_causal)


@flash_attn_fwd.register_fake
def _(q, k, v, is_causal):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


# bwd_variant: 0 two-pass, 1 atomic dQ, 2 fused (a bool, as the former `atomic_dq` argument, still binds:
# False -> 0, True -> 1)
@torch.library.custom_op("scalelab::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   is_causal: bool, bwd_variant: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention backward as one opaque op: (dq, dk, dv)."""
    return flash_bwd_impl(do, q, k, v, o, lse, is_causal, bwd_variant)


@flash_attn_bwd.register_fake
def _(do, q, k, v, o, lse, is_causal, bwd_variant=0):
    _bwd_code(bwd_variant)  # an unknown variant fails while tracing too
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup_context(ctx, inputs, output):
    q, k, v, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal


def _op_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(do, q, k, v, o, lse, ctx.is_causal, _default_bwd(q, k, do))
    return dq, dk, dv, None


flash_attn_fwd.register_autograd(_op_backward, setup_context=_op_setup_context)


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # older torch
        return False


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton: ``FlashAttentionTriton.apply(q, k, v, is_causal=False)``.

    q (..., N_q, d), k and v (..., N_k, d), same leading dims; fp32 (tf32 dots), fp16, bf16; any head dim
    d up to 256 (padded to a power of two with masks). Saves q, k, v, out and one logsumexp (..., N_q).
    Backward (`_default_bwd`): the fused one-launch kernel on small grids, the warp-specialised Gluon kernel
    (atomic fp32 dQ) for long rows on Hopper, else two passes (no atomics).
    `FlashAttentionTritonAtomicDQ`: one pass, atomic fp32 dQ; `FlashAttentionTritonFusedBwd`: one
    fused launch (dK/dV of key tile i and dQ of query tile i per program).
    """

    @classmethod
    def apply(cls, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
        # eager CUDA calls of this class go through flash_native's C++ autograd node where it has a plan for
        # the input signature (the host-bound short sequences); everything else through this Python Function
        if cls is FlashAttentionTriton and NATIVE_NODE and _eager_call is not None and q.__class__ is Tensor \
                and k.__class__ is Tensor and v.__class__ is Tensor and q.is_cuda and not _compiling():
            out = _eager_call(q, k, v, bool(is_causal))
            if out is not None:
                return out
        return super().apply(q, k, v, is_causal)

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
        check_inputs(q, k, v, "flash_triton")
        is_causal = bool(is_causal)
        in_dtypes = (q.dtype, k.dtype, v.dtype)
        cast = autocast_dtype(q.device.type)
        if cast is not None and cast != q.dtype:
            q, k, v = q.to(cast), k.to(cast), v.to(cast)
        q4, k4, v4 = _to_4d(q), _to_4d(k), _to_4d(v)
        if _compiling():
            o4, lse4 = torch.ops.scalelab.flash_attn_fwd(q4, k4, v4, is_causal)
        else:
            o4, lse4 = flash_fwd_impl(q4, k4, v4, is_causal)
        out = o4 if q.dim() == 4 else o4.reshape(q.shape)  # a view back to (..., N, d)
        # backward needs the 4-D operands: save those (same storage), not the caller's views; the logsumexp is
        # saved with the input's leading dims, (..., N_q), the one saved tensor of that shape
        ctx.save_for_backward(q4, k4, v4, o4, lse4.reshape(q.shape[:-1]))
        ctx.is_causal = is_causal
        ctx.in_dtypes = in_dtypes
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, do: Tensor):
        return _backward(ctx, do, None)  # None: two-pass or fused, as `_use_fused` decides


class FlashAttentionTritonAtomicDQ(FlashAttentionTriton):
    """`FlashAttentionTriton` with the one-pass backward: dK/dV plus atomically accumulated fp32 dQ."""

    @staticmethod
    def backward(ctx, do: Tensor):
        return _backward(ctx, do, BWD_ATOMIC_DQ)


class FlashAttentionTritonFusedBwd(FlashAttentionTriton):
    """`FlashAttentionTriton` with the fused backward: one launch, grid (tiles, batch x heads), program i
    computing dK/dV of key tile i and dQ of query tile i (about n tile steps each under a causal mask,
    against ~2n in two launches for the two-pass backward); delta = rowsum(dO * O) recomputed in place."""

    @staticmethod
    def backward(ctx, do: Tensor):
        return _backward(ctx, do, BWD_FUSED)


def _default_bwd(q4: Tensor, k4: Tensor, do4: Tensor) -> int:
    """The default class's backward variant for these 4-D operands: the fused kernel on small grids
    (`_use_fused`), the warp-specialised Gluon kernel on Hopper from WS_MIN_ROWS query rows (measured on the
    H100, d = 64 causal, time against the two-pass backward: 0.85x at 32768-65536 rows with B = H = 1,
    0.92-1.01x at 8192 rows (batch x heads 4-16), 1.08x at (16, 4096) and 1.6-2.1x at 1024-2048 rows, where
    the per-program set-up, the delta kernel and the dQ cast weigh more), else two passes."""
    z, h, n_q, d = q4.shape
    if _use_fused(z * h, n_q, k4.shape[2], d, q4.dtype):
        return BWD_FUSED
    if n_q >= WS_MIN_ROWS and not torch.are_deterministic_algorithms_enabled() and _gluon_ws_ok(q4, do4, d):
        return BWD_ATOMIC_DQ
    return BWD_TWO_PASS


def _backward(ctx, do: Tensor, variant: int | None):
    q4, k4, v4, o4, lse = ctx.saved_tensors
    lse4 = lse.reshape(q4.shape[:-1])
    qs, ks, vs = ctx.shapes
    if do.dtype != q4.dtype:
        do = do.to(q4.dtype)
    do4 = _to_4d(do)
    if variant is None:
        variant = _default_bwd(q4, k4, do4)
    if _compiling():
        dq, dk, dv = torch.ops.scalelab.flash_attn_bwd(do4, q4, k4, v4, o4, lse4, ctx.is_causal, variant)
    else:
        dq, dk, dv = flash_bwd_impl(do4, q4, k4, v4, o4, lse4, ctx.is_causal, variant)
    if len(qs) != 4:
        dq, dk, dv = dq.reshape(qs), dk.reshape(ks), dv.reshape(vs)
    tq, tk, tv = ctx.in_dtypes
    if tq != dq.dtype:
        dq = dq.to(tq)
    if tk != dk.dtype:
        dk = dk.to(tk)
    if tv != dv.dtype:
        dv = dv.to(tv)
    return dq, dk, dv, None


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) without autograd, for tests and diagnostics."""
    check_inputs(q, k, v, "flash_triton")
    lead = q.shape[:-2]
    o4, lse4 = flash_fwd_impl(_to_4d(q), _to_4d(k), _to_4d(v), bool(is_causal))
    return o4.reshape(*lead, *o4.shape[-2:]), lse4.reshape(*lead, lse4.shape[-1])
