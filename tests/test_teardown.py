"""A rank's `train()` leaves nothing of its process group behind when it returns.

Under torchrun or SLURM a rank is a plain Python process that exits through interpreter shutdown.
A gloo worker thread still alive then, releasing a finished collective's tensors, needs the GIL
from a finalizing interpreter and the process aborts (SIGABRT, "terminate called without an
active exception"; pytorch/pytorch#190489; 6 of 53 torchrun runs, and CI's torchrun test).
So every strategy's run must free its groups, and with them those threads, before `train()` returns.
"""
from pathlib import Path

import pytest

from tests.dist_utils import backend_threads, run_ranks
from tests.utils import CONF, compose_cfg

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to list threads")
STRATEGIES = sorted(p.stem for p in (CONF / "parallelism").glob("*.yaml") if p.stem != "none")
# options that open process groups of their own: each must be released with the run too
EXTRA_GROUPS = {"fsdp": ["parallelism.separate_reduce_scatter=false"]}


def _train_each_strategy(rank: int, world: int, root: str, fail_after_setup: bool) -> None:
    from core.trainer import train

    runs = [(s, []) for s in STRATEGIES] + [(s, extra) for s, extra in EXTRA_GROUPS.items()]
    for strategy, extra in runs:
        overrides = ["mesh=dp2", "mesh.device=cpu", "mesh.timeout_s=30", "model=tiny", "data=synthetic",
                     "train.max_steps=2", "train.batch_size=4", "train.eval_every=0", "train.eval_batches=1",
                     "logger=none", f"parallelism={strategy}", *extra]
        if fail_after_setup:  # the run dies with the model wrapped and hooks in place: the error path must free it too
            overrides.append(f"resume={root}/no_such_checkpoint")
        cfg = compose_cfg(overrides, Path(root) / (strategy + ("_extra" if extra else "")))
        try:
            summary = train(cfg)
        except Exception as e:  # noqa: BLE001 - the expected ConfigError, checked below
            assert fail_after_setup and "no_such_checkpoint" in str(e), e
        else:
            assert not fail_after_setup and summary["status"] == "ok", summary
        left = backend_threads()
        assert not left, f"parallelism={strategy} {extra}: {len(left)} backend threads outlived train(): {left}"


def test_train_frees_process_group_threads_for_every_strategy(tmp_path):
    run_ranks(_train_each_strategy, 2, args=(str(tmp_path), False), timeout_s=60, join_group=False)


def test_failed_run_frees_process_group_threads(tmp_path):
    run_ranks(_train_each_strategy, 2, args=(str(tmp_path), True), timeout_s=60, join_group=False)
