"""The baseline pipeline: PyTorch's `torch.distributed.pipelining` schedules over our stage split.

Each rank wraps each of its chunks (one, or `virtual_stages` for the multi-stage schedules) in a `PipelineStage`
and runs one of torch's schedules on them:

    ScheduleGPipe, Schedule1F1B            one stage per rank
    ScheduleInterleaved1F1B                v >= 2 chunks per rank, chunk c of rank r = virtual stage c*pp + r
    ScheduleInterleavedZeroBubble          the same, each backward split into input and weight parts (ZB1P)
    ScheduleZBVZeroBubble, ScheduleDualPipeV   two chunks per rank in a V: rank r holds virtual stages r and
                                           2pp-1-r (the first rank embeds and computes the loss)

whichever of them the installed torch has. A chunk's module runs this rank's model (the module the strategy
returned, so data parallelism stays ours) on the chunk's blocks and registers only the chunk's own parameters, so
torch's per-stage gradient scaling and weight-gradient passes touch each parameter once. The schedule cuts the batch
into `microbatches` pieces itself; each micro-batch's loss is divided by their number, so the step is one process's
mean, like ours (not torch's `scale_grads`, which divides `.grad` after the schedule: our fsdp accumulates a
pipeline's gradients unsharded and fills its shards' `.grad` only when it reduce-scatters them). The whole schedule
runs without data-parallel synchronisation; the strategy then reduces the accumulated gradients once
(`finish_gradient_synchronization`). Under torch_fsdp2 the stage's module is the FSDP2 module itself (one chunk per
rank), so torch's stage drives its gradient synchronisation (off in every backward, then one reduce-scatter per
weight after the last). Evaluation goes through our forward-only path (`PipelineParallel.loss`).

Every rank records the step's timeline as ours does: each stage's `forward_one_chunk`, `backward_one_chunk` and
`backward_weight_one_chunk` (the entry points torch's schedules call per micro-batch) are wrapped to stamp
(op, micro-batch, start, end).
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from core.distributed.pipeline import PipelineParallel, virtual_stage
from core.errors import require

# torch's schedules by how many chunks (stages) each rank runs
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")
LOOPED = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")  # v >= 2, virtual stage c*pp + r
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # exactly 2, virtual stages r and 2pp-1-r
KNOWN = SINGLE_STAGE + LOOPED + V_SHAPED


def available_schedules() -> tuple[str, ...]:
    """The schedules of `KNOWN` the installed torch has."""
    import torch.distributed.pipelining as pipelining

    return tuple(n for n in KNOWN if hasattr(pipelining, n))


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; makes the gradient contiguous (torch's stage sends it as it comes)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


class _Chunk(nn.Module):
    """One virtual stage for torch's `PipelineStage`: runs `model` (the strategy's module, not registered here)
    on `layers` (all of this rank's blocks when None) and registers only `parts`, the chunk's own modules. Its
    output and its input's gradient are contiguous: gloo and NCCL send only contiguous tensors, and sequence
    parallelism leaves the hidden state transposed (a view)."""

    def __init__(self, model: nn.Module, parts: list[nn.Module], layers: range | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._model = [model]  # a list: not a submodule, so its other chunks' parameters stay out of this one
        self.layers = layers

    def forward(self, x: Tensor) -> Tensor:
        if x.is_floating_point() and x.requires_grad:
            x = _ContiguousGrad.apply(x)
        model = self._model[0]
        out = model(x) if self.layers is None else model(x, layers=self.layers)
        return out.contiguous()


def _is_fsdp2(module: nn.Module) -> bool:
    """Whether `module` is an FSDP2 (`fully_shard`) module, which torch's pipeline stage drives itself."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


class TorchPipeline(PipelineParallel):
    """`torch.distributed.pipelining`'s `PipelineStage`s and schedules (`KNOWN`, as installed) over our stages;
    every rank records its step's (op, micro-batch, start, end) timeline."""

    name = "torch"
    records_timeline = True

    @property
    def schedules(self) -> tuple[str, ...]:  # type: ignore[override]
        return available_schedules()

    @property
    def style(self) -> str:
        return "v" if self.schedule in V_SHAPED else "loop"

    @property
    def counts_p2p(self) -> bool:  # type: ignore[override]
        """Whether this torch's schedules send through `_batch_p2p`, which a measured step counts."""
        import torch.distributed.pipelining.schedules as schedules

        return hasattr(schedules, "_batch_p2p")

    def validate(self, mesh, model_cfg, cfg, strategy_name: str, tensor_parallel_name: str) -> None:
        if self.schedule in KNOWN and self.schedule not in self.schedules:
            require(False, "pipeline.schedule", f"{self.schedule} is not in the installed torch {torch.__version__}",
                    f"use one of {', '.join(self.schedules)}")
        super().validate(mesh, model_cfg, cfg, strategy_name, tensor_parallel_name)
        m, pp, v = self.microbatches, mesh.pp, self.virtual
        if pp == 1:
            return
        # what torch's schedules would raise on their first step, said before anything starts
        if self.schedule == "Schedule1F1B" or self.schedule == "ScheduleDualPipeV":
            need = pp * v
            require(m >= need, "pipeline.microbatches",
                    f"{self.schedule} needs at least as many micro-batches as its {need} stages, got {m}",
                    f"set pipeline.microbatches={need} or more (dividing train.batch_size / dp)")
        if self.schedule in LOOPED:
            rounds = max(1, m // pp)
            require(m % rounds == 0, "pipeline.microbatches",
                    f"{self.schedule} runs micro-batches in rounds of pp={pp}: {m} is not a multiple of its "
                    f"{rounds} rounds", f"choose pipeline.microbatches as a multiple of {pp} (or at most {pp})")

    def _validate_virtual(self, v: int) -> None:
        if self.schedule in SINGLE_STAGE:
            require(v == 1, "pipeline.virtual_stages", f"{self.schedule} runs one stage per rank, got {v} chunks",
                    "set pipeline.virtual_stages=1, or pipeline.schedule=ScheduleInterleaved1F1B")
        elif self.schedule in LOOPED:
            require(v >= 2, "pipeline.virtual_stages", f"{self.schedule} runs several chunks per rank, got {v}",
                    "set pipeline.virtual_stages=2 or more")
        elif self.schedule in V_SHAPED:
            require(v == 2, "pipeline.virtual_stages",
                    f"{self.schedule} runs exactly two chunks per rank (a V), got {v}", "set pipeline.virtual_stages=2")

    def _chunk_module(self, run, c: int) -> nn.Module:
        if self.virtual == 1:
            if _is_fsdp2(run.model):
                # torch's stage recognises an FSDP2 module: it turns its gradient sync off for every backward and
                # reduce-scatters once after the last (tp == 1 here: no transposed hidden state to make contiguous)
                return run.model
            return _Chunk(run.model, [run.raw_model], None)
        layers = self.chunks[c]
        model = run.raw_model
        parts: list[nn.Module] = [model.blocks[i] for i in layers]
        if layers.start == 0:
            parts.insert(0, model.token_embeddings)
        if layers.stop == self.n_layers:
            parts += [model.final_norm, model.lm_head]
        return _Chunk(run.model, parts, layers)

    def _build(self, run, x: Tensor) -> None:
        import torch.distributed.pipelining as pipelining

        rows = x.shape[0] // self.microbatches
        dev = run.device
        # example tensors of one micro-batch: the stage allocates its receive buffers from them (no shape
        # inference round trip); the hidden state requires grad: the stage reads from the examples which tensors
        # get gradients (none is received for an output, or sent for an input, that does not)
        hidden = torch.empty(self.hidden_shape(run, rows, x.shape[1]), device=dev, requires_grad=True)
        tokens = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=dev)
        logits = torch.empty((rows, x.shape[1], run.model_cfg.vocab_size), device=dev)
        n = self.pp * self.virtual
        stages = []
        for c in range(self.virtual):
            s = virtual_stage(self.stage, c, self.pp, self.style)
            stages.append(pipelining.PipelineStage(
                self._chunk_module(run, c), s, n, dev, input_args=(tokens if s == 0 else hidden,),
                output_args=logits if s == n - 1 else hidden, group=self.group))
        for c, stage in enumerate(stages):
            self._record(run, stage, "" if self.virtual == 1 else str(c))
        cls = getattr(pipelining, self.schedule)
        self._schedule = cls(stages[0] if self.schedule in SINGLE_STAGE else stages, self.microbatches,
                             loss_fn=lambda out, y: run.tensor_parallel.loss(out, y) / self.microbatches,
                             scale_grads=False)

    def _record(self, run, stage, chunk: str) -> None:
        """Wrap `stage`'s per-micro-batch entry points (on the instance) so that each call appends (op, micro-batch,
        start, end) to `timeline`, in seconds from the step's start: "F" forward, "B" backward (the input-gradient
        part where the schedule splits it), "W" the weight-gradient part; `chunk` names the chunk under several."""

        def timed(op: str, plain):
            def call(mb: int, *args, **kwargs):
                start = self._stamp(run)
                try:
                    return plain(mb, *args, **kwargs)
                finally:
                    self.timeline.append((op + chunk, mb, start - self.step_begin, self._stamp(run) - self.step_begin))
            return call

        for op, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            plain = getattr(stage, name, None)
            if plain is not None:
                setattr(stage, name, timed(op, plain))

    @contextlib.contextmanager
    def _counting_p2p(self):
        """Counts the bytes of every point-to-point op torch's schedules issue (measured steps only): its schedules
        send and receive through the module function `_batch_p2p`, wrapped here for the step. A torch without it
        is not counted (`counts_p2p`)."""
        import torch.distributed.pipelining.schedules as schedules

        plain = getattr(schedules, "_batch_p2p", None)
        if plain is None:
            yield
            return

        def counted(ops, *args, **kwargs):
            self.p2p_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return plain(ops, *args, **kwargs)

        schedules._batch_p2p = counted
        try:
            yield
        finally:
            schedules._batch_p2p = plain

    def forward_backward(self, run, step: int) -> Tensor:
        x, y = run.micro_batch("train", step, 0)
        # the token rows are views into one (B, T + 1) draw; torch 2.11's stage checks every micro-batch's strides
        # against the contiguous ones it expects
        x, y = x.contiguous(), y.contiguous()
        if getattr(self, "_schedule", None) is None:
            self._build(run, x)
        losses: list[Tensor] = []
        self.timeline = []
        args = (x,) if self.is_first else ()
        kwargs = {"target": y, "losses": losses} if self.is_last else {}
        counter = self.saved_activations(run) if self.measuring else None
        self.p2p_bytes = 0
        self.step_begin = self._stamp(run)
        with run.strategy.gradient_sync(False), run.tensor_parallel.loss_context(), run.precision.autocast():
            if counter is None:
                self._schedule.step(*args, **kwargs)
            else:
                with counter.hooks(), self._counting_p2p():
                    self._schedule.step(*args, **kwargs)
        self.step_seconds = self._stamp(run) - self.step_begin
        if counter is not None:
            self._record_activations(counter)
            self.step_p2p_bytes = self.p2p_bytes
        run.strategy.finish_gradient_synchronization()
        run.tensor_parallel.finish_gradients(run.raw_model)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else \
            torch.zeros((), device=run.device)
        return self._broadcast_loss(total)
