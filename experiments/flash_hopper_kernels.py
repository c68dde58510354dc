"""The Hopper (Gluon) flash_triton kernels against the Triton kernels they replace and cuDNN, the kernels called
directly (no autograd), in one process:

    python3 experiments/flash_hopper_kernels.py --check                      # float64 checks, then the timings
    python3 experiments/flash_hopper_kernels.py --shapes 4x16x16384,8x16x8192,32x16x2048 --dims 128,96,80

Timed per shape (bf16, causal, medians of `triton.testing.do_bench`): the forward as the default config runs it
(the warp-specialised Gluon forward, `hopper_forward`) and the Triton forward; the backward as the warp-specialised
Gluon kernel (`backward: atomic_dq`) and as the Triton two-pass kernels; cuDNN's forward and backward through SDPA
(backward: `autograd.grad` on a saved output). At d = 128 the Triton kernels run at the autotuner's choices for
these shapes, pinned: forward 64x64 (4 warps, 3 stages), dQ 128x64 (8, 3), dK/dV 64x64 (4, 2); at other head dims
the autotuner runs. The Gluon kernels take d = 64, 80, 96 and 128 (elsewhere their columns show "-"), 80 and 96
as a 64-column part and a 16- or 32-column tail.
`--check` first runs forward+backward through `FlashAttentionTriton` against float64 attention on shapes that take
the Gluon kernels (causal and not, GQA, N_q != N_k, odd lengths, fp16, views of a fused qkv projection) and says
which kernels ran. Needs an sm_90 GPU and a Triton with Gluon. Writes a markdown table to `--out` (default
`outputs/bench/flash_hopper_kernels/<time>.md`).
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.kernels._flash_common import reference_attention  # noqa: E402
from core.kernels.flash_triton import FlashAttentionTriton, FlashConfig  # noqa: E402
from core.kernels.flash_triton import dispatch as ftd, hopper, hopper_forward  # noqa: E402
from experiments.results import default_out, write_result  # noqa: E402

# the autotuner's choices at d = 128 for the training grid's shapes (H100), pinned there
TRITON_TILES = {"fwd": (64, 64, 4, 3), "dq": (128, 64, 8, 3), "dkdv": (64, 64, 4, 2)}
GLUON = FlashConfig(backward="atomic_dq", hopper_fwd_d64_min_rows=0)  # Gluon fwd (tiles by row count) and bwd


def triton_config(d: int) -> FlashConfig:
    """The Triton forward and two-pass backward: pinned tiles at d = 128, the autotuner's elsewhere."""
    return FlashConfig(backward="two_pass", hopper_fwd=False, tiles=TRITON_TILES if d == 128 else {})


