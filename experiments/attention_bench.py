"""Attention benchmark: the CS336 section-4 table, and the CS336 leaderboard shape.

Standalone (torch, triton, numpy only; no hydra), one command per table:

    python3 experiments/attention_bench.py --preset leaderboard --check
    python3 experiments/attention_bench.py --preset sweep
    python3 experiments/attention_bench.py --preset quick            # a few shapes, seconds
    python3 experiments/attention_bench.py --preset training         # the shapes training runs use (below)

The `training` preset is the grid a training run hands the kernel: B x H x S about 1M (B x S = 64K tokens, S = 512
to 16384, H = 16; `--tokens` sets another B x S), head dims 64, 80 (the CS336 xl / 2.7B models), 96 and 128, bf16
(`--dtypes bf16,fp16` adds fp16; `--causal both` adds non-causal rows; `--gqa` adds grouped-query rows, 4 query
heads per KV head, `--gqa only` runs only those), ours against SDPA's flash and cuDNN backends, medians over 3
interleaved rounds. `--layout model` hands every implementation its inputs as the model does (q, k, v views of the
fused projection, dO laid out (B, S, H, d)) instead of dense (B, H, S, d) tensors.

The table is printed and written to `--out` (default `outputs/bench/attention_bench/<time>_<preset>.md`).

Every implementation is timed in the same process, side by side, with
`triton.testing.do_bench` (median, L2 flushed between calls): naive PyTorch, the same
under `torch.compile`, SDPA pinned to its flash and cuDNN backends, `flash_torch`
(small sizes only) and `flash_triton` (backward variants: `flash_triton` two-pass,
`flash_triton_atomic` one pass with atomic fp32 dQ, `flash_triton_fused` one fused launch).
Causal throughout. FLOPs counted as
forward = 4 * B * H * S^2 * D / 2 (causal), backward = 2.5x, forward+backward = 3.5x;
the fraction of the matmul ceiling uses a large matmul measured in the same run (fp32
rows: TF32, which every fp32 implementation here is allowed to use). Out-of-memory is
reported as OOM and the sweep continues. Peak memory is the extra memory one
forward+backward allocates beyond its inputs.

`--graph` adds two columns: fwd and fwd+bwd replayed as CUDA graphs, i.e. the kernels' GPU time
without the host's launch path (Python, autograd, dispatch). At B = H = 1 and S <= 4096 every
implementation's eager time is mostly that host path; the graph columns compare the kernels.

A flash_triton variant is its `FlashConfig` (core/kernels/flash_triton/config.py) with overrides after an `@`,
comma-separated: a kernel's tiles, ``flash_triton@fwd=128x64x8x3,dq=128x64x8x3,dkdv=64x128x8x3`` (BLOCK_M x
BLOCK_N x warps x stages, and optionally x maxnreg, a cap on registers per thread: ``dkdv=64x64x4x3x168``;
``flash_triton_fused@fused=64x64x4x3`` for the fused backward kernel), or any config field:
``flash_triton@hopper_ws=0`` (no warp-specialised Gluon backward on Hopper: the two-pass or Triton atomic-dQ
backward runs instead), ``flash_triton@split_merge=separate`` (the split-KV forward in two launches, split kernel
then merge kernel), ``flash_triton@split_kv=0``, ``flash_triton@backward=two_pass``. `flash_triton_atomic` and
`flash_triton_fused` are `flash_triton@backward=atomic_dq` and `@backward=fused`.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from core.dtypes import parse_dtype  # noqa: E402
from experiments.results import default_out, write_result  # noqa: E402


class Shape(NamedTuple):
    """One row of a table: q is (b, h, s, d); k and v have kv_heads heads (grouped-query attention) or h."""
    b: int
    h: int
    s: int
    d: int
    dtype: torch.dtype
    causal: bool = True
    kv_heads: int = 0  # 0: as many as q
    layout: str = "dense"  # or "model": `make_inputs`

    @property
    def kv(self) -> int:
        return self.kv_heads or self.h


LAYOUTS = ("dense", "model")


def make_inputs(shape: Shape, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and dO for a row: dense (B, H, S, d) tensors, or laid out as the model hands them
    over (layout "model"): q, k, v views of one fused (B, S, H + 2 KV, d) projection, dO a (B, S, H, d) tensor
    seen as (B, H, S, d), the output projection's gradient."""
    b, h, s, d, dtype = shape[:5]
    if shape.layout == "model":
        qkv = torch.randn(b, s, h + 2 * shape.kv, d, device=device, dtype=dtype, requires_grad=True)
        q, k, v = qkv.transpose(1, 2).split([h, shape.kv, shape.kv], dim=1)
        return q, k, v, torch.randn(b, s, h, d, device=device, dtype=dtype).transpose(1, 2)
    q = torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, shape.kv, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(b, h, s, d, device=device, dtype=dtype)

