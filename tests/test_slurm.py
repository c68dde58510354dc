"""Sweeps through hydra/launcher=slurm on a real one-node Slurm cluster (launchers/slurm_local_cluster.sh).

Skipped, with the reason, only when `sinfo` shows no idle node (the daemons could not start).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the local cluster is one node: jobs of two tests at once queue behind each other and miss their start deadlines,
# so under pytest-xdist (--dist loadgroup) these tests run on one worker, one after another. Together they take
# minutes: marked slow, they start early (tests/conftest.py), not as the suite's tail on one worker
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.slow]


def _cluster_reason() -> str | None:
    if shutil.which("sinfo") is None:
        return "no sinfo: run launchers/slurm_local_cluster.sh (installs slurm-wlm and munge) first"
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"sinfo failed ({r.stderr.strip()[:200]}): start the cluster with launchers/slurm_local_cluster.sh"
    if not {"idle", "mix"} & set(r.stdout.split()):
        return f"sinfo shows no idle node ({r.stdout.strip() or 'no nodes'}): launchers/slurm_local_cluster.sh"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster():
    reason = _cluster_reason()
    for _ in range(90):  # a node still completing an earlier job ("comp", "alloc") becomes idle shortly
        if reason is None or "no idle node (" not in reason or "no nodes" in reason:
            break
        time.sleep(1)
        reason = _cluster_reason()
    if reason is not None:
        pytest.skip(reason)


# The launcher's defaults on a CPU-only cluster: gpus and cpus_per_task are "auto", mesh.device "auto"
SLURM_CPU = ["hydra/launcher=slurm", "hydra/sweeper=validated", "hydra.launcher.timeout_min=10", "model=tiny"]
# how long a submitted job may take to log its first training step: Slurm schedules it, each rank imports torch and
# builds the model; on a 2-core CI machine busy with other work a two-rank job took over 150 s. The wait ends as
# soon as the step is logged, so the margin costs nothing when the job runs
START_DEADLINE_S = 420


def _node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, timeout=30).stdout
    return int(out.split()[0])


def _submitted_job_id(sweep: Path, deadline_s: float) -> tuple[str, Path]:
    """The first Slurm job id of the sweep and its metrics file, once the job has logged a training step."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        sub = sweep / ".submitit"
        ids = [d.name for d in sub.iterdir() if d.is_dir() and d.name[0].isdigit()] if sub.is_dir() else []
        found = list(sweep.glob("*/metrics.jsonl"))
        if ids and found and len(found[0].read_text().splitlines()) >= 1:
            return ids[0], found[0]
        time.sleep(1)
    raise AssertionError(f"the job did not start training within {deadline_s:.0f} s")


