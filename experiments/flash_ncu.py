"""One forward+backward of each attention implementation, for Nsight Compute to profile.

    ncu --profile-from-start off --set full -o attn python3 experiments/flash_ncu.py \
        --impls flash_triton,flash_triton_atomic,sdpa_cudnn --shape 1,16,16384,64
    ncu -i attn.ncu-rep --page details

Every implementation is first run (and autotuned) outside the profiled range; then each runs one
forward+backward between `cudaProfilerStart` / `cudaProfilerStop`, inside an NVTX range named after it,
so `--profile-from-start off` captures exactly those kernels. Impl names as in attention_bench.py
(pinned tiles too: ``flash_triton@dkdv=64x64x4x3x168``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_bench import make_impl  # noqa: E402  (it puts the repository root on sys.path)

from core.dtypes import parse_dtype  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="flash_triton,sdpa_cudnn")
    ap.add_argument("--shape", default="1,16,16384,64", help="B,H,S,D")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    dtype = parse_dtype(args.dtype, "--dtype")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((b, h, s, d), device="cuda", dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn((b, h, s, d), device="cuda", dtype=dtype, generator=gen)
    fns = {name: make_impl(name) for name in args.impls.split(",")}

    def step(fn):
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    for fn in fns.values():  # compiles and autotuning stay outside the profiled range
        for _ in range(args.warmup):
            step(fn)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in fns.items():
        torch.cuda.nvtx.range_push(name)
        step(fn)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(fns))


if __name__ == "__main__":
    main()
