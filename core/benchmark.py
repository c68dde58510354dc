"""Benchmark mode (CS336 2.1): w warm-up steps, then n timed steps of one kind, synchronising after each.
Between them one full pass of Python's garbage collector, whose survivors later passes skip (core/collector.py).

Modes: `forward` (forward + loss, graph kept as in training), `forward_backward`
(+ backward and gradient synchronisation), `train_step` (+ clipping and optimizer step).
Prints a table and writes it (markdown and JSON) to the run directory. A stop signal (core/stop.py) ends
the steps early: the steps timed so far are reported, with status "stopped".
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

from core import stop
from core.collector import FrozenHeap
from core.errors import require
from core.metrics import memory_stats, peak_memory_gib, reset_peak_memory
from core.summary import write_summary

MODES = ("forward", "forward_backward", "train_step")


def step_fn(run, mode: str) -> Callable[[int], None]:
    """One step of benchmark mode `mode` (`MODES`) of `run`, as a function of the step number."""
    if mode == "forward":
        return lambda step: run.loss(*run.micro_batch("train", step, 0))
    if mode == "forward_backward":
        def fb(step: int) -> None:
            run.forward_backward(step)
            run.optimizer.zero_grad(set_to_none=True)
        return fb
    return lambda step: run.train_step(step)


def time_steps(run, mode: str, warmup: int, steps: int) -> list[float]:
    """Seconds per step for `steps` timed steps after `warmup` untimed ones; fewer when a stop signal arrives
    (checked after each step, outside its timing, agreed by every rank)."""
    fn = step_fn(run, mode)
    for i in range(warmup):
        fn(i)
        run.synchronize()
        if stop.agreed(run.mesh, run.device):
            return []
    run.synchronize()
    times: list[float] = []
    with FrozenHeap() as heap:
        heap.freeze_now()  # untimed: the timed steps' passes of the collector then skip the run's objects
        run.mesh.barrier()
        reset_peak_memory(run.device)
        for i in range(steps):
            t0 = time.perf_counter()
            fn(warmup + i)
            run.synchronize()
            times.append(time.perf_counter() - t0)
            if i + 1 < steps and stop.agreed(run.mesh, run.device):
                break
    return times


def run_benchmark(run) -> dict[str, Any]:
    cfg = run.cfg.benchmark
    require(cfg.mode in MODES, "benchmark.mode", f"unknown mode {cfg.mode!r}", f"use one of {', '.join(MODES)}")
    require(cfg.steps >= 1 and cfg.warmup >= 0, "benchmark.steps", "need steps >= 1 and warmup >= 0",
            "set benchmark.steps and benchmark.warmup")
    times = time_steps(run, cfg.mode, cfg.warmup, cfg.steps)
    row = {
        "status": "ok" if len(times) == cfg.steps else "stopped", "benchmark_mode": cfg.mode,
        "model": run.model_cfg.name, "precision": run.precision.name,
        "attention": run.attention, "compile": bool(run.cfg.compile),
        "parallelism": run.strategy.name, "mesh": run.mesh.describe(), "world_size": run.mesh.world_size,
        "batch_size": run.cfg.train.batch_size, "seq_len": run.data.seq_len,
        "warmup": cfg.warmup, "steps": len(times), "steps_requested": cfg.steps,
    }
    if not times:  # stopped during the warm-up: nothing was timed
        if run.mesh.is_main:
            write_summary(run.run_dir, row)
        return row
    ms = [t * 1e3 for t in times]
    mean = statistics.fmean(ms)
    std = statistics.stdev(ms) if len(ms) > 1 else 0.0
    median = statistics.median(ms)
    flops = run.flops.model_flops_per_step * {"forward": 1 / 3, "forward_backward": 1.0, "train_step": 1.0}[cfg.mode]
    row |= {
        "mean_ms": mean, "std_ms": std, "median_ms": median,
        "min_ms": min(ms), "step_time_ms": median,
        "tokens_per_s": run.tokens_per_step / (median / 1e3),
        "tflops_per_s_per_device": flops / (median / 1e3) / 1e12 / run.mesh.world_size,
        "mfu": (flops / (median / 1e3) / (run.flops.peak_flops_per_device * run.mesh.world_size)
                if run.flops.peak_flops_per_device else None),
        "mfu_peak_source": run.flops.peak_source,
        "times_ms": ms,
        **_peaks_per_rank(run),
    }
    if run.mesh.is_main:
        table = format_table([row])
        print(table, flush=True)
        print("peak memory per GPU: " + ", ".join(f"rank {r} {g:.2f} GiB" for r, g in
                                                   enumerate(row["peak_mem_gib_per_rank"])), flush=True)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "benchmark.md").write_text(table + "\n")
        (run.run_dir / "benchmark.json").write_text(json.dumps(row, indent=2, default=str))
        write_summary(run.run_dir, row)
        _print_plan_comparison(run, row)
    return row


def _peaks_per_rank(run) -> dict[str, Any]:
    """Every rank's peak memory of the timed steps (the table's figure is the largest), the device, and rank 0's
    allocator figures (which the planner's comparison reads). Collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    peaks = [peak_memory_gib(run.device)]
    if run.mesh.world_size > 1:
        gathered: list[Any] = [None] * run.mesh.world_size
        dist.all_gather_object(gathered, peaks[0])
        peaks = [float(p) for p in gathered]
    device = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu"
    return {"peak_mem_gib": max(peaks), "peak_mem_gib_per_rank": peaks, "device": device,
            **memory_stats(run.device)}


def _print_plan_comparison(run, row: dict[str, Any]) -> None:
    """The planner's prediction (saved in summary.json before the run) beside the timed steps, as a training run
    prints it at its end."""
    from core.planner import format_comparison

    path = run.run_dir / "summary.json"
    predicted = json.loads(path.read_text()).get("plan") if path.is_file() else None
    if predicted:
        print(format_comparison(predicted, row), flush=True)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = "| model | precision | attention | compile | mode | B x T | mean ms | std ms | median ms | tok/s | MFU | peak GiB |"
    sep = "|" + "---|" * 12
    lines = [head, sep]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        lines.append(f"| {r['model']} | {r['precision']} | {r['attention']} | {r['compile']} | {r['benchmark_mode']} | "
                     f"{r['batch_size']}x{r['seq_len']} | {r['mean_ms']:.2f} | {r['std_ms']:.2f} | {r['median_ms']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {r['peak_mem_gib']:.2f} |")
    return "\n".join(lines)
