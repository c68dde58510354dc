"""Mixture-of-experts feed-forward: a top-k router over SwiGLU experts (docs/moe.md).

Shapes: N tokens (batch x sequence flattened), D d_model, F each expert's hidden width, E experts, k top_k.

    router     probs = softmax(x R^T) in (at least) float32, (N, E); the k largest per token, their weights
               renormalised to sum to 1
    dispatch   the N k token copies sorted by expert (stable: token order within an expert), so each expert's
               tokens are one contiguous slice; with a capacity, the copies past an expert's first
               ceil(capacity_factor N k / E) are dropped (they add nothing from that expert)
    experts    SwiGLU per expert on its slice: w2[e](silu(w1[e] x) * w3[e] x); a grouped matmul on CUDA bf16
               where torch has one, else (and as the reference) a loop over experts
    combine    each copy's output times its router weight, added back to its token (index_add)
    shared     optionally one dense SwiGLU every token also goes through, added to the result

After each forward the module holds `aux_loss`, the Switch/GShard load-balancing loss E * sum_e f_e P_e
(f_e: share of the N k assignments routed to e before any drop, P_e: mean router probability of e), and
`stats` (dropped share of the copies, the busiest expert's load over the mean), both of that forward's tokens.

Under expert parallelism (`core.distributed.expert_parallel`) each rank holds n_experts / ep of the experts: the
router, top-k, capacity and aux loss run on the rank's own tokens as above, then `dispatcher` sends each copy to the
rank holding its expert, runs the local experts there and brings the outputs back, in the same order.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts, a drop-in for the block's dense `SwiGLU` (module docstring).

    `shared`: a dense feed-forward added to every token's output (None: no shared expert). Expert weights are
    3-D parameters `w1`, `w3` (E, F, D) and `w2` (E, D, F), each expert's slice laid out like an nn.Linear weight.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int,
                 capacity_factor: Optional[float] = None, shared: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.w1 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.shared = shared
        # expert parallelism (core/distributed/expert_parallel.py): this rank's experts of the n_experts, and what
        # moves each expert's token copies to the rank holding it and back (None: every expert is here)
        self.expert_slice = slice(0, n_experts)
        self.dispatcher: Optional[Callable[..., tuple[Tensor, Optional[Tensor]]]] = None
        self.aux_loss: Optional[Tensor] = None
        self.stats: dict[str, Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's slice as `nn.Linear` initialises a weight of its shape (uniform, bound 1/sqrt(fan_in)), so
        a module built on its own is usable; `TransformerLM.init_weights` draws the model's values over these."""
        for w in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def capacity(self, tokens: int) -> Optional[int]:
        """The most token copies one expert takes from `tokens` tokens (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        n, k, n_exp = x.shape[0], self.top_k, self.n_experts
        logits = self.router(x)
        acc = torch.promote_types(logits.dtype, torch.float32)  # never route in bf16: ties and rounding flip choices
        probs = logits.to(acc).softmax(dim=-1)  # (N, E)
        top_w, top_i = probs.topk(k, dim=-1)  # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        flat_e = top_i.reshape(-1)  # copy c = token c // k's (c % k)-th choice
        order = torch.argsort(flat_e, stable=True)  # stable: within an expert, earlier tokens first
        counts = torch.bincount(flat_e, minlength=n_exp)  # (E,) assignments per expert, before any drop
        self.aux_loss = n_exp * (counts.to(acc) / (n * k) * probs.mean(dim=0)).sum()
        kept = counts
        cap = self.capacity(n)
        if cap is not None:
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(n * k, device=x.device) - starts[flat_e[order]]
            order = order[rank_in_expert < cap]  # still grouped by expert: each keeps its first `cap` copies
            kept = counts.clamp(max=cap)
        with torch.no_grad():  # cheap per-forward routing health, read by the trainer's logs
            self.stats = {"moe_dropped_fraction": 1 - kept.sum() / (n * k),
                          "moe_max_load": counts.max() * n_exp / (n * k)}
        token = order // k
        shared = None
        if self.dispatcher is None:
            y = self._experts(x[token], kept)  # (copies, D) in expert order
        else:  # the shared expert (if any) runs while the copies travel
            y, shared = self.dispatcher(x[token], kept, self._experts,
                                        None if self.shared is None else functools.partial(self.shared, x))
        weights = top_w.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(n, shape[-1], dtype=torch.promote_types(y.dtype, acc), device=x.device)
        out = out.index_add(0, token, y.to(out.dtype) * weights)
        if self.shared is not None:
            out = out + (self.shared(x) if shared is None else shared)
        return out.to(x.dtype).reshape(shape)

    def expert_parameters(self) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """The routed experts' weights (this rank's experts under expert parallelism)."""
        return self.w1, self.w3, self.w2

    def _experts(self, xs: Tensor, counts: Tensor) -> Tensor:
        """Each expert's SwiGLU on its contiguous slice of `xs` (`counts[e]` rows each, in expert order)."""
        if _grouped_mm_applies(xs, self.w1):
            return _grouped_swiglu(xs, counts, self.w1, self.w3, self.w2)
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):  # one host sync per layer: the slice sizes
            if c == 0:
                continue  # an expert no token reached: its weights get zero gradients
            part = xs[start:start + c]
            start += c
            outs.append(F.linear(F.silu(F.linear(part, self.w1[e])) * F.linear(part, self.w3[e]), self.w2[e]))
        if not outs:  # no rows at all: the empty input itself (d_model wide, like the output), so that under expert
            return xs[:0]  # parallelism this rank's backward still reaches, and joins, the all-to-alls
        return torch.cat(outs)


def _grouped_mm_applies(xs: Tensor, w: Tensor) -> bool:
    """Whether torch's grouped matmul can run the experts: CUDA, bf16 autocast, a Hopper-or-newer GPU, and
    dimensions its kernel accepts (multiples of 16 bytes); everything else takes the per-expert loop."""
    if not (xs.is_cuda and hasattr(torch, "_grouped_mm") and torch.is_autocast_enabled("cuda")):
        return False
    if torch.get_autocast_dtype("cuda") != torch.bfloat16 or torch.cuda.get_device_capability(xs.device)[0] < 9:
        return False
    return w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0


def _grouped_swiglu(xs: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """The experts' SwiGLU as three grouped matmuls in bf16 (`offs`: each expert's end row)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xb = xs.to(torch.bfloat16)
    h1 = torch._grouped_mm(xb, w1.to(torch.bfloat16).transpose(1, 2), offs=offs)
    h3 = torch._grouped_mm(xb, w3.to(torch.bfloat16).transpose(1, 2), offs=offs)
    return torch._grouped_mm(F.silu(h1) * h3, w2.to(torch.bfloat16).transpose(1, 2), offs=offs)
