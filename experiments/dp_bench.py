"""Data-parallel benchmark: 1 GPU, then every strategy on N GPUs, side by side (CS336 sections 5-7).

    python3 experiments/dp_bench.py --model xl --nproc 2                          # the full run (~6-8 min, 2x H200)
    python3 experiments/dp_bench.py --model small --nproc 2 --steps 5 --warmup 2  # quick check (~2 min)
    python3 experiments/dp_bench.py --strategies ddp_bucketed,zero1 \
        --variant ddp_bucketed:comm_dtype=bfloat16 \
        --variant ddp_bucketed:comm_dtype=bfloat16,env.NCCL_MAX_CTAS=8 \
        --variant zero1:overlap_param_gather=false --env NCCL_DEBUG=WARN

Experiment knobs: `--stream-priority -1` runs the compute on a high-priority CUDA stream, so the block
scheduler serves compute kernels before the NCCL kernels running beside them. `--memory-history DIR` records
every CUDA allocation from model set-up to the end of the first step and writes one snapshot per rank to DIR;
`python3 experiments/memory_peak.py DIR/*.pickle` lists what is alive at each one's peak.

Without `--variant`, a GPU run adds two rows: `ddp_bucketed` and `zero1` with `compute_dtype=bfloat16` (their
Linear layers' bf16 gradients all-reduced in bf16; opt-in, see docs/data_parallel.md).
Variants: `--variant STRATEGY:key=value,...` adds a row running STRATEGY with those constructor options
over its defaults (values: int, float, true/false, null, or a string); an option `env.KEY=VALUE` sets an
environment variable for that row's worker processes only. `--env KEY=VALUE` (repeatable) applies to
every row (single-GPU baseline included). Rows are labelled `strategy[options]`. The targets table is
computed from the default-configuration rows and repeated for the best row of each strategy.

Per-GPU batch 4 x 512 tokens, bf16 autocast, fused AdamW (the same step as experiments/reference_step.py).
Every configuration runs in fresh processes started through torch's elastic launch (launchers/local.py),
warm-up steps first, then `--steps` back-to-back steps with no host synchronisation between them (as in
training: work a strategy leaves in flight after the optimizer step, e.g. ZeRO-1's parameter gathers,
may overlap the next forward); ms/step is the median GPU time between consecutive step starts (CUDA
events; wall clock on the CPU). Communication (comm_ms, exposed) is the mean over 3 extra back-to-back
steps with the strategy's timer on, so the timed steps carry no extra syncs. "Over all steps" is the peak
before those 3 steps; "with comm timer on" includes them: the timer holds each NCCL work until the GPU has
finished it, and a work holds its tensors, so with FSDP it raises the peak (by 0.4-3.3 GiB on xl).
`--repeat N` runs the row list N times round-robin; machines drift within minutes (torch FSDP2 measured 152
then 174 ms on one host), so a ratio of medians over interleaved repeats is the one to trust.
Prints one markdown table plus the per-rank memory accounting of CS336 6a, and writes them to `--out`
(default `outputs/bench/dp_bench/<time>.md`).
No Hydra composition: the model and strategies are built directly from core.*.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.results import default_out, write_result  # noqa: E402

GiB = 2**30
STRATEGIES = {  # name -> (class path, kwargs)
    "ddp_naive": ("core.distributed.ddp.DDPNaiveStrategy", {}),
    "ddp_flat": ("core.distributed.ddp.DDPFlatStrategy", {}),
    "ddp_overlap": ("core.distributed.ddp.DDPOverlapStrategy", {}),
    "ddp_bucketed": ("core.distributed.ddp.DDPBucketedStrategy", {"bucket_size_mb": 25, "first_bucket_size_mb": 1}),
    "zero1": ("core.distributed.zero1.Zero1Strategy", {"grad_reduction": "all_reduce"}),
    "zero1_rs": ("core.distributed.zero1.Zero1RSStrategy", {}),
    "fsdp": ("core.distributed.fsdp.FSDPStrategy", {"compute_dtype": "bfloat16", "reduce_dtype": "float32"}),
    "torch_ddp": ("core.distributed.torch_baselines.TorchDDPStrategy", {}),
    "torch_fsdp2": ("core.distributed.torch_baselines.TorchFSDP2Strategy",
                    {"compute_dtype": "bfloat16", "reduce_dtype": "float32"}),
}
SIZES = {"tiny": (128, 384, 4, 4), "small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16),
         "large": (1280, 5120, 36, 20), "xl": (2560, 10240, 32, 32)}


def _worker(job: dict) -> dict:
    """One rank of one configuration (runs under elastic launch)."""
    import importlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from core.distributed.mesh import ParallelMesh
    from core.distributed.strategy import Strategy
    from core.model import ModelConfig, TransformerLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and job["device"] != "cpu"
    mesh = ParallelMesh(dp_shard=world, device="cuda" if cuda else "cpu", timeout_s=600).init()
    dev = mesh.device_obj
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        priority = job.get("stream_priority")
        if priority is not None:  # an experiment knob: forward/backward/optimizer on a stream of this priority
            torch.cuda.set_stream(torch.cuda.Stream(device=dev, priority=priority))
    d, dff, L, h = SIZES[job["model"]]
    cfg = ModelConfig(d_model=d, d_ff=dff, n_layers=L, n_heads=h, vocab_size=10_000, context_length=job["T"])
    if job["strategy"] == "single":
        strategy = Strategy()
    else:
        path, kw = STRATEGIES[job["strategy"]]
        if not cuda:  # the CPU smoke test runs fp32 throughout (no autocast): bf16 weights would be 10x slower
            kw = {k: v for k, v in kw.items() if k != "compute_dtype"}
        mod, cls = path.rsplit(".", 1)
        strategy = getattr(importlib.import_module(mod), cls)(**{**kw, **job.get("options", {})})
    strategy.validate(mesh)

    def mem():
        return torch.cuda.max_memory_allocated(dev) / GiB if cuda else float("nan")

    history_dir = job.get("memory_history") if cuda else None
    if history_dir:  # every allocation from model set-up to the end of the first step (experiments/memory_peak.py)
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    with torch.device("meta"):
        raw = TransformerLM(cfg)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    model = strategy.setup(raw, mesh, functools.partial(TransformerLM.init_weights_each, seed=0))
    after_init = mem()
    n_params = cfg.num_params()
    fused = cuda
    optimizer = strategy.build_optimizer(model, [{"params": [p for p in raw.parameters() if p.requires_grad]}],
                                         lambda groups: torch.optim.AdamW(groups, lr=1e-4, fused=fused))
    g = torch.Generator(device=dev).manual_seed(1234 + mesh.rank)
    B, T = job["B"], job["T"]
    x = torch.randint(0, 10_000, (B, T), device=dev, generator=g)
    y = torch.randint(0, 10_000, (B, T), device=dev, generator=g)
    timer = getattr(strategy, "timer", None)
    marks: dict = {}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(record: bool = False):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        strategy.finish_gradient_synchronization()
        if record:
            sync()
            marks["before_step"] = mem()
        optimizer.step()
        if record:
            sync()
            marks["after_step"] = mem()
            marks["breakdown"] = strategy.memory_breakdown(raw, optimizer)
        optimizer.zero_grad(set_to_none=True)

    if timer is not None:
        timer.enabled = False
    for i in range(job["warmup"]):
        step(record=i == 0)
        if i == 0 and history_dir:
            Path(history_dir).mkdir(parents=True, exist_ok=True)
            label = job.get("label", job["strategy"]).replace("/", "_")
            torch.cuda.memory._dump_snapshot(str(Path(history_dir) / f"{label}_rank{mesh.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
    sync()
    if world > 1:
        dist.barrier()
    sync()
    n = job["steps"]
    if cuda:
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    stamps = []
    t_start = time.perf_counter()
    for i in range(n):
        if cuda:
            evs[i].record()
        stamps.append(time.perf_counter())
        step()
    if cuda:
        evs[n].record()
    sync()
    stamps.append(time.perf_counter())
    wall_ms = (stamps[-1] - t_start) * 1e3 / n
    if cuda:
        times = [evs[i].elapsed_time(evs[i + 1]) for i in range(n)]
    else:
        times = [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(n)]
    # the peak before the timed communication steps: holding NCCL works for their durations keeps their
    # tensors alive until the GPU finishes them (later than the strategy frees them), which raises FSDP's peak
    peak_untimed = mem()
    comm, exposed = [], []
    if timer is not None:
        sync()
        timer.enabled = True
        timer.metrics()  # reset
        k = 3
        for _ in range(k):
            step()
        m = timer.metrics()
        comm.append(m.get("comm_ms", float("nan")) / k)
        exposed.append(m.get("exposed_comm_ms", float("nan")) / k)
        timer.enabled = False
    if hasattr(strategy, "wait_for_parameters"):
        strategy.wait_for_parameters()
    result = {"ms": statistics.median(times), "wall_ms": wall_ms, "comm_ms": statistics.median(comm) if comm else 0.0,
              "exposed_ms": statistics.median(exposed) if exposed else 0.0, "after_init": after_init,
              "before_step": marks["before_step"], "after_step": marks["after_step"], "peak_all": peak_untimed,
              "peak_timed": mem(),
              "params": n_params,
              "breakdown": marks["breakdown"], "world": world}
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, result)
        result["per_rank"] = everyone
        # median over ranks' step times is the same barrier-aligned number; report rank 0's
    else:
        result["per_rank"] = [result]
    mesh.destroy()
    return result


def _run(job: dict, nproc: int, env: dict | None = None) -> dict:
    """One configuration in fresh processes; `env` is set for its workers only (spawned children inherit it)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from launchers import local

    for k, v in local.WORKER_ENV.items():
        os.environ.setdefault(k, v)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"dpbench-{time.time_ns()}",
                           rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{local.free_port()}", max_restarts=0,
                           monitor_interval=0.5, start_method="spawn")
        return elastic_launch(cfg, _worker)(job)[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _value(text: str):
    low = text.strip().lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, val = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), val.strip()


