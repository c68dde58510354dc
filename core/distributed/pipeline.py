"""Pipeline parallelism over the mesh's pp axis: the `pipeline` plugins.

Stage r of pp keeps a contiguous, equal share of the Transformer blocks; the first stage also keeps the token
embedding, the last the final norm and the LM head (and computes the loss). Every other module is replaced by a
`core.model.Dropped` stand-in before anything is allocated, so a stage holds only its own parameters, while the
seeded initialisation still draws (and throws away) the dropped weights in order: each stage starts from exactly
one process's weights.

Each rank's micro-step batch is cut into `microbatches` pieces that flow through the stages. `OurPipeline` runs
them over torch.distributed point-to-point (`dist.batch_isend_irecv`; activations are (rows, seq_len, d_model)
float32 tensors whose shape every rank knows from the batch, so no shape is exchanged) in one of four orders
(`schedule_ops` defines them exactly):

    gpipe             every forward, then every backward             (holds m micro-batches' activations)
    1f1b              stage r: pp-1-r warm-up forwards, then one forward / one backward alternating, then the
                      cool-down backwards                            (holds at most pp-r micro-batches)
    interleaved_1f1b  Megatron's virtual pipeline: v chunks per stage, 1F1B over (micro-batch, chunk) units
    zb_h1             1F1B with each backward split into B (input gradient) and W (weight gradient), W deferred
                      into the cool-down / bubble                     (holds at most pp micro-batches)

`core.distributed.pipeline_torch.TorchPipeline` is the baseline: the same split under PyTorch's
`torch.distributed.pipelining` schedules. The loss of each micro-batch is divided by their number, so the
gradients and the reported loss are one process's mean over the same batch; the loss is broadcast from the last
stage to the whole pp group (every rank logs it).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import Tensor, nn

from core.distributed.mesh import ParallelMesh
from core.errors import ConfigError, require
from core.model import Dropped

# strategies whose gradient synchronisation a schedule drives through `gradient_sync`: every forward and every
# backward but the step's last run without it, the last with it, then finish_gradient_synchronization. torch_ddp
# arms its reducer before that last backward (`TorchDDPStrategy`), our fsdp holds its gathered weights and
# unsharded gradients for the step (`core.distributed.fsdp`), torch_fsdp2 keeps its weights gathered and its
# gradients unreduced until the last backward (`TorchFSDP2Strategy.gradient_sync`)
COMPOSES_WITH = ("none", "ddp_naive", "ddp_flat", "ddp_overlap", "ddp_bucketed", "zero1", "zero1_rs", "fsdp",
                 "torch_ddp", "torch_fsdp2")
# strategies whose stage state `TensorParallelCheckpoint` saves by the whole model's parameter names (every stage
# its own entries, any tp split as DTensors): a pipeline run resumes on another pp, tp or dp shape
CHECKPOINTS_WITH = ("none", "ddp_naive", "ddp_flat", "ddp_overlap", "ddp_bucketed", "torch_ddp", "zero1",
                    "zero1_rs")
# strategies whose own checkpoint format is already by the whole model's names (our fsdp): each stage writes its
# own entries through it
SAVES_BY_NAME = ("fsdp",)


def virtual_stage(stage: int, chunk: int, pp: int, style: str = "loop") -> int:
    """The virtual stage (position in the model, 0 .. pp*v - 1) chunk `chunk` of stage `stage` runs. "loop"
    (Megatron, torch's interleaved schedules): chunk * pp + stage, so a micro-batch loops over the stages v times;
    "v" (torch's ZBV / DualPipeV, two chunks): down the stages and back up, chunk 1 of stage r is 2pp - 1 - r, so
    the first stage holds the first and the last virtual stage."""
    if style == "v":
        return stage if chunk == 0 else 2 * pp - 1 - stage
    return chunk * pp + stage


def stage_of(virtual_stage_index: int, pp: int, style: str = "loop") -> int:
    """The stage (pp rank) that runs virtual stage `virtual_stage_index` (the inverse of `virtual_stage`)."""
    s = virtual_stage_index
    if style == "v":
        return s if s < pp else 2 * pp - 1 - s
    return s % pp


def uniform_pieces(n_layers: int, pieces: int) -> list[range]:
    """`pieces` contiguous, equal block ranges (`pieces` divides `n_layers`)."""
    per = n_layers // pieces
    return [range(k * per, (k + 1) * per) for k in range(pieces)]


def piece_costs(bounds: list[range], costs: list[float]) -> list[float]:
    """The cost of each piece: its blocks' costs, plus the embedding's on the first and the head's on the last
    (`costs` = [embedding, block 0 .. block L-1, norm + head + loss], as `layer_costs` gives)."""
    out = [sum(costs[1 + i] for i in b) for b in bounds]
    out[0] += costs[0]
    out[-1] += costs[-1]
    return out


def balanced_pieces(costs: list[float], pieces: int) -> list[range]:
    """Contiguous block ranges, at least one block each, that make the costliest piece as cheap as possible
    (`costs` as in `piece_costs`): the linear-partition dynamic programme over (pieces, blocks). Where the equal
    split is as good, it is kept."""
    n = len(costs) - 2
    block = costs[1:-1]
    prefix = [0.0]
    for c in block:
        prefix.append(prefix[-1] + c)

    def span(i: int, j: int, k: int) -> float:  # piece k holds blocks i .. j-1
        return prefix[j] - prefix[i] + (costs[0] if k == 0 else 0.0) + (costs[-1] if k == pieces - 1 else 0.0)

    inf = float("inf")
    # best[k][j]: the smallest costliest piece when pieces 0..k hold blocks 0..j-1; cut[k][j]: where piece k starts
    best = [[inf] * (n + 1) for _ in range(pieces)]
    cut = [[0] * (n + 1) for _ in range(pieces)]
    for j in range(1, n + 1):
        best[0][j] = span(0, j, 0)
    for k in range(1, pieces):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                c = max(best[k - 1][i], span(i, j, k))
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    bounds, j = [], n
    for k in range(pieces - 1, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    bounds.append(range(0, j))
    bounds.reverse()
    if n % pieces == 0:
        even = uniform_pieces(n, pieces)
        if max(piece_costs(even, costs)) <= max(piece_costs(bounds, costs)) * (1 + 1e-12):
            return even
    return bounds


# FLOPs one byte of elementwise (memory-bound) traffic is worth when costing layers against each other: about an
# H100's bf16 matmul rate over its HBM bandwidth, rounded down (a balance, not a device prediction)
ELEMENTWISE_FLOPS_PER_BYTE = 100.0


def layer_costs(m, seq: int) -> list[float]:
    """The cost of one token's forward and backward through each layer of a dense `ModelConfig`, in
    FLOP-equivalents: [embedding, block 0 .. block L-1, final norm + LM head + loss]. Matmul FLOPs counted as the
    planner counts them (`core.planner.matmul_flops`: backward 2x forward, attention over the full T x T) plus
    `ELEMENTWISE_FLOPS_PER_BYTE` per byte of the elementwise traffic the planner's step time counts (a block's
    norms, RoPE, residuals and SwiGLU; the head's norm and cross-entropy over the vocabulary; the embedding's row
    gather, its gradient's scatter and zeroing). `pipeline.balance=cost` balances the stages on it."""
    d, v, r = m.d_model, m.vocab_size, ELEMENTWISE_FLOPS_PER_BYTE
    heads = m.n_heads * m.head_dim
    linear = d * (heads + 2 * m.kv_heads * m.head_dim) + heads * d + 3 * d * m.d_ff  # qkv, output, SwiGLU
    block_fwd = 2 * linear + 2 * 2 * seq * heads  # + QK^T and PV per token
    block = 3 * block_fwd + r * 3 * (112 * d + 10 * m.d_ff)  # fp32 bytes per token, backward ~2x forward
    head = 3 * 2 * d * v + r * (30 * v + 3 * 56 * d)
    embedding = r * 3 * 4 * d
    return [embedding] + [block] * m.n_layers + [head]


def stage_layers(n_layers: int, pp: int, stage: int, virtual: int = 1, style: str = "loop",
                 bounds: list[range] | None = None) -> list[int]:
    """The blocks stage `stage` of `pp` keeps. With `virtual` chunks per stage (interleaved schedules) the blocks
    are cut into pp * virtual pieces (`bounds`; equal ones by default) and chunk c of the stage holds piece
    `virtual_stage(stage, c, pp, style)` (Megatron's assignment under "loop"), so a micro-batch visits every
    stage `virtual` times; with one chunk, a contiguous share."""
    return [i for c in range(virtual) for i in chunk_layers(n_layers, pp, stage, virtual, c, style, bounds)]


def chunk_layers(n_layers: int, pp: int, stage: int, virtual: int, chunk: int, style: str = "loop",
                 bounds: list[range] | None = None) -> range:
    """The blocks of chunk `chunk` of stage `stage`: piece `virtual_stage(stage, chunk, pp, style)` of `bounds`
    (pp * virtual equal pieces by default)."""
    bounds = bounds or uniform_pieces(n_layers, pp * virtual)
    return bounds[virtual_stage(stage, chunk, pp, style)]


def split_stage(model: nn.Module, pp: int, stage: int, virtual: int = 1, style: str = "loop",
                bounds: list[range] | None = None) -> None:
    """Keep stage `stage` of `pp` (its `virtual` chunks) of a (meta-device) `TransformerLM` in place; the rest
    becomes `Dropped` (which still draws every dropped weight, in order, at initialisation). The stage holding
    the first virtual stage keeps the embedding, the one holding the last the final norm and the head."""
    n = model.cfg.n_layers
    keep = set(stage_layers(n, pp, stage, virtual, style, bounds))
    for i, block in enumerate(model.blocks):
        if i not in keep:
            model.blocks[i] = Dropped.like(block)
    if stage != stage_of(0, pp, style):
        model.token_embeddings = Dropped.like(model.token_embeddings)
    if stage != stage_of(pp * virtual - 1, pp, style):
        model.final_norm = Dropped.like(model.final_norm)
        model.lm_head = Dropped.like(model.lm_head)


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> int:
    """Micro-batches whose activations the first stage holds at once: GPipe all m; 1F1B and ZB-H1 at most p
    (ZB-H1 defers on stage r only r weight-gradient parts, so r + (p - r) = p); interleaved 1F1B its warm-up of
    2(p-1) + (v-1)p chunk forwards plus one, each a 1/v share of the stage, rounded up."""
    s = schedule.lower()
    if "gpipe" in s:
        return microbatches
    if "interleaved" in s:
        chunks = min(2 * (pp - 1) + (virtual - 1) * pp + 1, microbatches * virtual)
        return min(-(-chunks // virtual), microbatches)
    return min(pp, microbatches)


def held_micro_batches(schedule: str, pp: int, microbatches: int, virtual: int = 1, stage: int = 0) -> float:
    """Micro-batches whose saved activations stage `stage` holds at its peak, in whole-stage units: GPipe all m;
    1F1B p - r; ZB-H1 p (1F1B's p - r plus r deferred weight-gradient parts); interleaved 1F1B its warm-up of
    2(p-1-r) + (v-1)p chunk forwards plus one, each 1/v of the stage; torch's zero-bubble and V schedules at most
    p (an estimate)."""
    s, m, r = schedule.lower(), microbatches, stage
    if "gpipe" in s:
        return float(m)
    if "interleaved" in s and "zerobubble" not in s:
        return min(2 * (pp - 1 - r) + (virtual - 1) * pp + 1, m * virtual) / virtual
    if "1f1b" in s:
        return float(min(pp - r, m))
    return float(min(pp, m))


def bubble_fraction(pp: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """The idle share of a step with equal-cost stages. GPipe and 1F1B: (p-1)/(m+p-1). Interleaved 1F1B
    (Megatron): the bubble shrinks by v, (p-1)/(v*m + p-1). ZB-H1 with equal forward, input-gradient and
    weight-gradient costs: each stage's p-1 bubble slots of F+B+W shrink to one part each, (p-1)/(3m + p-1).
    torch's interleaved zero-bubble, ZBV and DualPipeV schedules (v chunks, 2 for the V-shaped ones): both
    reductions, (p-1)/(3vm + p-1), an upper bound (the ideal ZB-V with equal parts has none)."""
    s = schedule.lower()
    if "zerobubble" in s or "dualpipe" in s:
        v = 2 if ("zbv" in s or "dualpipe" in s) else virtual
        return (pp - 1) / (3 * v * microbatches + pp - 1)
    if "interleaved" in s:
        return (pp - 1) / (virtual * microbatches + pp - 1)
    if "zb" in s:
        return (pp - 1) / (3 * microbatches + pp - 1)
    return (pp - 1) / (microbatches + pp - 1)


def schedule_ops(schedule: str, stage: int, pp: int, microbatches: int, virtual: int = 1) -> list[tuple[str, int]]:
    """The (op, micro-batch) order stage `stage` runs. Ops: "F" forward, "B" backward (the whole backward; under
    zb_h1 only the input-gradient part), "W" the weight-gradient part (zb_h1); under interleaved_1f1b each op
    names its chunk, "F1" = forward of chunk 1.

    zb_h1 is 1F1B's order of F and B with each W run after a later B: stage r runs W(i) right after B(i + r)
    (the later stages defer more, so their B's reach the earlier stages sooner), W(m-1-r) .. W(m-1) fill its
    tail bubble after its last B, and r deferred W's plus 1F1B's p - r micro-batches keep at most p in flight
    (1F1B's bound). interleaved_1f1b is Megatron's: the k-th forward is chunk
    (k // p) % v of micro-batch (k // (p v)) p + k % p, backwards the same with the chunks reversed;
    2(p-1-r) + (v-1)p warm-up forwards on stage r, then one forward / one backward, then the cool-down."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule in ("1f1b", "zb_h1"):
        warm = min(pp - 1 - stage, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        if schedule == "1f1b":
            return ops
        out: list[tuple[str, int]] = []
        for op, i in ops:
            out.append((op, i))
            if op == "B" and i - stage >= 0:
                out.append(("W", i - stage))
        return out + [("W", i) for i in range(max(m - stage, 0), m)]
    if schedule == "interleaved_1f1b":
        total = m * virtual

        def unit(k: int, backward: bool) -> tuple[int, int]:
            chunk = (k // pp) % virtual
            return (k // (pp * virtual)) * pp + k % pp, virtual - 1 - chunk if backward else chunk

        warm = min(2 * (pp - 1 - stage) + (virtual - 1) * pp, total)
        seq = [("F", k) for k in range(warm)]
        for k in range(total - warm):
            seq += [("F", warm + k), ("B", k)]
        seq += [("B", k) for k in range(total - warm, total)]
        return [(f"{op}{unit(k, op == 'B')[1]}", unit(k, op == "B")[0]) for op, k in seq]
    raise ValueError(f"unknown schedule {schedule!r}")


class PipelineParallel:
    """Base of the `pipeline` plugins. With `mesh.pp == 1` nothing changes (`active` stays False).

    `apply` splits a meta-device `TransformerLM` into this rank's stage in place; when active, the trainer hands
    each optimizer step's micro-batch loop to `forward_backward` and each evaluation batch to `loss`."""

    name = "none"
    schedules: tuple[str, ...] = ()
    # tensor_parallel plugins whose stages exchange plain tensors (DTensor plans pass DTensors between blocks)
    composes_with_tp = ("megatron",)
    records_timeline = False  # whether forward_backward fills `timeline`
    counts_p2p = False  # whether the plugin counts the bytes it sends and receives

    def __init__(self, schedule: str, microbatches: int = 4, virtual_stages: int = 1,
                 balance: str = "uniform") -> None:
        self.schedule = str(schedule)
        self.microbatches = microbatches
        self.virtual = virtual_stages  # model chunks per stage (interleaved 1F1B); 1 otherwise
        self.balance = str(balance)  # uniform: equal block counts; cost: the planner's per-layer cost
        self.seq_len: int | None = None  # the run's sequence length (validate reads it), for the per-layer cost
        self.active = False
        self.measuring = False
        self.timeline: list[tuple[str, int, float, float]] = []  # (op, micro-batch, start s, end s) of the step
        self.step_seconds = 0.0
        self.step_begin = 0.0  # time.perf_counter() at the step's start: one clock for every rank of a host
        self.p2p_bytes = 0  # bytes this rank has sent and received since the training step began
        self.step_p2p_bytes = 0  # ... in the last training step (evaluation's forward-only passes not counted)
        self.activation_peak = 0  # bytes saved for backward alive at once, the last measured step
        self.activation_peak_run = 0  # the most of any measured step

    @property
    def style(self) -> str:
        """How chunks map to virtual stages (`virtual_stage`): "loop" unless a V-shaped schedule runs."""
        return "loop"

    def describe(self) -> str:
        return f"{self.name}:{self.schedule}x{self.microbatches}" if self.active else "none"

    # ---- before anything starts ----------------------------------------------------------------------
    def validate(self, mesh: ParallelMesh, model_cfg, cfg, strategy_name: str, tensor_parallel_name: str) -> None:
        """Refuse (ConfigError naming the key) what this plugin cannot run; called before any process starts."""
        require(self.schedule in self.schedules, "pipeline.schedule",
                f"unknown schedule {self.schedule!r} for pipeline={self.name}",
                f"use one of {', '.join(self.schedules)}")
        m = self.microbatches
        require(isinstance(m, int) and m >= 1, "pipeline.microbatches", f"must be a positive integer, got {m!r}",
                "set pipeline.microbatches=1 or more")
        v = self.virtual
        require(isinstance(v, int) and v >= 1, "pipeline.virtual_stages", f"must be a positive integer, got {v!r}",
                "set pipeline.virtual_stages=1 (or more with pipeline.schedule=interleaved_1f1b)")
        self._validate_virtual(v)
        require(self.balance in ("uniform", "cost"), "pipeline.balance", f"unknown balance {self.balance!r}",
                "use pipeline.balance=uniform (equal block counts) or cost (the planner's per-layer cost)")
        self.seq_len = int(OmegaConf.select(cfg, "data.seq_len", default=None) or model_cfg.context_length)
        pp = mesh.pp
        if pp == 1:
            return
        if self.balance == "uniform":
            require(model_cfg.n_layers % pp == 0, "mesh.pp",
                    f"pp={pp} stages do not split model.n_layers={model_cfg.n_layers} blocks evenly",
                    "choose mesh.pp dividing model.n_layers, or pipeline.balance=cost")
            require(model_cfg.n_layers % (pp * v) == 0, "pipeline.virtual_stages",
                    f"pp={pp} x virtual_stages={v} chunks do not split model.n_layers={model_cfg.n_layers} blocks "
                    "evenly", "choose pipeline.virtual_stages with mesh.pp * virtual_stages dividing "
                    "model.n_layers, or pipeline.balance=cost")
        require(model_cfg.n_layers >= pp * v, "mesh.pp",
                f"pp={pp} x virtual_stages={v} pieces need at least as many blocks, model.n_layers="
                f"{model_cfg.n_layers}", "choose mesh.pp * pipeline.virtual_stages <= model.n_layers")
        # Megatron's interleaved order walks the micro-batches in groups of pp (one per stage)
        require(self.schedule != "interleaved_1f1b" or m % pp == 0, "pipeline.microbatches",
                f"interleaved 1F1B needs a multiple of pp={pp} micro-batches, got {m}",
                f"choose pipeline.microbatches as a multiple of {pp}")
        require(mesh.tp == 1 or tensor_parallel_name in self.composes_with_tp, "tensor_parallel",
                f"pipeline parallelism (pp={pp}) with tensor_parallel={tensor_parallel_name} (tp={mesh.tp}) is not "
                "implemented yet", f"use tensor_parallel={' or '.join(self.composes_with_tp)}, or mesh.tp=1")
        strategy = strategy_name
        require(strategy in COMPOSES_WITH, "parallelism",
                f"parallelism={strategy} does not compose with pipeline parallelism (mesh.pp={pp}) yet",
                f"use one of {', '.join(COMPOSES_WITH)}")
        accum = cfg.train.grad_accum_steps
        require(accum == 1, "train.grad_accum_steps",
                f"under pipeline parallelism the pipeline's micro-batches replace gradient accumulation, got {accum}",
                "set train.grad_accum_steps=1 and pipeline.microbatches=<micro-batches per step>")
        local = cfg.train.batch_size // mesh.dp_size
        require(local % m == 0, "pipeline.microbatches",
                f"{m} micro-batches do not split this rank's {local} sequences (train.batch_size / dp)",
                f"choose pipeline.microbatches dividing {local}")
        # torch's DDP reducer expects every parameter's gradient in the backward it arms: the step's last
        # backward covers only one chunk of an interleaved stage
        require(strategy != "torch_ddp" or self.virtual == 1, "parallelism",
                "torch_ddp under interleaved 1F1B: the step's last backward reaches only one chunk of the stage, so "
                "torch's reducer would wait for the other chunk's gradients", "use parallelism=ddp_bucketed")
        # FSDP2 reduce-scatters in the step's last backward, run synced: its post-backward of the modules it
        # reaches, and, at its end, of every other module (ours under interleaving: the other chunks). It must be
        # a whole backward (ZB-H1's W asks autograd for the gradients of the parameters, which under FSDP2 are the
        # shards, not the gathered weights the graph used), and reach the FSDP2 module: torch's multi-chunk
        # schedules run our chunk wrappers, so no backward of theirs would be synced
        require(strategy != "torch_fsdp2" or (self.schedule != "zb_h1" and
                                              (self.virtual == 1 or self.schedule == "interleaved_1f1b")),
                "parallelism", f"torch_fsdp2 under pipeline={self.name} pipeline.schedule={self.schedule}: FSDP2 "
                "reduces the gradients in the step's last backward, which must be a whole backward through the FSDP2 "
                "module", "use gpipe, 1f1b or interleaved_1f1b (pipeline=ours), ScheduleGPipe or Schedule1F1B "
                "(pipeline=torch), or parallelism=fsdp")
        if (cfg.checkpoint.every or cfg.checkpoint.at_end or cfg.resume) and not self.saves(strategy):
            raise ConfigError("checkpoint", f"checkpoints under pipeline parallelism (mesh.pp={pp}) with "
                              f"parallelism={strategy} are not implemented yet",
                              f"use one of {', '.join(CHECKPOINTS_WITH + SAVES_BY_NAME)}, or set "
                              "checkpoint.every=0 checkpoint.at_end=false resume=null")
        require(not cfg.compile, "compile", f"torch.compile under pipeline parallelism (mesh.pp={pp}) is not "
                "supported yet", "set compile=false")
        require(str(cfg.precision.get("dtype", "fp32")) != "fp16", "precision",
                "fp16 loss scaling under pipeline parallelism is not supported (each stage would decide alone "
                "whether to skip a step)", "use precision=bf16 or fp32")

    # ---- the stage split -----------------------------------------------------------------------------
    def apply(self, model: nn.Module, mesh: ParallelMesh, tensor_parallel=None) -> None:
        """Keep this rank's stage of a meta-device `TransformerLM` (after `tensor_parallel` split it); the rest
        becomes `Dropped` stand-ins."""
        self.active = mesh.pp > 1
        if not self.active:
            return
        self.mesh, self.pp = mesh, mesh.pp
        self.group = mesh.group("pp")
        self.stage = mesh.submesh("pp").get_local_rank()
        self.n_layers = model.cfg.n_layers
        self.bounds = self.piece_bounds(model.cfg, self.pp)
        # chunk c of this stage runs blocks chunks[c] (virtual stage virtual_stage(stage, c))
        self.chunks = [self.bounds[virtual_stage(self.stage, c, self.pp, self.style)] for c in range(self.virtual)]
        self.is_first = self.stage == stage_of(0, self.pp, self.style)
        self.is_last = self.stage == stage_of(self.pp * self.virtual - 1, self.pp, self.style)
        split_stage(model, self.pp, self.stage, self.virtual, self.style, self.bounds)
        if tensor_parallel is not None and tensor_parallel.active and getattr(tensor_parallel, "sequence_parallel", False):
            model.hidden_seq_parts = mesh.tp  # stages pass sequence shards
        self.d_model = model.cfg.d_model
        # each chunk's neighbours are `_peer`'s; the loss is on the stage holding the last virtual stage
        self.last_rank = dist.get_global_rank(self.group, stage_of(self.pp * self.virtual - 1, self.pp, self.style))

    def _validate_virtual(self, v: int) -> None:
        """Refuse chunks per stage the schedule cannot run (ours: only interleaved 1F1B runs several)."""
        require(v == 1 or self.schedule == "interleaved_1f1b", "pipeline.virtual_stages",
                f"{v} chunks per stage need the interleaved schedule, not {self.schedule}",
                "set pipeline.schedule=interleaved_1f1b (pipeline=ours) or pipeline.virtual_stages=1")

    def piece_bounds(self, model_cfg, pp: int) -> list[range]:
        """The blocks of each of the pp * virtual_stages virtual stages, in model order: equal counts, or (balance
        cost) the split whose costliest piece is cheapest under `layer_costs`."""
        pieces = pp * self.virtual
        if self.balance != "cost":
            return uniform_pieces(model_cfg.n_layers, pieces)
        return balanced_pieces(layer_costs(model_cfg, self.seq_len or model_cfg.context_length), pieces)

    def _peer(self, chunk: int, step: int) -> int:
        """The global rank running the virtual stage `step` (+1 / -1) away from this stage's chunk (under
        interleaving the neighbours wrap around: the last stage's chunk c feeds the first stage's chunk c+1)."""
        s = virtual_stage(self.stage, chunk, self.pp, self.style) + step
        return dist.get_global_rank(self.group, stage_of(s, self.pp, self.style))

    # ---- checkpoints --------------------------------------------------------------------------------------
    def can_checkpoint(self, strategy_name: str) -> bool:
        """Whether a run under `strategy_name` saves and resumes checkpoints with this plugin (always at pp=1)."""
        return not self.active or self.saves(strategy_name)

    @staticmethod
    def saves(strategy_name: str) -> bool:
        """Whether a stage under `strategy_name` saves its own entries by the whole model's names."""
        return strategy_name in CHECKPOINTS_WITH + SAVES_BY_NAME

    def checkpoint_view(self, view, strategy, tensor_parallel, mesh: ParallelMesh):
        """What saves and loads a stage's state: `TensorParallelCheckpoint` (`tensor_parallel`'s, already `view`
        under tp), every parameter and its optimizer state by the whole model's name through DCP. Each stage
        writes only its own entries (the `Dropped` stand-ins keep the names and hold none), dp replicas once, so
        the checkpoint holds the whole model once and loads on any pp, tp or dp shape (`reshardable`), one
        process included."""
        from core.distributed.tensor_parallel import TensorParallelCheckpoint

        if not self.active or isinstance(view, TensorParallelCheckpoint) or strategy.name not in CHECKPOINTS_WITH:
            return view
        return TensorParallelCheckpoint(tensor_parallel, mesh, strategy.name)

    def hidden_shape(self, run, rows: int, seq_len: int) -> tuple[int, int, int]:
        """The shape of the hidden state between stages: (rows, tokens, d_model); under sequence parallelism each
        tp rank holds seq_len / tp tokens, and sends them to the same tp rank of the next stage."""
        tp = run.tensor_parallel
        sharded = tp.active and getattr(tp, "sequence_parallel", False)
        return rows, seq_len // run.mesh.tp if sharded else seq_len, self.d_model

    # ---- chunks (virtual stages) -----------------------------------------------------------------------------
    def _first_chunk(self, chunk: int) -> bool:
        """Whether this stage's chunk is the first virtual stage (takes the tokens)."""
        return self.chunks[chunk].start == 0

    def _last_chunk(self, chunk: int) -> bool:
        """Whether this stage's chunk is the last virtual stage (computes the loss)."""
        return self.chunks[chunk].stop == self.n_layers

    def _run_chunk(self, run, h: Tensor, chunk: int, targets: Tensor | None = None) -> Tensor:
        """This stage's forward of one chunk (the whole stage without interleaving); with `targets` (the last chunk
        under `train.loss_chunk_tokens`) the model's chunked head returns the loss instead of logits."""
        kwargs = {} if targets is None else {"targets": targets}
        if self.virtual == 1:
            return run.model(h, **kwargs)
        return run.model(h, layers=self.chunks[chunk], **kwargs)

    def _last_chunk_loss(self, run, h: Tensor, chunk: int, y: Tensor) -> Tensor:
        """The mean loss of micro-batch (h, y) through the last chunk: from the model's chunked head
        (`train.loss_chunk_tokens`, core/loss.py: no logits), else the tensor-parallel plugin's loss of the logits."""
        if run.raw_model.loss_chunk_tokens:
            with run.precision.autocast():
                return self._run_chunk(run, h, chunk, targets=y)
        with run.precision.autocast():
            out = self._run_chunk(run, h, chunk)
        return run.tensor_parallel.loss(out, y)

    # ---- point to point --------------------------------------------------------------------------------
    def _recv(self, peer: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
        buf = torch.empty(shape, dtype=torch.float32, device=device)  # the residual stream stays float32
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, self.group)]):
            work.wait()
        self.p2p_bytes += buf.numel() * buf.element_size()
        return buf

    def _send(self, tensor: Tensor, peer: int) -> None:
        tensor = tensor.detach().float().contiguous()
        self.p2p_bytes += tensor.numel() * tensor.element_size()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer, self.group)])
        self._pending += [(w, tensor) for w in works]  # the tensor must live until its send completes

    def _broadcast_loss(self, total: Tensor) -> Tensor:
        """The last stage's loss on every rank of the pp group."""
        total = total.detach().float().clone()
        dist.broadcast(total, src=self.last_rank, group=self.group)
        return total

    # ---- the trainer's calls -----------------------------------------------------------------------------
    def forward_backward(self, run, step: int) -> Tensor:
        """One optimizer step's forwards and backwards on this stage; returns the step's mean loss (every rank)."""
        raise NotImplementedError

    @torch.no_grad()
    def loss(self, run, x: Tensor, y: Tensor) -> Tensor:
        """Mean loss of one batch, forward only, through every stage (each rank gets it): evaluation."""
        self._pending = []
        shape = self.hidden_shape(run, x.shape[0], x.shape[1])
        total = torch.zeros((), device=run.device)
        for c in range(self.virtual):  # a micro-batch passes every stage once per chunk, in virtual-stage order
            h = x if self._first_chunk(c) else self._recv(self._peer(c, -1), shape, run.device)
            with run.tensor_parallel.loss_context():
                if self._last_chunk(c):
                    total = self._last_chunk_loss(run, h, c, y)
                else:
                    with run.precision.autocast():
                        out = self._run_chunk(run, h, c)
            if not self._last_chunk(c):
                self._send(out, self._peer(c, +1))
        self._wait_sends()
        return self._broadcast_loss(total)

    def _wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def measure_communication(self, enabled: bool) -> None:
        """Record the timeline (synchronising the device at each op) on the steps the trainer logs."""
        self.measuring = enabled

    def _stamp(self, run) -> float:
        if self.measuring:
            run.synchronize()
        return time.perf_counter()

    def saved_activations(self, run) -> "SavedActivations":
        """A counter of this step's saved activations (its `hooks()` wrap the schedule); parameters left out."""
        local = (p.to_local() if hasattr(p, "to_local") else p for p in run.raw_model.parameters())  # FSDP2 shards
        return SavedActivations({t.untyped_storage().data_ptr() for t in local})

    def _record_activations(self, counter: "SavedActivations") -> None:
        self.activation_peak = counter.peak
        self.activation_peak_run = max(self.activation_peak_run, counter.peak)

    def step_metrics(self) -> dict[str, float]:
        """The last measured step on this rank: its bubble, 1 - (time in forwards and backwards) / step time
        (plugins that record a timeline), the peak bytes saved for backward at once (MiB) and the point-to-point
        MiB sent and received (plugins that count them)."""
        if not (self.active and self.measuring):
            return {}
        out = {"pp_activation_peak_mib": self.activation_peak / 2**20}
        if self.counts_p2p:
            out["pp_p2p_mib"] = self.step_p2p_bytes / 2**20
        if self.timeline and self.step_seconds > 0:
            busy = sum(end - start for _, _, start, end in self.timeline)
            out["pp_bubble_fraction"] = max(0.0, 1.0 - busy / self.step_seconds)
        return out

    def run_summary(self, mesh: ParallelMesh) -> dict[str, Any]:
        """For the run's summary, gathered from every rank (collective over the world: every rank calls it): the
        peak activation bytes of each rank (GiB, the most of any measured step) and their maximum, and the largest
        point-to-point MiB of a step on any rank."""
        if not self.active:
            return {}
        mine = [self.activation_peak_run / 2**30, self.step_p2p_bytes / 2**20]
        every: list[Any] = [None] * mesh.world_size
        dist.all_gather_object(every, mine)
        out: dict[str, Any] = {"pp_activation_gib_per_rank": [e[0] for e in every],
                               "pp_activation_gib": max(e[0] for e in every)}
        if self.counts_p2p:
            out["pp_p2p_mib"] = max(e[1] for e in every)
        return out

    def save_timeline(self, run) -> Path | None:
        """At the end of a run: every rank's peak activation bytes and point-to-point bytes (`run_summary`) join
        the run's summary (through `run.memory_marks`, which it carries), and every rank's timeline of the last
        step is written by rank 0 to `pipeline_timeline.json` in the run directory (with `t0`, the step's start on
        the host's monotonic clock, which every rank of one host shares) and `pipeline_timeline.png` (one row per
        rank, where matplotlib is installed). Collective over the whole world: every rank calls it. Returns the
        JSON's path on rank 0."""
        if not self.active:
            return None
        run.memory_marks.update(self.run_summary(run.mesh))
        if not self.records_timeline:
            return None
        mine = {"rank": run.mesh.rank, "stage": self.stage, "step_s": self.step_seconds, "t0": self.step_begin,
                "events": [list(e) for e in self.timeline]}
        every: list[Any] = [None] * run.mesh.world_size
        dist.all_gather_object(every, mine)
        if not run.mesh.is_main:
            return None
        path = Path(run.run_dir) / "pipeline_timeline.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"schedule": self.describe(), "pp": self.pp, "ranks": every}, indent=1))
        try:
            _plot_timeline(every, self.describe(), path.with_suffix(".png"))
        except ImportError:  # matplotlib is optional: the JSON holds the same
            pass
        return path

    def collectives(self, mesh: ParallelMesh, model_cfg, micro_batch: int, seq_len: int) -> list:
        """The point-to-point traffic of one optimizer step on the busiest stage (`CollectiveSpec`s over pp),
        counted as bytes it sends plus bytes it receives: each micro-batch's activation enters every virtual stage
        but the first and leaves every one but the last, its gradient the other way, unless the neighbouring virtual
        stage runs on the same stage (the turn of a V); float32."""
        if mesh.pp == 1:
            return []
        from core.distributed.strategy import CollectiveSpec

        m, pp, v = self.microbatches, mesh.pp, self.virtual
        nbytes = micro_batch // m * seq_len * model_cfg.d_model * 4
        last, style = pp * v - 1, self.style

        def moves(r: int) -> int:  # messages per micro-batch and direction on stage r: inputs in plus outputs out
            ends = [virtual_stage(r, c, pp, style) for c in range(v)]
            # a neighbour on the same stage (the turn of a V) is handed over in place
            return sum((s > 0 and stage_of(s - 1, pp, style) != r) + (s < last and stage_of(s + 1, pp, style) != r)
                       for s in ends)

        busiest = max(moves(r) for r in range(pp))
        return [CollectiveSpec("send_recv", "activations", busiest * m * nbytes, busiest * m, ("pp",)),
                CollectiveSpec("send_recv", "activation gradients", busiest * m * nbytes, busiest * m, ("pp",))]


