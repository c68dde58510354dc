"""Host side of flash_triton: which kernels run for a call (from its shapes, the GPU and the `FlashConfig`), the
output allocations, and the custom ops `scalelab::flash_attn_fwd` / `scalelab::flash_attn_bwd` that
`torch.compile` sees (one opaque node per direction, no graph break; they take the config as its `key` string).

Both entry points take 4-D (Z, H, N, d) inputs with unit last stride: `flash_fwd_impl` -> (out like q, lse
(Z, H, N_q) fp32); `flash_bwd_impl` -> (dq, dk, dv) shaped and strided like q, k, v.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from core.errors import ConfigError
from core.kernels.flash_triton import common, launch
from core.kernels.flash_triton.backward import (_bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel,
                                                _bwd_fused_kernel)
from core.kernels.flash_triton.common import HAVE_TRITON, LOG2E, _POW2_D, _TILE_D, _cdiv
from core.kernels.flash_triton.config import DEFAULT_CONFIG, FlashConfig
from core.kernels.flash_triton.forward import _fwd_kernel, _fwd_merge_kernel, _fwd_split_kernel, _fwd_split_merge_kernel
from core.kernels.flash_triton.launch import _ARRIVALS, _launch, _run
from core.kernels.flash_triton.tuning import _seq_class

if HAVE_TRITON:
    from core.kernels.flash_triton.tuning import _dkdv_atomic_tuned, _dkdv_tuned, _dq_tuned, _fused_tuned, _fwd_tuned


def _check_runtime(q: Tensor) -> None:
    if not HAVE_TRITON:
        raise ConfigError("attention_impl.kernel", "Triton is not installed",
                          "pip install triton, or use attention_impl=flash_torch")
    if not common.INTERPRET and not q.is_cuda:
        raise ConfigError("attention_impl.kernel", f"flash_triton got {q.device.type} tensors and Triton "
                          "runs on CUDA only", "move the model to a GPU, set TRITON_INTERPRET=1 before "
                          "importing triton (slow), or use attention_impl=flash_torch")


# the strides `_dense_layout` gives an operand, by its (shape, strides); () where `empty_like` keeps them
_DENSE_STRIDES: dict[tuple, tuple[int, ...]] = {}
_MAX_DENSE_STRIDES = 1024  # distinct layouts kept; the cache restarts beyond that


def _dense_like(x: Tensor) -> Tensor:
    """`_dense_layout(x)`, its strides computed once per operand layout (about 3 us a call, not 12: the forward's
    host time matters where the GPU waits for it, as at the first attention call of a train step)."""
    key = (x.shape, x.stride())
    try:
        strides = _DENSE_STRIDES.get(key)
    except TypeError:  # symbolic sizes (torch.compile tracing) hash to nothing
        return _dense_layout(x)
    if strides is None:
        out = _dense_layout(x)
        common._remember(_DENSE_STRIDES, key, () if out.stride() == x.stride() else out.stride(), _MAX_DENSE_STRIDES)
        return out
    if not strides:
        return torch.empty_like(x)
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)


def _dense_layout(x: Tensor) -> Tensor:
    """A new dense tensor shaped like x whose dimensions are laid out in x's stride order (outermost first).

    An output (O, dQ, dK, dV) gets the layout of its operand where that operand is dense, and otherwise the same
    dimension order without the gaps: q, k, v sliced from the model's fused qkv projection are (B, H, T, d) views of
    a (B, T, 3H, d) buffer, and O then is a dense (B, T, H, d) buffer viewed as (B, H, T, d), which the model's
    transpose back to (B, T, H * d) reads without a copy (as SDPA's outputs). An expanded GQA key (stride 0 over
    the heads) gets a full dK, which autograd sums over the group; the head dim stays innermost. The kernels take
    every output's strides, so no operand is copied."""
    out = torch.empty_like(x)  # keeps a dense operand's strides (the common case: ~1 us, not ~6)
    if out.stride() == x.stride():
        return out
    # the head dim innermost (the kernels' unit stride); the others outermost first, broadcast (stride 0) ones
    # first in their own order
    order = sorted(range(x.dim() - 1), key=lambda i: (x.stride(i) != 0, -x.stride(i), i)) + [x.dim() - 1]
    buf = torch.empty([x.shape[i] for i in order], dtype=x.dtype, device=x.device)
    return buf.permute([order.index(i) for i in range(x.dim())])


