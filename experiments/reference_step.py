"""A plain-PyTorch Transformer LM and its training step: the reference our trainer is timed against.

It imports nothing from `core/`, so a bug or a speed-up in our model cannot reach it: it is the step a user
would write by hand with stock PyTorch. The architecture is the CS336 basics one, the same our
`core.model.TransformerLM` builds: token embedding, pre-norm blocks (RMSNorm; one fused q/k/v projection;
rotary position embedding on interleaved pairs; causal `F.scaled_dot_product_attention`; output projection;
RMSNorm; SwiGLU feed-forward), a final RMSNorm and an untied LM head, no biases. The step is bf16 autocast
on CUDA (fp32 elsewhere), cross-entropy on fp32 logits, backward, fused AdamW (no gradient clipping).

`tests/test_reference_step.py` checks that, given the same weights, this model and ours compute the same
loss and gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LMShape:
    """The dimensions of one model size."""

    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    vocab_size: int = 10_000
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5


# CS336 assignment sizes (the same numbers as conf/model/<size>.yaml)
SIZES = {
    "small": LMShape(768, 3072, 12, 12),
    "medium": LMShape(1024, 4096, 24, 16),
    "large": LMShape(1280, 5120, 36, 20),
    "xl": LMShape(2560, 10240, 32, 32),
}


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of position * theta^(-2i/head_dim), each (seq_len, head_dim): every angle repeated for
    the two elements of its pair, so the rotation is elementwise over the head dimension."""
    freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angle = torch.arange(seq_len, dtype=torch.float32)[:, None] * freq[None, :]
    angle = angle.repeat_interleave(2, dim=-1)
    return angle.cos(), angle.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each interleaved pair (x[2i], x[2i+1]) of the last dimension by its angle:
    x * cos + (-x[2i+1], x[2i]) * sin."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


class ReferenceBlock(nn.Module):
    """x + attention(norm(x)), then + SwiGLU(norm(x))."""

    def __init__(self, shape: LMShape) -> None:
        super().__init__()
        d, self.heads = shape.d_model, shape.n_heads
        self.attn_norm = nn.RMSNorm(d, eps=shape.norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # rows: all query heads, all key heads, all value heads
        self.out = nn.Linear(d, d, bias=False)
        self.ffn_norm = nn.RMSNorm(d, eps=shape.norm_eps)
        self.w1 = nn.Linear(d, shape.d_ff, bias=False)
        self.w3 = nn.Linear(d, shape.d_ff, bias=False)
        self.w2 = nn.Linear(shape.d_ff, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, d // self.heads)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))  # each (batch, heads, seq, head_dim)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(batch, seq, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceLM(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). Default PyTorch initialisation."""

    def __init__(self, shape: LMShape, max_seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(ReferenceBlock(shape) for _ in range(shape.n_layers))
        self.final_norm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        cos, sin = rotary_tables(shape.d_model // shape.n_heads, max_seq_len, shape.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        seq = tokens.shape[1]
        cos, sin = self.cos[:seq], self.sin[:seq]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.final_norm(x))


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy, computed on fp32 logits."""
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_train_step(model: nn.Module, tokens: Tensor, targets: Tensor, lr: float = 1e-4,
                    compile: bool = False) -> Callable[[], Tensor]:
    """One training step on a fixed batch: forward (bf16 autocast on CUDA), backward, fused AdamW (CUDA),
    gradients freed. Returns the step function; each call returns the loss (not synchronised)."""
    cuda = tokens.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
    forward = torch.compile(model) if compile else model

    def step() -> Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = lm_loss(forward, tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step
