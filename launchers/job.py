"""One Hydra job -> one run: validate, then train in-process or start the worker ranks.

The job composes and resolves its config once (so every rank shares one output
directory and one `${now:}`), checks everything that can be checked without a GPU,
and only then starts processes. A failing job writes `summary.json` with
status "failed" and the error; in a multirun the sweep goes on to the next point.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from core import stop
from core.distributed.mesh import ParallelMesh, dist_env_present
from core.errors import ConfigError, require
from core.summary import write_summary
from launchers.output_paths import check_output_paths


def _job_context(cfg: DictConfig) -> dict[str, Any]:
    """Sweep group/job name and the job's overrides, for W&B grouping and the sweep report."""
    try:
        hc = HydraConfig.get()
    except ValueError:  # not under @hydra.main (tests calling run_job on a composed config)
        return {"multirun": False, "overrides": [], "group": None, "job_type": "run", "name": None}
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "multirun": multirun,
        "overrides": list(hc.overrides.task),
        "group": Path(hc.sweep.dir).name if multirun else None,
        "job_type": "sweep" if multirun else "run",
        "name": hc.job.override_dirname or None,
    }


def _record_stop(run_dir: Path, sig: signal.Signals) -> None:
    """After a stop signal: summary.json names the signal, and one that still says "running" (the run stopped
    before its loop wrote a status) gets the stop's status."""
    path = run_dir / "summary.json"
    if path.is_file():
        update: dict[str, Any] = {"signal": sig.name}
        if json.loads(path.read_text()).get("status") == "running":
            update["status"] = stop.status_for(sig)
        write_summary(run_dir, update)


def _is_signal(exc: BaseException) -> bool:
    """A termination signal relayed as an exception (torch elastic's SignalException)."""
    return type(exc).__name__ == "SignalException"


def config_error_in(exc: BaseException) -> ConfigError | None:
    """The ConfigError behind `exc`, if any (hydra.utils.instantiate wraps errors of the targets it calls)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@functools.cache
def _sections() -> dict[str, list[str]]:
    """conf/config.yaml's groups of settings (train, benchmark, ...) and their keys."""
    base = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "config.yaml")
    return {str(k): [str(f) for f in v] for k, v in base.items() if isinstance(v, DictConfig) and k != "hydra"}


def _missing_keys(node: Any, path: str = "") -> list[str]:
    """Full keys whose value is `???` (OmegaConf's mandatory marker) in a plain container, outside Hydra's node."""
    if isinstance(node, dict):
        children = [(f"{path}.{k}" if path else str(k), v) for k, v in node.items() if path or k != "hydra"]
    elif isinstance(node, list):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(node)]
    else:
        return []
    missing = []
    for key, value in children:
        missing += [key] if value == "???" else _missing_keys(value, key)
    return missing


def check_complete(cfg: DictConfig) -> None:
    """Every mandatory value (`???`) is given, and no group of settings was replaced by a value."""
    missing = sorted(_missing_keys(OmegaConf.to_container(cfg, resolve=False)))  # no resolving: no side effects
    if missing:
        raise ConfigError(missing[0], "is required and has no value", f"set {missing[0]}=<value> on the command line")
    for section, keys in _sections().items():
        value = OmegaConf.select(cfg, section)
        if section in cfg and not isinstance(value, DictConfig):
            raise ConfigError(section, f"is a group of settings ({', '.join(keys)}), got {value!r}",
                              f"set one of them, e.g. {section}.{keys[0]}=...")


def validate(cfg: DictConfig, check_devices: bool = True) -> ParallelMesh:
    """Every check that needs no process group: values given, model, mesh vs devices, strategy vs mesh, batch split,
    tensor parallelism vs model and strategy, pipeline parallelism vs model, batch and strategy."""
    from core.trainer import validate_batch

    check_complete(cfg)
    model = instantiate(cfg.model)
    mesh: ParallelMesh = instantiate(cfg.mesh)
    # a MoE model's 3-D expert weights have no tensor-parallel split, nor a pipeline stage's aux-loss path, yet
    for axis, degree in (("tp", mesh.tp), ("pp", mesh.pp)):
        require(not (model.n_experts and degree > 1), "model.n_experts",
                f"a mixture-of-experts model cannot run with mesh.{axis}={degree} yet",
                f"set mesh.{axis}=1 or model.n_experts=0 (a dense model)")
    if check_devices:
        mesh.validate_devices()
    strategy = instantiate(cfg.parallelism)
    strategy.validate(mesh)
    if cfg.activation_checkpointing and not strategy.supports_activation_checkpointing:
        raise ConfigError("activation_checkpointing", f"parallelism={strategy.name} cannot recompute activations yet",
                          "set activation_checkpointing=0 or use parallelism=torch_fsdp2")
    validate_batch(cfg, mesh.dp_size)
    tensor_parallel = instantiate(cfg.tensor_parallel)
    tensor_parallel.validate(mesh, instantiate(cfg.model), int(cfg.data.seq_len), strategy.name)
    wants_checkpoints = bool(cfg.checkpoint.every or cfg.checkpoint.at_end or cfg.resume)
    tensor_parallel.validate_checkpointing(mesh, strategy.name, wants_checkpoints)
    pipeline = instantiate(cfg.pipeline)
    pipeline.validate(mesh, instantiate(cfg.model), cfg, strategy.name, tensor_parallel.name)
    if "context_parallel" in cfg:
        instantiate(cfg.context_parallel).validate(mesh, instantiate(cfg.model), cfg, strategy.name,
                                                   tensor_parallel.name)
    if "expert_parallel" in cfg:
        instantiate(cfg.expert_parallel).validate(mesh, instantiate(cfg.model), strategy, bool(cfg.compile))
    from core.loss import validate as validate_loss_chunking

    validate_loss_chunking(OmegaConf.select(cfg, "train.loss_chunk_tokens", default=0), tensor_parallel.name,
                           mesh.tp, pipeline.name, mesh.pp)
    return mesh


