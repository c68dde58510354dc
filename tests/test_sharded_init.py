"""The sharding strategies (fsdp, torch_fsdp2) initialise without any rank holding the whole model.

On 4 gloo ranks, each run is built by the real trainer (`core.trainer.build` on a composed config). While the
parallelize step runs, a TorchDispatchMode counts the bytes of every storage an operator creates and uncounts them
when the storage is freed: its peak is what the rank held at most, whatever the strategy's code believes. The
weights after setup must equal, bit for bit, one process's `TransformerLM.init_weights(seed)`.
"""
from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from tests.dist_utils import run_ranks
from tests.utils import compose_cfg, train_py

WORLD = 4
# 8 small blocks: the largest weight (embedding, LM head, w1..w3) is ~3% of the model, so one full weight alive
# during init stays far below the whole; vocab 258 does not split evenly over 4 ranks (65, 65, 65, 63 rows)
COMMON = ["model=tiny", "model.d_model=64", "model.d_ff=256", "model.n_layers=8", "model.vocab_size=258",
          "data=synthetic", "data.seq_len=32", "train.batch_size=4", "train.max_steps=1", "logger=none",
          "mesh.device=cpu", f"mesh.dp_shard={WORLD}", "mesh.timeout_s=120", "seed=7"]
# the runs built: each strategy over the 4 ranks, FSDP2's HSDP (2 replicas of 2 shards: a 2-D DeviceMesh), and
# FSDP2 over DTensor tensor parallelism (dp_shard 2 x tp 2: each rank's chunk of its TP part)
CASES = {"fsdp": ["parallelism=fsdp"], "torch_fsdp2": ["parallelism=torch_fsdp2"],
         "torch_fsdp2_hsdp": ["parallelism=torch_fsdp2", "mesh.dp_replicate=2", "mesh.dp_shard=2"],
         "torch_fsdp2_tp": ["parallelism=torch_fsdp2", "tensor_parallel=dtensor", "mesh.dp_shard=2", "mesh.tp=2"]}
PEAK_CASES = ("fsdp", "torch_fsdp2", "torch_fsdp2_tp")  # one rank's share is 1/4 of the model in each
PEAK_LIMIT = 0.5  # of the full model's parameter bytes, per rank


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor owns no storage: its local tensor does
            names, _ = t.__tensor_flatten__()
            for name in names:
                self._track(getattr(t, name))
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)  # the storage's Python object lives exactly as long as the storage
        if key in self._seen:
            return  # a view or an in-place result: no new memory
        self._seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


def _build_measured(cfg):
    """`core.trainer.build(cfg)` with the parallelize step run under a `LiveStorageBytes`; (run, peak bytes)."""
    import core.trainer

    mode = LiveStorageBytes()
    parallelize = core.trainer.parallelize

    def measured(*args, **kwargs):
        with mode:
            return parallelize(*args, **kwargs)

    core.trainer.parallelize = measured
    try:
        run = core.trainer.build(cfg)
    finally:
        core.trainer.parallelize = parallelize
    return run, mode.peak


def _worker(rank: int, world: int, tmp: str) -> None:
    """Per case: the peak during the parallelize step (a fraction of the model's parameter bytes) and the
    parameters whose gathered value differs from one process's init, written to tmp/rank<r>.json."""
    from hydra.utils import instantiate

    from core.model import TransformerLM

    out = {}
    for case, overrides in CASES.items():
        cfg = compose_cfg(COMMON + overrides, Path(tmp) / case)
        ref = TransformerLM(instantiate(cfg.model))
        ref.init_weights(seed=int(cfg.seed))
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        full_bytes = sum(p.numel() * p.element_size() for p in ref_params.values())
        largest = max(p.numel() * p.element_size() for p in ref_params.values())
        run, peak = _build_measured(cfg)
        full = run.strategy.full_parameters(run.raw_model)  # collective: every rank gathers
        for n in ref_params:  # DTensor TP stores the fused qkv rows rank-major: compare in that order
            reorder = getattr(run.raw_model.get_submodule(n.rpartition(".")[0]), "reorder_full", None)
            if reorder is not None:
                ref_params[n] = reorder(ref_params[n])
        differ = [n for n, want in ref_params.items()
                  if n not in full or full[n].shape != want.shape or not torch.equal(full[n], want)]
        out[case] = {"peak": peak / full_bytes, "largest": largest / full_bytes,
                         "differ": differ + sorted(set(full) - set(ref_params))}
        del run, full
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> list[dict]:
    """Every case built on WORLD ranks in one spawn (starting ranks costs seconds); each rank's record."""
    tmp = tmp_path_factory.mktemp("sharded_init")
    run_ranks(_worker, world_size=WORLD, args=(str(tmp),), timeout_s=120)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", PEAK_CASES)
def test_setup_peak_is_a_fraction_of_the_model(sharded_runs, case):
    for rank, record in enumerate(sharded_runs):
        r = record[case]
        assert r["largest"] < 0.05, "the model must be many small weights for the bound below to mean much"
        assert r["peak"] < PEAK_LIMIT, f"rank {rank} held {r['peak']:.2f}x the model's parameter bytes during setup"
        assert r["peak"] > 1 / WORLD, f"rank {rank}: the counter saw less than a shard ({r['peak']:.3f}x)"


@pytest.mark.parametrize("case", CASES)
def test_setup_weights_are_one_processes_init(sharded_runs, case):
    for rank, record in enumerate(sharded_runs):
        assert not record[case]["differ"], \
            f"rank {rank}: these differ from one process's init_weights(seed): {record[case]['differ']}"


def test_plan_10b_fsdp_dp8_holds_an_eighth_of_the_parameters():
    proc = train_py(["model=10b", "parallelism=fsdp", "mesh.dp_shard=8", "plan=true", "planner.device=h100_sxm"],
                    timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    params = float(re.search(r"\((\d+(?:\.\d+)?)M params\)", proc.stdout).group(1)) * 1e6
    per_rank_gib = float(re.search(r"^\s+parameters\s+(\d+(?:\.\d+)?) GiB", proc.stdout, re.M).group(1))
    eighth_gib = 4 * params / 8 / 2**30  # fp32 master weights
    assert abs(per_rank_gib - eighth_gib) <= 0.01 * eighth_gib, (per_rank_gib, eighth_gib, proc.stdout[:1500])
