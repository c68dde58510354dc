"""The CS336 end-to-end benchmark table (section 2.1.3), one command:

    python experiments/e2e_table.py [--sizes small,medium,large,xl,10b,leaderboard_8b] [--precisions fp32,bf16]
    python experiments/e2e_table.py --sizes medium --precisions bf16 --seq 2048 --batch 8 --modes train_step \
        --extra compile=true --attention sdpa,flash_triton     # our kernel end to end against SDPA

An `--attention` entry may set its kernel's configuration after `@`: `flash_triton@ws_min_rows=2048;backward=fused`
sets `attention_impl.config.ws_min_rows=2048` and `attention_impl.config.backward=fused` (the same kernel under two
policies, side by side).

With several `--attention` implementations each (size, precision, mode) row is measured for each of them in
the same process, and a last table gives each one's median step time over the first one's; `--interleave R` builds
their models together and alternates R rounds of their timed steps (for ratios of a percent or two: the GPU's state
drifts between one model's run and the next's; peak memory then counts every model's), and the ratio table then
gives the median of the R rounds' ratios with their range, the spread to read a ratio against. Medians, because a
single step can take milliseconds longer when the host stalls (a step synchronises at its end, so the next one
starts with an idle GPU).

Every model size x precision x {forward, forward_backward, train_step}: mean, standard
deviation and median over timed steps after warm-up, synchronising after every step, B=4, T=512 by
default, through the trainer's own benchmark mode (`core.benchmark.time_steps`). Out of
memory is shown as such. Prints a markdown table and writes it to `--out` (default
`outputs/bench/e2e_table/<time>.md`).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from core.benchmark import MODES, time_steps  # noqa: E402
from core.collector import FrozenHeap  # noqa: E402
from core.trainer import build  # noqa: E402
from experiments.results import default_out, write_result  # noqa: E402


def attention_overrides(attn: str) -> list[str]:
    """The Hydra overrides of an `--attention` entry: `name` or `name@key=value;key=value` (keys of its
    `attention_impl.config`)."""
    name, _, config = attn.partition("@")
    return [f"attention_impl={name}"] + [f"attention_impl.config.{item}" for item in config.split(";") if item]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,medium,large,xl,10b,leaderboard_8b")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--extra", default="", help="more overrides, comma separated (e.g. compile=true)")
    ap.add_argument("--attention", default="sdpa", help="attention_impl options, comma separated; the first is "
                    "the baseline of the ratio table; name@key=value;key=value sets attention_impl.config keys")
    ap.add_argument("--interleave", type=int, default=0, help="with several --attention: build the models of one "
                    "size and precision together and time them in this many alternating rounds of steps / rounds "
                    "steps each (the GPU's clocks and temperature drift between one model's run and the next's); "
                    "0: one model after the other")
    ap.add_argument("--out", type=Path, default=None, help="default: outputs/bench/e2e_table/<time>.md")
    args = ap.parse_args()
    out = args.out or default_out("e2e_table")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    header = [f"device: {device} | torch {torch.__version__} | {time.strftime('%Y-%m-%d')} | B={args.batch} "
              f"T={args.seq} | warmup {args.warmup}, {args.steps} timed steps, synchronised each step",
              f"command: python experiments/e2e_table.py --sizes {args.sizes} --precisions {args.precisions} "
              f"--batch {args.batch} --seq {args.seq} --warmup {args.warmup} --steps {args.steps}"
              + (f" --extra {args.extra}" if args.extra else "") + f" --attention {args.attention}"
              + (f" --interleave {args.interleave}" if args.interleave else ""), "",
              "| model | params | precision | attention | mode | mean ms | std ms | median ms | tok/s | MFU "
              "| peak GiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    medians: dict[tuple, float] = {}
    round_medians: dict[tuple, list[float]] = {}  # interleaved: each round's median step, by (size, prec, mode, attn)
    attentions = args.attention.split(",")
    def overrides_for(size: str, prec: str, attn: str) -> list[str]:
        overrides = [f"model={size}", f"precision={prec}", *attention_overrides(attn), "data=synthetic", "logger=none",
                     f"train.batch_size={args.batch}", f"data.seq_len={args.seq}", "optimizer.grad_clip=0",
                     f"paths.run_dir={out.parent / 'e2e_runs'}", f"paths.output_root={out.parent}"]
        return overrides + [o for o in args.extra.split(",") if o]

    def build_run(size: str, prec: str, attn: str):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return build(compose(config_name="config", overrides=overrides_for(size, prec, attn)))

    def record(run, size: str, prec: str, attn: str, mode: str, ms: list[float]) -> None:
        mean, std = statistics.fmean(ms), statistics.stdev(ms) if len(ms) > 1 else 0.0
        share = 1 / 3 if mode == "forward" else 1.0
        mfu = run.flops.mfu(mean / 1e3)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        medians[(size, prec, mode, attn)] = statistics.median(ms)
        rows.append(f"| {size} | {run.model_cfg.num_params() / 1e9:.2f}B | {prec} | {attn} | {mode} | "
                    f"{mean:.1f} | {std:.1f} | {statistics.median(ms):.1f} | "
                    f"{run.tokens_per_step / (mean / 1e3):,.0f} | "
                    f"{(mfu * share if mfu is not None else float('nan')):.1%} | {peak:.1f} |")
        print(rows[-1], flush=True)

    def out_of_memory(size: str, prec: str, attn: str, what: str) -> None:
        rows.append(f"| {size} | | {prec} | {attn} | {what} | OOM | | | | | |")
        print(rows[-1], flush=True)

    def release() -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    interleave = args.interleave if len(attentions) > 1 else 0
    for size, prec in ((z, p) for z in args.sizes.split(",") for p in args.precisions.split(",")):
        if interleave:  # every attention's model at once, their timed steps alternating
            runs = {}
            try:
                for attn in attentions:
                    runs[attn] = build_run(size, prec, attn)
                for mode in args.modes.split(","):
                    ms: dict[str, list[float]] = {attn: [] for attn in attentions}
                    for attn, run in runs.items():
                        time_steps(run, mode, args.warmup, 0)
                    # one collection for all rounds (each time_steps inside leaves the frozen heap as it is)
                    with FrozenHeap() as heap:
                        heap.freeze_now()
                        for _ in range(interleave):
                            for attn, run in runs.items():
                                step_ms = [t * 1e3 for t in time_steps(run, mode, 0, max(1, args.steps // interleave))]
                                ms[attn] += step_ms
                                round_medians.setdefault((size, prec, mode, attn), []).append(
                                    statistics.median(step_ms))
                    for attn, run in runs.items():
                        record(run, size, prec, attn, mode, ms[attn])
            except torch.cuda.OutOfMemoryError:
                out_of_memory(size, prec, ",".join(attentions), "(models built together)")
            finally:
                del runs
                release()
            write_result(out, "\n".join(header + rows) + "\n")
            continue
        for attn in attentions:
            run = None
            try:
                run = build_run(size, prec, attn)
                for mode in args.modes.split(","):
                    try:
                        record(run, size, prec, attn, mode,
                               [t * 1e3 for t in time_steps(run, mode, args.warmup, args.steps)])
                    except torch.cuda.OutOfMemoryError:
                        out_of_memory(size, prec, attn, mode)
                        run.optimizer.zero_grad(set_to_none=True)
                        release()
            except torch.cuda.OutOfMemoryError:
                out_of_memory(size, prec, attn, "(model + optimizer)")
            finally:
                del run
                release()
            write_result(out, "\n".join(header + rows) + "\n")  # after every point: a crash keeps the rows so far
    if len(attentions) > 1:
        base = attentions[0]
        what = "median of the rounds' median-step ratios [their range]" if interleave else "median step ratio"
        rows += ["", f"{what}:", "",
                 f"| model | precision | mode | " + " | ".join(f"{a} / {base}" for a in attentions[1:]) + " |",
                 "|---|---|---|" + "---|" * (len(attentions) - 1)]
        for (size, prec, mode, attn) in medians:
            if attn == base:
                cells = [ratio_cell(medians, round_medians, (size, prec, mode), base, a) for a in attentions[1:]]
                rows.append(f"| {size} | {prec} | {mode} | " + " | ".join(cells) + " |")
        write_result(out, "\n".join(header + rows) + "\n")
    print("\n".join(header + rows))
    print(f"written to {out}")


def ratio_cell(medians: dict[tuple, float], round_medians: dict[tuple, list[float]], point: tuple, base: str,
               attn: str) -> str:
    """attn's step time over base's at point (size, precision, mode): with interleaved rounds the median of the
    rounds' ratios (each round's median step over the base's in the same round) and their range, else the ratio of
    the two median steps; "-" where either was not measured (out of memory)."""
    if (*point, attn) not in medians or (*point, base) not in medians:
        return "-"
    ours, theirs = round_medians.get((*point, attn)), round_medians.get((*point, base))
    if ours and theirs and len(ours) == len(theirs):
        ratios = [a / b for a, b in zip(ours, theirs)]
        return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
    return f"{medians[(*point, attn)] / medians[(*point, base)]:.3f}"


if __name__ == "__main__":
    main()
