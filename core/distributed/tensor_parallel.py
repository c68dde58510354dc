"""Tensor and sequence parallelism over the mesh's tp axis: the `tensor_parallel` plugins.

`MegatronTensorParallel` is ours (Megatron-LM's scheme, written here); `core.distributed.tensor_parallel_dtensor`
holds PyTorch's DTensor `parallelize_module` version as its baseline. Both shard the model in place while it is
still on the meta device, so that only this rank's shards are ever allocated (`TransformerLM.init_weights` draws
each full weight from the run's seed and keeps the rank's slice: every mesh shape starts from the same weights).

Each block runs two tensor-parallel regions, attention and the SwiGLU feed-forward:

    enter (f)  ->  column-parallel Linear(s)  ->  local heads / hidden units  ->  row-parallel Linear  ->  exit (g)

Without sequence parallelism, f is the identity forward / all-reduce backward and g its conjugate (all-reduce
forward / identity backward): 2 all-reduces of (B, T, D) per block forward and 2 backward. With sequence
parallelism (on by default) the residual stream and the norms between regions hold T / tp tokens per rank: f
all-gathers the sequence (reduce-scatters in backward) and g reduce-scatters (all-gathers in backward). Same bytes
on the wire, activations outside the regions divided by tp; the norm weights see only their rank's tokens, so
their gradients are summed over tp.

The embedding and the LM head are split over the vocabulary; the loss (`vocab_parallel_cross_entropy`) combines
the vocabulary shards with three all-reduces of (B, T) numbers and never gathers the logits.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from core.distributed.checkpoint_boxes import Boxed, as_checkpoint_entries, is_boxed
from core.distributed.comm import AxisCommTiming, CommTimer, all_gather_flat, reduce_scatter_flat
from core.distributed.mesh import ParallelMesh
from core.distributed.strategy import CollectiveSpec
from core.errors import ConfigError, require
from core.loss import chunked_linear_cross_entropy
from core.model import RMSNorm, TokenEmbedding

_SEQ = 1  # activations are (B, T, D): the sequence dimension


# ---- the communication of the regions, as autograd Functions ---------------------------------------------
class TPComm:
    """The tp group's collectives on (B, T, D) activations, each timed as exposed communication (they run inline:
    the next matmul needs their result)."""

    def __init__(self, group, world: int, timer: CommTimer) -> None:
        self.group, self.world, self.timer = group, world, timer

    def all_reduce(self, x: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        x = x.contiguous()
        with self.timer.blocking():
            dist.all_reduce(x, op=op, group=self.group)
        return x

    def gather_seq(self, x: Tensor) -> Tensor:
        # all_gather_flat concatenates along dim 0: gather (T/tp, B, D) blocks, then move T back
        local = x.transpose(0, _SEQ).contiguous()
        out = local.new_empty((local.shape[0] * self.world, *local.shape[1:]))
        with self.timer.blocking():
            all_gather_flat(out, local, group=self.group)
        return out.transpose(0, _SEQ)

    def scatter_seq(self, x: Tensor) -> Tensor:
        full = x.transpose(0, _SEQ).contiguous()
        out = full.new_empty((full.shape[0] // self.world, *full.shape[1:]))
        with self.timer.blocking():
            reduce_scatter_flat(out, full, group=self.group)
        return out.transpose(0, _SEQ)


class CopyToRegion(torch.autograd.Function):
    """f without sequence parallelism: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.all_reduce(grad), None


