"""The one parser for dtype names in configs: short names (bf16, fp16, fp32) and torch's own (bfloat16, ...)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from core.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def parse_dtype(value: Union[str, torch.dtype, None], key: str,
                allowed: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)) -> Optional[torch.dtype]:
    """`value` as a torch.dtype (None stays None); anything else, or a dtype outside `allowed`, is a one-line
    ConfigError naming `key`."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = DTYPES.get(str(value).removeprefix("torch."))
        if dtype is None:
            raise ConfigError(key, f"unknown dtype {value!r}", "use bf16, fp16 or fp32 (or bfloat16, float16, float32)")
    if dtype is not None and dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        written = repr(value) if isinstance(value, str) else repr(str(dtype).removeprefix("torch."))
        raise ConfigError(key, f"{written} is not supported here", f"use one of {names}")
    return dtype


def dtype_bytes(value: Union[str, torch.dtype, None], key: str, default: int = 4) -> int:
    """Bytes per element of a dtype name (`default` for None: fp32 gradients)."""
    dtype = parse_dtype(value, key)
    return default if dtype is None else dtype.itemsize
