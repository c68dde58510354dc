"""`FlashAttentionTriton`, the autograd Function: input checks, autocast, the view to 4-D and back, one saved
logsumexp with the input's leading dims, and the backward through `dispatch` (the custom ops under
`torch.compile`). The `FlashConfig` (5th argument) rides along to the backward.
"""
from __future__ import annotations

import torch
from torch import Tensor

from core.kernels._flash_common import autocast_dtype, check_inputs
from core.kernels.flash_triton.common import _as_4d, _to_4d
from core.kernels.flash_triton.config import DEFAULT_CONFIG, FlashConfig
from core.kernels.flash_triton.dispatch import BWD_AUTO, flash_bwd_impl, flash_fwd_impl


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # older torch
        return False


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton: ``FlashAttentionTriton.apply(q, k, v, is_causal=False, config=None)``.

    q (..., N_q, d), k and v (..., N_k, d), the same leading dims but for k and v's heads (dim -3), which may divide
    q's (grouped-query attention); fp32 (tf32 dots), fp16, bf16; any head dim d up to 256 (`common._tile_d`).
    Saves q, k, v, out and one logsumexp (..., N_q).
    `config` (a `FlashConfig`, None for the defaults) picks tiles, the backward variant and the split-KV policy;
    by default the backward is the fused one-launch kernel on small grids, the warp-specialised Gluon kernel
    (atomic fp32 dQ) for long rows on Hopper, else two passes (no atomics).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False,
                config: FlashConfig | None = None) -> Tensor:
        check_inputs(q, k, v, "flash_triton", gqa=True)
        cfg = DEFAULT_CONFIG if config is None else config
        is_causal = bool(is_causal)
        in_dtypes = (q.dtype, k.dtype, v.dtype)
        cast = autocast_dtype(q.device.type)
        if cast is not None and cast != q.dtype:
            q, k, v = q.to(cast), k.to(cast), v.to(cast)
        q4, k4, v4 = _to_4d(q), _to_4d(k), _to_4d(v)
        if _compiling():
            o4, lse4 = torch.ops.scalelab.flash_attn_fwd(q4, k4, v4, is_causal, cfg.key)
        else:
            o4, lse4 = flash_fwd_impl(q4, k4, v4, is_causal, cfg)
        out = o4 if q.dim() == 4 else o4.reshape(q.shape)  # a view back to (..., N, d)
        # backward needs the 4-D operands: save those (same storage), not the caller's views; the logsumexp is
        # saved with the input's leading dims, (..., N_q), the one saved tensor of that shape
        ctx.save_for_backward(q4, k4, v4, o4, lse4.reshape(q.shape[:-1]))
        ctx.is_causal = is_causal
        ctx.in_dtypes = in_dtypes
        ctx.shapes = (q.shape, k.shape, v.shape)
        ctx.config = cfg
        return out

    @staticmethod
    def backward(ctx, do: Tensor):
        q4, k4, v4, o4, lse = ctx.saved_tensors
        cfg = ctx.config
        lse4 = lse.reshape(q4.shape[:-1])
        qs, ks, vs = ctx.shapes
        if do.dtype != q4.dtype:
            do = do.to(q4.dtype)
        if _compiling():
            # nothing here reads the operands' layouts or addresses while torch.compile traces this backward: Dynamo
            # makes a gradient contiguous before a backward that reads its strides (a copy of dO a layer: the
            # model's dO is a (B, T, H, d) view), and cannot trace Tensor.data_ptr (the Gluon kernel's checks), which
            # would drop the whole Function out of the graph. The op picks the variant when it runs (`BWD_AUTO`).
            do4 = _as_4d(do)
            dq, dk, dv = torch.ops.scalelab.flash_attn_bwd(do4, q4, k4, v4, o4, lse4, ctx.is_causal, BWD_AUTO,
                                                           cfg.key)
        else:
            do4 = _to_4d(do)
            dq, dk, dv = flash_bwd_impl(do4, q4, k4, v4, o4, lse4, ctx.is_causal, BWD_AUTO, cfg)
        if len(qs) != 4:
            dq, dk, dv = dq.reshape(qs), dk.reshape(ks), dv.reshape(vs)
        tq, tk, tv = ctx.in_dtypes
        if tq != dq.dtype:
            dq = dq.to(tq)
        if tk != dk.dtype:
            dk = dk.to(tk)
        if tv != dv.dtype:
            dv = dv.to(tv)
        return dq, dk, dv, None, None


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False,
                             config: FlashConfig | None = None) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) without autograd, for tests and diagnostics."""
    check_inputs(q, k, v, "flash_triton", gqa=True)
    lead = q.shape[:-2]
    o4, lse4 = flash_fwd_impl(_to_4d(q), _to_4d(k), _to_4d(v), bool(is_causal),
                              DEFAULT_CONFIG if config is None else config)
    return o4.reshape(*lead, *o4.shape[-2:]), lse4.reshape(*lead, lse4.shape[-1])
