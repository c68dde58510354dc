"""The Slurm launcher's submitting side without a cluster: fake `sacct`/`squeue`/`sinfo` on PATH behave like a
cluster without accounting (tests/test_slurm.py runs the same paths on the real one-node cluster)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from core.errors import ConfigError
from launchers.slurm_resources import Partition, check_request, choose_cpus_per_task, choose_gpus, parse_sinfo
from launchers.slurm_state import ACTIVE_STATES, QueueStateWatcher, describe_end, watch

# squeue answers from QUEUE (lines "id|state|nodes"); like the real one, it names one unknown job id an error
FAKE_SQUEUE = """#!/bin/sh
ids=$(echo "$@" | sed -n 's/.*--jobs=\\([^ ]*\\).*/\\1/p')
echo "$@" >> "$QUEUE.calls"
out=$(cat "$QUEUE")
if [ -z "$out" ] && [ "${ids#*,}" = "$ids" ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi
[ -n "$out" ] && echo "$out"
exit 0
"""
NO_ACCOUNTING_SACCT = """#!/bin/sh
echo "Slurm accounting storage is disabled" >&2
exit 1
"""


@pytest.fixture()
def cluster(tmp_path: Path, monkeypatch) -> Path:
    """A bin dir with a sacct that fails as without accounting and a squeue reading the queue file it returns."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("squeue", FAKE_SQUEUE), ("sacct", NO_ACCOUNTING_SACCT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755 | stat.S_IXUSR)
    queue = tmp_path / "queue"
    queue.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("QUEUE", str(queue))
    return queue


def test_job_states_come_from_squeue_when_sacct_has_no_accounting(cluster: Path):
    cluster.write_text("12_0|RUNNING|n1\n12_1|PENDING|\n")
    watcher = QueueStateWatcher()
    for job_id in ("12_0", "12_1"):
        watcher.register_job(job_id)
    watcher.update()
    assert watcher.accounting is False
    assert not watcher.is_done("12_0", mode="cache") and not watcher.is_done("12_1", mode="cache")
    # 12_0 is cancelled (still listed, final state); 12_1 leaves the queue without ever running
    cluster.write_text("12_0|CANCELLED|n1\n")
    watcher.update()
    assert watcher.is_done("12_0", mode="cache") and describe_end(watcher, "12_0") == "ended CANCELLED"
    assert watcher.is_done("12_1", mode="cache") and describe_end(watcher, "12_1") == "left the queue while PENDING"


def test_a_single_job_no_longer_known_to_squeue_has_ended(cluster: Path):
    cluster.write_text("7|RUNNING|n1\n")
    watcher = QueueStateWatcher()
    watcher.register_job("7")
    watcher.update()
    assert not watcher.is_done("7", mode="cache")
    cluster.write_text("")  # squeue: "Invalid job id specified", exit 1
    watcher.update()
    assert watcher.is_done("7", mode="cache") and describe_end(watcher, "7") == "left the queue while RUNNING"


def test_an_unreachable_controller_ends_nothing(cluster: Path):
    cluster.write_text("7|RUNNING|n1\n")
    watcher = QueueStateWatcher()
    watcher.register_job("7")
    watcher.update()
    (cluster.parent / "bin" / "squeue").write_text("#!/bin/sh\necho 'Unable to contact slurm controller' >&2\nexit 1\n")
    watcher.update()
    assert not watcher.is_done("7", mode="cache")


def test_transient_states_are_not_the_end():
    watcher = QueueStateWatcher()
    for i, state in enumerate(["CONFIGURING", "SUSPENDED", "REQUEUE_HOLD", "COMPLETING", "PENDING"]):
        watcher._info_dict[str(i)] = {"State": state}
        assert not watcher.is_done(str(i), mode="cache"), state
    watcher._info_dict["9"] = {"State": "CANCELLED by 1000"}
    assert watcher.is_done("9", mode="cache")
    assert {"TIMEOUT", "CANCELLED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "COMPLETED"}.isdisjoint(ACTIVE_STATES)


def test_a_job_that_ended_without_a_result_is_a_failed_point(cluster: Path, tmp_path: Path, monkeypatch):
    """The sweep's wait returns (no hang), the point's summary ends 'failed' with how the job ended."""
    from submitit.slurm.slurm import SlurmJob

    from launchers.slurm import _outcome

    cluster.write_text("31_0|TIMEOUT|n1\n")
    job = SlurmJob(folder=tmp_path / "submitit", job_id="31_0", tasks=(0,))
    job.paths.folder.mkdir(parents=True)
    monkeypatch.setattr(job, "_results_timeout_s", 1)  # submitit's grace for a result file on a slow file system
    watcher = QueueStateWatcher(delay_s=1)
    watch([job], watcher)
    run_dir = tmp_path / "0_mesh=dp1"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "running", "plan": {"step_time_ms": 1.0}}))
    outcome: dict = {}
    waiter = threading.Thread(target=lambda: outcome.update(ret=_outcome(job, ["mesh=dp1"], 0, run_dir, watcher)),
                              daemon=True)
    waiter.start()
    waiter.join(120)
    assert "ret" in outcome, "the sweep still waits for a job that ended without a result"
    ret = outcome["ret"]
    assert ret.return_value["status"] == "failed" and "Slurm job 31_0 ended TIMEOUT without a result" in \
        ret.return_value["error"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "TIMEOUT" in summary["error"]
    assert summary["plan"] == {"step_time_ms": 1.0}  # what the job wrote first is kept


def test_a_job_whose_other_task_failed_names_that_tasks_error(cluster: Path, tmp_path: Path, monkeypatch):
    """Rank 1 failed: its task recorded the error and srun ended rank 0's task, which left no result. The point's
    error names rank 1's exception, not only "without a result"."""
    from submitit.core.utils import cloudpickle_dump
    from submitit.slurm.slurm import SlurmJob

    from launchers.slurm import _outcome

    cluster.write_text("32|FAILED|n1\n")
    monkeypatch.setattr(SlurmJob, "_results_timeout_s", 1)  # submitit's grace for a result file on a slow file system
    job = SlurmJob(folder=tmp_path / "submitit", job_id="32", tasks=(0, 1))
    job.paths.folder.mkdir(parents=True)
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: rank 1 could not start\n'
    cloudpickle_dump(("error", trace), job.task(1).paths.result_pickle)
    watcher = QueueStateWatcher(delay_s=1)
    watch([job], watcher)
    run_dir = tmp_path / "0_mesh=dp2"
    run_dir.mkdir()
    ret = _outcome(job, ["mesh=dp2"], 0, run_dir, watcher)
    error = ret.return_value["error"]
    assert "Slurm job 32 ended FAILED without a result" in error and \
        error.endswith("; task 1 failed: ValueError: rank 1 could not start"), error
    assert json.loads((run_dir / "summary.json").read_text())["error"] == error


@pytest.mark.parametrize("restarts,limit,allowed", [(0, 1, True), (1, 1, False), (3, 1, False), (0, 0, False),
                                                    (2, 3, True), (3, 3, False)])
def test_requeues_stop_at_max_num_timeout(restarts, limit, allowed, monkeypatch):
    from launchers.slurm import may_requeue

    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    assert may_requeue(limit) is allowed


@pytest.mark.parametrize("script,raises", [
    ('echo "$@" > "$LOG"', False),
    ('echo "$@" > "$LOG"; kill -TERM $$', False),  # killed by the requeue it asked for: the requeue is under way
    ('echo "$@" > "$LOG"; echo "Invalid job id" >&2; exit 1', True),
])
def test_requeue_calls_scontrol_and_a_signal_ending_it_is_not_a_failure(script, raises, tmp_path, monkeypatch):
    from launchers.slurm import requeue_current_job

    (tmp_path / "scontrol").write_text(f"#!/bin/sh\n{script}\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LOG", str(tmp_path / "args"))
    monkeypatch.setenv("SLURM_JOB_ID", "339")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    if raises:
        with pytest.raises(subprocess.CalledProcessError):
            requeue_current_job()
    else:
        requeue_current_job()
    assert (tmp_path / "args").read_text().split() == ["requeue", "339"]


# ---- resources ----------------------------------------------------------------------------------------

SINFO = """cpu*|c1|2|(null)|21694
cpu*|c2|4|(null)|30000+
gpu|g1|96|gpu:h100:8(S:0-1)|2000000
gpu|g2|96|gpu:4,gpu:a100:4|2000000
"""


def test_partitions_from_sinfo():
    assert parse_sinfo(SINFO, None) == Partition("cpu", nodes=2, cpus_per_node=4, gpus_per_node=0, mem_mb=30000)
    assert parse_sinfo(SINFO, "gpu") == Partition("gpu", nodes=2, cpus_per_node=96, gpus_per_node=8, mem_mb=2000000)
    assert parse_sinfo(SINFO, "nope") is None


CPU_NODE = Partition("debug", nodes=1, cpus_per_node=2, gpus_per_node=0, mem_mb=21694)


def test_defaults_fit_a_cpu_only_partition():
    assert choose_gpus("auto", CPU_NODE) is False and choose_gpus("auto", parse_sinfo(SINFO, "gpu")) is True
    assert choose_cpus_per_task("auto", 2, CPU_NODE) == 1 and choose_cpus_per_task("auto", 1, CPU_NODE) == 2
    assert choose_cpus_per_task("auto", 8, parse_sinfo(SINFO, "gpu")) == 8
    check_request(CPU_NODE, world=2, nodes=1, tasks_per_node=2, cpus_per_task=1, gpus_per_node=None, mem_gb=None)


@pytest.mark.parametrize("request_,key,fix", [
    (dict(cpus_per_task=8), "hydra.launcher.cpus_per_task", "cpus_per_task=1"),
    (dict(gpus_per_node=2), "hydra.launcher.gpus", "gpus=false"),
    (dict(tasks_per_node=4, world=4), "hydra.launcher.ranks_per_node", "ranks_per_node=2"),
    (dict(nodes=2, world=4), "hydra.launcher.ranks_per_node", "at most 2 ranks"),
    (dict(mem_gb=64), "hydra.launcher.mem_gb", "at most 21"),
])
def test_impossible_requests_are_refused_naming_the_key(request_, key, fix):
    args = {**dict(world=2, nodes=1, tasks_per_node=2, cpus_per_task=1, gpus_per_node=None, mem_gb=None), **request_}
    with pytest.raises(ConfigError) as e:
        check_request(CPU_NODE, **args)
    assert e.value.key == key and fix in e.value.fix, str(e.value)


_TASK_ENV = {"SLURM_JOB_ID": "114", "SLURM_ARRAY_JOB_ID": "114", "SLURM_ARRAY_TASK_ID": "1", "SLURM_NTASKS": "2",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1",
             "SUBMITIT_EXECUTOR": "slurm"}


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_task_of_a_job_rendezvouses_on_one_port_below_the_ephemeral_range(rank):
    """The port is the job's (both tasks of array job 114_1 agree), below 32768, where Linux hands out no
    ephemeral port (submitit's own draw for 114_1, 46350, was one in use on a busy node); MASTER_PORT where the
    user set it."""
    from unittest import mock

    from launchers.slurm import export_slurm_env, job_master_port

    # the export writes RANK, MASTER_*, CUDA_VISIBLE_DEVICES, ... into os.environ: all restored on leaving
    before = dict(os.environ)
    with mock.patch.dict(os.environ):
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)
        os.environ.update({**_TASK_ENV, "SLURM_PROCID": rank})
        assert export_slurm_env()
        port = int(os.environ["MASTER_PORT"])
        assert port == job_master_port("114_1") and 20000 <= port < 32768
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == (rank, "2", "vm")
        os.environ["MASTER_PORT"] = "29512"
        assert export_slurm_env() and os.environ["MASTER_PORT"] == "29512"
    assert dict(os.environ) == before  # nothing left for the tests after this one (the warm runner checks it)
    ports = {job_master_port(f"{j}_{t}") for j in range(100, 140) for t in range(4)}
    assert len(ports) > 150 and all(20000 <= p < 32768 for p in ports)  # jobs spread over the range
