"""SLURM through hydra-submitit-launcher (`hydra/launcher=slurm`, conf/hydra/launcher/slurm.yaml).

One SLURM job per sweep point; each job gets one task per rank (`tasks_per_node` = ranks per node,
nodes = ceil(world / ranks_per_node), both derived from *that point's* mesh, so `mesh=dp1,dp2` in one
sweep submits a 1-task and a 2-task job). Submitit runs the Hydra job in every task; each task exports
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the SLURM environment
(`export_slurm_env`) before the job starts, so `launchers.job.run_job` sees a distributed environment
and trains this rank in place: never torchrun inside srun.

Pre-emption and time limits: SLURM sends `preempt_signal` (SIGUSR2) `signal_delay_s` before the limit
(or on `scancel --signal=USR2`). Each task records it through `core.stop`, the one signal path of every
layout: the ranks checkpoint at the next step boundary and the run ends with status "preempted" (a
one-rank point's task forwards the signal to the worker it spawned); rank 0 then requeues the job
(`scontrol requeue`) and every task exits without a result, so the sweep keeps waiting. The requeued job
(SLURM_RESTART_COUNT > 0) runs with `resume=auto` and continues from the checkpoint. SIGTERM and SIGINT
(scancel) checkpoint too, and end the job with status "stopped", without a requeue.
A job requeues itself at most `max_num_timeout` times (Slurm's restart count, whatever restarted it);
after that it ends "preempted", its checkpoint kept, and the sweep counts the point as not finished.

On the submitting machine: every point's resources are checked against the partition (`sinfo`) before
anything is submitted (launchers/slurm_resources.py), and the wait for results follows job states
without needing Slurm accounting (launchers/slurm_state.py). A job that ends without a result
(cancelled, TIMEOUT, ...) gets `status: failed` and how it ended in its summary.json, and the sweep goes on.
In a job of several tasks, a rank that fails ends its task with the error, and srun (`--kill-on-bad-exit`) the
others, instead of leaving them to wait for it.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

import core.config  # noqa: F401  the resolvers a job's config uses, registered in the Slurm task's process too
from core.errors import ConfigError, require
from core.summary import write_summary
from launchers.slurm_resources import Partition, check_request, choose_cpus_per_task, choose_gpus, read_partition
from launchers.slurm_state import QueueStateWatcher, describe_end, watch

_OWN_KEYS = ("ranks_per_node", "gpus", "preempt_signal")


def in_slurm_multitask() -> bool:
    """True inside a task of a SLURM job with more than one task."""
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


# The port rank 0's store listens on, the same for every task of a job: drawn from the job id below Linux's
# ephemeral range (32768 up), where no outgoing connection or port-0 listener (gloo's, other jobs' launchers) holds
# it. submitit draws from 20000-60000: job 114_1's 46350 was in use on a busy node, rank 0 failed to listen and its
# peer waited for the store until the job's time limit.
_PORTS = (20000, 32768)


def job_master_port(job_id: str) -> int:
    """The rendezvous port of Slurm job `job_id` (an array task's "123_4" included): the same in every task."""
    low, high = _PORTS
    return low + zlib.crc32(job_id.encode()) % (high - low)


def export_slurm_env() -> bool:
    """Export torch.distributed's env:// variables from SLURM's (no-op outside a multi-task job); MASTER_PORT is
    the user's where set, else `job_master_port`.

    Returns True when it exported. Safe to call twice.
    """
    if not in_slurm_multitask():
        return False
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment()
    if "MASTER_PORT" not in os.environ:
        env.master_port = job_master_port(str(submitit.JobEnvironment().job_id))
    env.export(overwrite=True)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    return True


def requeue_current_job() -> None:
    """Ask Slurm to requeue the job this task belongs to.

    Slurm accepts the request and then signals every process of the job, `scontrol` itself included when
    it has not exited yet: a `scontrol` ended by a signal means the requeue is under way, not that it failed.
    """
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job
              else os.environ["SLURM_JOB_ID"])
    command = ["scontrol", "requeue", job_id]
    done = subprocess.run(command, timeout=60)
    if done.returncode > 0:
        raise subprocess.CalledProcessError(done.returncode, command)


def restart_count() -> int:
    """How many times Slurm has restarted (requeued) the job this task belongs to."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def may_requeue(max_num_timeout: int) -> bool:
    """Whether this job may requeue itself once more: it has been restarted fewer than `max_num_timeout` times."""
    return restart_count() < int(max_num_timeout)


def mesh_world_size(cfg) -> int:
    """World size of a composed config's mesh (product of the rank axes)."""
    from hydra.utils import instantiate

    return int(instantiate(cfg.mesh).world_size)


class ScalelabSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher with per-point task counts, rank env and pre-emption."""

    def __init__(self, **params: Any) -> None:
        own = {k: params.pop(k, None) for k in _OWN_KEYS}
        super().__init__(**params)
        self.ranks_per_node = own["ranks_per_node"]
        self.gpus = own["gpus"]  # true, false or auto (GPUs when the partition's nodes have them)
        self.preempt_signal = own["preempt_signal"] or "USR2"

    # ---- inside every SLURM task ----------------------------------------------------------------
    def __call__(self, sweep_overrides: List[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: Dict[type, Singleton]) -> JobReturn:
        from core import stop

        is_rank = export_slurm_env()  # a rank of a multi-task job (a one-task job starts a worker)
        if is_rank:  # the CPUs Slurm gave this task
            import torch

            from launchers.local import threads_per_rank

            torch.set_num_threads(threads_per_rank(1))
        overrides = list(sweep_overrides)
        if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            # a requeued job resumes from its newest checkpoint, in the same job directory
            keep = list(OmegaConf.select(self.config, "hydra.job.config.override_dirname.exclude_keys",
                                         default=[]) or [])
            overrides = [o for o in overrides if not o.lstrip("+~").startswith("resume=")] + [
                "resume=auto", f"hydra.job.config.override_dirname.exclude_keys=[{','.join(keep + ['resume'])}]"]
        try:
            with stop.handling_stop_signals():  # from here on, not submitit's handlers: the job's own stop path
                ret = super().__call__(overrides, job_dir_key, job_num, job_id, singleton_state)
            if ret.status == JobStatus.FAILED and is_rank:
                # One rank of several failed. Its task ends with the error (submitit records it, the task exits 1)
                # and srun, run with --kill-on-bad-exit, ends the job's other tasks: they would wait for this rank
                # up to mesh.join_timeout_s (for rank 0's rendezvous store) or mesh.timeout_s (in a collective).
                ret.return_value  # noqa: B018 - hydra's JobReturn raises a failed job's exception when read
            return ret
        except stop.RunStopped as stopped:
            if stopped.signal != getattr(signal, "SIG" + self.preempt_signal):
                raise  # scancel: the job ends here, its checkpoint kept
            limit = int(self.params.get("max_num_timeout", 3))
            if not may_requeue(limit):
                return self._give_up_requeue(stopped, overrides, limit)
            if int(os.environ.get("RANK", "0")) == 0:
                requeue_current_job()
                print("[scalelab] checkpoint saved; job requeued", file=sys.stderr, flush=True)
            else:
                time.sleep(60)  # the requeue ends this task; no result is written for a preempted run
            sys.exit(-1)

    @staticmethod
    def _give_up_requeue(stopped: Any, overrides: List[str], limit: int) -> JobReturn:
        """The job has requeued itself `limit` times: end it here, preempted, with its checkpoint kept."""
        value = dict(stopped.summary or {"status": "preempted"})
        value["error"] = (f"not requeued: the job was requeued {restart_count()} time(s) already "
                          f"(hydra.launcher.max_num_timeout={limit}); its checkpoints are in "
                          f"{stopped.run_dir}: run the point again with resume=auto to continue")
        if int(os.environ.get("RANK", "0")) == 0:
            write_summary(Path(stopped.run_dir), {"error": value["error"]})
            print(f"[scalelab] {value['error']}", file=sys.stderr, flush=True)
        return JobReturn(overrides=overrides, working_dir=str(stopped.run_dir), status=JobStatus.COMPLETED,
                         _return_value=value)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Submitit's own requeue path (a timeout it signalled itself): resubmit with the same arguments."""
        return super().checkpoint(*args, **kwargs)

    # ---- on the submitting machine ------------------------------------------------------------------
    def _resources(self, world: int, partition: Optional[Partition]) -> dict[str, Any]:
        """Nodes, tasks, CPUs and GPUs for a job of `world` ranks; ConfigError if the partition cannot hold it."""
        cap = max(1, int(self.ranks_per_node or self.params.get("gpus_per_node") or world))
        nodes = int(math.ceil(world / cap))
        require(world % nodes == 0, "hydra.launcher.ranks_per_node",
                f"{world} ranks do not split evenly over {nodes} nodes of at most {cap} ranks",
                "choose a mesh whose world size is a multiple of the node count (or change ranks_per_node)")
        per_node = world // nodes
        out: dict[str, Any] = {"tasks_per_node": per_node, "nodes": nodes}
        cpus = choose_cpus_per_task(self.params.get("cpus_per_task"), per_node, partition)
        if cpus is not None:
            out["cpus_per_task"] = cpus
        if choose_gpus(self.gpus, partition):
            out["gpus_per_node"] = per_node  # one GPU per task (hydra #2231)
        if partition is not None:
            check_request(partition, world, nodes, per_node, cpus, out.get("gpus_per_node"), self.params.get("mem_gb"))
        return out

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and self.hydra_context is not None
        params = dict(self.params)
        init_params = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init_params["slurm_max_num_timeout"] = params["max_num_timeout"]
        init_keys = {"submitit_folder", "max_num_timeout"}
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        base = set(OmegaConf.structured(BaseQueueConf).keys())
        common = {(k if k in base else f"slurm_{k}"): v for k, v in params.items() if k not in init_keys}
        sweep_dir = str(self.config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)

        groups: dict[int, list[int]] = {}
        all_args, run_dirs = [], []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            world = mesh_world_size(cfg)
            groups.setdefault(world, []).append(i)
            run_dirs.append(_job_dir(cfg, sweep_dir, idx))
            print(f"[scalelab] slurm #{idx} ({world} rank{'s' if world > 1 else ''}): "
                  f"{' '.join(filter_overrides(overrides))}", flush=True)
            all_args.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        try:  # every group's request is checked before the first is submitted
            partition = read_partition(self.params.get("partition"))
            resources = {world: self._resources(world, partition) for world in groups}
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        watcher = QueueStateWatcher()
        jobs: dict[int, Any] = {}
        for world, members in groups.items():
            executor = submitit.AutoExecutor(cluster="slurm", **init_params)
            # a task that exits non-zero (a failed rank, `__call__`) ends the job's other tasks
            kill_on_bad_exit = {"slurm_srun_args": ["--kill-on-bad-exit=1"]} if world > 1 else {}
            executor.update_parameters(**{**common, **resources[world], **kill_on_bad_exit})
            submitted = executor.map_array(self, *zip(*[all_args[i] for i in members]))
            watch(submitted, watcher)
            jobs.update(zip(members, submitted))
        return [_outcome(jobs[i], list(job_overrides[i]), initial_job_idx + i, run_dirs[i], watcher)
                for i in range(len(job_overrides))]


