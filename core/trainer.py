"""The training loop, run once per rank.

`train(cfg)` builds every plugin from the composed config (`hydra.utils.instantiate`
on each group's `_target_`), then trains, benchmarks or profiles. The order of
assembly is the documentation: model on the meta device -> the parallelize step (core/parallelize.py: tensor
parallelism -> pipeline stage split -> activation checkpointing -> compile -> strategy, which materialises this
rank's shards) -> optimizer -> resume.
"""
from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from core import loss as loss_chunking
from core import stop
from core.checkpoint import Checkpointer
from core.collector import FrozenHeap
from core.data import TokenSource
from core.distributed.context_parallel import ContextParallel
from core.distributed.expert_parallel import ExpertParallel
from core.distributed.mesh import ParallelMesh
from core.distributed.pipeline import PipelineParallel
from core.distributed.strategy import Strategy
from core.distributed.tensor_parallel import TensorParallel
from core.errors import require
from core.loggers import JsonlLogger, Logger, LoggerGroup
from core.metrics import (FlopCounter, memory_stats, model_flops_per_token, peak_flops, peak_memory_gib,
                          recompute_flops_per_token, reset_peak_memory)
from core.model import ModelConfig, TransformerLM
from core.optim import WarmupCosine, optimizer_factory, param_groups
from core.parallelize import parallelize
from core.precision import Precision
from core.summary import write_summary
from core.nvtx import nvtx_range
from core.resume import fingerprint