def _train(args: list[str], timeout: int = 240, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, "train.py", "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def test_two_point_sweep_of_two_rank_jobs(tmp_path: Path):
    """On the default sweep directory: claimed once by the submitting process, the one every Slurm task writes in."""
    r = _train([*SLURM_CPU, "mesh=dp2", "parallelism=ddp_bucketed,ddp_flat", "train.max_steps=4",
                "train.log_every=2", f"paths.output_root={tmp_path}"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sweep,) = (tmp_path / "sweeps").glob("*/*")
    jobs = sorted(p.parent for p in sweep.glob("*/summary.json"))
    assert len(jobs) == 2
    for job in jobs:
        s = json.loads((job / "summary.json").read_text())
        assert s["status"] == "ok", s
        assert s["world_size"] == 2 and len(s["peak_mem_gib_per_rank"]) == 2  # two SLURM tasks, one rank each
        steps = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps if "loss" in m][-1] == 4
    # each job was one 2-task SLURM job (no torchrun inside): submitit wrote one log per task
    job_dirs = [d for d in (sweep / ".submitit").iterdir() if list(d.glob("*_submitted.pkl"))]
    assert len(job_dirs) == 2
    for d in job_dirs:
        assert sorted(p.name.split("_")[-2] for p in d.glob("*_log.out")) == ["0", "1"]
    scripts = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_submission.sh"))
    assert "#SBATCH --ntasks-per-node=2" in scripts and "#SBATCH --nodes=1" in scripts
    # auto: no GPUs on a node without them, and the node's CPUs shared by its tasks
    assert "gpu" not in scripts and f"#SBATCH --cpus-per-task={max(1, min(8, _node_cpus() // 2))}" in scripts
    assert "torchrun" not in scripts
    md = (sweep / "report.md").read_text()
    assert "| ok | ddp_bucketed |" in md and "| ok | ddp_flat |" in md
    assert (sweep / "throughput_vs_memory.png").stat().st_size > 1000


def test_invalid_points_are_all_listed_and_nothing_is_submitted(tmp_path: Path):
    sweep = tmp_path / "sweep"
    r = _train([*SLURM_CPU, "mesh=dp2", "parallelism=ddp_bucketed", "train.batch_size=3,5,4",
                f"hydra.sweep.dir={sweep}"], timeout=120)
    assert r.returncode == 2
    assert "2 of 3 sweep points cannot run" in r.stderr
    assert "train.batch_size=3" in r.stderr and "train.batch_size=5" in r.stderr
    assert not (sweep / ".submitit").exists()


@pytest.mark.parametrize("mesh", ["dp1", "dp2"])  # dp1: the task trains in a worker it spawned and forwards to
def test_preemption_signal_checkpoints_requeues_and_resumes(tmp_path: Path, mesh: str):
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "train.py", "-m", *SLURM_CPU, f"mesh={mesh}", "parallelism=ddp_bucketed",
                             "train.max_steps=12", "train.log_every=1", "train.eval_every=0",
                             f"hydra.sweep.dir={sweep}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    try:
        job_id, metrics = _submitted_job_id(sweep, START_DEADLINE_S)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    job = metrics.parent
    s = json.loads((job / "summary.json").read_text())
    assert s["status"] == "ok" and s["steps"] == 12, s
    assert list((job / "checkpoints").iterdir()), "no checkpoint was saved on the signal"
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_0_log.*"))
    assert "job requeued" in logs and "resumed at step" in logs
    # the signal reaches every process of the step (dp1: the worker's forkserver too): a clean stop, not a failure
    assert "job failed" not in logs and "died unexpectedly" not in logs, logs[-4000:]


@pytest.mark.parametrize("request_,key", [("hydra.launcher.gpus=true", "hydra.launcher.gpus"),
                                          ("hydra.launcher.cpus_per_task=64", "hydra.launcher.cpus_per_task")])
def test_an_impossible_request_is_refused_before_submitting(tmp_path: Path, request_: str, key: str):
    """Before: the gres request ended in sbatch's error deep in submitit; too many CPUs pended forever."""
    sweep = tmp_path / "sweep"
    r = _train([*SLURM_CPU, "mesh=dp2", "parallelism=ddp_bucketed", request_, f"hydra.sweep.dir={sweep}"], timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}:") and "Fix: set" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (sweep / ".submitit").exists()


@pytest.mark.slow
def test_a_cancelled_job_ends_the_wait_as_a_failed_point(tmp_path: Path):
    """No accounting on this cluster (sacct fails): before, the sweep waited forever for the cancelled job."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "train.py", "-m", *SLURM_CPU, "mesh=dp1", "train.max_steps=100000",
                             "train.log_every=1", "train.eval_every=0", f"hydra.sweep.dir={sweep}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    try:
        job_id, metrics = _submitted_job_id(sweep, START_DEADLINE_S)
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-4000:]
    assert f"Slurm job {job_id} ended CANCELLED without a result" in out, out[-4000:]
    assert "error: 1 of 1 sweep points did not finish:" in out
    # the job caught scancel's SIGTERM, checkpointed and wrote "stopped" by SIGTERM; one that could not write
    # would read "killed" or "failed"
    s = json.loads((metrics.parent / "summary.json").read_text())
    assert (s["status"], s.get("signal")) == ("stopped", "SIGTERM") or s["status"] in ("killed", "failed"), s
    assert "stopped by SIGTERM" in out or s["status"] != "stopped", out[-4000:]


@pytest.mark.slow
def test_a_rank_that_fails_before_the_rendezvous_ends_its_job_at_once(tmp_path: Path):
    """Rank 0 cannot listen on MASTER_PORT (held here; the user's MASTER_PORT wins). Before, its task ended without
    an error and rank 1 waited for the rendezvous store for mesh.join_timeout_s (600 s), the job's whole time
    limit; now the failed rank's task exits non-zero and srun (--kill-on-bad-exit) ends the job's other task."""
    sweep = tmp_path / "sweep"
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "train.py", "-m", *SLURM_CPU, "mesh=dp2", "parallelism=ddp_bucketed",
                            f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "MASTER_PORT": str(port)})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "error: 1 of 1 sweep points did not finish:" in r.stderr, r.stderr[-3000:]
    [summary] = sweep.glob("*/summary.json")
    s = json.loads(summary.read_text())
    assert s["status"] == "failed" and str(port) in s["error"], s


@pytest.mark.slow
def test_max_num_timeout_bounds_the_requeues(tmp_path: Path):
    """max_num_timeout=0: the signal checkpoints, the job is not requeued, the sweep names the point and exits 1."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "train.py", "-m", *SLURM_CPU, "hydra.launcher.max_num_timeout=0",
                             "mesh=dp2", "parallelism=ddp_bucketed", "train.max_steps=100000", "train.log_every=1",
                             "train.eval_every=0", f"hydra.sweep.dir={sweep}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    try:
        job_id, metrics = _submitted_job_id(sweep, START_DEADLINE_S)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-4000:]
    s = json.loads((metrics.parent / "summary.json").read_text())
    assert s["status"] == "preempted" and "max_num_timeout=0" in s["error"], s
    assert list((metrics.parent / "checkpoints").iterdir()), "no checkpoint was saved on the signal"
    assert "error: 1 of 1 sweep points did not finish:" in out and "preempted by SIGUSR2: not requeued" in out, out[-4000:]
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_0_log.*"))
    assert "job requeued" not in logs
