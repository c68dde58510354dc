"""Attention implementations: the `attention_impl` plugins.

Every implementation is a callable ``impl(q, k, v, is_causal) -> out`` with
q of shape (B, H, T_q, D) and k, v of shape (B, H_kv, T_k, D), where H_kv divides H
(grouped-query attention). The model never branches on which one it has.

A kernel written as a ``torch.autograd.Function`` with the signature
``Fn.apply(q, k, v, is_causal)`` plugs in through `KernelAttention`, named by its
dotted path in the config (``kernel: core.kernels.flash_triton.FlashAttentionTriton``);
a kernel with options takes them as a fifth argument, ``Fn.apply(q, k, v, is_causal, config)``,
the object the plugin's ``config:`` block instantiates (flash_triton's `FlashConfig`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from hydra.utils import get_object
from torch import Tensor

from core.errors import ConfigError
from core.nvtx import nvtx_range


def repeat_kv(k: Tensor, n_heads: int) -> Tensor:
    """Expand k or v from H_kv to H heads for kernels that do not handle GQA natively."""
    n_kv = k.shape[-3]
    if n_kv == n_heads:
        return k
    return k.repeat_interleave(n_heads // n_kv, dim=-3)


class AttentionImpl:
    """Base class: maps (q, k, v, is_causal) to the attention output, shape of q."""

    name = "base"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def naive_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(d)) v with the full score matrix materialised (CS336 1.3)."""
    k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])
    with nvtx_range("attn.scores"):
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if is_causal:
            t_q, t_k = q.shape[-2], k.shape[-2]
            # bottom-right aligned, like SDPA and FlashAttention when T_q != T_k
            mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
            scores = scores.masked_fill(~mask, float("-inf"))
    with nvtx_range("attn.softmax"):
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    with nvtx_range("attn.output"):
        return torch.matmul(probs, v)


class NaiveAttention(AttentionImpl):
    """Materialised-softmax attention in plain PyTorch ops."""

    name = "naive"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
        return naive_attention(q, k, v, is_causal)


class CompiledAttention(AttentionImpl):
    """`torch.compile` of the naive implementation (fusion without a hand-written kernel)."""

    name = "compiled"

    def __init__(self, mode: str | None = None, dynamic: bool = False) -> None:
        self.mode = mode
        self._fn = torch.compile(naive_attention, mode=mode, dynamic=dynamic)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
        return self._fn(q, k, v, is_causal)


_SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


class SDPAAttention(AttentionImpl):
    """`F.scaled_dot_product_attention`, optionally pinned to one backend."""

    name = "sdpa"

    def __init__(self, backend: str = "auto") -> None:
        if backend not in _SDPA_BACKENDS:
            raise ConfigError("attention_impl.backend", f"unknown SDPA backend {backend!r}",
                              f"use one of {', '.join(_SDPA_BACKENDS)}")
        self.backend = backend
        self.name = "sdpa" if backend == "auto" else f"sdpa[{backend}]"
        self._backends = None
        if backend != "auto":
            from torch.nn.attention import SDPBackend
            self._backends = [{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
        # GQA through SDPA's own enable_gqa where heads differ (no copy of k and v)
        gqa = k.shape[-3] != q.shape[-3]
        if is_causal and q.shape[-2] != k.shape[-2]:
            # SDPA's is_causal is top-left aligned; use an explicit bottom-right mask instead
            t_q, t_k = q.shape[-2], k.shape[-2]
            mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
            return self._sdpa(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=gqa)
        return self._sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
        if self._backends is None:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(self._backends):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    def __repr__(self) -> str:
        return f"SDPAAttention(backend={self.backend!r})"


class KernelAttention(AttentionImpl):
    """Adapter for a kernel `torch.autograd.Function` ``Fn.apply(q, k, v, is_causal)``.

    `kernel` is the Function's dotted import path. Set `native_gqa` when the kernel
    accepts k, v with fewer heads than q; otherwise k and v are expanded first. `name` is what
    results tables and summary.json call it (default: the Function's class name). `config`, when
    given, is passed to every call as the Function's fifth argument (the kernel's own options object).
    """

    def __init__(self, kernel: str, native_gqa: bool = False, name: str | None = None,
                 config: object | None = None) -> None:
        try:
            fn = get_object(kernel)
        except Exception as e:  # ImportError, AttributeError, hydra's own wrapper
            raise ConfigError("attention_impl.kernel", f"cannot import {kernel!r} ({e})",
                              "name an existing torch.autograd.Function by its dotted path") from None
        self.kernel = kernel
        self.native_gqa = native_gqa
        self.config = config
        self._apply: Callable[..., Tensor] = fn.apply
        self._extra: tuple = () if config is None else (config,)
        self.name = name or kernel.rsplit(".", 1)[-1]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
        if not self.native_gqa:
            k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])
        return self._apply(q, k, v, is_causal, *self._extra)

    def __repr__(self) -> str:
        extra = "" if self.config is None else f", config={self.config!r}"
        return f"KernelAttention(kernel={self.kernel!r}{extra})"
