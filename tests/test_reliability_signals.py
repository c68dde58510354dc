"""Stop signals, stuck ranks and failing ranks, through `python train.py` as a user runs it.

SIGTERM/SIGINT/SIGUSR1/SIGUSR2 checkpoint at the next step boundary and end with a final status
(core/stop.py) in a single process and when the parent of spawned ranks is signalled; a stopped
(SIGSTOP) rank ends the job within `mesh.timeout_s` plus a margin, named as the culprit; a failing
rank's whole message and last frames reach the job's error.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.utils import ROOT, read_summary

TINY = ["model=tiny", "data=synthetic", "logger=none", "train.batch_size=4", "train.eval_every=0",
        "train.eval_batches=1", "train.log_every=1", "train.max_steps=100000"]
TWO_RANKS = ["mesh=dp2", "mesh.device=cpu", "parallelism=ddp_bucketed"]
# the job ends this long after its mesh.timeout_s at most (heartbeat check, kill, exit; docs/reliability.md)
STALL_MARGIN_S = 20


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"}, start_new_session=True)


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} logged steps within {timeout_s} s (rc {proc.poll()}):\n"
                         + (proc.communicate(timeout=30)[1][-3000:] if proc.poll() is not None else ""))


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> tuple[str, str, bool]:
    """The job's stdout and stderr, and whether any of its processes outlived it."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return out, err, _group_alive(proc.pid)
    finally:  # never leave a run (or its ranks) behind a failed test
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _group_alive(pgid: int, grace_s: float = 15) -> bool:
    """Whether a process of the job's group is still there `grace_s` after the job ended (exited ranks may
    stay zombies until reaped)."""
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    return True


def _stop_and_check(run_dir: Path, sig: signal.Signals, status: str, *overrides: str,
                    group: bool = False) -> tuple[int, str]:
    """Start a run, signal its process (with group, every process of its group) after 3 logged steps; check the
    checkpoint and summary; return its step and stderr."""
    proc = _start(run_dir, *overrides)
    _wait_for_steps(proc, run_dir, 3)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err, left_behind = _finish(proc)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert not left_behind, "a rank outlived its job"
    s = read_summary(run_dir)
    assert s["status"] == status and s["signal"] == sig.name, s
    step = s["steps"]
    assert step >= 3 and (run_dir / "checkpoints" / f"step_{step:06d}").is_dir(), \
        sorted(p.name for p in (run_dir / "checkpoints").glob("*"))
    assert f"stopped by {sig.name} at step {step}" in err, err[-2000:]
    return step, err


def _resume_two_steps(run_dir: Path, step: int, *overrides: str) -> None:
    proc = _start(run_dir, *overrides, "resume=auto", f"train.stop_at_step={step + 2}")
    out, err, _ = _finish(proc, 180)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed at step {step}" in out, out[-2000:]
    s = read_summary(run_dir)
    assert s["status"] == "stopped" and s["steps"] == step + 2 and s["signal"] is None, s


@pytest.mark.slow
def test_sigterm_single_process_checkpoints_and_resumes(tmp_path):
    step, _ = _stop_and_check(tmp_path / "run", signal.SIGTERM, "stopped")
    _resume_two_steps(tmp_path / "run", step)


def test_sigusr1_single_process_is_a_preemption(tmp_path):
    _stop_and_check(tmp_path / "run", signal.SIGUSR1, "preempted")


@pytest.mark.slow
def test_sigterm_to_the_parent_of_two_ranks_checkpoints_and_resumes(tmp_path):
    """Only the parent is signalled: it forwards the signal, both ranks agree on the step and save it."""
    step, _ = _stop_and_check(tmp_path / "run", signal.SIGTERM, "stopped", *TWO_RANKS)
    _resume_two_steps(tmp_path / "run", step, *TWO_RANKS)


def test_sigusr2_to_every_process_of_two_ranks_is_a_clean_preemption(tmp_path):
    """As Slurm's `scancel --signal` and a terminal's `kill -- -PGID` do, the signal reaches every process of the
    job: the launcher, its ranks, and the forkserver and resource tracker multiprocessing started. Before, it ended
    those two: the ranks' exit codes, which the forkserver relays, read 255, and a preempted run reported "rank 0
    failed" with a traceback before its stop."""
    _, err = _stop_and_check(tmp_path / "run", signal.SIGUSR2, "preempted", *TWO_RANKS, group=True)
    assert "failed" not in err and "resource_tracker" not in err, err[-3000:]


def _wait_for_status(proc: subprocess.Popen, run_dir: Path, status: str, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        try:
            if read_summary(run_dir).get("status") == status:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"summary status never read {status!r} within {timeout_s} s (rc {proc.poll()})")