def _poisoned(out: Tensor, cfg: FlashConfig) -> Tensor:
    """out, NaN-filled with `cfg.poison_outputs` (an element the kernels leave unwritten then shows)."""
    return out.fill_(float("nan")) if cfg.poison_outputs else out


def _output_like(x: Tensor, cfg: FlashConfig) -> Tensor:
    """The output for operand x (`_dense_like`), poisoned on request."""
    return _poisoned(_dense_like(x), cfg)


def _strides(*tensors: Tensor) -> tuple[int, ...]:
    """The (batch, head, row) strides of 4-D tensors, in order: the kernels' stride arguments."""
    out: tuple[int, ...] = ()
    for t in tensors:
        out += t.stride()[:3]
    return out


# ------------------------------------------------------------------------------------------------ forward
# the autotuner's pick for the one-kernel forward at S <= 4096, B = H = 1 on an H100: the split forward's tiles
_SPLIT_TILES = (64, 64, 4, 3)
# rows of fewer than `short_row_tiles` key tiles (S = 1024): 32-row query tiles, twice the programs, and each
# split's keys in one masked loop rather than an unmasked and a masked one (one pipeline start-up, not two); the
# 64-row tiles spill registers at d = 128
_SHORT_SPLIT_TILES = (32, 64, 4, 3)


