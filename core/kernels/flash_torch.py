"""FlashAttention-2 as a tiled, pure-PyTorch autograd.Function (CS336 section 4.1).

The readable reference that the Triton kernel is debugged against. Forward: for each
query tile, one pass over the key tiles with an online softmax (running max m, running
sum l, rescaled accumulator), fp32 accumulators, output cast back to the input dtype.
Backward: recompute the probabilities from the saved logsumexp L (FlashAttention-2,
Algorithm 2), with D = rowsum(dO * O).

    from core.kernels.flash_torch import FlashAttentionTorch
    out = FlashAttentionTorch.apply(q, k, v, is_causal)   # q (..., N_q, d), k/v (..., N_k, d)
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from core.kernels._flash_common import autocast_dtype, check_inputs

TILE_Q = 64  # query rows per tile (>= 16)
TILE_K = 64  # key rows per tile (>= 16)


def _causal_mask(q0: int, q1: int, k0: int, k1: int, offset: int, device) -> Tensor:
    """(q1-q0, k1-k0) bool: True where key j is visible to query i (j <= i + offset)."""
    i = torch.arange(q0, q1, device=device)[:, None]
    j = torch.arange(k0, k1, device=device)[None, :]
    return j <= i + offset


def flash_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    """Tiled forward. Returns out (q's dtype) and logsumexp (fp32, shape (..., N_q))."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    offset = n_k - n_q  # bottom-right causal alignment
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for q0 in range(0, n_q, TILE_Q):
        q1 = min(q0 + TILE_Q, n_q)
        qi = q[..., q0:q1, :].float()                                   # (..., Bq, d)
        m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)    # (..., Bq)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)
        k_end = min(n_k, q1 + offset) if is_causal else n_k  # tiles above the diagonal skipped
        for k0 in range(0, max(k_end, 0), TILE_K):
            k1 = min(k0 + TILE_K, n_k)
            s = qi @ k[..., k0:k1, :].float().transpose(-2, -1) * scale  # (..., Bq, Bk)
            if is_causal and k1 - 1 > q0 + offset:                         # diagonal tile only
                s = s.masked_fill(~_causal_mask(q0, q1, k0, k1, offset, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ v[..., k0:k1, :].float()
            m = m_new
        l_safe = torch.where(l == 0, torch.ones_like(l), l)   # rows that see no key: output 0
        out[..., q0:q1, :] = (acc / l_safe.unsqueeze(-1)).to(q.dtype)
        lse[..., q0:q1] = m + torch.log(l)
    return out, lse


def flash_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Tiled backward by recomputation: dQ, dK, dV in the inputs' dtype."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    offset = n_k - n_q
    delta = (do.float() * o.float()).sum(dim=-1)                       # D_i = rowsum(dO * O)
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for k0 in range(0, n_k, TILE_K):
        k1 = min(k0 + TILE_K, n_k)
        kj, vj = k[..., k0:k1, :].float(), v[..., k0:k1, :].float()
        q_start = max(0, k0 - offset) // TILE_Q * TILE_Q if is_causal else 0
        for q0 in range(q_start, n_q, TILE_Q):
            q1 = min(q0 + TILE_Q, n_q)
            qi, doi = q[..., q0:q1, :].float(), do[..., q0:q1, :].float()
            s = qi @ kj.transpose(-2, -1) * scale
            if is_causal and k1 - 1 > q0 + offset:
                s = s.masked_fill(~_causal_mask(q0, q1, k0, k1, offset, q.device), float("-inf"))
            p = torch.exp(s - lse_safe[..., q0:q1].unsqueeze(-1))        # (..., Bq, Bk)
            dv[..., k0:k1, :] += p.transpose(-2, -1) @ doi
            dp = doi @ vj.transpose(-2, -1)
            ds = p * (dp - delta[..., q0:q1].unsqueeze(-1)) * scale
            dq[..., q0:q1, :] += ds @ kj
            dk[..., k0:k1, :] += ds.transpose(-2, -1) @ qi
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention-2 in tiled PyTorch: ``FlashAttentionTorch.apply(q, k, v, is_causal=False)``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
        check_inputs(q, k, v, "flash_torch")
        in_dtypes = (q.dtype, k.dtype, v.dtype)
        cast = autocast_dtype(q.device.type)
        if cast is not None:
            q, k, v = q.to(cast), k.to(cast), v.to(cast)
        with torch.autocast(q.device.type, enabled=False):
            out, lse = flash_forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = bool(is_causal)
        ctx.in_dtypes = in_dtypes
        return out

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = flash_backward(do.to(q.dtype), q, k, v, out, lse, ctx.is_causal)
        tq, tk, tv = ctx.in_dtypes
        return dq.to(tq), dk.to(tk), dv.to(tv), None
