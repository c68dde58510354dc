"""The CS336 basics Transformer language model.

token embedding -> n_layers x pre-norm block (RMSNorm, causal self-attention with RoPE,
RMSNorm, SwiGLU feed-forward) -> final RMSNorm -> untied LM head. No biases.
Shapes: B batch, T sequence, D d_model, H query heads, K kv heads, E head dim, V vocab.

The attention math is a plugin (`core.attention`); everything else reads top to bottom.
Build large models on the meta device (`with torch.device("meta")`), then call
`init_weights()` after `to_empty(device=...)`, or let a sharding strategy allocate only its shards and fill them
through `init_weights_each` (one full weight alive at a time): nothing is allocated before sharding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from core.attention import AttentionImpl, SDPAAttention
from core.errors import require
from core.loss import chunked_linear_cross_entropy
from core.moe import MoEFeedForward
from core.nvtx import nvtx_range

# init_weight(module, draw): initialise module.weight (or this rank's part of it) by calling draw(full) once
WeightInit = Callable[[nn.Module, Callable[[Tensor], object]], None]


@dataclass
class ModelConfig:
    """One model size ("flavour") as data. `n_kv_heads` None means multi-head (= n_heads)."""

    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    vocab_size: int = 10_000
    context_length: int = 512
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    name: str = "custom"
    # mixture of experts (docs/moe.md); n_experts 0 keeps the dense SwiGLU and ignores the other keys
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: Optional[float] = None  # None: dropless; else at most ceil(cf * tokens * top_k / E) per expert
    shared_expert: bool = False              # one dense SwiGLU (moe_d_ff wide) every token also goes through
    moe_d_ff: Optional[int] = None           # each expert's hidden width; None: d_ff
    aux_loss_coef: float = 0.01              # weight of the load-balancing loss in the training loss

    def __post_init__(self) -> None:
        for key in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size", "context_length"):
            v = getattr(self, key)
            require(isinstance(v, int) and v > 0, f"model.{key}", f"must be a positive integer, got {v!r}",
                    f"set model.{key} to a positive integer")
        require(self.d_model % self.n_heads == 0, "model.n_heads",
                f"{self.n_heads} heads do not divide d_model={self.d_model}",
                "choose model.n_heads dividing model.d_model")
        require(self.head_dim % 2 == 0, "model.n_heads", f"head dim {self.head_dim} is odd; RoPE rotates pairs",
                "choose model.n_heads so that d_model / n_heads is even")
        kv = self.kv_heads
        require(kv > 0 and self.n_heads % kv == 0, "model.n_kv_heads",
                f"{kv} kv heads do not divide {self.n_heads} query heads (GQA groups must be whole)",
                "choose model.n_kv_heads dividing model.n_heads (or null for multi-head attention)")
        self._validate_moe()

    def _validate_moe(self) -> None:
        e = self.n_experts
        require(isinstance(e, int) and e >= 0, "model.n_experts", f"must be a non-negative integer, got {e!r}",
                "set model.n_experts to 0 (dense) or the number of experts")
        if e == 0:
            return
        require(isinstance(self.top_k, int) and 1 <= self.top_k <= e, "model.top_k",
                f"{self.top_k!r} experts per token is not between 1 and model.n_experts={e}",
                f"set model.top_k to an integer in 1..{e}")
        cf = self.capacity_factor
        require(cf is None or (isinstance(cf, (int, float)) and cf > 0), "model.capacity_factor",
                f"must be null (dropless) or a positive number, got {cf!r}", "set model.capacity_factor=null or e.g. 1.25")
        require(self.moe_d_ff is None or (isinstance(self.moe_d_ff, int) and self.moe_d_ff > 0), "model.moe_d_ff",
                f"must be null (= d_ff) or a positive integer, got {self.moe_d_ff!r}", "set model.moe_d_ff")
        require(isinstance(self.aux_loss_coef, (int, float)) and self.aux_loss_coef >= 0, "model.aux_loss_coef",
                f"must be a non-negative number, got {self.aux_loss_coef!r}", "set model.aux_loss_coef, e.g. 0.01")
        require(isinstance(self.shared_expert, bool), "model.shared_expert",
                f"must be true or false, got {self.shared_expert!r}", "set model.shared_expert=true or false")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def expert_d_ff(self) -> int:
        """Each expert's hidden width (and the shared expert's)."""
        return self.d_ff if self.moe_d_ff is None else self.moe_d_ff

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of `TransformerLM(self)` (tested against the module)."""
        return self._count(include_embedding, self.n_experts)

    def active_params(self, include_embedding: bool = True) -> int:
        """Parameters one token's forward uses: `num_params` with only top_k experts per block (plus the router
        and shared expert); equal to `num_params` for a dense model."""
        return self._count(include_embedding, self.top_k if self.n_experts else 0)

    def _count(self, include_embedding: bool, experts: int) -> int:
        d, e = self.d_model, self.head_dim
        attn = d * (self.n_heads * e) + 2 * d * (self.kv_heads * e) + (self.n_heads * e) * d
        if self.n_experts:  # router, `experts` experts, optional shared expert
            ffn = d * self.n_experts + (experts + int(self.shared_expert)) * 3 * d * self.expert_d_ff
        else:
            ffn = 3 * d * self.d_ff
        block = attn + ffn + 2 * d
        total = self.n_layers * block + d + self.vocab_size * d  # + final norm + lm head
        return total + (self.vocab_size * d if include_embedding else 0)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (CS336 3.4.1)."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        # at least float32 whatever the input (autocast leaves the residual stream fp32 anyway)
        acc = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(acc), (x.shape[-1],), weight.to(acc), self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class TokenEmbedding(nn.Embedding):
    """`nn.Embedding` that draws no values on the meta device (a model built there for its shapes).

    Why: `normal_` on a meta tensor runs through `torch._refs`, whose first call imports `torch._dynamo`: about
    2 s of CPU in every process that plans or builds a model, for values nobody reads."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on interleaved pairs (x0, x1), (x2, x3), ... of each head."""

    def __init__(self, head_dim: int, context_length: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.context_length, self.theta = head_dim, context_length, theta
        cos, sin = self._tables(torch.device("cpu") if torch.get_default_device().type == "meta" else None)
        self.register_buffer("cos", cos, persistent=False)  # (T, E/2)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[Tensor, Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(self.context_length, device=device).float(), inv_freq)
        return angles.cos(), angles.sin()

    def reset_parameters(self) -> None:
        cos, sin = self._tables(self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        # x: (B, H, T, E); positions: (T,)
        cos = self.cos[positions].to(x.dtype)  # (T, E/2)
        sin = self.sin[positions].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention; the score math is `attention`."""

    def __init__(self, cfg: ModelConfig, attention: AttentionImpl, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        # q, k and v projections fused in one matmul (rows: H*E query, K*E key, K*E value)
        self.qkv_proj = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.output_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.attention = attention
        self.rope = (rope,)  # shared; a tuple keeps it out of this module's children

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.transpose(1, 2).split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        # q: (B, H, T, E); k, v: (B, K, T, E)
        rope = self.rope[0]
        q, k = rope(q, positions), rope(k, positions)
        y = self.attention(q, k, v, is_causal=True)  # (B, H, T, E)
        return self.output_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LMHead(nn.Linear):
    """The untied output projection (bias-free Linear). `head(h)` gives the logits; `head(h, targets, chunk)` the
    mean cross-entropy instead, computed `chunk` tokens at a time (all at once for 0) by
    `core.loss.ChunkedLinearCrossEntropy`, so the (tokens, vocabulary) logits never exist whole. Called as a module
    either way, so the hooks a strategy or tensor parallelism puts on it (weight gathers, region entry) run."""

    # both paths run the weight in autocast's dtype, as F.linear does: a strategy may hand it a low-precision copy
    # (BucketedDDP's compute_dtype)
    weight_in_autocast_dtype = True

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, x: Tensor, targets: Tensor | None = None, chunk: int = 0) -> Tensor:
        if targets is None:
            return super().forward(x)
        return chunked_linear_cross_entropy(x, self.weight, targets, chunk or targets.numel())


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, attention: AttentionImpl, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, attention, rope)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff) if not cfg.n_experts else MoEFeedForward(
            cfg.d_model, cfg.expert_d_ff, cfg.n_experts, cfg.top_k, cfg.capacity_factor,
            SwiGLU(cfg.d_model, cfg.expert_d_ff) if cfg.shared_expert else None)
        self.activation_checkpoint = False  # set by core.activation_checkpointing.apply

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), positions)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    """Decoder-only LM. `forward(tokens (B, T) int64) -> logits (B, T, V)`."""

    def __init__(self, cfg: ModelConfig, attention: AttentionImpl | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        attention = attention if attention is not None else SDPAAttention()
        self.token_embeddings = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, attention, self.rope) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.loss_chunk_tokens = 0  # > 0: forward(tokens, targets=...) returns the loss from the chunked head
        # the hidden state a later pipeline stage receives holds 1/hidden_seq_parts of the sequence (sequence
        # parallelism shards it over tp): the positions are those of the whole sequence
        self.hidden_seq_parts = 1

    def forward(self, tokens: Tensor, layers: range | None = None, targets: Tensor | None = None) -> Tensor:
        """Logits of `tokens`, or with `targets` their mean cross-entropy from the LM head in chunks of
        `loss_chunk_tokens` tokens (core/loss.py: no (B, T, V) logits). A pipeline stage (some modules `Dropped`)
        maps its input to its output instead: a later stage takes the hidden state (B, T, D), an earlier one
        returns it. `layers` runs only those blocks (one chunk of an interleaved pipeline stage): it embeds only if
        it starts at block 0 and applies the head only if it ends at the last block."""
        chunk_first = layers is None or layers.start == 0
        chunk_last = layers is None or layers.stop == len(self.blocks)
        first = not isinstance(self.token_embeddings, Dropped) and chunk_first
        T = tokens.shape[1] * (1 if first else self.hidden_seq_parts)
        require(T <= self.cfg.context_length, "data.seq_len",
                f"sequence of {T} tokens is longer than model.context_length={self.cfg.context_length}",
                "set data.seq_len <= model.context_length (or raise model.context_length)")
        positions = torch.arange(T, device=tokens.device)
        x = self.token_embeddings(tokens) if first else tokens  # (B, T, D)
        for i, block in enumerate(self.blocks):
            if isinstance(block, Dropped) or (layers is not None and i not in layers):
                continue
            with nvtx_range(f"block{i}"):
                if block.activation_checkpoint and torch.is_grad_enabled():
                    x = checkpoint(block, x, positions, use_reentrant=False)
                else:
                    x = block(x, positions)
        if isinstance(self.lm_head, Dropped) or not chunk_last:
            return x
        if targets is not None:
            return self.lm_head(self.final_norm(x), targets, self.loss_chunk_tokens)  # scalar loss
        return self.lm_head(self.final_norm(x))  # (B, T, V)

    def aux_loss(self) -> Tensor | None:
        """The sum of the MoE layers' load-balancing losses from the last forward (None for a dense model)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def router_stats(self) -> dict[str, float]:
        """The MoE layers' routing statistics of the last forward: mean dropped share, worst max load / mean."""
        stats = [m.stats for m in self.modules() if isinstance(m, MoEFeedForward) and m.stats]
        if not stats:
            return {}
        return {"moe_dropped_fraction": float(torch.stack([s["moe_dropped_fraction"] for s in stats]).mean()),
                "moe_max_load": float(torch.stack([s["moe_max_load"] for s in stats]).max())}

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Truncated-normal linears/embedding (std 0.02, output projections scaled by depth), unit norms.

        With `seed`, draws from a private generator so every strategy gets identical weights. The whole model
        must be materialised; a strategy that shards while it initialises uses `init_weights_each`.
        """
        self.init_weights_each(seed)

    @torch.no_grad()
    def init_weights_each(self, seed: int | None = None, init_weight: Optional[WeightInit] = None) -> None:
        """`init_weights`, handing each Linear/Embedding weight to `init_weight(module, draw)` as it comes.

        `draw(t)` fills `t`, a tensor shaped like the module's full (unsplit) weight on the generator's device,
        with that weight's values; `init_weight` must call it exactly once per module, in the order it is called
        (the generator is sequential), and store the module's part: a caller can allocate, shard and free one
        full weight at a time. A `Dropped` weight (another pipeline stage holds it) is drawn and thrown away, so
        the weights after it still get one process's values. Default: `init_part` (in place, or this rank's
        tensor-parallel part). Norms and RoPE tables are reset in place, so they must be materialised before.
        The generator lives on the device of `lm_head.weight` (the CPU while that is on the meta device)."""
        init_weight = init_weight if init_weight is not None else init_part
        gen = None
        if seed is not None:
            dev = self.lm_head.weight.device
            gen = torch.Generator(device=dev if dev.type != "meta" else "cpu").manual_seed(seed)
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            drawn_elsewhere = isinstance(module, Dropped) and module.full_weight_shape is not None
            if isinstance(module, (nn.Linear, nn.Embedding)) or drawn_elsewhere:
                s = out_std if name.endswith(("output_proj", "ffn.w2", "ffn.shared.w2")) else std
                init_weight(module, lambda t, s=s: nn.init.trunc_normal_(t, mean=0.0, std=s, a=-3 * s, b=3 * s,
                                                                         generator=gen))
            elif isinstance(module, MoEFeedForward):
                # the 3-D expert weights, before the router (named_modules yields the parent first); each goes
                # through `init_weight` like a Linear's, so a sharding strategy keeps only its part
                for p, s in ((module.w1, std), (module.w3, std), (module.w2, out_std)):
                    init_weight(_WeightSlot(p, module), lambda t, s=s: nn.init.trunc_normal_(
                        t, mean=0.0, std=s, a=-3 * s, b=3 * s, generator=gen))
            elif isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.reset_parameters()


class _WeightSlot(nn.Module):
    """A parameter presented as a module's `weight`, so the `WeightInit` protocol (built for Linear/Embedding)
    initialises a 3-D expert weight too; transient, never part of the model."""

    def __init__(self, weight: nn.Parameter, owner: Optional[MoEFeedForward] = None) -> None:
        super().__init__()
        self.weight = weight
        experts = owner.expert_slice if owner is not None else None
        if experts is not None and experts != slice(0, owner.n_experts):
            # expert parallelism: the parameter holds this rank's experts; all n_experts are drawn, in order
            self.full_weight_shape = (owner.n_experts, *weight.shape[1:])
            self.shard_of_full = lambda full: full[experts]


class Dropped(nn.Module):
    """Stands in for a module that another pipeline stage holds: no parameters, but the same child names and
    order, and one `full_weight_shape` per Linear / Embedding it replaces, so that `init_weights_each` still
    consumes that weight's draws in order (the generator is sequential) and this stage's weights come out as
    one process's. `weight` is an empty buffer: it moves with `to_empty` and tells the generator's device."""

    def __init__(self, full_weight_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.full_weight_shape = full_weight_shape
        self.register_buffer("weight", torch.empty(0), persistent=False)

    @classmethod
    def like(cls, module: nn.Module) -> "Dropped":
        """A stand-in for `module` and all its children (Linear / Embedding weights become draw-only slots)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # a tensor-parallel part draws its whole weight: the shape one process has
            return cls(tuple(getattr(module, "full_weight_shape", None) or module.weight.shape))
        out = cls()
        for name, child in module.named_children():
            out.add_module(name, cls.like(child))
        return out

    def shard_of_full(self, full: Tensor) -> Tensor:
        """Nothing of the drawn weight is kept here."""
        return full.flatten()[:0]


def init_part(module: nn.Module, init: Callable[[Tensor], object]) -> None:
    """Initialise `module.weight` in place with `init`; a weight split over ranks (tensor parallelism) gets its
    part of the full weight `init` draws, so every mesh shape starts from the weights one process would have."""
    weight = module.weight
    if not hasattr(module, "shard_of_full") and getattr(weight, "placements", None) is None:
        init(weight)
        return
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    shape = getattr(module, "full_weight_shape", None) or tuple(weight.shape)  # a DTensor's shape is the full one
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    init(full)
    local.copy_(part_of_full(module, full))


def part_of_full(module: nn.Module, full: Tensor) -> Tensor:
    """This rank's part of `full`, a tensor shaped like the whole of `module.weight`: our tensor parallelism's
    modules say it (`shard_of_full`); a DTensor weight's part follows its placements (after the module's
    `reorder_full`, where the plan stores the rows in another order than the model's)."""
    if hasattr(module, "shard_of_full"):
        return module.shard_of_full(full)
    weight = module.weight
    placements = getattr(weight, "placements", None)
    if placements is None:
        return full
    reorder = getattr(module, "reorder_full", None)
    if reorder is not None:
        full = reorder(full)
    mesh, coord = weight.device_mesh, weight.device_mesh.get_coordinate()

    def split_dim(placement) -> int | None:
        return placement.dim if placement.is_shard() or _is_strided(placement) else None

    # DTensor splits along the mesh dims left to right; FSDP2 over a tensor-parallel DTensor nests its dp shard
    # inside TP's instead (right to left), marked by a _StridedShard on the outer dim whose split_factor counts the
    # inner shards of that tensor dim: FSDP2 chunks this rank's TP part over dp
    strided = any(_is_strided(p) for p in placements)
    for mesh_dim in (reversed(range(len(placements))) if strided else range(len(placements))):
        placement = placements[mesh_dim]
        if split_dim(placement) is None:
            continue
        inner = math.prod(mesh.size(j) for j in range(mesh_dim + 1, len(placements))
                          if split_dim(placements[j]) == placement.dim)
        if type(placement).__name__ != "Shard" and not (_is_strided(placement) and placement.split_factor == inner):
            raise NotImplementedError(f"this rank's part of a weight placed {tuple(placements)}")
        full = chunk_of(full, mesh.size(mesh_dim), placement.dim, coord[mesh_dim])
    return full


def _is_strided(placement) -> bool:
    # torch's private _StridedShard (FSDP2 over TP); not a Shard subclass in every torch version
    return type(placement).__name__ == "_StridedShard"


def chunk_of(full: Tensor, n: int, dim: int, i: int) -> Tensor:
    """Piece `i` of `full.chunk(n, dim)`: torch.chunk's split, which DTensor's Shard and FSDP2 use, with an empty
    piece for the ranks past the last chunk (5 rows over 4 ranks: 2, 2, 1, 0)."""
    pieces = full.chunk(n, dim=dim)
    return pieces[i] if i < len(pieces) else full.narrow(dim, 0, 0)
