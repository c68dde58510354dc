"""Host (CPU) cost per call of attention forward / forward+backward, on problems small enough that the GPU
keeps up with the host, so the time per call is what the host spends enqueueing it.

    python3 experiments/flash_host_cost.py [--seq 256] [--dim 64] [--calls 400] [--out FILE]

Rows: SDPA's flash backend, an empty `torch.autograd.Function` (the floor of any Python autograd op) and
`flash_triton`. At short sequences (B = H = 1) `triton.testing.do_bench` reads this host time, not the
kernels' (docs/attention.md). The device VM's host time drifts by tens of percent within a minute, so the
rows are measured round-robin and each keeps its best round.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def _per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import core.kernels.flash_triton as ft

    shape = (1, 1, args.seq, args.dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def sdpa_fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), g)

    def empty_fwd_bwd():
        torch.autograd.grad(_Identity.apply(q, k, v), (q, k, v), g, allow_unused=True)

    def ours_fwd():
        with torch.no_grad():
            ft.FlashAttentionTriton.apply(q, k, v, True)

    def ours_fwd_bwd():
        torch.autograd.grad(ft.FlashAttentionTriton.apply(q, k, v, True), (q, k, v), g)

    rows = [("sdpa_flash", "fwd", sdpa_fwd), ("sdpa_flash", "fwd+bwd", sdpa_fwd_bwd),
            ("empty autograd.Function", "fwd+bwd", empty_fwd_bwd),
            ("flash_triton", "fwd", ours_fwd), ("flash_triton", "fwd+bwd", ours_fwd_bwd)]
    for _, _, fn in rows:  # warm-up: compiles and autotuning
        for _ in range(20):
            fn()
    best = {(name, what): float("inf") for name, what, _ in rows}
    for _ in range(args.rounds):
        for name, what, fn in rows:
            best[name, what] = min(best[name, what], _per_call_us(fn, args.calls))
    results = [(name, best.get((name, "fwd")), best[name, "fwd+bwd"])
               for name in dict.fromkeys(name for name, _, _ in rows)]

    lines = [f"Host us per call, (1, 1, {args.seq}, {args.dim}) bf16 causal, best of {args.rounds} round-robin "
             f"rounds of {args.calls} calls; {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| impl | fwd us | fwd+bwd us |", "|---|---|---|"]
    for name, f, fb in results:
        lines.append(f"| {name} | {'-' if f is None else f'{f:.1f}'} | {fb:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
