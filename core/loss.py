"""The LM head and its cross-entropy in token chunks: the (tokens, vocabulary) logits are never materialised.

At the leaderboard's shape (65,536 tokens x 151,936 words) the plain head's fp32 logits alone are 40 GB (80 GB
with the bf16 logits and log-softmax output autograd keeps). `ChunkedLinearCrossEntropy` computes the head
`h @ W^T` and the mean cross-entropy `chunk_tokens` rows at a time: forward keeps only the inputs and one fp32
log-sum-exp per token; backward recomputes each chunk's logits, turns them into softmax - one-hot in place and
multiplies into the gradients of `h` and `W`. Numerics follow the plain path (`lm_head(h)` then
`F.cross_entropy(logits.float(), y)`): under autocast the matmuls run in the autocast dtype and the softmax in
fp32; the weight gradient is accumulated over chunks in fp32.

Vocabulary-parallel (our tensor parallelism): each rank holds rows `vocab_start:vocab_start + V/tp` of `W`; the
per-token max, sum of exponentials and target logit of its columns are combined over the tp group with two
all-reduces (as `VocabParallelCrossEntropy`), and backward is local; the partial gradient of `h` is summed over
tp by the region-entry op in front of the head.

Enabled by `train.loss_chunk_tokens` (0: the plain head); `validate` refuses the combinations it does not cover.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from core.errors import require


def _compute_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the plain head's matmul runs in here: autocast's if it is on for h's device, else the inputs'."""
    dev = h.device.type
    try:
        enabled = torch.is_autocast_enabled(dev)
    except TypeError:  # older torch: no device argument
        enabled = torch.is_autocast_enabled() if dev == "cuda" else torch.is_autocast_cpu_enabled()
    if enabled and h.is_floating_point():
        if hasattr(torch, "get_autocast_dtype"):
            return torch.get_autocast_dtype(dev)
        return torch.get_autocast_gpu_dtype() if dev == "cuda" else torch.get_autocast_cpu_dtype()
    return torch.result_type(h, weight)


def _local_targets(target: Tensor, vocab_start: int, local_v: int) -> tuple[Tensor, Tensor]:
    """(column of each target in this rank's vocabulary shard, clamped; whether the shard holds it)."""
    local = target - vocab_start
    in_shard = (local >= 0) & (local < local_v)
    return local.clamp(0, local_v - 1), in_shard


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over tokens of cross_entropy(h @ weight^T, target), `chunk` tokens at a time (module docstring).

    h: (..., D) hidden states; weight: (V_local, D); target: (...) int64 word ids of the whole vocabulary;
    `comm` (with `all_reduce(x, op)`, e.g. `TPComm`) when the vocabulary is split over ranks, else None."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, target: Tensor, chunk: int, vocab_start: int = 0,
                comm: Optional[Any] = None) -> Tensor:
        dt = _compute_dtype(h, weight)
        with torch.autocast(h.device.type, enabled=False):
            hc = h.reshape(-1, h.shape[-1]).to(dt)
            w = weight.to(dt)
            t = target.reshape(-1)
            n, local_v = hc.shape[0], w.shape[0]
            local_t, in_shard = _local_targets(t, vocab_start, local_v)
            row_max = torch.empty(n, dtype=torch.float32, device=h.device)
            sum_exp = torch.empty_like(row_max)
            target_logit = torch.empty_like(row_max)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                logits = (hc[s:e] @ w.t()).float()  # (chunk, V_local), the only vocabulary-wide tensors
                mx = logits.amax(dim=-1)
                target_logit[s:e] = logits.gather(-1, local_t[s:e, None]).squeeze(-1)
                sum_exp[s:e] = logits.sub_(mx[:, None]).exp_().sum(dim=-1)
                row_max[s:e] = mx
                del logits
            target_logit.mul_(in_shard)
            if comm is not None:
                # combine the shards: the global max, then every shard's sum rescaled to it, and the target logit
                global_max = comm.all_reduce(row_max.clone(), op=dist.ReduceOp.MAX)
                sum_exp.mul_((row_max - global_max).exp_())
                sum_exp, target_logit = comm.all_reduce(torch.stack((sum_exp, target_logit)))
                row_max = global_max
            lse = sum_exp.log_().add_(row_max)  # log-sum-exp per token, fp32
            loss = (lse - target_logit).mean()
        ctx.chunk, ctx.vocab_start, ctx.dt = chunk, vocab_start, dt
        ctx.h_shape, ctx.h_dtype = h.shape, h.dtype
        ctx.save_for_backward(hc, weight, target, lse)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        hc, weight, target, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hc.device.type, enabled=False):
            w = weight.to(ctx.dt)
            n, local_v = hc.shape[0], w.shape[0]
            local_t, in_shard = _local_targets(target.reshape(-1), ctx.vocab_start, local_v)
            scale = (grad.float() / n)
            grad_h = torch.empty_like(hc) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            for s in range(0, n, ctx.chunk):
                e = min(s + ctx.chunk, n)
                p = (hc[s:e] @ w.t()).float()
                p.sub_(lse[s:e, None]).exp_()  # softmax over the whole vocabulary, this rank's columns
                p.scatter_add_(-1, local_t[s:e, None], -in_shard[s:e, None].float())
                g = p.mul_(scale).to(ctx.dt)
                del p
                if need_h:
                    grad_h[s:e] = g @ w
                if need_w:
                    grad_w.add_(g.t() @ hc[s:e])  # accumulated in fp32 over the chunks
                del g
        gh = grad_h.view(ctx.h_shape).to(ctx.h_dtype) if need_h else None
        gw = grad_w.to(weight.dtype) if need_w else None
        return gh, gw, None, None, None, None


def chunked_linear_cross_entropy(h: Tensor, weight: Tensor, target: Tensor, chunk: int, vocab_start: int = 0,
                                 comm: Optional[Any] = None) -> Tensor:
    """The mean cross-entropy of `h @ weight^T` against `target`, computed `chunk` tokens at a time."""
    return ChunkedLinearCrossEntropy.apply(h, weight, target, int(chunk), int(vocab_start), comm)


# pipeline plugins whose last stage asks the model for the loss (`TransformerLM.forward(..., targets=...)`)
PIPELINES: tuple[str, ...] = ("ours",)


def validate(chunk_tokens: Any, tensor_parallel_name: str, tp: int, pipeline_name: str, pp: int) -> int:
    """Check `train.loss_chunk_tokens` against the rest of the run before any process starts; returns it."""
    require(isinstance(chunk_tokens, int) and not isinstance(chunk_tokens, bool) and chunk_tokens >= 0,
            "train.loss_chunk_tokens", f"must be 0 (the plain head) or a positive number of tokens, got "
            f"{chunk_tokens!r}", "set train.loss_chunk_tokens=0 or e.g. 4096")
    if chunk_tokens == 0:
        return 0
    require(tp == 1 or tensor_parallel_name == "megatron", "train.loss_chunk_tokens",
            f"the chunked loss is not implemented for tensor_parallel={tensor_parallel_name} (mesh.tp={tp}): its "
            "LM head returns DTensor logits", "use tensor_parallel=megatron, or train.loss_chunk_tokens=0")
    require(pp == 1 or pipeline_name in PIPELINES, "train.loss_chunk_tokens",
            f"the chunked loss is not implemented for pipeline={pipeline_name} (mesh.pp={pp}): its last stage "
            "takes the logits", "set train.loss_chunk_tokens=0" + (f" or use pipeline={PIPELINES[0]}" if PIPELINES
                                                                  else ""))
    return chunk_tokens