def _fwd_split_len(device: torch.device, zh: int, n_q: int, n_k: int, bm: int, bn: int,
                   cfg: FlashConfig = DEFAULT_CONFIG) -> int:
    """Keys per split for the split-KV forward (a multiple of bn), or 0 for the one-kernel forward.

    Splits only when the one-kernel grid (batch x heads x query tiles) has fewer programs than the GPU has
    SMs and rows span at least 32 key tiles; then about two programs per SM, each with 4 key tiles or more,
    in at most `cfg.max_splits` splits. Why: on a grid that leaves SMs idle a query tile's whole row is the
    critical path, and splitting it costs one merge of fp32 partial rows. Measured on an H100 at B = H = 1, the
    split pays from S = 2048 on every head dim, and at S = 1024 (16-31 key tiles) only on the tiniest grids
    (at most a quarter as many programs as SMs, B x H <= 2); more than 4 splits lost to the merge's extra traffic
    (docs/attention.md). `cfg.split_keys` forces a length (tests: the interpreter never splits on its own)."""
    if cfg.split_keys is not None:
        return _cdiv(cfg.split_keys, bn) * bn
    if not cfg.split_kv or common.INTERPRET:
        return 0
    programs, k_tiles = zh * _cdiv(n_q, bm), _cdiv(n_k, bn)
    sms = launch._sm_count(device)
    # rows of 16-31 key tiles split only on the tiniest grids, where it was measured (B = H = 1, S = 1024)
    if programs >= sms or k_tiles < (16 if 4 * programs <= sms else 32):
        return 0
    splits = min(k_tiles // 4, _cdiv(2 * sms, programs), cfg.max_splits)
    return _cdiv(k_tiles, splits) * bn if splits >= 2 else 0


def _hopper_fwd_ok(q: Tensor, k: Tensor, v: Tensor, cfg: FlashConfig) -> bool:
    """Whether the forward runs the Hopper warp-specialised Gluon kernel (`hopper_forward.fwd_applies`)."""
    if not cfg.hopper_fwd or common.INTERPRET:
        return False
    from core.kernels.flash_triton import hopper_forward  # Gluon, imported where it may run
    return hopper_forward.fwd_applies(q, k, v)


# the Gluon forward's launches by the call's geometry (`flash_fwd_impl`): (O's strides, `hopper_forward.FwdReplay`)
_FWD_REPLAYS: dict[tuple, tuple] = {}
_MAX_FWD_REPLAYS = 256  # distinct geometries kept; the cache restarts beyond that


def flash_fwd_impl(q: Tensor, k: Tensor, v: Tensor, is_causal: bool,
                   cfg: FlashConfig = DEFAULT_CONFIG) -> tuple[Tensor, Tensor]:
    """Forward on 4-D (Z, H, N, d) inputs with unit last stride: (out like q, lse (Z, H, N_q) fp32).

    A call whose geometry (shapes, strides, dtypes, device), mask and config took the Gluon forward before replays
    that launch (`hopper_forward.FwdReplay`) without the policy below: a model's forward makes the same call every
    step, and at a train step's first attention call the GPU waits for this host code (on the H100 host, at the
    medium model's shape, a replayed call takes about 43 us and one through the policy 85, several times either
    inside a compiled step)."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), is_causal, cfg.key)
    hit = _FWD_REPLAYS.get(key)
    if hit is not None and all(map(common._tma_aligned, (q, k, v))) and launch.replays_ok():
        o_strides, replay = hit
        o = torch.empty_strided(q.shape, o_strides, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        replay(q, k, v, o, lse)
        return o, lse
    _check_runtime(q)
    z, h, n_q, d = q.shape
    n_k = k.shape[2]
    group = h // k.shape[1]  # query heads per KV head (grouped-query attention)
    o = _output_like(q, cfg)
    lse = _poisoned(torch.empty((z, h, n_q), device=q.device, dtype=torch.float32), cfg)
    causal_off = n_k - n_q if is_causal else 0
    seq_class = _seq_class(max(n_q, n_k), z * h)
    pinned = cfg.tile("fwd")
    bm, bn, warps, stages = (pinned or ((32, 16, 4, 1) if common.INTERPRET else _SPLIT_TILES))[:4]
    # the split forward's fixed tiles are sized for head dims up to 128
    block_d, tail_d = _TILE_D[d]
    split_len = _fwd_split_len(q.device, z * h, n_q, n_k, bm, bn, cfg) if block_d + tail_d <= 128 else 0
    # the Gluon forward on Hopper (`hopper_forward`), unless tiles pin the Triton one or the call is split
    min_rows, short_rows, long_rows = cfg.hopper_fwd_rows(d, is_causal)
    if not split_len and pinned is None and n_q >= min_rows and _hopper_fwd_ok(q, k, v, cfg):
        from core.kernels.flash_triton import hopper_forward
        replay = hopper_forward.launch_fwd(q, k, v, o, lse, is_causal, 1.0 / math.sqrt(d),
                                           hopper_forward.fwd_tiles(d, n_q, is_causal, short_rows, long_rows),
                                           replay=not cfg.poison_outputs)
        if replay is not None:
            common._remember(_FWD_REPLAYS, key, (o.stride(), replay), _MAX_FWD_REPLAYS)
        return o, lse
    if split_len:  # small grid: split-KV
        short = _cdiv(n_k, bn) < cfg.short_row_tiles
        if short and pinned is None and not common.INTERPRET:
            bm, bn, warps, stages = _SHORT_SPLIT_TILES
        splits = _cdiv(n_k, split_len)
        o_part = torch.empty((z * h, splits, n_q, block_d + tail_d), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((z * h, splits, n_q), device=q.device, dtype=torch.float32)
        if cfg.split_merge == "in_kernel":
            n_counts = z * h * _cdiv(n_q, bm)  # one per query tile
            arrivals = _ARRIVALS.get(q.device, n_counts)
            _run(_fwd_split_merge_kernel, (z * h, _cdiv(n_q, bm), splits),
                 (q, k, v, o, lse, o_part, lse_part, arrivals, *_strides(q, k, v, o),
                  h, group, n_q, n_k, causal_off, LOG2E / math.sqrt(d), split_len, seq_class), 8,
                 IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d, TAIL_D=tail_d, BLOCK_M=bm, BLOCK_N=bn,
                 SPLITS=splits, ONE_LOOP=short, num_warps=warps, num_stages=stages)
            return o, lse
        _run(_fwd_split_kernel, (z * h, _cdiv(n_q, bm), splits),
             (q, k, v, o_part, lse_part, *_strides(q, k, v),
              h, group, n_q, n_k, causal_off, LOG2E / math.sqrt(d), split_len, seq_class), 5,
             IS_CAUSAL=is_causal, HEAD_DIM=d, BLOCK_D=block_d, TAIL_D=tail_d, BLOCK_M=bm, BLOCK_N=bn,
             num_warps=warps, num_stages=stages)
        # 32-row merge tiles: 96 registers at d = 128 (64 rows: 230), and twice the programs on a small grid
        _run(_fwd_merge_kernel, (z * h, _cdiv(n_q, 32)),
             (o_part, lse_part, o, lse, *_strides(o), h, n_q, splits), 4,
             HEAD_DIM=d, BLOCK_D=block_d, TAIL_D=tail_d, BLOCK_M=32)
        return o, lse
    args = (q, k, v, o, lse, *_strides(q, k, v, o), h, group, n_q, n_k, causal_off, LOG2E / math.sqrt(d),
            seq_class)
    _launch("fwd", _fwd_tuned if not common.INTERPRET else None, _fwd_kernel, z * h, n_q, args,
            is_causal, d, block_d, seq_class, q.dtype, tiles=pinned, TAIL_D=tail_d)
    return o, lse


# ----------------------------------------------------------------------------------------------- backward
# Backward variants (the int `bwd_variant` of flash_bwd_impl and of the op `scalelab::flash_attn_bwd`;
# 0 and 1 are what the op's former `bool atomic_dq` passed, so old callers keep their meaning).
BWD_TWO_PASS, BWD_ATOMIC_DQ, BWD_FUSED = 0, 1, 2
_BWD_NAMES = {"two_pass": BWD_TWO_PASS, "atomic_dq": BWD_ATOMIC_DQ, "fused": BWD_FUSED}
# -1: picked when the call runs, by `_default_bwd` for the operands it gets. The backward torch.compile traces passes
# this: picking reads the operands' layouts and addresses (the Gluon kernel's TMA checks), which a traced backward
# must not (Dynamo cannot trace Tensor.data_ptr: the whole autograd.Function would fall out of the graph, a graph
# break at every attention call)
BWD_AUTO = -1
_BWD_CODES = {**_BWD_NAMES, "auto": BWD_AUTO}


def _bwd_code(variant) -> int:
    """0/1/2, a name from _BWD_NAMES, -1 / "auto" (`BWD_AUTO`), or a bool (the old atomic_dq flag: True = atomic
    dQ)."""
    code = _BWD_CODES.get(variant) if isinstance(variant, str) else int(variant)
    if code not in (BWD_AUTO, BWD_TWO_PASS, BWD_ATOMIC_DQ, BWD_FUSED):
        raise ConfigError("flash_triton bwd_variant", f"unknown backward variant {variant!r}",
                          "use 0 / 'two_pass', 1 / 'atomic_dq', 2 / 'fused' or -1 / 'auto'")
    return code


def _use_fused(zh: int, n_q: int, n_k: int, d: int, cfg: FlashConfig = DEFAULT_CONFIG) -> bool:
    """Policy for the "auto" backward: True sends it to the fused one-launch kernel.

    Measured on the H100 (B = H = 1, bf16, causal): the fused backward beat the
    two-pass one wherever the grid was small, d = 64 up to 256 64-row tiles (S = 16384: 0.340 vs 0.404 ms)
    and d = 128 up to 128 tiles (S = 8192: 0.293 vs 0.406 ms), and lost where it was large: d = 128 at 256
    tiles (0.774 vs 0.500 ms; its 64x64 tiles spill registers at d = 128) and the leaderboard shape, 4096
    tiles (4.50 vs 3.80 ms), where the two-pass grid already fills the GPU. So: fused only up to the
    measured tile counts (`cfg.fused_max_tiles`, `cfg.fused_max_tiles_wide`)."""
    tiles = zh * _cdiv(max(n_q, n_k), 64)
    return tiles <= (cfg.fused_max_tiles if d <= 64 else cfg.fused_max_tiles_wide)


def _ws_ok(q: Tensor, do: Tensor, d: int, cfg: FlashConfig = DEFAULT_CONFIG) -> bool:
    """Whether the atomic-dQ backward runs the Hopper warp-specialised Gluon kernel (`hopper.ws_applies`)."""
    if not cfg.hopper_ws or common.INTERPRET:
        return False
    from core.kernels.flash_triton import hopper  # Gluon, imported where it may run
    return hopper.ws_applies(q, do, d)


def _default_bwd(q4: Tensor, k4: Tensor, do4: Tensor, is_causal: bool,
                 cfg: FlashConfig = DEFAULT_CONFIG) -> int:
    """The backward variant for these 4-D operands: `cfg.backward` unless "auto". "auto": the fused kernel on small
    grids (`_use_fused`), the warp-specialised Gluon kernel on Hopper from `cfg.ws_rows(d)` causal rows on
    (`cfg.takes_ws`), else two passes. Measured on the H100 (bf16, causal, `do_bench`, one process), the backward's time
    over cuDNN's, the Gluon kernel against the two-pass one: d = 64, 0.97-0.98 against 0.86-0.89 at 1024 rows, 0.92-0.96
    against 0.93-1.01 at 2048 (8 to 32 x 16 heads; the two-pass kernel, 7 tile matmuls a pair to 5, loses ground as a
    longer call holds the card at its power limit), 0.92 against 1.09 at 8192. Calls back to back, the Gluon time over
    the two-pass time at 512 / 1024 / 2048 / 4096 / 8192 rows: d = 80, 1.15 / 1.03 / 1.01 / 0.96 / 0.91x; d = 96,
    1.20 / 1.07 / 1.00 / 0.98 / 0.93x; d = 128, 1.11 / 0.95 / 0.88 / 0.84 / 0.79x. On short rows its fixed costs
    weigh more (the delta kernel, the fp32 dQ buffer's zeros and cast, a program's set-up). The Gluon kernel's fp32
    reductions add in any order: not under torch.use_deterministic_algorithms."""
    if cfg.backward != "auto":
        return _BWD_NAMES[cfg.backward]
    z, h, n_q, d = q4.shape
    if _use_fused(z * h, n_q, k4.shape[2], d, cfg):
        return BWD_FUSED
    if cfg.takes_ws(d, n_q, is_causal) and not torch.are_deterministic_algorithms_enabled() \
            and _ws_ok(q4, do4, d, cfg):
        return BWD_ATOMIC_DQ
    return BWD_TWO_PASS


def _sum_groups(dx: Tensor, x: Tensor, group: int) -> Tensor:
    """dK or dV per query head (Z, H, N_k, d) summed over each KV head's `group` query heads into a gradient laid
    out like its operand x (`_dense_like`), rounded once (the kernels run per query head, so no two programs add
    into one row). One reduction straight into the gradient: torch sums half-precision inputs in fp32 and rounds
    the result, so an fp32 sum and a copy (1.8x the bytes moved) would round the same way."""
    if group == 1:
        return dx
    z, h, n, d = dx.shape
    return torch.sum(dx.view(z, h // group, group, n, d), 2, out=_dense_like(x))


def flash_bwd_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   is_causal: bool, bwd_variant: int | str = BWD_TWO_PASS,
                   cfg: FlashConfig = DEFAULT_CONFIG) -> tuple[Tensor, Tensor, Tensor]:
    """Backward on 4-D inputs: dq, dk, dv shaped and strided like q, k, v.

    bwd_variant -1 / "auto" (`BWD_AUTO`): the variant `_default_bwd` picks for these operands and `cfg`.
    bwd_variant 0 / "two_pass": two passes (dQ kernel, then dK/dV kernel), 7 tile matmuls, no atomics.
    1 / "atomic_dq" (or True, the old atomic_dq flag): one dK/dV pass that also adds each key tile's
    dS K into an fp32 dQ buffer (5 matmuls; a small kernel computes rowsum(dO * O) first): on Hopper the
    warp-specialised Gluon kernel where it applies (`cfg.hopper_ws`), else one TMA bulk reduction per tile on
    sm_90+, per-element atomics elsewhere; dQ is cast from the buffer.
    2 / "fused": one kernel, program i doing dK/dV of key tile i and dQ of query tile i (7 matmuls,
    delta recomputed from O in place, no atomics, one launch, critical path ~n tile steps, not ~2n)."""
    _check_runtime(q)
    variant = _bwd_code(bwd_variant)
    if do.stride(-1) != 1:
        do = do.contiguous()
    if variant == BWD_AUTO:
        variant = _default_bwd(q, k, do, is_causal, cfg)
    z, h, n_q, d = q.shape
    n_k = k.shape[2]
    if variant == BWD_FUSED and z * h > launch._MAX_GRID_Y:  # the fused grid's dim 1 is batch x heads
        variant = BWD_TWO_PASS
    group = h // k.shape[1]  # query heads per KV head (grouped-query attention)
    atomic_dq = variant == BWD_ATOMIC_DQ
    ws = atomic_dq and _ws_ok(q, do, d, cfg)
    if ws:
        from core.kernels.flash_triton import hopper
        # query heads a program of the Gluon kernel walks: with GQA the group's, short of long rows
        heads = cfg.ws_gqa_heads(group, n_q, is_causal)
    else:
        heads = 1
    dq = _output_like(q, cfg)
    if heads == group:  # one gradient per KV head, from the kernels
        dk, dv = _output_like(k, cfg), _output_like(v, cfg)
    else:  # per query head here, summed over each KV head's group at the end (`_sum_groups`)
        dk, dv = (_poisoned(torch.empty((z, h, n_k, d), dtype=k.dtype, device=k.device), cfg) for _ in range(2))
    block_d, tail_d = _TILE_D[d]
    causal_off = n_k - n_q if is_causal else 0
    sm_scale = 1.0 / math.sqrt(d)
    seq_class = _seq_class(max(n_q, n_k), z * h)
    interpret = common.INTERPRET
    if variant == BWD_FUSED:  # one launch, no delta buffer
        args = (q, k, v, o, do, dq, dk, dv, lse, *_strides(q, k, v, do, o, dq, dk, dv),
                h, group, n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale, seq_class)
        _launch("fused", _fused_tuned if not interpret else None, _bwd_fused_kernel, z * h, n_q, args,
                is_causal, d, block_d, seq_class, q.dtype, n_k=n_k, tiles=cfg.tile("fused"), TAIL_D=tail_d)
        return dq, _sum_groups(dk, k, group), _sum_groups(dv, v, group)
    dq_tma = atomic_dq and launch._has_tma(q.device) and d % 4 == 0  # TMA: 16-byte rows of the fp32 dQ buffer
    if dq_tma:
        launch._ensure_scratch_allocator()
    # per row, (base-2 logsumexp, delta = rowsum(dO * O)), written by the first launch for the dK/dV pass
    stats = torch.empty((z, h, n_q, 2), device=q.device, dtype=torch.float32)
    if atomic_dq:  # the row stats first; the dK/dV pass then adds dS K into an fp32 buffer
        if ws:
            dq_acc = hopper.ws_dq_buffer(q)  # its own layout (`ws_dq_buffer`)
        else:
            dq_acc = torch.empty((z, h, n_q, d), device=q.device, dtype=torch.float32)  # zeroed by the delta kernel
        _run(_bwd_delta_kernel, (z * h, _cdiv(n_q, 64)),
             (o, do, lse, stats, dq_acc, *_strides(o, do), h, n_q), 5,
             HEAD_DIM=d, BLOCK_D=_POW2_D[d], BLOCK_M=64)
    else:  # the dQ pass (it also computes and stores the row stats)
        dq_args = (q, k, v, o, do, dq, lse, stats, *_strides(q, k, v, do, o, dq),
                   h, group, n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale, seq_class)
        _launch("dq", _dq_tuned if not interpret else None, _bwd_dq_kernel, z * h, n_q, dq_args,
                is_causal, d, block_d, seq_class, q.dtype, tiles=cfg.tile("dq"), TAIL_D=tail_d)
        dq_acc = stats  # DQ_ACC is not touched without atomics
    if ws:
        # the warp-specialised Gluon kernel adds unscaled dS K tiles
        hopper.launch_ws(q, k, v, do, dk, dv, stats, dq_acc, h, n_q, n_k, causal_off, sm_scale, is_causal, heads)
        hopper.ws_dq_finish(dq_acc, dq, sm_scale)
        return dq, _sum_groups(dk, k, group // heads), _sum_groups(dv, v, group // heads)
    dkdv_args = (q, k, v, do, dk, dv, stats, dq_acc, *_strides(q, k, v, do, dk, dv),
                 h, group, n_q, n_k, causal_off, sm_scale * LOG2E, sm_scale, seq_class)
    name, tuned = ("dkdv_atomic", _dkdv_atomic_tuned if not interpret else None) if atomic_dq \
        else ("dkdv", _dkdv_tuned if not interpret else None)
    _launch(name, tuned, _bwd_dkdv_kernel, z * h, n_k, dkdv_args,
            is_causal, d, block_d, seq_class, q.dtype, tiles=cfg.tile("dkdv"), TAIL_D=tail_d, ATOMIC_DQ=atomic_dq,
            DQ_TMA=dq_tma)
    if atomic_dq:
        dq.copy_(dq_acc)
    return dq, _sum_groups(dk, k, group), _sum_groups(dv, v, group)


# ------------------------------------------------------------------------------- torch.library registration
# `config` is `FlashConfig.key` ("" for the defaults): custom ops take strings, not Python objects
@torch.library.custom_op("scalelab::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, config: str = "") -> tuple[Tensor, Tensor]:
    """FlashAttention forward as one opaque op: (out, logsumexp) for 4-D (Z, H, N, d) inputs."""
    return flash_fwd_impl(q, k, v, is_causal, FlashConfig.from_key(config))


@flash_attn_fwd.register_fake
def _(q, k, v, is_causal, config=""):
    return _dense_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


# bwd_variant: 0 two-pass, 1 atomic dQ, 2 fused, -1 picked when the op runs (`BWD_AUTO`); a bool, as the former
# `atomic_dq` argument, still binds: False -> 0, True -> 1
@torch.library.custom_op("scalelab::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   is_causal: bool, bwd_variant: int = 0, config: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention backward as one opaque op: (dq, dk, dv)."""
    return flash_bwd_impl(do, q, k, v, o, lse, is_causal, bwd_variant, FlashConfig.from_key(config))


@flash_attn_bwd.register_fake
def _(do, q, k, v, o, lse, is_causal, bwd_variant=0, config=""):
    _bwd_code(bwd_variant)  # an unknown variant fails while tracing too
    return _dense_like(q), _dense_like(k), _dense_like(v)


def _op_setup_context(ctx, inputs, output):
    q, k, v, is_causal, config = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal
    ctx.config = config


def _op_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(do, q, k, v, o, lse, ctx.is_causal, BWD_AUTO, ctx.config)
    return dq, dk, dv, None, None


flash_attn_fwd.register_autograd(_op_backward, setup_context=_op_setup_context)
