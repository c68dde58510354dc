"""The one dtype parser: every spelling the configs use maps to torch's dtype; anything else names its key."""
import pytest
import torch

from core.dtypes import dtype_bytes, parse_dtype
from core.errors import ConfigError


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("torch.bfloat16", torch.bfloat16), ("fp16", torch.float16),
                                        ("float16", torch.float16), ("fp32", torch.float32),
                                        ("float32", torch.float32), (torch.float16, torch.float16), (None, None)])
def test_names_parse(name, dtype):
    assert parse_dtype(name, "k") is dtype


def test_unknown_or_unsupported_names_their_key():
    with pytest.raises(ConfigError, match=r"^parallelism.comm_dtype: unknown dtype 'int8'"):
        parse_dtype("int8", "parallelism.comm_dtype")
    with pytest.raises(ConfigError, match=r"^parallelism.compute_dtype: 'fp16' is not supported here"):
        parse_dtype("fp16", "parallelism.compute_dtype", allowed=(torch.bfloat16,))


def test_bytes_per_element():
    assert [dtype_bytes(x, "k") for x in ("bf16", "float16", "fp32", None)] == [2, 2, 4, 4]
