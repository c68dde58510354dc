"""Shared test set-up: CPU stands in for the GPU."""
import os

import torch

# Triton kernels run under the interpreter on CPU-only machines; this must happen before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# each xdist worker (the README's command runs two), and the processes its tests start, takes its share of the
# cores: more busy threads than cores leave OpenMP's threads spinning for each other, and multi-process tests on a
# 2-core machine slowed several-fold. Set in the workers only: they inherit the controlling process's environment,
# and a value set there (all the cores: it has no worker count) would be theirs too, and their tests' processes'
# (Slurm's tasks trained 10-20 times slower for it)
_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)


def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests first, in their collected order, then the rest: pytest-xdist hands tests out in this order, and
    a minute-long test left to the end kept one worker busy while the other had nothing left to run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
