"""NVTX ranges that cost nothing unless profiling is on (a leaf module: the model and attention import it).

`nvtx_range` is called from hot code (every block, inside attention), so when
profiling is off it returns a shared null context instead of touching CUDA.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

_ENABLED = False
_NULL = contextlib.nullcontext()


def set_nvtx_enabled(enabled: bool) -> None:
    """Turn NVTX annotation on (profile mode on a CUDA device) or off."""
    global _ENABLED
    _ENABLED = bool(enabled) and torch.cuda.is_available()


def nvtx_range(name: str) -> ContextManager:
    """A `torch.cuda.nvtx.range(name)` when profiling, else a no-op context."""
    if not _ENABLED or torch.compiler.is_compiling():
        return _NULL
    return torch.cuda.nvtx.range(name)