# Extra rows of every GPU run unless --variant is given: ddp_bucketed and zero1 with the Linear layers' bf16
# gradients all-reduced as bf16 (docs/data_parallel.md), the configuration that meets the efficiency target.
DEFAULT_VARIANTS = ("ddp_bucketed:compute_dtype=bfloat16", "zero1:compute_dtype=bfloat16")


def parse_variant(text: str) -> dict:
    """`strategy:key=value,...,env.KEY=VALUE` -> {label, strategy, options, env}."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in STRATEGIES:
        raise argparse.ArgumentTypeError(f"unknown strategy {name!r} in --variant {text!r} (one of {', '.join(STRATEGIES)})")
    options, env = {}, {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, val = _env_pair(item)
        if key.startswith("env."):
            env[key[4:]] = val
        else:
            options[key] = _value(val)
    label = f"{name}[{rest.strip()}]" if rest.strip() else name
    return {"label": label, "strategy": name, "options": options, "env": env}


def combine_repeats(runs: list[dict]) -> dict:
    """One row's repeats -> one result: median step time and communication, the highest memory figures
    (a peak seen once is a peak), the first run's accounting. Failed repeats are dropped; all failed: the
    last error."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    out = dict(ok[0])
    out["ms_runs"] = [r["ms"] for r in ok]
    for key in ("ms", "wall_ms", "comm_ms", "exposed_ms"):
        out[key] = statistics.median(r[key] for r in ok)
    for key in ("after_init", "before_step", "after_step", "peak_all", "peak_timed"):
        vals = [r[key] for r in ok if key in r and r[key] == r[key]]
        out[key] = max(vals) if vals else float("nan")
    return out