def _job_dir(cfg: DictConfig, sweep_dir: str, idx: int) -> Path:
    """The output directory Hydra gives point `idx` (hydra.sweep.dir / hydra.sweep.subdir)."""
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = idx
    return Path(sweep_dir) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))


def _outcome(job: Any, overrides: list[str], idx: int, run_dir: Path, watcher: QueueStateWatcher) -> JobReturn:
    """The point's result, or, for a job that ended without one, a failed point recorded in its summary.json."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    try:
        return job.results()[0]
    except FailedJobError as e:  # a task raised outside the Hydra job (its own errors are caught there)
        message = f"Slurm job {job.job_id} failed: {_last_error_line(str(e))}"
    except UncompletedJobError:
        message = (f"Slurm job {job.job_id} {describe_end(watcher, job.job_id)} without a result "
                   f"(log: {job.task(0).paths.stdout})")
        failed = _failed_task(job)
        if failed:
            message += f"; {failed}"
    summary = run_dir / "summary.json"
    try:
        status = json.loads(summary.read_text()).get("status") if summary.is_file() else None
    except (OSError, ValueError):
        status = "unreadable"  # left as it is: the report counts an unreadable summary as failed
    if status in (None, "running"):  # the job never recorded how it ended

        write_summary(run_dir, {"status": "failed", "error": message, "overrides": overrides})
    print(f"[scalelab] slurm #{idx}: {message}", file=sys.stderr, flush=True)
    # like a failing local point: recorded as failed, and the sweep goes on to collect the others
    return JobReturn(overrides=overrides, status=JobStatus.COMPLETED,
                     _return_value={"status": "failed", "error": message})


def _failed_task(job: Any) -> str | None:
    """The first task of `job` that recorded an error (a failed rank, whose non-zero exit made srun end the other
    tasks, rank 0's without a result), as 'task N failed: <its exception line>'."""
    from submitit.core.utils import FailedJobError

    for k in range(job.num_tasks):
        task = job.task(k)
        if task.paths.result_pickle.exists():
            error = task.exception()
            if isinstance(error, FailedJobError):
                return f"task {k} failed: {_last_error_line(str(error))}"
    return None


def _last_error_line(text: str) -> str:
    """The exception line of a traceback that submitit framed between lines of dashes."""
    lines = [line.strip() for line in text.split("-" * 22)[1].splitlines() if line.strip()] if "-" * 22 in text else []
    return lines[-1] if lines else text.strip().splitlines()[0]
