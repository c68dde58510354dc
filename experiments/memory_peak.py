"""What is alive at the peak of a CUDA memory history (torch.cuda.memory._dump_snapshot pickles).

    python3 experiments/dp_bench.py --memory-history mem --strategies fsdp,torch_fsdp2 ...
    python3 experiments/memory_peak.py mem/fsdp_rank0.pickle mem/torch_fsdp2_rank0.pickle

Replays each snapshot's allocation trace (+size on `alloc`, -size on `free_completed`, which is when the
caching allocator's allocated-bytes statistic drops), finds the moment of the highest level, and prints
the tensors alive then (allocated since recording began), grouped by the innermost Python frame of their
allocation that is not inside torch's own plumbing, plus the allocation that reached the peak. Levels are
relative to the start of recording (allocations made before it are not in the trace).
"""
from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

MiB = 2**20
_PLUMBING = ("torch/utils/", "torch/_tensor.py", "torch/nn/modules/module.py", "torch/_ops.py",
             "torch/autograd/", "torch/overrides.py", "contextlib.py", "torch/_compile.py", "torch/_dynamo/")


def site(frames: list[dict], depth: int = 2) -> str:
    """The innermost `depth` Python frames outside torch's dispatch plumbing, as file:line name."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        if not name.endswith(".py") or any(p in name for p in _PLUMBING):
            continue
        short = "/".join(name.split("/")[-2:])
        out.append(f"{short}:{f.get('line')} {f.get('name')}")
        if len(out) == depth:
            break
    return " <- ".join(out) or "(no Python frame)"


def peak_report(path: str, top: int) -> str:
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    traces = [t for t in snap.get("device_traces", []) if t]
    if not traces:
        return f"{path}: no allocation trace (was memory history recorded?)"
    trace = max(traces, key=len)
    level = peak = 0
    peak_i = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            level += ev["size"]
        elif ev["action"] == "free_completed":
            level -= ev["size"]
        if level > peak:
            peak, peak_i = level, i
    live: dict[int, dict] = {}
    freed_before = 0  # pre-recording tensors freed before the peak
    for ev in trace[: peak_i + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            if live.pop(ev["addr"], None) is None:
                freed_before += ev["size"]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in live.values():
        g = groups[site(ev.get("frames", []))]
        g[0] += ev["size"]
        g[1] += 1
    lines = [f"## {path}", "",
             f"peak {peak / MiB:,.1f} MiB above the start of recording (event {peak_i} of {len(trace)}); "
             f"{len(live)} traced tensors alive, {sum(e['size'] for e in live.values()) / MiB:,.1f} MiB; "
             f"{freed_before / MiB:,.1f} MiB of earlier tensors freed by then", "",
             f"reached by: {trace[peak_i]['size'] / MiB:,.1f} MiB at {site(trace[peak_i].get('frames', []), 3)}", "",
             "| MiB | tensors | allocated at |", "|---|---|---|"]
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {size / MiB:,.1f} | {count} | {key} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshots", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    print("\n\n".join(peak_report(p, a.top) for p in a.snapshots))


if __name__ == "__main__":
    main()
