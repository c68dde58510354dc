"""SLURM through hydra-submitit-launcher (`hydra/launcher=slurm`, conf/hydra/launcher/slurm.yaml).

One SLURM job per sweep point; each job gets one task per rank (`tasks_per_node` = ranks per node,
nodes = ceil(world / ranks_per_node), both derived from *that point's* mesh, so `mesh=dp1,dp2` in one
sweep submits a 1-task and a 2-task job). Submitit runs the Hydra job in every task; each task exports
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the SLURM environment
(`export_slurm_env`) before the job starts, so `launchers.job.run_job` sees a distributed environment
and trains this rank in place: never torchrun inside srun.

Pre-emption and time limits: SLURM sends SIGUSR2 `signal_delay_s` before the limit (or on
`scancel --signal=USR2`). Every rank's handler asks the trainer to checkpoint at the next step boundary
(`core.trainer.request_checkpoint_and_exit`); the loop saves and returns status "preempted"; rank 0 then
requeues the job (`scontrol requeue`) and every task exits without a result, so the sweep keeps waiting.
The requeued job (SLURM_RESTART_COUNT > 0) runs with `resume=auto` and continues from the checkpoint.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

_OWN_KEYS = ("ranks_per_node", "gpus", "preempt_signal")


def in_slurm_multitask() -> bool:
    """True inside a task of a SLURM job with more than one task."""
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def export_slurm_env() -> bool:
    """Export torch.distributed's env:// variables from SLURM's (no-op outside a multi-task job).

    Returns True when it exported. Safe to call twice.
    """
    if not in_slurm_multitask():
        return False
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment().export(overwrite=True)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    return True


def _preempt_handler(signum: int, frame: Any) -> None:
    from core.trainer import request_checkpoint_and_exit

    print(f"[scalelab] rank {os.environ.get('RANK', '0')}: caught {signal.Signals(signum).name}: "
          "checkpointing at the next step boundary, then requeueing", file=sys.stderr, flush=True)
    request_checkpoint_and_exit()


def requeue_current_job() -> None:
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job
              else os.environ["SLURM_JOB_ID"])
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)


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
        self.use_gpus = bool(own["gpus"])
        self.preempt_signal = own["preempt_signal"] or "USR2"

    # ---- inside every SLURM task ----------------------------------------------------------------
    def __call__(self, sweep_overrides: List[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: Dict[type, Singleton]) -> JobReturn:
        export_slurm_env()
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
        signal.signal(getattr(signal, "SIG" + self.preempt_signal), _preempt_handler)
        overrides = list(sweep_overrides)
        if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            # a requeued job resumes from its newest checkpoint, in the same job directory
            keep = list(OmegaConf.select(self.config, "hydra.job.config.override_dirname.exclude_keys",
                                         default=[]) or [])
            overrides = [o for o in overrides if not o.lstrip("+~").startswith("resume=")] + [
                "resume=auto", f"hydra.job.config.override_dirname.exclude_keys=[{','.join(keep + ['resume'])}]"]
        ret = super().__call__(overrides, job_dir_key, job_num, job_id, singleton_state)
        value = getattr(ret, "_return_value", None)
        if isinstance(value, dict) and value.get("status") == "preempted":
            if int(os.environ.get("RANK", "0")) == 0:
                requeue_current_job()
                print("[scalelab] checkpoint saved; job requeued", file=sys.stderr, flush=True)
            else:
                time.sleep(60)  # the requeue ends this task; no result is written for a preempted run
            sys.exit(-1)
        return ret

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Submitit's own requeue path (a timeout it signalled itself): resubmit with the same arguments."""
        return super().checkpoint(*args, **kwargs)

    # ---- on the submitting machine ------------------------------------------------------------------
    def _resources(self, world: int) -> dict[str, Any]:
        from core.errors import require

        cap = max(1, int(self.ranks_per_node or self.params.get("gpus_per_node") or world))
        nodes = int(math.ceil(world / cap))
        require(world % nodes == 0, "hydra.launcher.ranks_per_node",
                f"{world} ranks do not split evenly over {nodes} nodes of at most {cap} ranks",
                "choose a mesh whose world size is a multiple of the node count (or change ranks_per_node)")
        per_node = world // nodes
        out: dict[str, Any] = {"tasks_per_node": per_node, "nodes": nodes}
        if self.use_gpus:
            out["gpus_per_node"] = per_node  # one GPU per task (hydra #2231)
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
        all_args = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            world = mesh_world_size(cfg)
            groups.setdefault(world, []).append(i)
            print(f"[scalelab] slurm #{idx} ({world} rank{'s' if world > 1 else ''}): "
                  f"{' '.join(filter_overrides(overrides))}", flush=True)
            all_args.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs: dict[int, Any] = {}
        for world, members in groups.items():
            executor = submitit.AutoExecutor(cluster="slurm", **init_params)
            executor.update_parameters(**{**common, **self._resources(world)})
            submitted = executor.map_array(self, *zip(*[all_args[i] for i in members]))
            jobs.update(zip(members, submitted))
        return [jobs[i].results()[0] for i in range(len(job_overrides))]