class _Saved:
    """One tensor autograd saved for backward: alive exactly as long as its slot in the graph."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter: "SavedActivations", key: int, tensor: Tensor) -> None:
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self.counter._release(self.key)


class SavedActivations:
    """Counts the bytes of the tensors autograd saves for backward that are alive at once, and their peak.

    Within `hooks()` (`torch.autograd.graph.saved_tensors_hooks`) every saved tensor is packed into a `_Saved`
    holder, which the graph keeps until the backward that uses it has freed it, so the count follows the
    micro-batches in flight exactly (on any device, whatever the allocator caches). A storage counts once
    however many slots hold it (the whole storage: a saved view keeps all of it alive); storages of
    `exclude` (the parameters, which matmuls save too) are not activations and are not counted, nor is any other
    parameter or view of one (FSDP2's gathered weights)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [slots holding it, its bytes]
        self.live = 0
        self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        # a parameter, or a view of one, that is not among `exclude`: FSDP2's gathered weights (parameters it
        # allocates at its all-gather, not the sharded ones the model lists)
        if t.device.type == "meta" or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t
        ref = self.refs.get(key)
        if ref is None:
            self.refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        ref = self.refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]


def _plot_timeline(ranks: list[dict], title: str, path: Path) -> None:
    """One row per rank: forwards, backwards (and weight-gradient parts) as bars labelled with their micro-batch;
    the gaps are the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
    for row, r in enumerate(ranks):
        for op, mb, start, end in r["events"]:
            color = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange"}[op[0]]
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8), facecolors=color,
                           edgecolor="white")
            # an interleaved op names its chunk after the micro-batch ("3.1": micro-batch 3, chunk 1)
            label = f"{mb}.{op[1:]}" if op[1:] else str(mb)
            ax.text((start + end) / 2 * 1e3, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']} (stage {r['stage']})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (blue: forward, green: backward, orange: weight gradients)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class OurPipeline(PipelineParallel):
    """Our schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) over batched isend/irecv; every rank records its
    (op, micro-batch, start, end) timeline of the step for the measured bubble.

    ZB-H1 splits each backward in two autograd calls over the graph the forward built: B takes the gradient of
    the stage output with respect to the stage input only (`torch.autograd.grad(..., retain_graph=True)`) and
    sends it on; W later runs `torch.autograd.backward` from the same output and output gradient with
    `inputs=` the stage's parameters, accumulating their `.grad` and freeing the graph. Memory: the graph (every
    saved activation) and the received output gradient live from B until W. Compute: W walks the activation-
    gradient chain again to reach the weights (autograd keeps no intermediate gradients), so B + W costs more
    than one backward; what ZB-H1 wins is that the next stage's B no longer waits for this stage's W."""

    name = "ours"
    schedules = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
    records_timeline = True
    counts_p2p = True

    def forward_backward(self, run, step: int) -> Tensor:
        if not self.measuring:
            return self._forward_backward(run, step)
        counter = self.saved_activations(run)
        with counter.hooks():
            loss = self._forward_backward(run, step)
        self._record_activations(counter)
        return loss

    def _forward_backward(self, run, step: int) -> Tensor:
        x, y = run.micro_batch("train", step, 0)
        m = self.microbatches
        xs, ys = x.chunk(m), y.chunk(m)
        shape = self.hidden_shape(run, xs[0].shape[0], xs[0].shape[1])
        ops = schedule_ops(self.schedule, self.stage, self.pp, m, self.virtual)
        split = self.schedule == "zb_h1"  # backward in an input-gradient part (B) and a weight part (W)
        params = [p for p in run.raw_model.parameters() if p.requires_grad]
        # keyed by (micro-batch, chunk): a stage holds several chunks' activations of one micro-batch
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        out_grads: dict[tuple[int, int], Tensor | None] = {}  # zb_h1: B's output gradient, kept for W
        total = torch.zeros((), device=run.device)
        self._pending, self.timeline, self.p2p_bytes = [], [], 0
        begin = self.step_begin = self._stamp(run)
        for n, (op, i) in enumerate(ops):
            kind, c = op[0], int(op[1:] or 0)
            key, first, last = (i, c), self._first_chunk(c), self._last_chunk(c)
            # gradients are synchronised over dp by the last backward only (all earlier ones accumulate)
            sync = n == len(ops) - 1
            if kind == "F":
                h = xs[i] if first else self._recv(self._peer(c, -1), shape, run.device).requires_grad_()
                start = self._stamp(run)
                with run.strategy.gradient_sync(False), run.tensor_parallel.loss_context():
                    if last:
                        out = self._last_chunk_loss(run, h, c, ys[i]) / m
                        total += out.detach()
                    else:
                        with run.precision.autocast():
                            out = self._run_chunk(run, h, c)
                inputs[key], outputs[key] = h, out
                if not last:
                    self._send(out, self._peer(c, +1))
            elif kind == "B":
                grad = None if last else self._recv(self._peer(c, +1), shape, run.device)
                start = self._stamp(run)
                with run.strategy.gradient_sync(sync), run.tensor_parallel.loss_context():
                    if split:
                        # the input gradient only; the graph stays for W (the first stage has no input gradient)
                        h_grad = None if first else torch.autograd.grad(outputs[key], [inputs[key]], grad,
                                                                        retain_graph=True)[0]
                        out_grads[key] = grad
                    else:
                        if last:
                            run.precision.backward(outputs.pop(key))
                        else:
                            torch.autograd.backward(outputs.pop(key), grad)
                        h_grad = inputs.pop(key).grad
                if not first:
                    self._send(h_grad, self._peer(c, -1))
            else:  # "W": the deferred weight gradients of micro-batch i, into .grad; frees its graph
                start = self._stamp(run)
                with run.strategy.gradient_sync(sync), run.tensor_parallel.loss_context():
                    torch.autograd.backward(outputs.pop(key), out_grads.pop(key), inputs=params)
                inputs.pop(key)
            self.timeline.append((op, i, start - begin, self._stamp(run) - begin))
        self._wait_sends()
        self.step_seconds = self._stamp(run) - begin
        self.step_p2p_bytes = self.p2p_bytes
        run.strategy.finish_gradient_synchronization()
        run.tensor_parallel.finish_gradients(run.raw_model)
        return self._broadcast_loss(total)
