"""Python's garbage collector in a train step: its full passes with and without `core.collector.FrozenHeap`.

Builds one run from Hydra overrides, warms it up, then times N train steps as they come (the collector on its own
schedule), and N more after `FrozenHeap.freeze_now()`, as benchmark mode runs them. For
each: the step times (median, mean, max, steps over 1.15x the median), the full (generation 2) passes the collector
ran by itself and how long each took, and the time of one full pass forced at the end.

    python experiments/gc_pauses.py --steps 300 model=medium precision=bf16 data=synthetic train.batch_size=8 \\
        data.seq_len=2048 model.context_length=2048 optimizer.grad_clip=0 compile=true

On the CPU (`model=tiny`, the default config) it runs too, with far fewer objects alive.
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

from hydra import compose, initialize_config_dir  # noqa: E402

from core.benchmark import step_fn  # noqa: E402
from core.collector import FrozenHeap  # noqa: E402
from core.trainer import build  # noqa: E402


class FullPasses:
    """The collector's full passes while installed, in ms (a gc callback)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.ms.append((time.perf_counter() - self._start) * 1e3)


def timed_steps(run, step, n: int, passes: FullPasses, label: str) -> str:
    passes.ms.clear()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        step(i)
        run.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    natural = list(passes.ms)
    passes.ms.clear()
    gc.collect()
    med = statistics.median(times)
    return (f"| {label} | {len(gc.get_objects()):,} | {gc.get_freeze_count():,} | {med:.2f} | "
            f"{statistics.fmean(times):.2f} | {max(times):.1f} | {sum(t > 1.15 * med for t in times)} | "
            f"{len(natural)}: {', '.join(f'{p:.1f}' for p in natural) or '-'} | {passes.ms[0]:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="timed steps of each kind")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the run")
    args = ap.parse_args()
    overrides = ["logger=none", "paths.run_dir=outputs/gc_pauses", "paths.output_root=outputs", *args.overrides]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        run = build(compose(config_name="config", overrides=overrides))
    step = step_fn(run, "train_step")
    for i in range(args.warmup):
        step(i)
        run.synchronize()
    passes = FullPasses()
    print(f"Python {sys.version.split()[0]}, objects frozen before: {gc.get_freeze_count()}\n\n"
          "| steps | objects the collector walks | frozen | median ms | mean ms | max ms | steps > 1.15x median "
          "| full passes by itself, ms | a forced full pass, ms |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    print(timed_steps(run, step, args.steps, passes, "as they come"), flush=True)
    with FrozenHeap() as heap:
        heap.freeze_now()
        print(timed_steps(run, step, args.steps, passes, "FrozenHeap"), flush=True)


if __name__ == "__main__":
    main()
