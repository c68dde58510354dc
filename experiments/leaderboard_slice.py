"""A slice of the 8B leaderboard step on ONE GPU, against the planner: a few of the 34 blocks at full width and
context, timed, with their peak memory, beside what the planner predicts for the same slice, and the full 2-GPU
step extrapolated from the measurement (issue #23).

On one H200 (about a minute):

    python experiments/leaderboard_slice.py --out outputs/bench/leaderboard_slice/h200.json
    python experiments/leaderboard_slice.py --layers 2,4 --warmup 2 --steps 5 --out slice.json   # the defaults

On the CPU, scaled down (what tests/test_leaderboard_slice.py runs so the script cannot rot):

    python experiments/leaderboard_slice.py --tiny --out /tmp/slice.json

What runs: `k` TransformerBlocks of `experiment=leaderboard_8b` (d_model 4096, d_ff 11008, 32 heads of 128), each
on one sequence of 32,768 tokens (the preset's batch per GPU), bf16 autocast over fp32 master weights, the
preset's activation checkpointing (every block) and attention (flash_triton), forward from a random fp32 residual
stream that requires grad (as the embedding's output does), backward from a fixed random output gradient, and a
fused AdamW step over the blocks' parameters. Each `k` of `--layers`: `--warmup` steps, then `--steps` steps each
synchronised and timed; the median, and the allocator's peak over the timed steps (weights, AdamW state and the
gradients included: nothing is sharded on one GPU).

The prediction for the same slice is the planner's `plan()` of the preset with `model.n_layers=k`, one GPU, no
strategy and a 256-word vocabulary (the slice has no embedding or head, so they must cost next to nothing). With two
or more depths the per-layer slope and the fixed part of time and memory are fitted to both the measurement and the
prediction. The full step on 2 GPUs (the preset's own plan) is then corrected by the measured per-layer error
times 34 layers, and for memory also by the error of the fixed part (a recomputed block's transient):

    full ms  = planned full ms + 34 x (measured / predicted ms per layer - 1) x predicted ms per layer on the full
               step's device (the slice may run on another GPU than the H200 the full step is planned for)
    full GiB = planned full GiB + 34 x (measured - predicted GiB per layer) x 1/2 (the states are sharded over 2
               GPUs in the full step, the activations are not: the per-layer error counted at the smaller share is
               the lower, at the whole the upper bound; both are printed) + (measured - predicted fixed GiB)

With one depth, the whole time error is taken as per-layer and the whole memory error as fixed.
Results: a table on stdout and JSON at `--out`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from core.config import unique_dir  # noqa: E402 - importing core.config registers the configs' resolvers
from core import activation_checkpointing  # noqa: E402
from core.model import TransformerLM  # noqa: E402
from core.planner import GIB, plan  # noqa: E402
from experiments.results import default_out, write_result  # noqa: E402

assert unique_dir  # the resolvers are registered on import
FULL_LAYERS = 34
SLICE_VOCAB = 256  # the slice runs no embedding or head: a token vocabulary keeps them negligible in the plan
TINY = ["model.d_model=64", "model.d_ff=160", "model.n_heads=4", "model.context_length=128", "attention_impl=sdpa"]


def compose_preset(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=leaderboard_8b", *overrides])


def slice_overrides(base: list[str], layers: int, planner_device: str) -> list[str]:
    return [*base, f"model.n_layers={layers}", f"model.vocab_size={SLICE_VOCAB}", "mesh=single", "parallelism=none",
            "train.batch_size=1", f"planner.device={planner_device}"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_slice(cfg, device: torch.device, warmup: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Time forward + backward + AdamW of the config's blocks on `device` (module docstring)."""
    mcfg = instantiate(cfg.model)
    attention = instantiate(cfg.attention_impl)
    with torch.device(device):
        model = TransformerLM(mcfg, attention)
    model.init_weights(seed)
    checkpointed = activation_checkpointing.apply(model, int(cfg.activation_checkpointing))
    params = [p for p in model.blocks.parameters()]
    opt = torch.optim.AdamW(params, lr=float(cfg.optimizer.lr), betas=tuple(cfg.optimizer.factory.betas),
                            weight_decay=float(cfg.optimizer.weight_decay), fused=device.type == "cuda")
    seq = int(cfg.data.seq_len)
    batch = int(cfg.train.batch_size) // int(cfg.mesh.dp_shard)  # sequences per GPU in the full step
    gen = torch.Generator(device=device).manual_seed(seed)
    x0 = torch.randn(batch, seq, mcfg.d_model, device=device, generator=gen).requires_grad_()
    grad_out = torch.randn(batch, seq, mcfg.d_model, device=device, generator=gen) * 1e-3
    positions = torch.arange(seq, device=device)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.precision.dtype))

    def step() -> None:
        h = x0
        with torch.autocast(device.type, dtype=low or torch.float32, enabled=low is not None):
            for block in model.blocks:
                h = checkpoint(block, h, positions, use_reentrant=False) if block.activation_checkpoint \
                    else block(h, positions)
        h.backward(grad_out)
        opt.step()
        opt.zero_grad(set_to_none=True)
        x0.grad = None

    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {"median_ms": statistics.median(times), "times_ms": times, "peak_gib": peak,
            "checkpointed_blocks": checkpointed}


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(per layer, fixed) of a least-squares line through (layers, value); one point: all of it per layer."""
    if len(points) == 1:
        k, v = points[0]
        return v / k, 0.0
    n = len(points)
    mk = sum(k for k, _ in points) / n
    mv = sum(v for _, v in points) / n
    slope = sum((k - mk) * (v - mv) for k, v in points) / sum((k - mk) ** 2 for k, _ in points)
    return slope, mv - slope * mk


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,4", help="slice depths, comma separated (2-4 of the 34 blocks)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="scaled-down dims on the CPU (the test)")
    ap.add_argument("--planner-device", default=None, help="the slice's plan: auto (this GPU; the default on a "
                    "GPU) or a core/hardware.py key; the full step is planned for the preset's (h200)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default outputs/bench/leaderboard_slice/)")
    ap.add_argument("overrides", nargs="*", help="more config overrides for the slice and the full plan")
    args = ap.parse_args(argv)
    out = args.out or default_out("leaderboard_slice", ".json")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    base = (TINY if args.tiny else []) + list(args.overrides)
    planner_device = args.planner_device or ("auto" if device.type == "cuda" else "cpu")
    full_base = base + (["planner.device=cpu"] if args.tiny else [])
    full_cfg = compose_preset(full_base)
    full = plan(full_cfg)
    full_device = str(full_cfg.planner.device)  # the full step's plan is for this device (the preset's h200)
    depths = [int(k) for k in args.layers.split(",")]
    rows = []
    for k in depths:
        cfg = compose_preset(slice_overrides(base, k, planner_device))
        predicted = plan(cfg)
        # the same slice planned for the full step's device: the measured error is carried over to it as a ratio
        on_full_device = plan(compose_preset(slice_overrides(base, k, full_device)))
        measured = measure_slice(cfg, device, args.warmup, args.steps)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the slice's tensors are gone: the next depth starts from an empty cache
        rows.append({"layers": k, **measured, "predicted_ms": predicted.step_time_ms,
                     "predicted_ms_full_device": on_full_device.step_time_ms, "predicted_peak_gib": predicted.peak_gib,
                     "predicted_memory_gib": predicted.to_dict()["memory_gib"], "predicted_time_ms": predicted.time_ms})
        nan = float("nan")
        print(f"[slice] {k} layers: {measured['median_ms']:.1f} ms (planned {predicted.step_time_ms or nan:.1f}), "
              f"peak {nan if measured['peak_gib'] is None else measured['peak_gib']:.2f} GiB "
              f"(planned {predicted.peak_gib:.2f})", flush=True)
    t_meas = fit([(r["layers"], r["median_ms"]) for r in rows])
    t_pred = fit([(r["layers"], r["predicted_ms"]) for r in rows]) if all(r["predicted_ms"] for r in rows) else None
    t_full = fit([(r["layers"], r["predicted_ms_full_device"]) for r in rows]) \
        if all(r["predicted_ms_full_device"] for r in rows) else None
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "command": "python experiments/leaderboard_slice.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seq_len": int(compose_preset(base).data.seq_len), "slices": rows,
        "per_layer_ms": {"measured": t_meas[0], "predicted": t_pred[0] if t_pred else None,
                         "predicted_full_device": t_full[0] if t_full else None, "full_device": full_device},
        "full_step": {"planned_ms": full.step_time_ms, "planned_peak_gib": full.peak_gib,
                      "planned_memory_gib": full.to_dict()["memory_gib"], "planned_mfu": full.mfu},
    }
    if t_pred is not None and t_full is not None and full.step_time_ms is not None:
        error = t_meas[0] / t_pred[0] - 1
        result["full_step"]["extrapolated_ms"] = full.step_time_ms + FULL_LAYERS * t_full[0] * error
    if all(r["peak_gib"] is not None for r in rows):
        m_meas = fit([(r["layers"], r["peak_gib"]) for r in rows])
        m_pred = fit([(r["layers"], r["predicted_peak_gib"]) for r in rows])
        if len(rows) == 1:  # one depth: the error is taken as fixed (module docstring)
            m_meas, m_pred = (0.0, m_meas[0] * depths[0]), (0.0, m_pred[0] * depths[0])
        per_layer_err, fixed_err = m_meas[0] - m_pred[0], m_meas[1] - m_pred[1]
        result["per_layer_gib"] = {"measured": m_meas[0], "predicted": m_pred[0]}
        result["fixed_gib"] = {"measured": m_meas[1], "predicted": m_pred[1]}
        lo, hi = sorted((FULL_LAYERS * per_layer_err / 2, FULL_LAYERS * per_layer_err))
        result["full_step"]["extrapolated_peak_gib"] = [full.peak_gib + lo + fixed_err,
                                                        full.peak_gib + hi + fixed_err]
    write_result(out, json.dumps(result, indent=2, default=str) + "\n")
    print(format_table(result))
    print(f"written to {out}")
    return result


def format_table(r: dict[str, Any]) -> str:
    f = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"device: {r['device']} | torch {r['torch']} | {r['date']} | seq {r['seq_len']}",
             "| layers | measured ms | planned ms | measured peak GiB | planned peak GiB |", "|---|---|---|---|---|"]
    for s in r["slices"]:
        lines.append(f"| {s['layers']} | {f(s['median_ms'])} | {f(s['predicted_ms'])} | {f(s['peak_gib'], '.2f')} | "
                     f"{f(s['predicted_peak_gib'], '.2f')} |")
    fs = r["full_step"]
    ext = fs.get("extrapolated_peak_gib")
    pl = r["per_layer_ms"]
    lines += [f"per layer: measured {f(pl['measured'])} ms, planned {f(pl['predicted'])} ms (on the full step's "
              f"{pl['full_device']}: planned {f(pl['predicted_full_device'])} ms)",
              f"full step on 2 GPUs: planned {f(fs['planned_ms'])} ms, {f(fs['planned_peak_gib'], '.2f')} GiB per GPU; "
              f"extrapolated from the slice {f(fs.get('extrapolated_ms'))} ms"
              + (f", {ext[0]:.2f}-{ext[1]:.2f} GiB per GPU" if ext else "")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
