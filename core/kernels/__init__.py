"""Attention kernels. Importing the package installs flash_native's C++ autograd node as the eager CUDA path of
`flash_triton.FlashAttentionTriton` (flash_native imports flash_triton, never the reverse; the node builds on first
use, and only where CUDA and a tested Triton are present)."""
from core.kernels import flash_native  # noqa: F401
