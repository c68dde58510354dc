"""Autotuning: the short config lists per kernel, the pruning, and the autotuner's choices (launched directly
after the first call of a key, `launch._launch`). `FlashConfig.tiles` bypasses this per kernel.

Each kernel is tuned per (sequence class, causal, head dim, tile width), the class being the length bucket plus a
small-grid flag (`_seq_class`): a new key costs one compile per config, so the lists are short.
"""
from __future__ import annotations

import torch

from core.kernels.flash_triton.backward import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_fused_kernel
from core.kernels.flash_triton.common import HAVE_TRITON, triton
from core.kernels.flash_triton.forward import _fwd_kernel

if HAVE_TRITON:
    def _cfg(bm, bn, warps, stages):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)

    # short lists: a new (head dim, dtype, causal, seq class) key costs one compile per config
    # 32-row / 32-key tiles double the programs when batch x heads is small and the grid does not fill the
    # SMs; 64x128 (128-key tiles) halves the key steps on the critical path of long rows on small grids, and
    # loses where the grid is already full (the autotuner picks per sequence class)
    _FWD_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3),
                    _cfg(64, 128, 4, 3)]
    _DQ_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3), _cfg(64, 32, 4, 2)]
    # 64x64 in 2 stages: at d = 128 (and 80, 96: 128-wide tiles) 0.89-0.92x the time of the 32x64 tiles the
    # autotuner took without it (batched training shapes, H100); 3 stages do not fit there
    _DKDV_CONFIGS = [_cfg(32, 128, 8, 2), _cfg(64, 64, 4, 3), _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 3),
                     _cfg(32, 64, 4, 2)]
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
        # the tile width over the head: both parts (`common._tile_d`)
        d = (named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs.get("BLOCK_D", 64)) \
            + (named_args["TAIL_D"] if "TAIL_D" in named_args else kwargs.get("TAIL_D", 0))
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

# autotuner's pick per (kernel, seq class, causal, d, dtype): launched directly from the second call on
_CHOSEN: dict[tuple, tuple[int, int, int, int]] = {}

# Fixed tiles under TRITON_INTERPRET=1 (the CPU interpreter: autotuning would only cost time).
# ("fused": BLOCK_M != BLOCK_N on purpose, so the CPU tests cover unequal query / key tile counts and
# the fused kernel's skipped phases.)
_INTERPRET_TILES = {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 32), "fused": (32, 16)}


def tuned_configs() -> dict[tuple, tuple[int, int, int, int]]:
    """The autotuner's choices so far: (kernel, seq class, causal, d, dtype) -> (BM, BN, warps, stages)."""
    return dict(_CHOSEN)


def _seq_class(n: int, zh: int = 1 << 30) -> int:
    """Autotuning bucket: sequence length <=256, <=1024, <=4096, longer (0-3), plus 4 when the
    grid is small (batch x heads x 64-row tiles < 264, two per H100 SM), where smaller tiles win."""
    c = 0 if n <= 256 else 1 if n <= 1024 else 2 if n <= 4096 else 3
    return c + 4 if zh * ((n + 63) >> 6) < 264 else c