@dataclass
class Run:
    """Everything one rank has built for a run; the loop, benchmark and profiler share it."""

    cfg: DictConfig
    mesh: ParallelMesh
    strategy: Strategy
    precision: Precision
    model_cfg: ModelConfig
    model: torch.nn.Module          # what the loop calls (possibly a strategy wrapper)
    raw_model: TransformerLM        # the TransformerLM inside
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    data: TokenSource
    flops: FlopCounter
    run_dir: Path
    local_batch: int                # sequences per rank per micro-step
    attention: str                  # the attention implementation's name (flash_triton, sdpa[cudnn], ...)
    tensor_parallel: TensorParallel  # the model's loss goes through it (vocabulary-parallel under tp > 1)
    pipeline: PipelineParallel      # under pp > 1 it runs each step's micro-batches over the stages
    memory_marks: dict[str, float] = field(default_factory=dict)
    context_parallel: ContextParallel = field(default_factory=ContextParallel)  # cp > 1: this rank's tokens only
    expert_parallel: ExpertParallel = field(default_factory=ExpertParallel)  # ep > 1: averages the expert gradients

    @property
    def device(self) -> torch.device:
        return self.mesh.device_obj

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.data.seq_len

    def micro_batch(self, split: str, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of global batch `step` belonging to this rank's micro-step `micro`."""
        start = (self.mesh.dp_rank * self.cfg.train.grad_accum_steps + micro) * self.local_batch
        x, y = self.data.batch(split, step, self.cfg.train.batch_size, self.cfg.seed, self.device,
                               rows=slice(start, start + self.local_batch))
        return self.context_parallel.shard_batch(x, y)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one micro-batch, forward only (for a backward, call it inside the
        tensor-parallel loss context, as `forward_backward` does). Under pipeline parallelism the batch goes
        through every stage and each rank gets the loss."""
        if self.pipeline.active:
            return self.pipeline.loss(self, x, y)
        with self.tensor_parallel.loss_context():
            return self._loss(x, y)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.raw_model.loss_chunk_tokens:  # the head returns the loss chunk by chunk (core/loss.py)
            with self.precision.autocast():
                loss = self.model(x, targets=y)
        else:
            with self.precision.autocast():
                logits = self.model(x)
            loss = self.tensor_parallel.loss(logits, y)
        if self.model_cfg.n_experts and torch.is_grad_enabled():
            # MoE: the routers' load-balancing loss joins what training minimises (evaluation stays cross-entropy)
            loss = loss + self.model_cfg.aux_loss_coef * self.raw_model.aux_loss()
        return loss

    def forward_backward(self, step: int) -> torch.Tensor:
        """All micro-steps of one optimizer step: returns this rank's mean loss (detached). Under pipeline
        parallelism the pipeline plugin runs the step's micro-batches over the stages."""
        if self.pipeline.active:
            loss = self.pipeline.forward_backward(self, step)
            self.context_parallel.finish_gradients(self.raw_model, self.strategy)
            return loss
        accum = self.cfg.train.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = self.micro_batch("train", step, micro)
            with self.strategy.gradient_sync(micro == accum - 1), self.tensor_parallel.loss_context():
                with nvtx_range("forward"):
                    loss = self._loss(x, y) / accum
                with nvtx_range("backward"):
                    self.precision.backward(loss)
            total += loss.detach()
        self.strategy.finish_gradient_synchronization()
        self.tensor_parallel.finish_gradients(self.raw_model)
        self.context_parallel.finish_gradients(self.raw_model, self.strategy)
        self.expert_parallel.finish_gradients(self.raw_model)
        return total

    def optimizer_step(self, step: int, measure_norm: bool) -> tuple[float | None, bool]:
        """Schedule, clip, step, zero: returns (grad norm or None, whether the step was taken)."""
        lr = self.schedule(step)
        WarmupCosine.apply(self.optimizer, lr)
        self.precision.unscale_(self.optimizer)
        clip = float(self.cfg.optimizer.grad_clip)
        norm = None
        if clip > 0 or measure_norm:
            norm = self.strategy.clip_grad_norm_(self.raw_model, clip if clip > 0 else math.inf)
        stepped = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return (float(norm) if norm is not None else None), stepped

    def train_step(self, step: int, measure_norm: bool = False) -> tuple[torch.Tensor, float | None]:
        loss = self.forward_backward(step)
        norm, _ = self.optimizer_step(step, measure_norm)
        return loss, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        n = self.cfg.train.eval_batches
        for i in range(n):
            x, y = self.micro_batch("val", i, 0)
            total += self.loss(x, y)
        self.model.train()
        return all_reduce_mean(total / n, self.mesh)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _step_mark(device: torch.device) -> Any:
    """A point in the step stream: a CUDA event on the GPU (no sync), the wall clock elsewhere."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _window_step_seconds(marks: list[tuple[Any, Any, bool]], wall_s: float) -> float:
    """A logged window's step time: the median of its steps that ran without the communication timer.

    The timer holds every NCCL work until the GPU has finished it (for its duration) and records events
    around every wait; on FSDP's ~500 collectives a step that made the timed step tens of ms slower and
    its memory peak higher. Per-step GPU time (events at step start and end) keeps the timed step, the
    logging sync and checkpoint I/O out of the figure. A window whose every step was timed (log_every=1)
    uses them all; without marks, the window's wall-clock mean."""
    if not marks:
        return wall_s

    def seconds(a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a

    untimed = [seconds(a, b) for a, b, timed in marks if not timed]
    return statistics.median(untimed or [seconds(a, b) for a, b, _ in marks])


def all_reduce_mean(value: torch.Tensor, mesh: ParallelMesh) -> float:
    """Mean of a scalar over the data-parallel ranks, cp ranks included (a no-op on one rank). Each cp rank's
    loss is the mean over its equal share of the tokens, so this is the mean over every token of the step."""
    group = mesh.group("dp")
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return float(value)


def _gather_floats(value: float, mesh: ParallelMesh) -> list[float]:
    if mesh.world_size == 1:
        return [value]
    out: list[Any] = [None] * mesh.world_size
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def validate_batch(cfg: DictConfig, dp_size: int) -> int:
    """Per-rank micro-batch size; errors if the global batch does not split evenly."""
    b, accum = cfg.train.batch_size, cfg.train.grad_accum_steps
    require(isinstance(b, int) and b >= 1, "train.batch_size", f"must be a positive number of sequences, got {b!r}",
            "set train.batch_size=1 or more (the global batch: all ranks, all micro-steps)")
    require(isinstance(accum, int) and accum >= 1, "train.grad_accum_steps", f"must be >= 1, got {accum!r}",
            "set train.grad_accum_steps=1 or more")
    require(b % accum == 0, "train.grad_accum_steps",
            f"train.batch_size={b} is not divisible by {accum} accumulation steps",
            "choose train.batch_size divisible by train.grad_accum_steps")
    require(b % (accum * dp_size) == 0, "train.batch_size",
            f"batch {b} does not split over {dp_size} data-parallel ranks x {accum} micro-steps",
            f"use a train.batch_size divisible by {accum * dp_size}")
    return b // (accum * dp_size)


def instantiate_mesh(cfg: DictConfig) -> ParallelMesh:
    return instantiate(cfg.mesh)


def build(cfg: DictConfig, mesh: ParallelMesh | None = None) -> Run:
    """Assemble one rank's run from the config (on `mesh`, initialised, or the config's own)."""
    model_cfg: ModelConfig = instantiate(cfg.model)
    mesh = (mesh or instantiate_mesh(cfg)).init()
    # under torchrun every rank composed its own config: all must share rank 0's directories
    cfg.paths.run_dir, cfg.checkpoint.dir = mesh.broadcast_object((cfg.paths.run_dir, cfg.checkpoint.dir))
    run_dir = Path(cfg.paths.run_dir)
    strategy: Strategy = instantiate(cfg.parallelism)
    strategy.validate(mesh)
    local_batch = validate_batch(cfg, mesh.dp_size)
    precision: Precision = instantiate(cfg.precision).setup(mesh.device_obj)

    data: TokenSource = instantiate(cfg.data).load()
    require(data.seq_len <= model_cfg.context_length, "data.seq_len",
            f"sequence length {data.seq_len} is longer than model.context_length={model_cfg.context_length}",
            "set data.seq_len <= model.context_length")
    data.check_vocab(model_cfg.vocab_size)

    attention = instantiate(cfg.attention_impl)
    tensor_parallel: TensorParallel = instantiate(cfg.tensor_parallel)
    tensor_parallel.validate(mesh, model_cfg, data.seq_len, strategy.name)
    pipeline: PipelineParallel = instantiate(cfg.pipeline)
    pipeline.validate(mesh, model_cfg, cfg, strategy.name, tensor_parallel.name)
    context_parallel: ContextParallel = instantiate(cfg.context_parallel) if "context_parallel" in cfg \
        else ContextParallel()
    context_parallel.validate(mesh, model_cfg, cfg, strategy.name, tensor_parallel.name)
    chunk = loss_chunking.validate(OmegaConf.select(cfg, "train.loss_chunk_tokens", default=0),
                                   tensor_parallel.name, mesh.tp, pipeline.name, mesh.pp)
    expert_parallel: ExpertParallel = instantiate(cfg.expert_parallel) if "expert_parallel" in cfg \
        else ExpertParallel()
    expert_parallel.validate(mesh, model_cfg, strategy, bool(cfg.compile))
    with torch.device("meta"):
        model = TransformerLM(model_cfg, attention)
    model.loss_chunk_tokens = chunk
    reset_peak_memory(mesh.device_obj)
    parallel = parallelize(model, mesh, tensor_parallel, strategy, cfg.activation_checkpointing, bool(cfg.compile),
                           int(cfg.seed), pipeline, context_parallel, expert_parallel=expert_parallel)
    wrapped, n_ckpt = parallel.module, parallel.checkpointed_blocks
    marks = {"after_model_init_gib": peak_memory_gib(mesh.device_obj)}

    groups = param_groups(model, cfg.optimizer.weight_decay)
    optimizer = strategy.build_optimizer(wrapped, groups, optimizer_factory(cfg.optimizer, mesh.device_obj))
    strategy.measure_communication(False)  # the training loop turns it on for the steps it logs
    schedule = WarmupCosine(cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.warmup_steps, cfg.train.max_steps)

    per_token = model_flops_per_token(model_cfg, data.seq_len, cfg.metrics.causal_attention_flops)
    recompute = recompute_flops_per_token(model_cfg, data.seq_len, n_ckpt, cfg.metrics.causal_attention_flops)
    peak, source = peak_flops(mesh.device_obj, precision.name, precision.tf32, cfg.metrics.peak_tflops)
    tokens = cfg.train.batch_size * data.seq_len
    flops = FlopCounter(per_token * tokens, (per_token + recompute) * tokens, peak, source, mesh.world_size)
    return Run(cfg, mesh, strategy, precision, model_cfg, wrapped, model, optimizer, schedule, data, flops,
               run_dir, local_batch, context_parallel.attention_name(attention.name), tensor_parallel, pipeline, marks,
               context_parallel, expert_parallel=expert_parallel)


def _build_loggers(cfg: DictConfig, is_main: bool) -> Logger:
    if not is_main:
        return LoggerGroup([])
    extra = [instantiate(c) for c in (cfg.logger or {}).values()]
    if not any(isinstance(lg, JsonlLogger) for lg in extra):
        extra.insert(0, JsonlLogger())
    return LoggerGroup(extra)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one rank of a job (train, benchmark or profile); returns the summary on every rank.

    Training stops early, with a checkpoint, on a stop signal received inside `core.stop.handling_stop_signals()`
    (the job and the local launcher's workers run in one)."""
    torch.autograd.set_detect_anomaly(bool(cfg.detect_anomaly))
    mesh = instantiate_mesh(cfg).init()
    try:
        return _run_mode(build(cfg, mesh))
    except Exception as e:
        stalled = mesh.blame_stalled_ranks(e)
        if stalled is not None:
            raise stalled from e
        raise
    finally:
        # The run (its strategy, hooks, optimizer) holds the process groups. mesh.destroy() can free them
        # only once nothing does: with an exception on its way out, the frames it passed through still
        # hold the run, so drop their locals (the traceback keeps its lines).
        exc, seen = sys.exc_info()[1], set()
        while exc is not None and id(exc) not in seen:  # the error and the ones it was raised from
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)
            exc = exc.__cause__ or exc.__context__
        mesh.destroy()


def _run_mode(run: Run) -> dict[str, Any]:
    if run.cfg.benchmark.enabled:
        from core.benchmark import run_benchmark

        return run_benchmark(run)
    if run.cfg.profile.enabled:
        from core.profiling import run_profile

        return run_profile(run)
    return _train_loop(run)


class _MetricWindow:
    """The steps since the last logged step: their wall-clock marks, from which a logged step reports the median
    time of the steps that were not communication-timed (`_window_step_seconds`), and every reported time."""

    def __init__(self) -> None:
        self.marks: list[tuple[Any, Any, bool]] = []  # (start, end, comm-timed) of each step of the window
        self.step_times: list[float] = []
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing anew (after checkpoint I/O, which is not a step's time)."""
        self.start, self.steps = time.perf_counter(), 0

    def add(self, start: Any, end: Any, timed: bool) -> None:
        self.marks.append((start, end, timed))
        self.steps += 1

    def close(self, run: Run) -> float:
        """Seconds per step of the window now ending (after synchronising the device); a new window starts."""
        run.synchronize()
        now = time.perf_counter()
        step_s = _window_step_seconds(self.marks, (now - self.start) / self.steps)
        self.marks.clear()
        self.step_times.append(step_s)
        self.start, self.steps = now, 0
        return step_s


def _resume(run: Run, ckpt: Checkpointer) -> tuple[int, Path | None]:
    """Load the checkpoint `resume` names, if any: (the step to start from, the checkpoint or None)."""
    cfg = run.cfg
    resume_from = ckpt.resolve(cfg.resume)
    if resume_from is None:
        if cfg.resume == "auto" and run.mesh.is_main:
            print(f"[scalelab] resume=auto: no checkpoint in {ckpt.dir}, starting fresh", flush=True)
        return 0, None
    reader = run.tensor_parallel.checkpoint_reader(run.strategy, run.mesh)
    state = ckpt.load(resume_from, _checkpoint_view(run), run.raw_model,
                      run.optimizer, OmegaConf.select(cfg, "resume_allow_changes", default=None) or [],
                      readers=[reader] if reader is not None else [])
    run.precision.load_state_dict(state.get("precision", {}))
    return int(state["step"]), resume_from


def _log_record(run: Run, step: int, loss: float, norm: float | None, step_s: float) -> dict[str, Any]:
    """What a logged step writes to metrics.jsonl and the loggers."""
    require(math.isfinite(loss) or run.precision.scaler is not None, "optimizer.lr",
            f"the loss became {loss} at step {step}", "lower optimizer.lr or use bf16/fp32")
    return {"loss": loss, "lr": run.schedule(step - 1), "grad_norm": norm,
            "step_time_ms": step_s * 1e3, "tokens_per_s": run.tokens_per_step / step_s,
            "mfu": run.flops.mfu(step_s), "hfu": run.flops.hfu(step_s),
            "peak_mem_gib": peak_memory_gib(run.device), "skipped_steps": run.precision.skipped_steps,
            **_comm_metrics(run), **run.pipeline.step_metrics(), **run.raw_model.router_stats()}


def _comm_metrics(run: Run) -> dict[str, float]:
    """Communication time of the logged step: the strategy's (dp axis) and, under tensor / expert / context
    parallelism, the tp / ep / cp axis's, each with its exposed part; `comm_ms` / `exposed_comm_ms` are their sums."""
    dp = run.strategy.step_metrics()
    axes = {"tp": run.tensor_parallel.step_metrics(), "ep": run.expert_parallel.step_metrics(),
            "cp": run.context_parallel.step_metrics()}
    axes = {a: m for a, m in axes.items() if m}
    if not axes:
        return dp
    dp_ms, dp_exposed = dp.get("comm_ms", 0.0), dp.get("exposed_comm_ms", 0.0)
    per_axis = {k: v for m in axes.values() for k, v in m.items()}  # tp_/ep_ comm and exposed ms
    return {**dp, "dp_comm_ms": dp_ms, "dp_exposed_comm_ms": dp_exposed, **per_axis,
            "comm_ms": dp_ms + sum(m[f"{a}_comm_ms"] for a, m in axes.items()),
            "exposed_comm_ms": dp_exposed + sum(m[f"{a}_exposed_comm_ms"] for a, m in axes.items())}


def _stop_reason(run: Run, step: int, is_log: bool) -> tuple[str | None, signal.Signals | None]:
    """(status, signal) when training must stop after `step`: a stop signal any rank received (agreed at steps
    that synchronise anyway), or `train.stop_at_step`; (None, None) to go on."""
    tcfg = run.cfg.train
    received = stop.agreed(run.mesh, run.device) if (is_log or run.mesh.world_size == 1) else None
    if received:
        return stop.status_for(received), received
    if tcfg.stop_at_step is not None and tcfg.stop_at_step <= step < tcfg.max_steps:
        return "stopped", None
    return None, None


def _save(run: Run, ckpt: Checkpointer, step: int) -> None:
    # configs without a checkpoint format are refused up front; a stop signal still asks, and is told why not
    missing = None
    if not run.pipeline.can_checkpoint(run.strategy.name):
        missing = f"pipeline parallelism under parallelism={run.strategy.name}"
    elif not run.tensor_parallel.can_checkpoint(run.strategy.name):
        missing = f"{run.tensor_parallel.describe()} tensor parallelism under parallelism={run.strategy.name}"
    if missing is not None:
        if run.mesh.is_main:
            print(f"not saving step {step}: {missing} has no checkpoint format yet", flush=True)
        return
    ckpt.save(step, _checkpoint_view(run), run.raw_model, run.optimizer, {"precision": run.precision.state_dict()})


def _checkpoint_view(run: Run):
    """What saves and loads the model and optimizer state: the strategy, or tensor, expert or pipeline parallelism's
    by-name view of it (`TensorParallelCheckpoint`)."""
    view = run.tensor_parallel.checkpoint_view(run.strategy, run.mesh)
    view = run.expert_parallel.checkpoint_view(view, run.strategy, run.tensor_parallel, run.mesh)
    return run.pipeline.checkpoint_view(view, run.strategy, run.tensor_parallel, run.mesh)


def _train_loop(run: Run) -> dict[str, Any]:
    """Train from the start (or the checkpoint `resume` names) to `train.max_steps` or a stop, logging every
    `train.log_every` steps, evaluating every `train.eval_every`, checkpointing every `checkpoint.every`."""
    cfg, mesh = run.cfg, run.mesh
    tcfg = cfg.train
    loggers = _build_loggers(cfg, mesh.is_main)
    ckpt = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep_last, fingerprint(cfg, mesh.world_size))
    start_step, resume_from = _resume(run, ckpt)
    earlier = _logged_before(run.run_dir, start_step) if resume_from is not None else _Logged()

    loggers.start(OmegaConf.to_container(cfg, resolve=True), run.run_dir, tcfg.max_steps)
    if mesh.is_main:
        print(f"[scalelab] {run.model_cfg.name}: {run.model_cfg.num_params() / 1e6:.2f}M params | "
              f"{run.data.describe()} | {mesh.describe()} on {run.device} | {run.strategy.name} | "
              f"{run.precision.name} | attention {run.attention}"
              + (f" | resumed at step {start_step} from {resume_from}" if resume_from else ""), flush=True)
        if run.flops.peak_flops_per_device is None:
            print(f"[scalelab] {run.flops.peak_source}", flush=True)

    window = _MetricWindow()
    history: list[dict[str, Any]] = []
    # a resumed run's summary covers the whole run: losses logged before the checkpoint count
    first_loss, last_loss, val_loss = earlier.first_loss, earlier.last_loss, earlier.val_loss
    status, stop_signal = "ok", None
    step = start_step
    reset_peak_memory(run.device)
    try:
        # after the collector's first full pass, the run's long-lived objects leave its later ones
        with FrozenHeap() as heap:
            while step < tcfg.max_steps:
                is_log = (step + 1) % tcfg.log_every == 0 or step == start_step or step + 1 == tcfg.max_steps
                run.strategy.measure_communication(is_log)
                run.tensor_parallel.measure_communication(is_log)
                run.expert_parallel.measure_communication(is_log)
                run.context_parallel.measure_communication(is_log)
                run.pipeline.measure_communication(is_log)
                start = _step_mark(run.device)
                loss, norm = run.train_step(step, measure_norm=is_log)
                window.add(start, _step_mark(run.device), is_log)
                step += 1
                if is_log:
                    step_s = window.close(run)
                    last_loss = all_reduce_mean(loss, mesh)
                    first_loss = last_loss if first_loss is None else first_loss
                    history.append(_log_record(run, step, last_loss, norm, step_s))
                    loggers.log(history[-1], step)
                if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.max_steps:
                    val_loss = run.evaluate()
                    loggers.log({"val_loss": val_loss}, step)
                stop_status, stop_signal = _stop_reason(run, step, is_log)
                if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or stop_status:
                    _save(run, ckpt, step)
                    window.restart_clock()  # keep checkpoint I/O out of step times
                if stop_status:
                    status = stop_status
                    break
                heap.step_boundary()
        finished_before = step == start_step and resume_from is not None
        if finished_before and mesh.is_main:
            print(f"[scalelab] the checkpoint is at step {step}, train.max_steps={tcfg.max_steps}: the run was "
                  "finished, nothing to train (its summary is kept)", flush=True)
        if status == "ok" and not (finished_before and val_loss is not None):
            val_loss = run.evaluate()
            loggers.log({"val_loss": val_loss}, step)
        if status == "ok" and (cfg.checkpoint.at_end or cfg.checkpoint.every) and not finished_before:
            _save(run, ckpt, step)
        run.pipeline.save_timeline(run)  # the last (logged) step's schedule, as run
        step_times = window.step_times
        if step == start_step:  # no step ran here: the timings are the logged ones
            step_times, history = earlier.step_times, earlier.history
        summary = _summary(run, status, step, first_loss, last_loss, val_loss, step_times, history)
        summary["signal"] = stop_signal.name if stop_signal else None
        loggers.summary(summary)
        if mesh.is_main:
            write_summary(run.run_dir, summary)
            from core.planner import format_comparison

            predicted = json.loads((run.run_dir / "summary.json").read_text()).get("plan")
            if predicted:
                print(format_comparison(predicted, summary), flush=True)
        return summary
    finally:
        loggers.finish()


@dataclass
class _Logged:
    """What metrics.jsonl holds up to a step: the summary's losses and timings for a resumed run."""

    first_loss: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    step_times: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)


def _logged_before(run_dir: Path, step: int) -> _Logged:
    """The records of `run_dir/metrics.jsonl` at or before `step` (a resumed run's earlier invocations)."""
    path = run_dir / JsonlLogger.filename
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                records.append(rec)
    losses = [r for r in records if isinstance(r.get("loss"), (int, float))]
    vals = [r["val_loss"] for r in records if isinstance(r.get("val_loss"), (int, float))]
    return _Logged(losses[0]["loss"] if losses else None, losses[-1]["loss"] if losses else None,
                   vals[-1] if vals else None,
                   [r["step_time_ms"] / 1e3 for r in losses if isinstance(r.get("step_time_ms"), (int, float))],
                   losses)


def _summary(run: Run, status: str, step: int, first_loss, last_loss, val_loss, step_times, history) -> dict[str, Any]:
    # skip the first window (compilation, allocator warm-up) when there is more than one
    steady = step_times[1:] if len(step_times) > 1 else step_times
    step_s = statistics.median(steady) if steady else float("nan")
    peaks = _gather_floats(peak_memory_gib(run.device), run.mesh)
    comm = [h for h in history[1:] if "comm_ms" in h] or [h for h in history if "comm_ms" in h]
    out = {
        "status": status, "error": None, "steps": step, "pid": os.getpid(),  # rank 0's process
        "model": run.model_cfg.name, "params": run.model_cfg.num_params(),
        "parallelism": run.strategy.name, "mesh": run.mesh.describe(), "world_size": run.mesh.world_size,
        "device": str(torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu"),
        "precision": run.precision.name, "attention": run.attention, "batch_size": run.cfg.train.batch_size,
        "seq_len": run.data.seq_len, "first_loss": first_loss, "final_loss": last_loss, "final_val_loss": val_loss,
        "step_time_ms": step_s * 1e3, "tokens_per_s": run.tokens_per_step / step_s if step_s > 0 else None,
        "mfu": run.flops.mfu(step_s), "hfu": run.flops.hfu(step_s), "mfu_peak_source": run.flops.peak_source,
        "model_tflops_per_step": run.flops.model_flops_per_step / 1e12,
        "peak_mem_gib": max(peaks), "peak_mem_gib_per_rank": peaks,
        "skipped_steps": run.precision.skipped_steps,
        **run.memory_marks, **memory_stats(run.device),
    }
    for key in ("comm_ms", "exposed_comm_ms", "dp_comm_ms", "dp_exposed_comm_ms", "tp_comm_ms",
                "tp_exposed_comm_ms", "ep_comm_ms", "ep_exposed_comm_ms", "cp_comm_ms", "cp_exposed_comm_ms"):
        if comm and key in comm[0]:
            out[key] = statistics.median(h[key] for h in comm)
    bubbles = [h["pp_bubble_fraction"] for h in history if "pp_bubble_fraction" in h]
    if bubbles:  # rank 0's measured pipeline bubble (the first stage's), median of the logged steps
        out["pp_bubble_fraction"] = statistics.median(bubbles[1:] or bubbles)
    return out
