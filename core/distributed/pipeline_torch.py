"""The baseline pipeline: PyTorch's `torch.distributed.pipelining` schedules over our stage split.

Each rank wraps its stage (the module the strategy returned, so data parallelism stays ours) in a `PipelineStage`
and runs one of torch's single-stage schedules (`ScheduleGPipe`, `Schedule1F1B`) on it. The schedule cuts the
batch into `microbatches` pieces itself; each micro-batch's loss is divided by their number, so the step is one
process's mean, like ours (not torch's `scale_grads`, which divides `.grad` after the schedule: our fsdp
accumulates a pipeline's gradients unsharded and fills its shards' `.grad` only when it reduce-scatters them). The whole schedule runs without data-parallel synchronisation; the strategy then
reduces the accumulated gradients once (`finish_gradient_synchronization`). Evaluation goes through our
forward-only path (`PipelineParallel.loss`).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from core.distributed.pipeline import PipelineParallel

# torch's schedules that run one stage per rank (the interleaved / zero-bubble ones need several per rank)
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")


def available_schedules() -> tuple[str, ...]:
    """The single-stage schedules the installed torch has."""
    import torch.distributed.pipelining as pipelining

    return tuple(n for n in SINGLE_STAGE if hasattr(pipelining, n))


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; makes the gradient contiguous (torch's stage sends it as it comes)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


class _ContiguousStage(nn.Module):
    """The stage's module, with its output and its input's gradient contiguous: gloo and NCCL send only contiguous
    tensors, and sequence parallelism leaves the hidden state transposed (a view)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Tensor) -> Tensor:
        if x.is_floating_point() and x.requires_grad:
            x = _ContiguousGrad.apply(x)
        return self.module(x).contiguous()


class TorchPipeline(PipelineParallel):
    """`torch.distributed.pipelining`'s `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` over our stages."""

    name = "torch"

    @property
    def schedules(self) -> tuple[str, ...]:  # type: ignore[override]
        return available_schedules()

    def _build(self, run, x: Tensor) -> None:
        import torch.distributed.pipelining as pipelining

        rows = x.shape[0] // self.microbatches
        dev = run.device
        # example tensors of one micro-batch: the stage allocates its receive buffers from them (no shape
        # inference round trip)
        # the hidden state requires grad: the stage reads from the examples which tensors get gradients (none
        # is received for an output, or sent for an input, that does not)
        hidden = torch.empty(self.hidden_shape(run, rows, x.shape[1]), device=dev, requires_grad=True)
        inp = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=dev) if self.is_first else hidden
        out = torch.empty((rows, x.shape[1], run.model_cfg.vocab_size), device=dev) if self.is_last else hidden
        stage = pipelining.PipelineStage(_ContiguousStage(run.model), self.stage, self.pp, dev, input_args=(inp,), output_args=out,
                                         group=self.group)
        cls = getattr(pipelining, self.schedule)
        self._schedule = cls(stage, self.microbatches,
                             loss_fn=lambda out, y: run.tensor_parallel.loss(out, y) / self.microbatches,
                             scale_grads=False)

    def forward_backward(self, run, step: int) -> Tensor:
        x, y = run.micro_batch("train", step, 0)
        # the token rows are views into one (B, T + 1) draw; torch 2.11's stage checks every micro-batch's strides
        # against the contiguous ones it expects
        x, y = x.contiguous(), y.contiguous()
        if getattr(self, "_schedule", None) is None:
            self._build(run, x)
        losses: list[Tensor] = []
        self.timeline = []
        with run.strategy.gradient_sync(False), run.tensor_parallel.loss_context(), run.precision.autocast():
            if self.is_first:
                self._schedule.step(x)
            elif self.is_last:
                self._schedule.step(target=y, losses=losses)
            else:
                self._schedule.step()
        run.strategy.finish_gradient_synchronization()
        run.tensor_parallel.finish_gradients(run.raw_model)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else \
            torch.zeros((), device=run.device)
        return self._broadcast_loss(total)