class ReduceFromRegion(torch.autograd.Function):
    """g without sequence parallelism: all-reduce forward (sums the row-parallel partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        return comm.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """f with sequence parallelism: all-gather the sequence forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return comm.gather_seq(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.scatter_seq(grad), None


class ReduceScatterSequence(torch.autograd.Function):
    """g with sequence parallelism: reduce-scatter the sequence forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return comm.scatter_seq(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.gather_seq(grad), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split over the vocabulary across `group`; the full rows are never gathered.

    Per row: the global max and the sum of exponentials are all-reduced (max, then sum), and the target's logit
    comes from the rank whose shard holds it (an all-reduce of mostly zeros). Backward is local: softmax minus
    the one-hot target, on this rank's columns."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, vocab_start: int, comm: TPComm) -> Tensor:
        logits = logits.float()
        row_max = comm.all_reduce(logits.max(dim=-1).values, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local_v = logits.shape[-1]
        in_shard = (target >= vocab_start) & (target < vocab_start + local_v)
        local_target = (target - vocab_start).clamp(0, local_v - 1)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        sum_exp, target_logit = comm.all_reduce(torch.stack((sum_exp, target_logit)))
        loss = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax on this rank's columns, kept for backward
        ctx.save_for_backward(exp, local_target, in_shard)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local_target, in_shard = ctx.saved_tensors
        # a new tensor, not the saved softmax in place: ZB-H1 runs this backward twice over one graph (its input-
        # and weight-gradient parts)
        scale = grad / local_target.numel()
        grad_logits = softmax * scale
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), (-in_shard.unsqueeze(-1).to(softmax.dtype)) * scale)
        return grad_logits, None, None, None


# ---- the sharded modules --------------------------------------------------------------------------------
def _rank_slices(segments: Sequence[int], rank: int, world: int) -> list[slice]:
    """Rank `rank`'s slice of each of `segments` (consecutive row blocks of one fused weight)."""
    out, start = [], 0
    for n in segments:
        part = n // world
        out.append(slice(start + rank * part, start + (rank + 1) * part))
        start += n
    return out


class ColumnParallelLinear(nn.Linear):
    """A Linear whose output features are split over tp (no bias); its input is the whole region input.

    `segments` are the row blocks of a fused weight that are split separately (q, k and v of the fused
    projection: each rank gets whole heads of each); the local weight is the rank's rows of every segment."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, segments: Sequence[int] | None = None) -> None:
        require(linear.bias is None, "tensor_parallel", "biased Linear layers are not split", "use bias-free layers")
        segments = tuple(segments or (linear.out_features,))
        super().__init__(linear.in_features, linear.out_features // world, bias=False,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.full_weight_shape = (linear.out_features, linear.in_features)
        self._slices = _rank_slices(segments, rank, world)

    def shard_of_full(self, full: Tensor) -> Tensor:
        """This rank's rows of a full weight."""
        return torch.cat([full[s] for s in self._slices], dim=0)

    def rows_in_full(self, lo: int, hi: int) -> list[tuple[int, int, tuple[int, int]]]:
        """Where rows [lo, hi) of this rank's weight lie in the full weight: (first local row, rows, the box's
        offset in the full weight), one box per segment the rows touch."""
        out, start = [], 0
        for s in self._slices:
            a, b = max(lo, start), min(hi, start + s.stop - s.start)
            if b > a:
                out.append((a, b - a, (s.start + a - start, 0)))
            start += s.stop - s.start
        return out


class VocabParallelLMHead(ColumnParallelLinear):
    """The LM head split over the vocabulary: `head(h)` gives this rank's logit columns; `head(h, targets, chunk)`
    the mean cross-entropy over the whole vocabulary, `chunk` tokens at a time (core/loss.py), its statistics
    combined over tp (the region entry in front of the head sums the partial gradient of h)."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, comm: "TPComm") -> None:
        super().__init__(linear, rank, world)
        self.vocab_start, self.comm = rank * self.out_features, comm

    def forward(self, x: Tensor, targets: Tensor | None = None, chunk: int = 0) -> Tensor:
        if targets is None:
            return super().forward(x)
        return chunked_linear_cross_entropy(x, self.weight, targets, chunk or targets.numel(), self.vocab_start,
                                            self.comm)


class RowParallelLinear(nn.Linear):
    """A Linear whose input features are split over tp (no bias); its output is a partial sum until g."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        require(linear.bias is None, "tensor_parallel", "biased Linear layers are not split", "use bias-free layers")
        super().__init__(linear.in_features // world, linear.out_features, bias=False,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.full_weight_shape = (linear.out_features, linear.in_features)
        self._columns = slice(rank * self.in_features, (rank + 1) * self.in_features)

    def shard_of_full(self, full: Tensor) -> Tensor:
        """This rank's columns of a full weight."""
        return full[:, self._columns]

    def rows_in_full(self, lo: int, hi: int) -> list[tuple[int, int, tuple[int, int]]]:
        """Rows [lo, hi) of this rank's weight in the full weight (see `ColumnParallelLinear.rows_in_full`)."""
        return [(lo, hi - lo, (lo, self._columns.start))] if hi > lo else []


class VocabParallelEmbedding(TokenEmbedding):
    """The token embedding split over the vocabulary: each rank looks up the tokens its rows hold, zeros the
    rest, and `g` sums the ranks' outputs (all-reduce, or reduce-scatter into sequence shards)."""

    def __init__(self, embedding: nn.Embedding, rank: int, world: int, exit_region: Callable[[Tensor], Tensor]) -> None:
        part = embedding.num_embeddings // world
        super().__init__(part, embedding.embedding_dim, device=embedding.weight.device, dtype=embedding.weight.dtype)
        self.vocab_start = rank * part
        self.exit_region = exit_region
        self.full_weight_shape = tuple(embedding.weight.shape)

    def shard_of_full(self, full: Tensor) -> Tensor:
        """This rank's rows (vocabulary entries) of a full weight."""
        return full[self.vocab_start:self.vocab_start + self.num_embeddings]

    def rows_in_full(self, lo: int, hi: int) -> list[tuple[int, int, tuple[int, int]]]:
        """Rows [lo, hi) of this rank's weight in the full weight (see `ColumnParallelLinear.rows_in_full`)."""
        return [(lo, hi - lo, (self.vocab_start + lo, 0))] if hi > lo else []

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.exit_region(out.masked_fill(outside.unsqueeze(-1), 0.0))


def rows_in_full(module: nn.Module, lo: int, hi: int) -> list[tuple[int, int, tuple[int, int]]]:
    """Where rows [lo, hi) of `module`'s 2-D weight (this rank's tensor-parallel part, or a whole weight) lie in
    the full weight: (first row, rows, the box's offset in the full weight) per box. Our FSDP's checkpoints
    save its row shards of a tensor-parallel part as these boxes of the one-process tensor."""
    if hasattr(module, "rows_in_full"):
        return module.rows_in_full(lo, hi)
    return [(lo, hi - lo, (lo, 0))] if hi > lo else []


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm over this rank's T / tp tokens: its weight enters through `CopyToRegion`, so the weight's gradient
    is summed over tp in backward (each rank's tokens contribute their part)."""

    def __init__(self, norm: RMSNorm, comm: TPComm) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x, CopyToRegion.apply(self.weight, self.comm))


# ---- the plugins ------------------------------------------------------------------------------------------
class TensorParallel(AxisCommTiming):
    """Base of the `tensor_parallel` plugins. With `mesh.tp == 1` every plugin leaves the model as it is.

    `apply` shards a meta-device `TransformerLM` in place; the trainer's loss goes through `loss` inside
    `loss_context()` (forward and backward both)."""

    name = "none"
    comm_axis = "tp"  # every tp collective is exposed: the regions wait for it
    composes_with: tuple[str, ...] = ()  # strategies (parallelism names) this plugin runs under when tp > 1
    checkpoints_with: tuple[str, ...] = ()  # those of them whose checkpoints hold every rank's shards

    def __init__(self, sequence_parallel: bool = True) -> None:
        self.sequence_parallel = bool(sequence_parallel)
        self.active = False

    def describe(self) -> str:
        return f"{self.name}{'+sp' if self.sequence_parallel else ''}" if self.active else "none"

    def validate(self, mesh: ParallelMesh, model_cfg, seq_len: int, strategy_name: str) -> None:
        """Refuse (ConfigError naming the key) what cannot run: degrees that do not divide the model, strategies
        this plugin does not compose with. Called before any process starts."""
        tp = mesh.tp
        if tp == 1:
            return
        for key, n in (("model.n_heads", model_cfg.n_heads), ("model.n_kv_heads", model_cfg.kv_heads),
                       ("model.d_ff", model_cfg.d_ff), ("model.vocab_size", model_cfg.vocab_size)):
            require(n % tp == 0, "mesh.tp", f"tp={tp} does not divide {key}={n}",
                    f"choose mesh.tp dividing {key} (and the other split sizes: heads, kv heads, d_ff, vocabulary)")
        if self.sequence_parallel:
            require(seq_len % tp == 0, "tensor_parallel.sequence_parallel",
                    f"sequence parallelism splits data.seq_len={seq_len} tokens over tp={tp}, which does not divide it",
                    f"choose data.seq_len divisible by {tp}, or tensor_parallel.sequence_parallel=false")
        require(strategy_name in self.composes_with, "parallelism",
                f"parallelism={strategy_name} does not compose with tensor_parallel={self.name} (mesh.tp={tp})",
                f"use one of {', '.join(self.composes_with)}, or the other tensor_parallel option")

    def validate_checkpointing(self, mesh: ParallelMesh, strategy_name: str, wants_checkpoints: bool) -> None:
        """Refuse checkpoints (saving or resuming) where this plugin has no format for the shards yet."""
        if mesh.tp == 1 or not wants_checkpoints or strategy_name in self.checkpoints_with:
            return
        with_ = " or ".join(f"tensor_parallel={self.name} parallelism={s}" for s in self.checkpoints_with)
        raise ConfigError("checkpoint", f"checkpoints of tensor_parallel={self.name} under parallelism={strategy_name} "
                          f"(mesh.tp={mesh.tp}) are not implemented yet: rank 0 would save only its own shards",
                          "set checkpoint.every=0 checkpoint.at_end=false resume=null"
                          + (f", or use {with_}" if with_ else ", or use tensor_parallel=dtensor parallelism=torch_fsdp2"))

    def checkpoint_view(self, strategy, mesh: ParallelMesh):
        """What saves and loads this run's checkpoints: the strategy itself, or, for a whole-tensor strategy
        under our tensor parallelism, `TensorParallelCheckpoint` (also the reader of such checkpoints when a
        run on another mesh resumes from one)."""
        return strategy

    def can_checkpoint(self, strategy_name: str) -> bool:
        """Whether a run under `strategy_name` saves and resumes checkpoints with this plugin (always at tp=1)."""
        return not self.active or strategy_name in self.checkpoints_with

    def checkpoint_reader(self, strategy, mesh: ParallelMesh):
        """A reader for checkpoints this run's own view does not write (None: only its own format)."""
        return None

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> None:
        self.active = mesh.tp > 1

    def loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy over every token of the micro-batch (float32)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def loss_context(self) -> ContextManager:
        return contextlib.nullcontext()

    def collectives(self, mesh: ParallelMesh, model_cfg, micro_batch: int, seq_len: int, activation_bytes: int,
                    micro_steps: int, recomputed_blocks: int) -> list:
        """The tensor-parallel collectives of one optimizer step (`CollectiveSpec`s over the tp axis), as
        `MegatronTensorParallel` runs them (the DTensor plans issue the same), per micro-step:

        - each block's two regions enter and leave once forward and once backward; the embedding leaves once
          forward and once backward, the LM head enters once each way;
        - a recomputed (checkpointed) block repeats its forward up to the last tensor its backward needs: both
          entries and the attention's exit (the MLP's exit feeds nothing saved, and non-reentrant checkpointing
          stops before it);
        - the loss: two all-reduces of three (B, T) float32 rows in all (the row max; the sums of exponentials
          and the target logits);
        - with sequence parallelism, each norm weight's gradient is summed over tp (float32, d_model).

        Activation calls move the full (B, T, D) tensor (`activation_bytes` per element)."""
        if mesh.tp == 1:
            return []
        m, n_layers, rec = micro_steps, model_cfg.n_layers, recomputed_blocks
        btd = micro_batch * seq_len * model_cfg.d_model * activation_bytes
        loss = CollectiveSpec("all_reduce", "loss statistics", 3 * m * micro_batch * seq_len * 4, 2 * m, ("tp",))
        if self.sequence_parallel:
            # enter: all-gather forward, reduce-scatter backward; leave: the reverse
            gathers = m * (4 * n_layers + 2 + 2 * rec)
            scatters = m * (4 * n_layers + 2 + rec)
            norms = m * (2 * n_layers + 1)
            return [CollectiveSpec("all_gather", "activations", gathers * btd, gathers, ("tp",)),
                    CollectiveSpec("reduce_scatter", "activations", scatters * btd, scatters, ("tp",)), loss,
                    CollectiveSpec("all_reduce", "norm gradients", norms * model_cfg.d_model * 4, norms, ("tp",))]
        # enter: all-reduce backward; leave: all-reduce forward
        reduces = m * (4 * n_layers + 2 + rec)
        return [CollectiveSpec("all_reduce", "activations", reduces * btd, reduces, ("tp",)), loss]

    def finish_gradients(self, model: nn.Module) -> None:
        """Called once gradients are complete and synchronised, before clipping and the optimizer step."""


class MegatronTensorParallel(TensorParallel):
    """Our tensor parallelism (Megatron-LM): column/row-parallel Linears with conjugate communication Functions,
    attention heads (and grouped KV heads) split over tp, SwiGLU w1/w3 column- and w2 row-parallel, vocabulary-
    parallel embedding, LM head and cross-entropy; sequence parallelism optional (on by default)."""

    name = "megatron"
    composes_with = ("none", "ddp_naive", "ddp_flat", "ddp_overlap", "ddp_bucketed", "zero1", "zero1_rs",
                     "torch_ddp", "fsdp")
    # the whole-parameter strategies: `TensorParallelCheckpoint` saves their state with its tp placements
    whole_parameter = ("none", "ddp_naive", "ddp_flat", "ddp_overlap", "ddp_bucketed", "torch_ddp", "zero1",
                       "zero1_rs")
    # our FSDP saves its own format, its row shards of each tp part as boxes of the one-process tensor
    # (`rows_in_full`), so its checkpoints reshard too
    checkpoints_with = whole_parameter + ("fsdp",)

    def checkpoint_view(self, strategy, mesh: ParallelMesh):
        if self.active and strategy.name in self.whole_parameter:
            return TensorParallelCheckpoint(self, mesh, strategy.name)
        return strategy

    def checkpoint_reader(self, strategy, mesh: ParallelMesh) -> "TensorParallelCheckpoint | None":
        """The reader of `TensorParallelCheckpoint`s for a whole-parameter strategy on any mesh (tp 1 included)."""
        return TensorParallelCheckpoint(self, mesh, strategy.name) if strategy.name in self.whole_parameter else None

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> None:
        super().apply(model, mesh)
        if not self.active:
            return
        world, rank = mesh.tp, mesh.submesh("tp").get_local_rank()
        self.timer = CommTimer(mesh.device_obj, enabled=False)
        comm = self.comm = TPComm(mesh.group("tp"), world, self.timer)
        sp = self.sequence_parallel
        enter = (lambda x: GatherSequence.apply(x, comm)) if sp else (lambda x: CopyToRegion.apply(x, comm))
        leave = (lambda x: ReduceScatterSequence.apply(x, comm)) if sp else (lambda x: ReduceFromRegion.apply(x, comm))

        def enter_hook(module, args):
            return (enter(args[0]), *args[1:])

        def leave_hook(module, args, out):
            return leave(out)

        cfg = model.cfg
        for block in model.blocks:
            attn, ffn = block.attn, block.ffn
            e = cfg.head_dim
            attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, rank, world,
                                                 (cfg.n_heads * e, cfg.kv_heads * e, cfg.kv_heads * e))
            attn.output_proj = RowParallelLinear(attn.output_proj, rank, world)
            attn.n_heads, attn.n_kv_heads = cfg.n_heads // world, cfg.kv_heads // world
            ffn.w1 = ColumnParallelLinear(ffn.w1, rank, world)
            ffn.w3 = ColumnParallelLinear(ffn.w3, rank, world)
            ffn.w2 = RowParallelLinear(ffn.w2, rank, world)
            for region in (attn, ffn):
                region.register_forward_pre_hook(enter_hook)
                region.register_forward_hook(leave_hook)
            if sp:
                block.ln1 = SequenceParallelRMSNorm(block.ln1, comm)
                block.ln2 = SequenceParallelRMSNorm(block.ln2, comm)
        model.token_embeddings = VocabParallelEmbedding(model.token_embeddings, rank, world, leave)
        if sp:
            model.final_norm = SequenceParallelRMSNorm(model.final_norm, comm)
        model.lm_head = VocabParallelLMHead(model.lm_head, rank, world, comm)
        model.lm_head.register_forward_pre_hook(enter_hook)
        self.vocab_start = rank * (cfg.vocab_size // world)

    def loss(self, logits: Tensor, target: Tensor) -> Tensor:
        if not self.active:
            return super().loss(logits, target)
        return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), target.flatten(), self.vocab_start, self.comm)


