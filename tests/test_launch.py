"""Launcher and full `train.py` runs over 2 CPU ranks (gloo): the data-parallel strategies with their own checkpoint
formats, each resumed exactly (every strategy's 2-rank `train()` in `tests/test_teardown.py`)."""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.utils import TINY_SYNTHETIC_FIRST_LOSS, train_py

ROOT = Path(__file__).resolve().parents[1]
# the strategies with dcp (sharded) checkpoints and one with a full-state one: each run, then resumed exactly
STRATEGIES = ["ddp_bucketed", "zero1", "fsdp", "torch_fsdp2"]


def _train(tmp: Path, *overrides: str, timeout: int = 240) -> dict:
    argv = ["mesh=dp2", "mesh.device=cpu", "mesh.timeout_s=60", "model=tiny", "data=synthetic", "train.max_steps=4",
            "train.batch_size=4", "train.eval_every=0", "train.eval_batches=1", "logger=none",
            f"paths.output_root={tmp}", f"hydra.run.dir={tmp}/run", *overrides]
    proc = train_py(argv, timeout=timeout, env={"PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    return summary


@pytest.mark.slow
def test_fsdp_separate_reduce_scatter_group_trains_the_same(tmp_path):
    """Reduce-scatters in a process group of their own change where they run, not what they compute."""
    a = _train(tmp_path / "a", "parallelism=fsdp", "parallelism.separate_reduce_scatter=false")
    b = _train(tmp_path / "b", "parallelism=fsdp", "parallelism.separate_reduce_scatter=true")
    assert b["world_size"] == 2 and b["steps"] == 4
    assert abs(a["final_loss"] - b["final_loss"]) < 1e-6, (a["final_loss"], b["final_loss"])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.slow
def test_train_py_dp2_cpu(strategy, tmp_path):
    s = _train(tmp_path / "a", f"parallelism={strategy}", "checkpoint.every=2")
    assert s["world_size"] == 2 and s["steps"] == 4 and math.isfinite(s["final_loss"])
    # same seed, same data: the strategy starts from the same loss as single-process training
    assert abs(s["first_loss"] - TINY_SYNTHETIC_FIRST_LOSS) < 1e-4, s["first_loss"]
    # resume from step 2 under the same mesh: continues exactly
    ckpts = sorted((tmp_path / "a" / "run" / "checkpoints").glob("step_*"))
    step2 = next(c for c in ckpts if c.name.endswith("2"))
    r = _train(tmp_path / "b", f"parallelism={strategy}", f"resume={step2}")
    assert r["final_loss"] == s["final_loss"], (r["final_loss"], s["final_loss"])


def test_ranks_share_the_cpus_this_process_may_use(monkeypatch):
    """OMP_NUM_THREADS where set; else this process's CPUs (its affinity, within a Slurm task's cpus-per-task)
    shared among the ranks, at least one each."""
    from launchers.local import threads_per_rank

    for k in ("OMP_NUM_THREADS", "SLURM_JOB_ID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [threads_per_rank(n) for n in (1, 2, 4, 32)] == [16, 8, 4, 1]
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")  # outside a Slurm job: not this process's
    assert threads_per_rank(2) == 8
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert [threads_per_rank(n) for n in (1, 2, 8)] == [4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [threads_per_rank(n) for n in (1, 2)] == [3, 3]


def test_port_in_use_is_a_config_error():
    from core.errors import ConfigError
    from launchers.local import choose_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match="launcher.port"):
            choose_port(OmegaConf.create({"launcher": {"port": port}}))
        picked = choose_port(OmegaConf.create({}))  # not set: a port nobody holds, never the busy one
        assert picked != port and 1024 <= picked < 65536
        with socket.socket() as other:
            other.bind(("127.0.0.1", picked))


@pytest.mark.slow
def test_sweep_points_run_in_their_own_processes(tmp_path):
    """Every point of a local sweep, one-rank points too, runs in a fresh worker process: a point left in
    the sweep's own process would keep its CUDA memory for the next one (the next job's rank 0 then runs
    out of memory on that GPU while its peer waits in a collective)."""
    cmd = [sys.executable, "train.py", "-m", "mesh=dp1,dp2", "parallelism=ddp_bucketed", "mesh.device=cpu",
           "mesh.timeout_s=60", "model=tiny",
           "data=synthetic", "train.max_steps=2", "train.batch_size=4", "train.eval_every=0", "train.eval_batches=1",
           "logger=none", f"paths.output_root={tmp_path}", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").rglob("summary.json"))]
    assert [s["status"] for s in summaries] == ["ok", "ok"], summaries
    pids = {s["pid"] for s in summaries}
    assert len(pids) == 2 and proc.pid not in pids, (pids, proc.pid)
    assert (tmp_path / "sweep" / "report.md").is_file()


_ENV_PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from omegaconf import OmegaConf
    import core.trainer, launchers.local as L

    def train(cfg):  # what a rank sees
        return {{**{{k: os.environ.get(k) for k in ("PROBE", "GONE", "RANK", "WORLD_SIZE", "PYTHONPATH",
                                                       "NCCL_NVLS_ENABLE", "TORCH_NCCL_ENABLE_TIMING")}},
                "cwd": os.getcwd(), "local": L.__file__,
                "forked": L._IMPORTED_IN != os.getpid()}}

    core.trainer.train = train
    if __name__ == "__main__":
        cfg = OmegaConf.create({{"mesh": {{"timeout_s": 30}}}})
        os.environ.update(PROBE="first", GONE="set")
        first = L.launch_workers(cfg, 2)
        own = {{k: os.environ.get(k) for k in L.WORKER_ENV}}  # the launcher's own, after a launch
        os.environ.update(PROBE="second", TORCH_NCCL_ENABLE_TIMING="0")
        del os.environ["GONE"]
        os.chdir(sys.argv[1])
        print(json.dumps([first, L.launch_workers(cfg, 2), own]))
""")


def test_ranks_get_the_environment_and_directory_of_their_launch(tmp_path):
    """Ranks fork from a forkserver that imported the trainer once, started by the first launch; a later launch in
    the same process (the next point of a local sweep) still gives its ranks the environment and working directory
    of that launch, not those the forkserver started with, plus elastic's RANK and WORLD_SIZE and the launcher's
    WORKER_ENV defaults (which the launching process does not keep, and which the user's own settings override)."""
    script, later = tmp_path / "probe.py", tmp_path / "later"
    script.write_text(_ENV_PROBE.format(root=str(ROOT)))
    later.mkdir()
    # the script puts the repository on its sys.path at run time: the launcher hands that path to the forkserver
    proc = subprocess.run([sys.executable, str(script), str(later)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, launcher_own = json.loads(proc.stdout.strip().splitlines()[-1])
    # the forkserver's import path reaches it as PYTHONPATH; the ranks keep the launcher's
    same = {"RANK": "0", "WORLD_SIZE": "2", "PYTHONPATH": os.environ.get("PYTHONPATH"), "forked": True,
            "local": str(ROOT / "launchers" / "local.py"), "NCCL_NVLS_ENABLE": "0"}
    assert first == {**same, "PROBE": "first", "GONE": "set", "cwd": str(tmp_path),
                     "TORCH_NCCL_ENABLE_TIMING": "1"}, first
    assert second == {**same, "PROBE": "second", "GONE": None, "cwd": str(later),
                      "TORCH_NCCL_ENABLE_TIMING": "0"}, second
    assert launcher_own == {k: os.environ.get(k) for k in launcher_own}, launcher_own


_SLEEPING_RANKS = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from omegaconf import OmegaConf
    import core.trainer, launchers.local as L

    def train(cfg):  # a rank that says where it is, then works for longer than the test waits
        open(os.path.join(sys.argv[1], f"rank{{os.environ['RANK']}}.pid"), "w").write(str(os.getpid()))
        time.sleep(300)

    core.trainer.train = train
    if __name__ == "__main__":
        L.launch_workers(OmegaConf.create({{"mesh": {{"timeout_s": 30}}}}), 2)
""")


def test_ranks_end_with_a_launcher_killed_outright(tmp_path):
    """SIGKILL to the launching process (as a cancelled or requeued Slurm job's may get) ends its ranks too: they
    watch the launcher and end with it (the forkserver they come from stays up while they do)."""
    script = tmp_path / "sleep.py"
    script.write_text(_SLEEPING_RANKS.format(root=str(ROOT)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all(f.is_file() and f.read_text() for f in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int(f.read_text()) for f in pid_files]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in ranks if _running(pid)]
    finally:
        proc.kill()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