def _fmt(x, spec=".1f"):
    return "n/a" if x is None or x != x else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="xl", choices=sorted(SIZES))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="per-GPU batch (sequences)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="default-configuration rows to run (comma-separated; empty: variants only)")
    ap.add_argument("--variant", action="append", default=None, type=parse_variant, metavar="STRATEGY:k=v,...",
                    help="an extra row: STRATEGY with these options (env.KEY=VAL: env for that row); repeatable. "
                         "Not given: on the GPU, " + ", ".join(DEFAULT_VARIANTS))
    ap.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE",
                    help="environment variable for every row's workers; repeatable")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole row list this many times, round-robin (A B A B ...), and report each "
                         "row's median over the repeats with its min-max: drift of the machine hits every row")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"])
    ap.add_argument("--stream-priority", type=int, default=None, metavar="N",
                    help="run forward, backward and optimizer on a CUDA stream of this priority (-1: high)")
    ap.add_argument("--memory-history", default=None, metavar="DIR",
                    help="record every CUDA allocation up to the end of the first step; one snapshot per rank "
                         "in DIR (read it with experiments/memory_peak.py)")
    ap.add_argument("--out", default=None, help="write the markdown here (default: outputs/bench/dp_bench/<time>.md)")
    a = ap.parse_args()
    if a.variant is None:  # the bf16-gradient rows (opt-in options of their strategies) belong to the full table
        a.variant = [parse_variant(v) for v in DEFAULT_VARIANTS] if a.device != "cpu" else []
    base = {"model": a.model, "B": a.batch, "T": a.seq, "steps": a.steps, "warmup": max(a.warmup, 1),
            "device": a.device, "stream_priority": a.stream_priority, "memory_history": a.memory_history}
    common_env = dict(a.env)
    for s in a.strategies.split(","):
        if s and s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}")
    rows = [{"label": "single", "strategy": "single", "options": {}, "env": {}, "n": 1}]
    rows += [{"label": s, "strategy": s, "options": {}, "env": {}, "n": a.nproc} for s in a.strategies.split(",") if s]
    rows += [{**v, "n": a.nproc} for v in a.variant]
    labels = [r["label"] for r in rows]
    if len(set(labels)) != len(labels):
        ap.error(f"two rows share a label: {labels}")
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    runs: dict = {name: [] for name in labels}
    t_all = time.time()
    for rep in range(a.repeat):
        for row in rows:
            name, n = row["label"], row["n"]
            t0 = time.time()
            tag = f" (repeat {rep + 1}/{a.repeat})" if a.repeat > 1 else ""
            try:
                r = _run({**base, "strategy": row["strategy"], "options": row["options"], "label": name}, n,
                         {**common_env, **row["env"]})
                runs[name].append(r)
                print(f"[dp_bench] {name:13s} x{n}: {r['ms']:.1f} ms/step ({time.time() - t0:.0f}s){tag}", flush=True)
            except Exception as e:  # noqa: BLE001 - one broken strategy must not hide the others
                msg = str(e).strip()
                runs[name].append({"error": f"{type(e).__name__}: {msg.splitlines()[-1] if msg else ''}"})
                print(f"[dp_bench] {name} FAILED{tag}: {runs[name][-1]['error']}", flush=True)
    results = {name: combine_repeats(rs) for name, rs in runs.items()}
    tok = a.batch * a.seq
    single = results.get("single", {})
    env_note = f", env {' '.join(f'{k}={v}' for k, v in common_env.items())}" if common_env else ""
    lines = [f"## Data-parallel benchmark: model {a.model}, per-GPU batch {a.batch} x T={a.seq}, bf16 autocast, "
             f"fused AdamW, {a.nproc} GPUs (median of {a.steps} back-to-back steps{env_note}"
             + (f"; every row run {a.repeat} times round-robin, median of the repeats, min-max beside it"
                if a.repeat > 1 else "") + ")", "",
             "| strategy | GPUs | ms/step | min-max over repeats | tokens/s | scaling eff. | comm ms | exposed comm ms | "
             "peak GiB after init | before opt step | after opt step | over all steps | with comm timer on |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        name, n = row["label"], row["n"]
        r = results[name]
        if "error" in r:
            lines.append(f"| {name} | {n} | failed: {r['error']} | | | | | | | | | | |")
            continue
        tps = tok * n / r["ms"] * 1e3
        eff = tps / (n * tok / single["ms"] * 1e3) if "ms" in single else float("nan")
        spread = f"{_fmt(min(r['ms_runs']))}-{_fmt(max(r['ms_runs']))}" if len(r["ms_runs"]) > 1 else ""
        lines.append(f"| {name} | {n} | {_fmt(r['ms'])} | {spread} | {_fmt(tps, ',.0f')} | {_fmt(eff * 100)}% | "
                     f"{_fmt(r['comm_ms'])} | {_fmt(r['exposed_ms'])} | {_fmt(r['after_init'], '.2f')} | "
                     f"{_fmt(r['before_step'], '.2f')} | {_fmt(r['after_step'], '.2f')} | "
                     f"{_fmt(r.get('peak_all', float('nan')), '.2f')} | {_fmt(r.get('peak_timed', float('nan')), '.2f')} |")
    lines += ["", "### Memory accounting per rank (CS336 6a), GiB", "",
              "| strategy | rank | parameters | gradients | optimizer state |", "|---|---|---|---|---|"]
    for row in rows:
        name = row["label"]
        for rank, pr in enumerate(results[name].get("per_rank", [])):
            b = pr["breakdown"]
            lines.append(f"| {name} | {rank} | {b['param_bytes'] / GiB:.2f} | {b['grad_bytes'] / GiB:.2f} | "
                         f"{b['optimizer_state_bytes'] / GiB:.2f} |")

    def get(name, key):
        return results.get(name, {}).get(key, float("nan"))

    def opt_state(name):
        pr = results.get(name, {}).get("per_rank") or [{"breakdown": {"optimizer_state_bytes": float("nan")}}]
        return max(p["breakdown"]["optimizer_state_bytes"] for p in pr)

    def best(strategy):
        """Fastest successful row of `strategy` (default or variant); the default label if none ran."""
        cands = [r["label"] for r in rows if r["strategy"] == strategy and "ms" in results.get(r["label"], {})]
        return min(cands, key=lambda lab: results[lab]["ms"]) if cands else strategy

    def peak(name):
        """Peak over set-up, warm-up and the timed steps (not the comm-timer steps): from the second step on
        the optimizer state exists during backward, so a strategy's steady-state peak can exceed its first's."""
        return get(name, "peak_all")

    def checks(ddp, zero1, fsdp, tfsdp):
        eff_b = single.get("ms", float("nan")) / get(ddp, "ms")
        return [
            (f"{ddp} scaling efficiency >= 92%", eff_b, eff_b >= 0.92),
            (f"{zero1} optimizer state / {ddp} <= 0.55", opt_state(zero1) / opt_state(ddp),
             opt_state(zero1) / opt_state(ddp) <= 0.55),
            (f"{zero1} step time / {ddp} <= 1.05", get(zero1, "ms") / get(ddp, "ms"),
             get(zero1, "ms") / get(ddp, "ms") <= 1.05),
            (f"{fsdp} step time / {tfsdp} <= 1.00", get(fsdp, "ms") / get(tfsdp, "ms"),
             get(fsdp, "ms") / get(tfsdp, "ms") <= 1.00),
            (f"{fsdp} peak memory / {tfsdp} <= 1.00", peak(fsdp) / peak(tfsdp), peak(fsdp) <= peak(tfsdp)),
        ]

    lines += ["", "### Targets (default configurations)", "", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t} | {_fmt(v, '.3f')} | {'yes' if ok else 'NO'} |"
              for t, v, ok in checks("ddp_bucketed", "zero1", "fsdp", "torch_fsdp2")]
    if a.variant:
        bests = (best("ddp_bucketed"), best("zero1"), best("fsdp"), best("torch_fsdp2"))
        lines += ["", "### Targets (best row of each strategy, variants included)", "",
                  "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t} | {_fmt(v, '.3f')} | {'yes' if ok else 'NO'} |" for t, v, ok in checks(*bests)]
    text = "\n".join(lines) + "\n"
    print(text)
    path = write_result(a.out or default_out("dp_bench"), text)
    print(f"[dp_bench] written to {path} ({time.time() - t_all:.0f}s in all)")


if __name__ == "__main__":
    main()