# ---- checkpoints ------------------------------------------------------------------------------------------
class TensorParallelCheckpoint:
    """Checkpoint state of a run whose strategy keeps whole parameters per data-parallel rank (`none`, the DDP
    family, `torch_ddp`; ZeRO-1, whose ranks each hold their owned parameters' optimizer state) under our tensor
    parallelism, as torch.distributed.checkpoint entries that any mesh can read.

    Every tp-split weight, and each optimizer-state tensor shaped like it, is saved as a DTensor sharded over the
    tp axis, so its global value is the one-process tensor; the fused qkv weight is saved as its three segments
    (`<name>#q`, `#k`, `#v`), each split on its own (a rank's qkv rows are its q, k and v heads, not one slice of
    the fused weight). Replicas over dp write once (DCP deduplicates). Loading reads whatever slices this rank's
    mesh needs: a run on another tp or dp degree resumes from it, and so does a one-process run (the adapter with
    tensor parallelism inactive reads whole tensors). Tensors that `boxes` places (under expert parallelism a rank's
    experts of each MoE layer and their optimizer state, `expert_box`) are saved as their box of the whole model's
    tensor, so the checkpoint reads on any ep degree too. Behaves like a `Strategy` to `core.checkpoint.Checkpointer`."""

    checkpoint_format = "dcp_tp"
    reshardable = True

    def __init__(self, tensor_parallel: "TensorParallel", mesh: ParallelMesh, strategy_name: str,
                 boxes: Callable[[nn.Module, str, Tensor], Boxed | None] | None = None) -> None:
        self.tp, self.mesh, self.name = tensor_parallel, mesh, strategy_name
        # (model, parameter name, tensor) -> its explicit box of the whole model's tensor, or None (expert parallelism)
        self.boxes = boxes

    def _pieces(self, model: nn.Module, fqn: str, value: Tensor) -> list[tuple[str, Tensor, int | None]]:
        """(key suffix, local piece, tp-sharded dim or None) of `value`: parameter `fqn` or optimizer state shaped
        like it."""
        owner, _, leaf = fqn.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf != "weight" or value.dim() == 0:
            return [("", value, None)]
        split = isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
        dim = 1 if isinstance(module, RowParallelLinear) else 0
        if owner.endswith("attn.qkv_proj"):
            cfg, world = model.cfg, self.mesh.tp if split else 1
            sizes = [n * cfg.head_dim // world for n in (cfg.n_heads, cfg.kv_heads, cfg.kv_heads)]
            return [(f"#{tag}", part, 0 if split else None) for tag, part in zip("qkv", value.split(sizes, dim=0))]
        return [("", value, dim if split else None)]

    def _as_global(self, piece: Tensor, dim: int | None):
        if dim is None:
            return piece
        from torch.distributed.tensor import DTensor, Shard

        shape = list(piece.shape)
        shape[dim] *= self.mesh.tp
        return DTensor.from_local(piece, self.mesh.submesh("tp"), [Shard(dim)], run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    def _flat(self, model: nn.Module, fqn: str, entries: dict[str, Any], boxed: dict[str, Boxed],
              where: str) -> dict[str, Any]:
        """`entries` (keyed by name) of parameter `fqn` as checkpoint entries: split pieces get key suffixes; a
        tensor `boxes` places (a rank's experts) is recorded in `boxed` under a placeholder key (`where` + key) that
        `state_dict` replaces by their entry once every rank's boxes are known."""
        out = {}
        for key, value in entries.items():
            if not torch.is_tensor(value):
                out[key] = value
            elif self.boxes is not None and (box := self.boxes(model, fqn, value)) is not None:
                boxed[where + key] = box
                out[key] = _Placeholder(where + key)
            else:
                for tag, piece, dim in self._pieces(model, fqn, value):
                    out[key + tag] = self._as_global(piece, dim)
        return out

    def _entries(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The live tensors to save or load into: parameters by name, and this rank's optimizer state by parameter
        name (all of it for a whole-tensor strategy, the owned parameters' under ZeRO-1)."""
        from core.distributed.comm import init_optimizer_state

        # a template before the first step needs every state tensor (ZeRO-1: of the inner, owned-state optimizer)
        init_optimizer_state(getattr(optimizer, "local_optimizer", optimizer))
        named = dict(model.named_parameters())
        name_of = {id(p): n for n, p in named.items()}
        state = {name_of[id(p)]: s for p, s in optimizer.state.items() if id(p) in name_of}
        return {n: p.detach() for n, p in named.items()}, state

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        params, state = self._entries(model, optimizer)
        boxed: dict[str, Boxed] = {}
        flat_model: dict[str, Any] = {}
        for fqn, value in params.items():
            flat_model.update(self._flat(model, fqn, {fqn: value}, boxed, "model/"))
        flat_optim = {fqn: self._flat(model, fqn, s, boxed, f"optimizer/{fqn}/") for fqn, s in state.items()}
        if boxed:  # every rank holds experts of every MoE layer: the same keys everywhere (one exchange)
            made = as_checkpoint_entries(boxed)

            def fill(d: dict[str, Any]) -> dict[str, Any]:
                return {k: made[v] if isinstance(v, _Placeholder) else v for k, v in d.items()}

            flat_model, flat_optim = fill(flat_model), {fqn: fill(s) for fqn, s in flat_optim.items()}
        return {"model": flat_model, "optimizer": flat_optim}

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        params, opt_state = self._entries(model, optimizer)

        def restore(fqn: str, entries: dict[str, Any], loaded: dict) -> None:
            for key, value in entries.items():
                if not torch.is_tensor(value):
                    entries[key] = loaded[key]
                    continue
                if is_boxed(loaded.get(key)):  # views of `value`: DCP loaded them in place
                    continue
                parts = [loaded[key + tag] for tag, _, _ in self._pieces(model, fqn, value)]
                parts = [p.to_local() if hasattr(p, "to_local") else p for p in parts]
                value.copy_(torch.cat(parts, dim=0) if len(parts) > 1 else parts[0])

        for fqn, value in params.items():
            restore(fqn, {fqn: value}, state["model"])
        for fqn, s in opt_state.items():
            restore(fqn, s, state["optimizer"][fqn])


class _Placeholder(str):
    """Stands for an entry `as_checkpoint_entries` makes once every tensor of the state has been visited."""