class _Counted:
    """Counts calls of a module function (which kernels a check ran), calling through to it."""

    def __init__(self, module, name: str):
        self.fn, self.calls = getattr(module, name), 0
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def check(lines: list[str], name: str, q, k, v, causal: bool, fwd_calls: _Counted, bwd_calls: _Counted,
          leaf=None, split=None) -> bool:
    """Forward+backward through FlashAttentionTriton (config GLUON) against float64; `leaf`/`split`: q, k, v are
    views of one leaf, rebuilt from its float64 copy by `split`."""
    fwd_calls.calls = bwd_calls.calls = 0
    leaves = (leaf,) if leaf is not None else (q, k, v)
    out = FlashAttentionTriton.apply(q, k, v, causal, GLUON)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = tuple(x.detach().double().requires_grad_() for x in leaves)
    rq, rk, rv = split(ref_leaves[0]) if split else ref_leaves
    if rk.shape[1] != rq.shape[1]:  # grouped-query: the reference repeats each KV head (autograd sums the group)
        rk, rv = (x.repeat_interleave(rq.shape[1] // rk.shape[1], 1) for x in (rk, rv))
    ref, _ = reference_attention(rq, rk, rv, causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    errs = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(grads, ref_grads)]
    tol = 5e-3 if q.dtype == torch.float16 else 2e-2
    ok = max(errs) < tol and all(torch.isfinite(x).all().item() for x in (out, *grads))
    lines.append(f"| {name} | {'PASS' if ok else 'FAIL'} | {' / '.join(f'{e:.1e}' for e in errs)} | "
                 f"{'Gluon' if fwd_calls.calls else 'Triton'} | {'Gluon' if bwd_calls.calls else 'Triton'} |")
    print(lines[-1], flush=True)
    return ok


def run_checks(lines: list[str], d: int) -> bool:
    fwd_calls, bwd_calls = _Counted(hopper_forward, "launch_fwd"), _Counted(hopper, "launch_ws")
    lines += [f"### correctness against float64 (relative max error), d = {d}", "",
              "| case | result | out / dq / dk / dv | forward | backward |", "|---|---|---|---|---|"]

    def qkv(b, h, n_q, n_k=None, h_kv=None, dtype=torch.bfloat16):
        q = torch.randn(b, h, n_q, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(b, h_kv or h, n_k or n_q, d, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))
        return q, k, v

    ok = True
    for name, args, causal in [("(2, 4, 2048) causal", qkv(2, 4, 2048), True),
                               ("(2, 4, 2048) non-causal", qkv(2, 4, 2048), False),
                               ("(1, 2, 8192) causal", qkv(1, 2, 8192), True),
                               ("GQA 8 query / 2 KV heads, (2, 8, 2048) causal", qkv(2, 8, 2048, h_kv=2), True),
                               ("N_q 2048 < N_k 3072 causal", qkv(1, 2, 2048, 3072), True),
                               ("N_q 4096 > N_k 2048 causal (rows that see no key)", qkv(1, 2, 4096, 2048), True),
                               ("odd N_q = N_k = 2049 causal", qkv(1, 2, 2049), True),
                               ("fp16 (1, 4, 2048) causal", qkv(1, 4, 2048, dtype=torch.float16), True)]:
        ok &= check(lines, name, *args, causal, fwd_calls, bwd_calls)
    qkv_leaf = torch.randn(2, 2048, 12, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def split(x):  # the model's layout: (B, H, T, d) views of a fused (B, T, 3H, d) projection
        return x.transpose(1, 2).split([4, 4, 4], dim=1)

    ok &= check(lines, "views of a fused qkv projection (2, 4, 2048) causal", *split(qkv_leaf), True, fwd_calls,
                bwd_calls, leaf=qkv_leaf, split=split)
    hopper_forward.launch_fwd, hopper.launch_ws = fwd_calls.fn, bwd_calls.fn
    lines.append("")
    return ok


def _ms(t: float, ref: float) -> str:
    """A time in ms and its ratio to ref; "-" for a kernel that does not run at this shape."""
    return "-" if math.isnan(t) else f"{t:.3f} ({t / ref:.2f})"


def run_timings(lines: list[str], shapes: list[tuple[int, int, int]], d: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import triton

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    gluon_bwd = d in hopper.HEAD_DIMS
    triton_cfg = triton_config(d)
    lines += [f"### kernels alone, d = {d}, bf16, causal: ms (ratio to cuDNN)", "",
              "| B, H, S | fwd Gluon | fwd Triton | fwd cuDNN | bwd Gluon | bwd Triton two-pass | bwd cuDNN | "
              "fwd+bwd default policy / cuDNN | Gluon fwd TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for b, h, s in shapes:
        try:
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            do = torch.randn_like(q)
            t = {"fwd_gluon": bench(lambda: ftd.flash_fwd_impl(q, k, v, True, GLUON)),
                 "fwd_triton": bench(lambda: ftd.flash_fwd_impl(q, k, v, True, triton_cfg))}
            o, lse = ftd.flash_fwd_impl(q, k, v, True, GLUON)
            t["bwd_gluon"] = (bench(lambda: ftd.flash_bwd_impl(do, q, k, v, o, lse, True, "atomic_dq", GLUON))
                              if gluon_bwd else float("nan"))
            t["bwd_triton"] = bench(lambda: ftd.flash_bwd_impl(do, q, k, v, o, lse, True, "two_pass", triton_cfg))
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                t["fwd_cudnn"] = bench(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True))
                oc = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                t["bwd_cudnn"] = bench(lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True))
            # the default policy: the Gluon forward (at d = 64 from hopper_fwd_d64_min_rows), and the backward
            # `dispatch._default_bwd` picks (the Gluon one from `ws_min_rows` rows at the head dim)
            cfg = FlashConfig()
            fwd = t["fwd_gluon"] if d != 64 or s >= cfg.hopper_fwd_d64_min_rows else t["fwd_triton"]
            bwd = t["bwd_gluon"] if ftd._default_bwd(q, k, do, True, cfg) == ftd.BWD_ATOMIC_DQ else t["bwd_triton"]
            fc, bc = t["fwd_cudnn"], t["bwd_cudnn"]
            flops = 4 * b * h * s * s * d / 2
            lines.append(f"| {b}, {h}, {s} | {t['fwd_gluon']:.3f} ({t['fwd_gluon'] / fc:.2f}) | "
                         f"{t['fwd_triton']:.3f} ({t['fwd_triton'] / fc:.2f}) | {fc:.3f} | "
                         f"{_ms(t['bwd_gluon'], bc)} | {t['bwd_triton']:.3f} "
                         f"({t['bwd_triton'] / bc:.2f}) | {bc:.3f} | {(fwd + bwd) / (fc + bc):.2f} | "
                         f"{flops / t['fwd_gluon'] / 1e9:.0f} |")
            del q, k, v, do, o, lse, qg, kg, vg, oc
        except Exception:  # one shape's failure (memory, a compile) is reported, the others still run
            lines.append(f"| {b}, {h}, {s} | error: {traceback.format_exc(limit=1).splitlines()[-1]} |")
        print(lines[-1], flush=True)
    lines.append("")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4x16x16384,8x16x8192,32x16x2048", help="BxHxS, comma-separated")
    ap.add_argument("--dims", default="128,96,80", help="head dims, comma-separated (the Gluon forward's: 64, 80, "
                    "96, 128)")
    ap.add_argument("--check", action="store_true", help="first check the kernels against float64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 3 for s in shapes)
    except (ValueError, AssertionError):
        print(f"--shapes: {args.shapes!r} is not a list of BxHxS (e.g. 4x16x16384,8x16x8192)", file=sys.stderr)
        return 2
    try:
        dims = [int(x) for x in args.dims.split(",")]
        assert all(d in hopper_forward.HEAD_DIMS for d in dims)
    except (ValueError, AssertionError):
        print(f"--dims: {args.dims!r} is not a list of the Gluon forward's head dims "
              f"{', '.join(map(str, hopper_forward.HEAD_DIMS))}", file=sys.stderr)
        return 2
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and hopper.HAVE_GLUON and hopper_forward.HAVE_GLUON):
        print("needs an sm_90 GPU (H100 / H200) and a Triton with Gluon: the kernels measured here are Hopper's",
              file=sys.stderr)
        return 2
    import triton
    lines = ["# flash_triton Hopper kernels", "",
             f"- device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
             f"- command: `python3 experiments/flash_hopper_kernels.py {' '.join(argv or sys.argv[1:])}`", ""]
    ok = all([run_checks(lines, d) for d in dims]) if args.check else True
    for d in dims:
        run_timings(lines, shapes, d)
    print(f"written to {write_result(args.out or default_out('flash_hopper_kernels'), chr(10).join(lines) + chr(10))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
