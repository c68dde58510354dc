"""Profile mode: peak memory, a torch.profiler trace, NVTX ranges and a CUDA memory snapshot of a run's steps.

A stop signal (core/stop.py) ends the profiled steps early; the trace of the steps done is still written, with
status "stopped"."""
from __future__ import annotations

import torch

from core import stop
from core.nvtx import nvtx_range, set_nvtx_enabled
from core.summary import write_summary


def run_profile(run) -> dict:
    """Profile mode: peak memory of forward-only and full steps, a torch.profiler trace, and on CUDA
    NVTX ranges plus a memory snapshot (`memory_snapshot.pickle`, open at pytorch.org/memory_viz,
    and `memory_snapshot.html`, PyTorch's own rendering). Files go to the run directory."""
    import json

    from torch.profiler import ProfilerActivity, profile, record_function

    from core.benchmark import time_steps
    from core.metrics import peak_memory_gib

    cfg = run.cfg.profile
    out = run.run_dir
    out.mkdir(parents=True, exist_ok=True)
    cuda = run.device.type == "cuda"
    set_nvtx_enabled(cuda)
    result: dict = {"status": "ok", "profile_dir": str(out)}
    # peak memory: forward only, then a full training step (CS336 2.1.6)
    time_steps(run, "forward", cfg.warmup, 1)
    result["peak_mem_forward_gib"] = peak_memory_gib(run.device)
    time_steps(run, "train_step", 0, 1)
    result["peak_mem_train_step_gib"] = peak_memory_gib(run.device)

    if cuda and cfg.memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=cfg.max_memory_events)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = 0
    with profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False) as prof:
        while steps < cfg.steps and not stop.agreed(run.mesh, run.device):
            with record_function("train_step"):
                run.forward_backward(1000 + steps)  # NVTX "forward" / "backward" ranges inside
                with nvtx_range("optimizer_step"):
                    run.optimizer_step(1000 + steps, measure_norm=False)
            run.synchronize()
            steps += 1
    result["steps"] = steps
    if steps < cfg.steps:
        result["status"] = "stopped"
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    result["trace"] = str(trace)
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    (out / "profile_table.txt").write_text(table)
    if cuda and cfg.memory_snapshot:
        snap = out / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(snap))
        torch.cuda.memory._record_memory_history(enabled=None)
        result["memory_snapshot"] = str(snap)
        try:  # PyTorch's own HTML rendering (a private module): never lose the pickle over it
            import pickle

            from torch.cuda import _memory_viz

            with open(snap, "rb") as f:
                (out / "memory_snapshot.html").write_text(_memory_viz.trace_plot(pickle.load(f)))
            result["memory_snapshot_html"] = str(out / "memory_snapshot.html")
        except Exception as e:  # noqa: BLE001
            result["memory_snapshot_html"] = f"not rendered: {type(e).__name__}: {e}"
    set_nvtx_enabled(False)
    if run.mesh.is_main:
        print(table, flush=True)
        print(json.dumps(result, indent=2), flush=True)
        (out / "profile.json").write_text(json.dumps(result, indent=2))
        write_summary(out, result)
    return result