ALL_IMPLS = ("naive", "compiled", "sdpa_flash", "sdpa_cudnn", "flash_torch", "flash_triton", "flash_triton_atomic",
             "flash_triton_fused")
# each flash_triton impl name's config overrides (FlashConfig.with_overrides), before the name's own `@...`
TRITON_VARIANTS = {"flash_triton": "", "flash_triton_atomic": "backward=atomic_dq",
                   "flash_triton_fused": "backward=fused"}
FLASH_TORCH_MAX_SEQ = 1024
# the training preset: a global batch of TRAINING_TOKENS tokens per step at each sequence length
TRAINING_TOKENS, TRAINING_HEADS = 65536, 16
TRAINING_SEQS = (512, 2048, 8192, 16384)
TRAINING_DIMS = (64, 80, 96, 128)
TRAINING_IMPLS = ("flash_triton", "sdpa_flash", "sdpa_cudnn")
TRAINING_GQA = 4  # --gqa: 4 query heads per KV head
MODES = ("fwd", "bwd", "fwd_bwd")


def naive_attention(q, k, v, is_causal=True):
    """softmax(q k^T / sqrt(d)) v with the full score matrix (same as core.attention.naive_attention)."""
    s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        t_q, t_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


_compiled = None


def _expanding_kv(fn):
    """fn(q, k, v, causal) for a kernel without grouped-query attention of its own: k and v expanded to q's heads
    first, as the model's `KernelAttention` does (the copy is part of what a training step pays)."""
    def run(q, k, v, causal=True):
        if k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return fn(q, k, v, causal)
    return run


def make_impl(name: str):
    """Map an impl name to fn(q, k, v, causal=True) -> out (k, v may have fewer heads than q), or raise
    NotImplementedError if it cannot run."""
    global _compiled
    base, _, spec = name.partition("@")
    if base == "naive":
        return _expanding_kv(naive_attention)
    if base == "compiled":
        if _compiled is None:
            # the bwd timing replays one graph (retain_graph=True): no donated buffers
            import torch._functorch.config as functorch_config
            functorch_config.donated_buffer = False
            _compiled = torch.compile(naive_attention, dynamic=True)
        return _expanding_kv(lambda q, k, v, causal: _compiled(q, k, v, causal))
    if base in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.FLASH_ATTENTION if base == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION

        def sdpa(q, k, v, causal=True):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
        return sdpa
    if base == "flash_torch":
        from core.kernels.flash_torch import FlashAttentionTorch
        return _expanding_kv(FlashAttentionTorch.apply)
    if base in TRITON_VARIANTS:  # _atomic: one-pass backward, atomic fp32 dQ; _fused: one fused bwd launch
        from core.kernels.flash_triton import FlashAttentionTriton
        cfg = triton_config(name)

        def fa(q, k, v, causal=True):  # grouped-query attention natively: k, v keep their heads
            return FlashAttentionTriton.apply(q, k, v, causal, cfg)
        return fa
    raise ValueError(f"unknown impl {name!r}: use one of {', '.join(ALL_IMPLS)} (flash_triton@..., "
                     "flash_triton_fused@fused=... for pinned tiles)")