@pytest.mark.parametrize("mode, sig", [(("benchmark.enabled=true", "benchmark.warmup=0", "benchmark.steps=1000000"),
                                        signal.SIGTERM),
                                       (("profile.enabled=true", "profile.warmup=0", "profile.steps=1000000"),
                                        signal.SIGINT)], ids=["benchmark", "profile"])
def test_a_signal_ends_a_benchmark_or_profile_run_with_what_it_measured(tmp_path, mode, sig):
    """Before, both ran their million steps to the end whatever the signal; now they stop at the next step and
    report the steps done."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *mode)
    _wait_for_status(proc, run_dir, "running")  # written inside the signal handling, before the steps
    time.sleep(3)
    proc.send_signal(sig)
    out, err, left_behind = _finish(proc)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    s = read_summary(run_dir)
    assert s["status"] == "stopped" and s["signal"] == sig.name, s
    assert s["steps"] < 1000000, s
    if mode[0].startswith("benchmark"):
        assert f"benchmark stopped by {sig.name}" in err and "resume=auto" not in err, err[-2000:]
        if s["steps"]:  # stopped in the timed steps: their figures were written
            assert json.loads((run_dir / "benchmark.json").read_text())["steps"] == s["steps"]
    else:
        assert f"profile stopped by {sig.name}" in err, err[-2000:]
        assert (run_dir / "trace.json").is_file() and (run_dir / "profile_table.txt").is_file()


def _worker_pids(parent: int) -> list[int]:
    """The job's ranks: the children of the forkserver its launcher started (launchers/local.py)."""
    def children(pid: int) -> list[int]:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    servers = [c for c in children(parent) if b"multiprocessing.forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [rank for server in servers for rank in children(server)]


def test_a_collective_timeout_is_recognised_however_the_backend_words_it():
    """The rank whose collective timed out names the stopped peers (`DeviceMesh.blame_stalled_ranks`) for each
    wording gloo and NCCL use; gloo's "pair closure" one once reached the job's error as it was, blaming rank 0."""
    from core.distributed.mesh import _timed_out
    for message in ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to "
                    "complete", "Application timeout caused pair closure",
                    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran "
                    "for 20000 milliseconds before timing out."):
        assert _timed_out(RuntimeError(message)), message
    assert not _timed_out(RuntimeError("Connection reset by peer"))
    assert not _timed_out(ValueError("timed out"))  # not a collective's error


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to find the ranks")
def test_stopped_rank_ends_the_job_within_its_timeout_and_is_named(tmp_path):
    timeout_s = 20
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *TWO_RANKS, f"mesh.timeout_s={timeout_s}")
    _wait_for_steps(proc, run_dir, 3)
    workers = _worker_pids(proc.pid)
    assert len(workers) == 2, workers
    victim = workers[-1]
    start = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    out, err, left_behind = _finish(proc, timeout_s + 120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < timeout_s + STALL_MARGIN_S, f"the job took {elapsed:.0f} s for mesh.timeout_s={timeout_s}"
    assert f"(pid {victim}) of 2 stopped making progress" in err, err[-3000:]
    assert f"(pid {victim})" in read_summary(run_dir)["error"]
    assert not left_behind, "a rank outlived its job"


_FAILING_WORKER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from omegaconf import OmegaConf
    import core.trainer, launchers.local as L

    class LoadFailed(BaseException):  # like DCP's CheckpointException: a BaseException with many lines
        pass

    def read_shard(name):
        raise LoadFailed("could not load the checkpoint\\n  rank 1: FileNotFoundError: " + name
                         + "\\nTo enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")

    def train(cfg):
        if os.environ["RANK"] == "1":
            read_shard("step_000004/dcp/__1_0.distcp")
        time.sleep(120)  # rank 0 would wait forever in a collective

    core.trainer.train = train
    if __name__ == "__main__":
        start = time.monotonic()
        try:
            L.launch_workers(OmegaConf.create({{"mesh": {{"timeout_s": 30}}}}), 2)
        except L.WorkerFailedError as e:
            print("CAUGHT:", e)
        print(f"ENDED AFTER {{time.monotonic() - start:.0f}} s")
""")


def test_failed_rank_relays_its_whole_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(_FAILING_WORKER.format(root=str(ROOT)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout
    assert "CAUGHT: rank 1 of 2 failed: LoadFailed: could not load the checkpoint\n" in out, out + proc.stderr[-2000:]
    assert "rank 1: FileNotFoundError: step_000004/dcp/__1_0.distcp" in out, out
    assert 'in read_shard: raise LoadFailed("could not load the checkpoint' in out, out  # its last frame
    # rank 0 sleeps in place of a collective: it is stopped, not waited for
    assert int(out.split("ENDED AFTER ")[1].split()[0]) < 60, out