def plan_only(cfg: DictConfig) -> dict[str, Any]:
    """`plan=true`: print the planner's prediction, refuse it if it does not fit, and return it."""
    from core.planner import plan

    prediction = plan(cfg)
    print(prediction.format(), flush=True)
    prediction.check_fits(cfg)
    return prediction.to_dict()


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """Run one job: resolve the config, validate, plan, then train on this process or on N ranks.

    A stop signal (`core.stop`) ends the training with a checkpoint; the job then raises `RunStopped`
    (exit code 128 + the signal's number), which also keeps a sweep from starting its next point."""
    with stop.handling_stop_signals():
        summary = _run_job(cfg)
        received = stop.requested()
        signal_name = summary.get("signal") if isinstance(summary, dict) else None
        if signal_name or received is not None:
            sig = signal.Signals[signal_name] if signal_name else received
            if int(os.environ.get("RANK", "0")) == 0:
                run_dir = Path(cfg.paths.run_dir)
                _record_stop(run_dir, sig)
                step = summary.get("steps") if isinstance(summary, dict) else None
                if cfg.benchmark.enabled or cfg.profile.enabled:  # nothing to resume: the steps done are reported
                    what = "benchmark" if cfg.benchmark.enabled else "profile"
                    print(f"[scalelab] {what} stopped by {sig.name}" + (f" after {step} timed steps" if step else "")
                          + f"; what it measured is in {run_dir}", file=sys.stderr, flush=True)
                else:
                    print(f"[scalelab] stopped by {sig.name}" + (f" at step {step}" if step is not None else "")
                          + f"; continue with: python train.py <same overrides> resume=auto hydra.run.dir={run_dir}",
                          file=sys.stderr, flush=True)
            raise stop.RunStopped(sig, summary if isinstance(summary, dict) else None, Path(cfg.paths.run_dir))
        return summary


def _run_job(cfg: DictConfig) -> dict[str, Any] | None:
    ctx = _job_context(cfg)
    run_dir: Path | None = None
    try:
        OmegaConf.resolve(cfg)  # ${hydra:...} and ${now:...} become plain values, once, in this process
        with open_dict(cfg):
            cfg._sweep = {k: ctx[k] for k in ("group", "job_type", "name")}
        run_dir = Path(cfg.paths.run_dir)
        mesh = validate(cfg)
        check_output_paths(cfg)
        if cfg.plan:
            planned = plan_only(cfg)
            if ctx["multirun"]:  # a plan-only sweep's report ranks its points by the prediction (experiments/report.py)
                write_summary(run_dir, {"status": "planned", "overrides": ctx["overrides"], "plan": planned},
                              replace=True)
            return planned
        from core.planner import plan_or_none

        prediction = plan_or_none(cfg)  # every real run logs the prediction; the summary keeps it
        if prediction is not None:
            prediction.check_fits(cfg)  # refuse what cannot fit before any rank allocates
        if not dist_env_present() or int(os.environ.get("RANK", "0")) == 0:
            if prediction is not None:
                print(prediction.format(), flush=True)
            write_summary(run_dir, {"status": "running", "overrides": ctx["overrides"],
                                    "plan": prediction.to_dict() if prediction else None}, replace=True)
        # Ranks run in worker processes. In a sweep a one-rank job does too: points run one after another
        # in this process, and one left here would keep its CUDA memory, compiled kernels and allocator
        # state for the next point (the next job's rank 0 then runs out of memory on the same GPU).
        if not dist_env_present() and (mesh.world_size > 1 or ctx["multirun"]):
            from launchers.local import launch_workers

            return launch_workers(cfg, mesh.world_size)
        from core.trainer import train

        return train(cfg)
    except Exception as e:
        if _is_signal(e):  # killed (timeout, scancel, Ctrl-C): stop the whole sweep, do not go on
            if run_dir is not None:
                write_summary(run_dir, {"status": "killed", "error": str(e), "overrides": ctx["overrides"]}, replace=True)
            print(f"[scalelab] {e}: stopping", file=sys.stderr, flush=True)
            # SystemExit, not an Exception: Hydra's launcher would record an Exception and start the next point
            raise SystemExit(128 + int(getattr(e, "sigval", 15))) from None
        config_error = config_error_in(e)
        bad_input = config_error is not None
        message = str(config_error) if bad_input else f"{type(e).__name__}: {e}"
        if run_dir is not None and int(os.environ.get("RANK", "0")) == 0:
            write_summary(run_dir, {"status": "failed", "error": message, "overrides": ctx["overrides"]}, replace=True)
        # a rank of a job of several processes (a Slurm task, a torchrun rank) ends with the error instead: its
        # launcher (srun, torchrun) then ends the other ranks, which would otherwise wait for this one
        if ctx["multirun"] and not (dist_env_present() and int(os.environ["WORLD_SIZE"]) > 1):
            print(f"[scalelab] job failed, sweep continues: {message}", file=sys.stderr, flush=True)
            if not bad_input:
                traceback.print_exc()
            return None
        if bad_input:
            print(f"error: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise
