"""Shared input checks and float64 reference for the FlashAttention kernels.

Both kernels take q of shape (..., N_q, d) and k, v of shape (..., N_k, d) with the
same leading (batch, head) dimensions. Causal masking with N_q != N_k is bottom-right
aligned: query i sees keys j <= i + N_k - N_q (as SDPA and FlashAttention do).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from core.errors import ConfigError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # any head dim up to this; the Triton kernels pad it to a power of two with masks


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype if autocast is on for `device_type`, else None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # device types autocast does not know
        return None
    return None


def _gqa_heads(qs, ks) -> bool:
    """q and k shapes of grouped-query attention: the same batch dims, k's heads (dim -3) a divisor of q's."""
    return len(qs) >= 3 and len(ks) == len(qs) and qs[:-3] == ks[:-3] and ks[-3] > 0 and qs[-3] % ks[-3] == 0


def check_inputs(q: Tensor, k: Tensor, v: Tensor, who: str, gqa: bool = False) -> None:
    """Raise a one-line ConfigError for anything the kernels do not support. `gqa`: k and v may have fewer heads
    (dim -3) than q, a divisor of q's (grouped-query attention)."""
    try:  # the common case in one expression: this runs on every attention call (host-bound when short)
        qs, ks = q.shape, k.shape
        if (len(qs) >= 2 and ks == v.shape and (qs[:-2] == ks[:-2] or gqa and _gqa_heads(qs, ks))
                and ks[-1] == qs[-1]
                and 0 < qs[-1] <= MAX_HEAD_DIM and qs[-2] > 0 and ks[-2] > 0
                and q.dtype in SUPPORTED_DTYPES and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
            return
    except AttributeError:  # not tensors: the checks below say which
        pass
    key = f"{who}.inputs"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ConfigError(key, f"{name} has shape {tuple(t.shape)}, need (..., seq, head_dim)",
                              "pass tensors of at least 2 dimensions")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(key, f"{name} has dtype {t.dtype}",
                              "use float32, float16 or bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ConfigError(key, f"dtypes differ (q {q.dtype}, k {k.dtype}, v {v.dtype})",
                          "cast q, k and v to one dtype")
    if not (q.device == k.device == v.device):
        raise ConfigError(key, f"devices differ (q {q.device}, k {k.device}, v {v.device})",
                          "move q, k and v to one device")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ConfigError(key, f"head dims differ (q {d}, k {k.shape[-1]}, v {v.shape[-1]})",
                          "give q, k and v the same last dimension")
    if not 0 < d <= MAX_HEAD_DIM:
        raise ConfigError(key, f"head dim {d} is not supported",
                          f"use a head dim from 1 to {MAX_HEAD_DIM} (or attention_impl=sdpa)")
    if k.shape != v.shape:
        raise ConfigError(key, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape",
                          "give k and v the same shape")
    if q.shape[:-2] != k.shape[:-2] and not (gqa and _gqa_heads(q.shape, k.shape)):
        fix = ("give k and v q's batch dims and a number of heads (dim -3) that divides q's" if gqa
               else "expand k and v to q's batch/head dims (grouped-query: repeat_kv)")
        raise ConfigError(key, f"leading dims differ (q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])})", fix)
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ConfigError(key, "empty sequence", "pass at least one query and one key")


def reference_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) in float64 with the full score matrix: the test oracle."""
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float64).min))
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key give zeros, like the kernels
    return p @ v, lse
