"""Our train.py step against the plain-PyTorch reference step, side by side in one run (needs a CUDA GPU).

    python experiments/trainer_vs_reference.py --size xl

1. The reference (experiments/reference_step.py: a Transformer LM and training step in stock PyTorch,
   independent of core/): bf16 autocast, fused AdamW, torch.compile, B=4, T=512, timed with do_bench (median).
2. Ours: `python train.py model=xl precision=bf16 attention_impl=sdpa compile=true
   benchmark.enabled=true benchmark.mode=train_step` (experiment=xl_bf16_compiled_benchmark),
   per-step synchronised timing (median), in a subprocess so the two never share memory.
3. An independent MFU: (6 N + 12 L d T) * tokens from the reference model's own parameter
   count, over our median time, over the datasheet peak, against the MFU train.py reports.
Prints a markdown table and writes it to `--out` (default `outputs/bench/trainer_vs_reference/<time>.md`);
our run's directory is beside it (`<out stem>_train_<size>/`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.reference_step import SIZES, ReferenceLM, make_train_step  # noqa: E402
from experiments.results import default_out, write_result  # noqa: E402


def reference_step_ms(size: str, batch: int, seq: int, steps: int) -> dict:
    import torch
    from triton.testing import do_bench

    shape = SIZES[size]
    torch.manual_seed(0)
    model = ReferenceLM(shape, max_seq_len=seq).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, shape.vocab_size, (batch, seq), device="cuda")
    y = torch.randint(0, shape.vocab_size, (batch, seq), device="cuda")
    step = make_train_step(model, x, y, lr=1e-4, compile=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    bench_ms = do_bench(step, warmup=0, rep=4000, return_mode="median")
    synced = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t0) * 1e3)
    return {"do_bench_median_ms": bench_ms, "synced_median_ms": statistics.median(synced), "params": n_params,
            "d": shape.d_model, "layers": shape.n_layers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="xl", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="default: outputs/bench/trainer_vs_reference/<time>.md")
    ap.add_argument("--_reference-only", dest="reference_only", action="store_true")
    args = ap.parse_args()
    if args.reference_only:
        print("REFERENCE " + json.dumps(reference_step_ms(args.size, args.batch, args.seq, args.steps)), flush=True)
        return
    out = (args.out or default_out("trainer_vs_reference")).resolve()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ref_proc = subprocess.run([sys.executable, __file__, "--_reference-only", "--size", args.size,
                               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)],
                              capture_output=True, text=True, env=env)
    ref_line = [line for line in ref_proc.stdout.splitlines() if line.startswith("REFERENCE ")]
    if not ref_line:
        sys.exit(f"reference failed:\n{ref_proc.stdout[-2000:]}\n{ref_proc.stderr[-3000:]}")
    ref = json.loads(ref_line[0][len("REFERENCE "):])
    run_dir = out.parent / f"{out.stem}_train_{args.size}"
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=xl_bf16_compiled_benchmark", f"model={args.size}",
           f"train.batch_size={args.batch}", f"data.seq_len={args.seq}", f"benchmark.steps={args.steps}",
           f"hydra.run.dir={run_dir}"]
    ours_proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if ours_proc.returncode != 0:
        sys.exit(f"train.py failed:\n{ours_proc.stdout[-2000:]}\n{ours_proc.stderr[-3000:]}")
    ours = json.loads((run_dir / "benchmark.json").read_text())
    import torch

    from core.hardware import DEVICES, key_for_name

    tokens = args.batch * args.seq
    flops = (6 * ref["params"] + 12 * ref["layers"] * ref["d"] * args.seq) * tokens
    device = DEVICES.get(key_for_name(torch.cuda.get_device_name()) or "")
    if device is None or device.peak_tflops is None:
        sys.exit(f"no datasheet bf16 peak for {torch.cuda.get_device_name()} in core/hardware.py's DEVICES")
    peak = device.peak_tflops["bf16"] * 1e12  # the datasheet figure MFU divides by, from the one hardware table
    independent_mfu = flops / (ours["median_ms"] / 1e3) / peak
    ratio = ours["median_ms"] / ref["do_bench_median_ms"]
    ratio_synced = ours["median_ms"] / ref["synced_median_ms"]

    lines = [
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | date {time.strftime('%Y-%m-%d')}",
        f"command: {' '.join(cmd[1:])}",
        "",
        "| what | ms/step (median) | ratio ours/reference |",
        "|---|---|---|",
        f"| reference (experiments/reference_step.py, compiled), do_bench | {ref['do_bench_median_ms']:.1f} | "
        f"{ratio:.3f} |",
        f"| reference, synchronised per step | {ref['synced_median_ms']:.1f} | {ratio_synced:.3f} |",
        f"| ours: train.py benchmark train_step (mean {ours['mean_ms']:.1f} ± {ours['std_ms']:.1f}) | "
        f"{ours['median_ms']:.1f} | 1.000 |",
        "",
        f"params: reference {ref['params']:,} | model FLOPs/step {flops / 1e12:.2f} TFLOP (6N + 12LdT) x {tokens} tokens",
        f"MFU reported by train.py: {ours['mfu']:.4f} ({ours['mfu_peak_source']})",
        f"MFU computed independently here: {independent_mfu:.4f} (peak {peak / 1e12:.0f} TFLOP/s)",
        f"peak memory: ours {ours['peak_mem_gib']:.1f} GiB",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    write_result(out, text + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