def triton_config(name: str):
    """The FlashConfig of a flash_triton impl name: its variant's overrides, then those after `@`."""
    from core.kernels.flash_triton import FlashConfig
    base, _, spec = name.partition("@")
    return FlashConfig().with_overrides(TRITON_VARIANTS[base]).with_overrides(spec)


def attn_flops(b: int, h: int, s: int, d: int, mode: str, causal: bool = True) -> float:
    fwd = 4 * b * h * s * s * d / (2 if causal else 1)  # causal: half the score matrix
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def matmul_ceiling(dtype: torch.dtype, warmup: int, rep: int) -> float:
    """TFLOP/s of a large random matmul in `dtype` (fp32 runs as TF32, as in the attention rows)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = do_bench(lambda: a @ b, warmup=warmup, rep=rep, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def graph_ms(step, warmup: int, rep: int) -> float:
    """Median ms of one CUDA-graph replay of step(): the GPU's time for its kernels with the host's
    launch path (Python, autograd, dispatch) taken out, for implementations alike."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")


def _one_call_ms(fn) -> float:
    """One call's time (ms), synchronized: what `_bench` sizes its repetitions by."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _bench(fn, warmup: float, rep: float, min_calls: int) -> float:
    """do_bench's median (L2 flushed before each call) over at least min_calls timed calls: do_bench sizes its
    repetitions to `rep` ms, which leaves a few calls, or one, where a call takes tens of ms."""
    fn()  # do_bench's own estimate should not meet a first call's allocations
    return do_bench(fn, warmup=warmup, rep=max(rep, min_calls * _one_call_ms(fn)), return_mode="median")


def _prepare(fn_causal, res: dict, shape: Shape, graph: bool = False) -> dict:
    """An implementation's inputs for a row, compiled / autotuned by a first fwd+bwd, its peak extra memory of one
    fwd+bwd (MiB) in res; returns the calls each mode times (`MODES`, and with graph the CUDA-graph replays')."""
    q, k, v, do = make_inputs(shape)

    def fn(q, k, v):
        return fn_causal(q, k, v, shape.causal)
    leaves = [q, k, v] if q._base is None else [q._base]  # the model layout's grads land in the projection

    def clear_grads():
        for t in leaves:
            t.grad = None
    fn(q, k, v).backward(do)  # compile / autotune outside the timings
    clear_grads()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    res["mem_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    clear_grads()
    out = fn(q, k, v)

    def fwd():
        with torch.no_grad():
            fn(q, k, v)
    calls = {"fwd": fwd, "bwd": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
             "fwd_bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)}
    if graph:
        calls["fwd_graph"] = fwd
        calls["fwd_bwd_graph"] = calls["fwd_bwd"]
    return calls


def _failure(e: Exception) -> dict:
    """A cell's result for an exception: out of memory, or an error (e.g. a backend that refuses the shape)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return {"oom": True}
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return {"oom": True} if "out of memory" in msg.lower() else {"error": msg[:80]}


_FAILURES = (torch.cuda.OutOfMemoryError, RuntimeError, NotImplementedError, ValueError)


def bench_round(impls: list[str], fns: dict, shape: Shape, warmup, rep, graph: bool = False,
                min_calls: int = 1) -> dict[str, dict]:
    """One round of a row: every implementation's inputs prepared (`_prepare`), then each mode timed for every
    implementation in turn (impls' order), so the times a ratio compares are taken next to each other, the card in
    the same state (timing one implementation's modes, then the next's, let the other's backward heat the card before
    its forward was timed). Returns per implementation the times (ms) for fwd, bwd, fwd_bwd (and with graph,
    fwd_graph and fwd_bwd_graph: CUDA-graph replays) and the peak extra memory (MiB) of one fwd+bwd."""
    res: dict[str, dict] = {impl: {} for impl in impls}
    calls = {}
    try:
        for impl in impls:
            try:
                calls[impl] = _prepare(fns[impl], res[impl], shape, graph)
            except _FAILURES as e:
                res[impl] = _failure(e)
        for mode in (*MODES, *(("fwd_graph", "fwd_bwd_graph") if graph else ())):
            for impl in calls:
                if "oom" in res[impl] or "error" in res[impl]:
                    continue
                try:
                    if mode.endswith("_graph"):
                        res[impl][mode] = graph_ms(calls[impl][mode], warmup, rep)
                    else:
                        res[impl][mode] = _bench(calls[impl][mode], warmup, rep, min_calls)
                except _FAILURES as e:
                    if not (mode.endswith("_graph") and isinstance(e, RuntimeError)):
                        res[impl] = _failure(e)
                    elif mode == "fwd_graph":  # an implementation that cannot be captured: its graph cells stay empty
                        print(f"  (no CUDA graph: {str(e).splitlines()[0][:80]})", flush=True)
    finally:
        calls.clear()  # the inputs go with the calls
        torch.cuda.empty_cache()
    return res


CHECK_CASES = [  # (B, H, N_q, N_k, D), dtype, pinned tiles or None (autotuned)
    ((2, 3, 257, 257, 64), torch.bfloat16, None),
    ((1, 2, 200, 333, 128), torch.bfloat16, None),
    ((1, 2, 333, 200, 32), torch.float16, None),
    ((2, 2, 129, 129, 16), torch.float32, None),
    ((1, 1, 190, 190, 96), torch.bfloat16, None),
    # fused pinned with BLOCK_M != BLOCK_N: unequal query / key tile counts, some programs skip a phase
    ((1, 2, 300, 300, 64), torch.bfloat16, dict(fwd=(64, 32, 4, 2), dq=(64, 32, 4, 2), dkdv=(32, 64, 4, 2),
                                               fused=(64, 32, 4, 2))),
]


def check_correctness(cases=CHECK_CASES, variants=("flash_triton",)) -> list[str]:
    """flash_triton against a float64 reference on the GPU (out, lse, dq, dk, dv); poisoned outputs.

    variants: impl names from TRITON_VARIANTS (backward variants), each checked on every case."""
    from core.kernels import flash_triton as ft
    from core.kernels._flash_common import reference_attention
    lines = ["| impl | shape (B,H,Nq,Nk,D) | dtype | causal | out | lse | dq | dk | dv |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    worst = 0.0
    for (b, h, nq, nk, d), dtype, pins in cases:
        for variant in variants:
            cfg = triton_config(variant).replace(tiles=pins or {}, poison_outputs=True)
            for causal in (True, False):
                # non-contiguous q (B, T, H, D) transposed, as the model passes it
                q = torch.randn(b, nq, h, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
                k = torch.randn(b, h, nk, d, device="cuda", dtype=dtype, requires_grad=True)
                v = torch.randn(b, h, nk, d, device="cuda", dtype=dtype, requires_grad=True)
                o = ft.FlashAttentionTriton.apply(q, k, v, causal, cfg)
                do = torch.randn_like(o)
                o.backward(do)
                _, lse = ft.flash_attention_with_lse(q.detach(), k.detach(), v.detach(), causal, cfg)
                qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
                ro, rl = reference_attention(qr, kr, vr, causal)
                ro.backward(do.double())

                def rel(a, r):
                    if torch.isnan(a).any():
                        return float("nan")
                    return ((a.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
                fin = torch.isfinite(rl)
                errs = [rel(o, ro), (lse.double()[fin] - rl[fin]).abs().max().item(),
                        rel(q.grad, qr.grad), rel(k.grad, kr.grad), rel(v.grad, vr.grad)]
                worst = max([worst] + [e if e == e else float("inf") for e in errs])
                lines.append(f"| {variant} | {b},{h},{nq},{nk},{d}{' pinned' if pins else ''} | {str(dtype)[6:]} | "
                             f"{causal} | "
                             + " | ".join(f"{e:.1e}" for e in errs) + " |")
                print(lines[-1], flush=True)
    lines.append(f"\nworst relative error: {worst:.2e} ({'PASS' if worst < 2e-2 else 'FAIL'})")
    return lines


def fmt_ms(r: dict, mode: str) -> str:
    if r.get("oom"):
        return "OOM"
    if "error" in r:
        return "n/a" if "fp32" in r["error"] else "error"
    return f"{r[mode]:.3f}" if mode in r else "-"


def _median_result(runs: list[dict]) -> dict:
    """Per mode, the median over rounds (a failed round fails the cell)."""
    for r in runs:
        if "oom" in r or "error" in r:
            return r
    out = dict(runs[0])
    for mode in runs[0]:
        vals = sorted(r[mode] for r in runs if mode in r)
        out[mode] = vals[len(vals) // 2]
    return out


def run_table(configs, impls, warmup, rep, ceilings, out_lines, label, graph: bool = False, rounds: int = 1,
              min_calls: int = 1):
    """configs: list of Shape. Returns results[(shape, impl)] = dict, its "rounds" the per-round results. With
    rounds > 1 every implementation of a row is measured once per round (`bench_round`: each mode for the
    implementations in turn, in reverse order every second round, so neither always runs first, on a GPU that the
    one before left hotter or cooler), and each time is the median over the rounds (the host's speed drifts by tens
    of percent between seconds on a virtual machine, the GPU's clocks with its power draw). Every time is a median of
    at least min_calls calls (`_bench`)."""
    results = {}
    hdr = ("| dtype | B,H | KV | S | D | causal | impl | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s (% ceil) "
           "| fwd+bwd TFLOP/s (% ceil) | peak extra MiB |" + (" fwd graph ms | fwd+bwd graph ms |" if graph else ""))
    out_lines += [f"\n### {label}\n", hdr, "|" + "---|" * (15 if graph else 13)]
    print("\n".join(out_lines[-3:]), flush=True)
    for shape in configs:
        b, h, s, d, dtype = shape[:5]
        ceil = ceilings[dtype]
        row_impls = [i for i in impls if not (i.partition("@")[0] == "flash_torch" and s > FLASH_TORCH_MAX_SEQ)]
        runs: dict[str, list] = {impl: [] for impl in row_impls}
        no_fp32 = [i for i in row_impls if i.partition("@")[0].startswith("sdpa") and dtype == torch.float32]
        fns = {impl: make_impl(impl) for impl in row_impls if impl not in no_fp32}
        for rnd in range(rounds):
            order = [i for i in (row_impls if rnd % 2 == 0 else row_impls[::-1]) if i not in no_fp32]
            for impl, r in bench_round(order, fns, shape, warmup, rep, graph, min_calls).items():
                runs[impl].append(r)
            for impl in no_fp32:
                runs[impl].append({"error": "backend has no fp32"})
        for impl in row_impls:
            r = {**_median_result(runs[impl]), "rounds": runs[impl]}
            results[(shape, impl)] = r

            def tf(mode):
                if mode not in r:
                    return "-"
                t = attn_flops(b, h, s, d, mode, shape.causal) / (r[mode] * 1e-3) / 1e12
                return f"{t:.0f} ({100 * t / ceil:.0f}%)"
            mem = f"{r['mem_mib']:.0f}" if "mem_mib" in r and not r.get("oom") and "error" not in r else \
                ("OOM" if r.get("oom") else "n/a")
            if "error" in r and "fp32" not in r["error"]:
                print(f"  {impl} S={s} D={d}: {r['error']}", flush=True)
            line = (f"| {str(dtype)[6:]} | {b},{h} | {shape.kv} | {s} | {d} | {'yes' if shape.causal else 'no'} | {impl} | {fmt_ms(r, 'fwd')} | {fmt_ms(r, 'bwd')} | "
                    f"{fmt_ms(r, 'fwd_bwd')} | {tf('fwd')} | {tf('fwd_bwd')} | {mem} |")
            if graph:
                line += f" {fmt_ms(r, 'fwd_graph')} | {fmt_ms(r, 'fwd_bwd_graph')} |"
            out_lines.append(line)
            print(line, flush=True)
    return results


def _round_ratios(r: dict, o: dict, mode: str) -> list[float]:
    """r's time over o's in a mode, round by round (each round's two times taken next to each other,
    `bench_round`); empty unless both have every round's time."""
    pairs = list(zip(r.get("rounds", []), o.get("rounds", [])))
    if pairs and len(r["rounds"]) == len(o["rounds"]) and all(mode in a and mode in b for a, b in pairs):
        return [a[mode] / b[mode] for a, b in pairs]
    return []


def _ratio(r: dict, o: dict, mode: str) -> float:
    """r's time over o's in a mode: the median of the rounds' ratios (`_round_ratios`) where there are any, else
    the ratio of the medians."""
    ratios = _round_ratios(r, o, mode)
    return statistics.median(ratios) if ratios else r[mode] / o[mode]


def _ratio_cell(r: dict, o: dict, mode: str) -> str:
    """A ratio table's cell: `_ratio`, with the range of the rounds' ratios in brackets where there are several
    (the spread to read a ratio near 1 against), "-" where either was not measured."""
    if mode not in r or mode not in o:
        return "-"
    ratios = _round_ratios(r, o, mode)
    if len(ratios) > 1:
        return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
    return f"{_ratio(r, o, mode):.2f}"


def ratio_summary(results, impls, out_lines, graph: bool = False):
    """flash_triton over SDPA flash / cuDNN time, per shape (bf16 only; `_ratio`); with graph, also the ratios of
    the CUDA-graph replays (kernels only)."""
    ours = [i for i in impls if i.startswith("flash_triton")]
    if not ours:
        return
    modes = ("fwd", "bwd", "fwd_bwd", "fwd_graph", "fwd_bwd_graph") if graph else ("fwd", "bwd", "fwd_bwd")
    names = {"fwd": "fwd", "bwd": "bwd", "fwd_bwd": "fwd+bwd", "fwd_graph": "fwd graph",
             "fwd_bwd_graph": "fwd+bwd graph"}
    cols = [f"{names[m]} / {o}" for o in ("flash", "cuDNN") for m in modes]
    start = len(out_lines)
    out_lines += ["\n### ratios (time of flash_triton / time of the SDPA backend; < 1 means faster; with rounds the "
                  "median of the rounds' ratios [their range])\n",
                  "| impl | dtype | B,H | KV | S | D | causal | " + " | ".join(cols) + " |",
                  "|---|---|---|---|---|---|---|" + "---|" * len(cols)]
    shapes = sorted({key[0] for key in results}, key=lambda sh: (str(sh.dtype), sh.kv, not sh.causal, sh.d, sh.s))
    for shape in shapes:
        if shape.dtype == torch.float32:
            continue
        for impl in ours:
            r = results.get((shape, impl), {})
            cells = []
            for other in ("sdpa_flash", "sdpa_cudnn"):
                o = results.get((shape, other), {})
                for mode in modes:
                    cells.append(_ratio_cell(r, o, mode))
            b, h, s, d, dtype = shape[:5]
            out_lines.append(f"| {impl} | {str(dtype)[6:]} | {b},{h} | {shape.kv} | {s} | {d} | "
                             f"{'yes' if shape.causal else 'no'} | " + " | ".join(cells) + " |")
    print("\n".join(out_lines[start:]), flush=True)


def training_shapes(seqs, dims, dtypes, causal: str = "yes", gqa: str = "no",
                    tokens: int = TRAINING_TOKENS) -> list[Shape]:
    """The training preset's rows: B = tokens // S sequences of each length S (at least one), TRAINING_HEADS heads;
    causal "yes" / "no" / "both"; gqa "no", "also" (rows of TRAINING_GQA query heads per KV head too) or "only"."""
    masks = {"yes": (True,), "no": (False,), "both": (True, False)}[causal]
    kv = {"no": (0,), "also": (0, TRAINING_HEADS // TRAINING_GQA), "only": (TRAINING_HEADS // TRAINING_GQA,)}[gqa]
    return [Shape(max(tokens // s, 1), TRAINING_HEADS, s, d, t, c, g) for t in dtypes for g in kv
            for c in masks for d in dims for s in seqs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=("leaderboard", "sweep", "quick", "training"), default="quick")
    ap.add_argument("--impls", default=None, help="comma-separated impl names (default: all; for the training "
                    "preset flash_triton, sdpa_flash, sdpa_cudnn)")
    ap.add_argument("--seq", default=None, help="comma-separated sequence lengths (sweep)")
    ap.add_argument("--dims", default=None, help="comma-separated head dims (sweep)")
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="yes", help="training preset: causal rows, "
                    "non-causal rows, or both")
    ap.add_argument("--layout", choices=LAYOUTS, default="dense", help="inputs as dense (B, H, S, d) tensors, or "
                    "as the model hands them over: q, k, v views of its fused projection, dO laid out (B, S, H, d)")
    ap.add_argument("--gqa", nargs="?", const="also", default="no", choices=("no", "also", "only"),
                    help="training preset: also (or, with 'only', only) grouped-query rows (4 query heads per KV "
                    "head; SDPA with enable_gqa, flash_triton natively, the others with k and v expanded)")
    ap.add_argument("--tokens", type=int, default=TRAINING_TOKENS, help="training preset: tokens a row, B = "
                    "tokens / S (default 65536; 16384 at S = 2048 is the medium model's B = 8)")
    ap.add_argument("--dtypes", default=None, help="default bf16,fp32 (training preset: bf16)")
    ap.add_argument("--warmup", type=int, default=None, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=None, help="do_bench repetitions, ms")
    ap.add_argument("--check", action="store_true", help="first check flash_triton (and the backward variants "
                    "in --impls) against float64 on the GPU")
    ap.add_argument("--graph", action="store_true", help="also time fwd and fwd+bwd as CUDA-graph replays: the "
                    "kernels' GPU time without the host's launch path, which dominates B = H = 1 rows at S <= 4096")
    ap.add_argument("--min-calls", type=int, default=20, help="every time a median of at least this many calls "
                    "(do_bench's rep, in ms, leaves one or a few where a call takes tens of ms)")
    ap.add_argument("--rounds", type=int, default=1, help="measure every row this many times, the implementations "
                    "in turn, and report medians over the rounds")
    ap.add_argument("--out", default=None, help="write the markdown here (default: "
                    "outputs/bench/attention_bench/<time>_<preset>.md)")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens {args.tokens}: give the tokens a row as a whole number >= 1 (B = tokens / S)")

    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA GPU (run it on a machine with one)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True   # fp32 rows: every impl may use TF32
    torch.backends.cudnn.allow_tf32 = True
    training = args.preset == "training"
    dtypes = [parse_dtype(x, "--dtypes") for x in (args.dtypes or ("bf16" if training else "bf16,fp32")).split(",")]
    impls = (args.impls or (",".join(TRAINING_IMPLS) if training else ",".join(ALL_IMPLS))).split(",")
    if training and args.rounds == 1:
        args.rounds = 3
    t0 = time.time()

    out = [f"# attention benchmark ({args.preset})\n",
           f"- device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
           f"date {datetime.date.today()}",
           f"- command: `python3 {' '.join(sys.argv)}`"]
    if args.check:
        out += ["\n### correctness (flash_triton backward variants vs float64; outputs poisoned with NaN first)\n"]
        print("\n".join(out), flush=True)
        # the backward variants being benchmarked (the default one always)
        asked = {i.partition("@")[0] for i in impls}
        variants = [v for v in TRITON_VARIANTS if v == "flash_triton" or v in asked]
        out += check_correctness(variants=tuple(variants))
        print(out[-1], flush=True)

    if args.preset == "leaderboard":
        warmup, rep = args.warmup or 50, args.rep or 300
        configs = [Shape(1, 16, 16384, 64, torch.bfloat16)]
        dtypes = [torch.bfloat16]
    elif args.preset == "sweep":
        warmup, rep = args.warmup or 10, args.rep or 40
        seqs = [int(x) for x in args.seq.split(",")] if args.seq else [2**i for i in range(7, 17)]
        dims = [int(x) for x in args.dims.split(",")] if args.dims else [16, 32, 64, 128]
        configs = [Shape(1, 1, s, d, t) for t in dtypes for d in dims for s in seqs]
    elif training:
        warmup, rep = args.warmup or 10, args.rep or 60
        seqs = [int(x) for x in args.seq.split(",")] if args.seq else list(TRAINING_SEQS)
        dims = [int(x) for x in args.dims.split(",")] if args.dims else list(TRAINING_DIMS)
        configs = training_shapes(seqs, dims, dtypes, args.causal, args.gqa, args.tokens)
    else:
        warmup, rep = args.warmup or 10, args.rep or 40
        seqs = [int(x) for x in args.seq.split(",")] if args.seq else [1024, 4096]
        dims = [int(x) for x in args.dims.split(",")] if args.dims else [64]
        configs = [Shape(1, 1, s, d, t) for t in dtypes for d in dims for s in seqs]

    ceilings = {t: matmul_ceiling(t, 25, 200) for t in dtypes}
    out += ["- matmul ceiling (8192^3, same run): "
            + ", ".join(f"{str(t)[6:]} {c:.0f} TFLOP/s" for t, c in ceilings.items())
            + f"; do_bench warmup={warmup} ms rep={rep} ms (at least {args.min_calls} calls), median"]
    print(out[-1], flush=True)
    configs = [c._replace(layout=args.layout) for c in configs]
    label = (f"{args.preset}: causal, times in ms" + (", the model's layout" if args.layout == "model" else "")
             + (f", medians of {args.rounds} rounds" if args.rounds > 1 else ""))
    results = run_table(configs, impls, warmup, rep, ceilings, out, label, args.graph, args.rounds, args.min_calls)
    ratio_summary(results, impls, out, args.graph)
    if args.preset == "leaderboard" and "flash_triton" in impls:
        out += ["\n### flash_triton kernels alone (no autograd), leaderboard shape\n"]
        from core.kernels import flash_triton as ft
        q, k, v, do = (torch.randn(1, 16, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = ft.flash_fwd_impl(q, k, v, True)
        t_f = do_bench(lambda: ft.flash_fwd_impl(q, k, v, True), warmup=warmup, rep=rep, return_mode="median")
        t_b = do_bench(lambda: ft.flash_bwd_impl(do, q, k, v, o, lse, True), warmup=warmup, rep=rep,
                       return_mode="median")
        t_a = do_bench(lambda: ft.flash_bwd_impl(do, q, k, v, o, lse, True, ft.BWD_ATOMIC_DQ), warmup=warmup,
                       rep=rep, return_mode="median")
        f = attn_flops(1, 16, 16384, 64, "fwd")
        out += [f"- forward kernel {t_f:.3f} ms ({f / t_f / 1e9:.0f} TFLOP/s); backward kernels (dq pass + "
                f"dk/dv pass) {t_b:.3f} ms ({2.5 * f / t_b / 1e9:.0f} TFLOP/s); one-pass atomic-dQ backward "
                f"(the warp-specialised Gluon kernel where it applies) {t_a:.3f} ms ({2.5 * f / t_a / 1e9:.0f} TFLOP/s)"]
        if any(i.partition("@")[0] == "flash_triton_fused" for i in impls):
            t_u = do_bench(lambda: ft.flash_bwd_impl(do, q, k, v, o, lse, True, ft.BWD_FUSED), warmup=warmup,
                           rep=rep, return_mode="median")
            out[-1] += f"; fused one-launch backward {t_u:.3f} ms ({2.5 * f / t_u / 1e9:.0f} TFLOP/s)"
        print(out[-1], flush=True)
    if any(i.startswith("flash_triton") for i in impls):
        from core.kernels.flash_triton import tuned_configs
        out.append("\n### flash_triton autotuner choices\n")
        for key, cfg in tuned_configs().items():
            out.append(f"- {key[0]} seq_class={key[1]} causal={key[2]} d={key[3]} {str(key[4])[6:]}: "
                       f"BLOCK_M={cfg[0]} BLOCK_N={cfg[1]} warps={cfg[2]} stages={cfg[3]}")
        print("\n".join(out[-len(tuned_configs()) - 1:]), flush=True)
    out.append(f"\n(total bench time {time.time() - t0:.0f} s)")
    print(out[-1])
    path = write_result(args.out or default_out("attention_bench", f"_{args.preset}.md"), "\n".join(out) + "\n")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
