"""Attention kernels: `flash_torch` (tiled PyTorch, the readable reference) and the `flash_triton` package
(Triton kernels, a Hopper backward in Gluon); `_flash_common` holds their input checks and float64 reference."""
