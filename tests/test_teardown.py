"""A rank's `train()` leaves nothing of its process group behind when it returns.

Under torchrun or SLURM a rank is a plain Python process that exits through interpreter shutdown.
A gloo worker thread still alive then, releasing a finished collective's tensors, needs the GIL
from a finalizing interpreter and the process aborts (SIGABRT, "terminate called without an
active exception"; pytorch/pytorch#190489; 6 of 53 torchrun runs, and CI's torchrun test).
So every strategy's run must free its groups, and with them those threads, before `train()` returns.
"""
from pathlib import Path

import pytest

from tests.dist_utils import backend_threads, free_port, run_ranks
from tests.utils import CONF, TINY_SYNTHETIC_FIRST_LOSS, compose_cfg

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to list threads")
STRATEGIES = sorted(p.stem for p in (CONF / "parallelism").glob("*.yaml") if p.stem != "none")
# options that open process groups of their own: each must be released with the run too
EXTRA_GROUPS = {"fsdp": ["parallelism.separate_reduce_scatter=false"]}

# every run, each on a port of its own
RUNS = [(s, []) for s in STRATEGIES] + [(s, extra) for s, extra in EXTRA_GROUPS.items()]


def _train_each_strategy(rank: int, world: int, root: str, fail_after_setup: bool, ports: list[int]) -> None:
    import os

    from core.trainer import train

    for (strategy, extra), port in zip(RUNS, ports):
        # a port per run: a rank that finishes a run first must not meet its peer's previous store, still open
        # on the old port until that peer has left its run too (it would wait there for a client that never comes)
        os.environ["MASTER_PORT"] = str(port)
        overrides = ["mesh=dp2", "mesh.device=cpu", "mesh.timeout_s=120", "model=tiny", "data=synthetic",
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
            # same seed, same data: every strategy starts from single-process training's first loss
            assert abs(summary["first_loss"] - TINY_SYNTHETIC_FIRST_LOSS) < 1e-4, \
                (strategy, extra, summary["first_loss"])
        left = backend_threads()
        assert not left, f"parallelism={strategy} {extra}: {len(left)} backend threads outlived train(): {left}"


def _ports() -> list[int]:
    return [free_port() for _ in RUNS]


@pytest.mark.slow
def test_train_frees_process_group_threads_for_every_strategy(tmp_path):
    run_ranks(_train_each_strategy, 2, args=(str(tmp_path), False, _ports()), timeout_s=60, join_group=False)


@pytest.mark.slow
def test_failed_run_frees_process_group_threads(tmp_path):
    run_ranks(_train_each_strategy, 2, args=(str(tmp_path), True, _ports()), timeout_s=60, join_group=False)
