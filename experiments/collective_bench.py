"""NCCL collective bandwidth on this machine, nccl-tests style (the planner's `intra_busbw_gbps` and
`collective_latency_us` come from numbers like these).

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 experiments/collective_bench.py

For each collective and message size: the median time of `--iters` back-to-back calls (after warm-up,
CUDA events around each call), algorithm bandwidth (bytes / time) and bus bandwidth (algbw scaled by the
collective's ring factor, as nccl-tests reports it: all-reduce 2(p-1)/p, all-gather and reduce-scatter
(p-1)/p). The sizes include those of our strategies' calls on xl: 25 MiB DDP buckets, 13-52 MiB bf16
FSDP layer gathers. Runs on the CPU (gloo) too, for a smoke test. Rank 0 prints the table and writes it to
`--out` (default `outputs/bench/collective_bench/<time>.md`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.results import default_out, write_result  # noqa: E402

MiB = 2**20


def bus_factor(kind: str, p: int) -> float:
    return 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p


def time_collective(kind: str, nbytes: int, dtype: torch.dtype, device: torch.device, iters: int, warmup: int) -> float:
    """Median ms of one call; `nbytes` is the full (output) buffer of the collective."""
    p = dist.get_world_size()
    n = max(p, nbytes // dtype.itemsize // p * p)
    full = torch.ones(n, dtype=dtype, device=device)
    shard = torch.ones(n // p, dtype=dtype, device=device)
    from core.distributed.comm import all_gather_flat, reduce_scatter_flat  # torch 2.11 and 2.13 names

    call = {"all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: all_gather_flat(full, shard),
            "reduce_scatter": lambda: reduce_scatter_flat(shard, full)}[kind]
    cuda = device.type == "cuda"
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="0.0625,1,4,13,25,52,100,400",
                    help="full-buffer sizes in MiB (comma-separated)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the markdown table here (rank 0; default: "
                    "outputs/bench/collective_bench/<time>.md)")
    a = ap.parse_args()
    from core.distributed.mesh import destroy_process_groups, init_process_group

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_process_group("nccl" if cuda else "gloo", timeout_s=120, **({"device_id": device} if cuda else {}))
    p, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for kind, dtype in (("all_reduce", torch.float32), ("all_gather", torch.bfloat16),
                        ("reduce_scatter", torch.float32)):
        for s in a.sizes_mib.split(","):
            nbytes = int(float(s) * MiB)
            ms = time_collective(kind, nbytes, dtype, device, a.iters, a.warmup)
            algbw = nbytes / (ms / 1e3) / 1e9
            rows.append((kind, str(dtype).replace("torch.", ""), float(s), ms, algbw, algbw * bus_factor(kind, p)))
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        lines = [f"## Collectives: {p} x {name}, torch {torch.__version__}, NCCL {nccl} (median of {a.iters})", "",
                 "| collective | dtype | MiB | ms | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {d} | {s:g} | {ms:.3f} | {al:.1f} | {bu:.1f} |" for k, d, s, ms, al, bu in rows]
        text = "\n".join(lines)
        print(text, flush=True)
        path = write_result(a.out or default_out("collective_bench"), text + "\n")
        print(f"written to {path}", flush=True)
    destroy_process_groups()


if __name__ == "__main__":
    main()
