"""The planner: a prediction for every run, made before anything starts.

`plan(cfg) -> Plan` reads the composed config and predicts, per rank:

  * parameter count and FLOPs per step (the PaLM model FLOPs that MFU uses, and the matmul
    FLOPs the hardware executes: what `torch.utils.flop_counter.FlopCounterMode` counts);
  * memory (`predict_memory`), broken into parameters, gradients, optimizer state, saved activations
    (with and without activation checkpointing), autocast's low-precision weight copies, communication
    buffers and transients, evaluated at the three moments a step can peak (end of forward, end of
    backward, optimizer step);
  * communication (`predict_communication`): volume per step per collective and its time on a ring;
  * a step time (`predict_time`) from a roofline (matmul FLOPs at the measured matmul ceiling,
    elementwise traffic at the measured memory bandwidth, a per-kernel floor) plus the exposed part of
    the communication.

What a strategy shards and sends is the strategy's own answer (`Strategy.profile`, core/distributed/);
the device figures come from core/hardware.py. The planner only costs them.

Activation sizes are exact counts of what autograd saves in `core.model.TransformerLM`
(checked against `saved_tensors_hooks` in tests/test_planner.py). Per block, with
B sequences of T tokens per micro-step, D = d_model, F = d_ff, H heads, r = kv_heads/H, E = D/H,
a = bytes of the compute dtype (2 under bf16/fp16 autocast, 4 in fp32):

    RMSNorm x2        2 * (8 BTD + 4 BT)     fp32 input and x*rsqrt, rms
    linear inputs     autocast: a BTD per linear that reads it (qkv, w1, w3: 3 casts);
                      fp32: 4 BTD per norm output (shared by the linears)
    RoPE cos/sin      2 T E a
    attention (SDPA)  a BTD (q) + r a BTD (k) + (1 + 2r) a BTD (the fused qkv output v views)
                      + a BTD (out) + 4 BHT (logsumexp)
    output_proj in    a BTD
    SwiGLU            4 a BTF (w1 out, silu out, w3 out, product)
plus, once: tokens 8 BT, final norm 8 BTD + 4 BT, lm_head input a BTD, log-softmax output 4 BTV. Autocast also saves a bf16 copy of every linear weight it casts
(2 bytes per matmul parameter), which is what makes bf16-autocast runs *larger* than their
fp32 parameter count suggests. A checkpointed block saves only its fp32 input (4 BTD; all share one int64 positions tensor).

Calibration (docs/planner.md): 2x H200, xl (3.41B), 4 sequences x 512 per GPU, bf16 autocast,
fused AdamW, eager; the measured points are in docs/data_parallel.md and docs/planner.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from core.distributed.strategy import ModelLayout, Strategy, StrategyProfile, axes_degree
from core.errors import ConfigError, require
from core.hardware import DEVICES, DeviceSpec, cpu_memory_available_gib, key_for_name, visible_gpus

GIB = 2**30
GPU_KEYS = ", ".join(k for k, d in DEVICES.items() if k != "cpu" and d.has_ceilings)


# ---- the device ------------------------------------------------------------------------------------
def device_spec(cfg: DictConfig, world_size: int) -> tuple[Optional[DeviceSpec], str]:
    """The device the plan is for and a line saying why: `planner.device` (auto | a core/hardware.py key),
    then `planner.device_overrides`. None when auto finds a GPU the table does not know."""
    pcfg = OmegaConf.select(cfg, "planner", default=None) or {}
    want = pcfg.get("device", "auto") if pcfg else "auto"
    mesh_dev = OmegaConf.select(cfg, "mesh.device", default="auto")
    if want not in (None, "auto"):
        require(want in DEVICES, "planner.device", f"no device-table entry {want!r}",
                f"use planner.device=auto or one of {', '.join(DEVICES)}")
        key, why = want, "planner.device"
    elif mesh_dev == "cpu":
        key, why = "cpu", "mesh.device=cpu"
    else:
        gpus = visible_gpus()
        if not gpus:
            # the run would train on this machine's CPU; someone planning a GPU job from a laptop or a login
            # node must say which GPU, and the plan says so on its first line
            key = "cpu"
            why = (f"planner.device=auto and this machine has no GPU, so the plan is for its CPU; "
                   f"to plan for GPUs set planner.device={GPU_KEYS.replace(', ', '|')}")
        else:
            key = key_for_name(gpus[0])
            if key is None:
                return None, (f"{gpus[0]!r} is not in the device table: no time or fit prediction "
                              f"(set planner.device to one of {GPU_KEYS})")
            why = f"planner.device=auto found {gpus[0]}"
            if world_size > len(gpus):
                why += (f"; the mesh has {world_size} ranks and this machine {len(gpus)} GPUs: planned as "
                        f"{world_size} of them (planner.device=... to plan for another GPU)")
    spec = DEVICES[key].copy()
    if key == "cpu":
        spec.memory_gib = cpu_memory_available_gib()
    overrides = pcfg.get("device_overrides", None) if pcfg else None
    if overrides:
        for k, v in OmegaConf.to_container(overrides, resolve=True).items():
            if k in ("matmul_tflops", "peak_tflops") and isinstance(v, dict):
                setattr(spec, k, {**(getattr(spec, k) or {}), **{kk: float(vv) for kk, vv in v.items()}})
            else:
                require(hasattr(spec, k) and k != "sources", f"planner.device_overrides.{k}", "is not a device figure",
                        f"use one of {', '.join(f.name for f in dataclasses.fields(DeviceSpec) if f.name != 'sources')}")
                setattr(spec, k, v if k == "name" else float(v) if k != "devices_per_node" else int(v))
            spec.sources[k] = "config override"
    return spec, f"{key} ({why})"


# ---- the plan ------------------------------------------------------------------------------------
@dataclass
class Collective:
    """One kind of collective per optimizer step, with its predicted time."""

    name: str            # all_reduce | reduce_scatter | all_gather
    what: str            # gradients | parameters
    bytes_per_step: int  # summed over calls (the full, unsharded size for all-gather / reduce-scatter)
    calls: int           # per optimizer step
    ranks: int           # ranks in each group that runs it
    ms: float = float("nan")
    overlappable: bool = False
    axes: tuple[str, ...] = ("dp_replicate", "dp_shard")  # the mesh axes whose ranks take part


@dataclass
class Plan:
    """The prediction for one run (per rank where it says so). All memory in bytes."""

    model: str
    strategy: str
    mesh: str
    world_size: int
    dp: int
    precision: str
    params: int
    tokens_per_step: int
    micro_batch: int             # sequences per rank per micro-step
    seq_len: int
    grad_accum: int
    checkpointed_blocks: int
    model_flops_per_step: float  # PaLM convention (core.metrics), all ranks
    matmul_flops_per_step: float  # executed matmul FLOPs forward+backward, all ranks (FlopCounterMode's count)
    recompute_flops_per_step: float
    memory: dict[str, int]       # per rank, by component
    activations_no_ckpt: int
    activations_with_ckpt: int
    moments: dict[str, int]      # per rank total at end_of_forward, end_of_backward, optimizer_step
    peak_bytes: int
    peak_moment: str
    collectives: list[Collective]
    device: Optional[str]
    device_note: str
    device_memory_gib: Optional[float]  # per device; on the CPU, what the whole machine has available
    ranks_per_memory: int        # ranks sharing that memory (the CPU: every rank of the job)
    time_ms: dict[str, float]    # compute parts, comm, exposed comm, step
    step_time_ms: Optional[float]
    tokens_per_s: Optional[float]
    mfu: Optional[float]
    notes: list[str] = field(default_factory=list)
    # under pipeline parallelism, compared with the run's measured figures: pp_bubble_fraction, pp_activation_gib
    # (the most saved activations of any stage; pp_activation_gib_per_stage each stage's), pp_p2p_mib (the busiest
    # stage's sends and receives per step)
    pipeline: dict[str, float] = field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["peak_mem_gib"] = self.peak_gib
        d["memory_gib"] = {k: v / GIB for k, v in self.memory.items()}
        d["comm_bytes_per_step"] = sum(c.bytes_per_step for c in self.collectives)
        d["comm_ms"] = self.time_ms.get("comm_ms")
        d["exposed_comm_ms"] = self.time_ms.get("exposed_comm_ms")
        d.update(self.pipeline)  # compared with the run's measured bubble, activations and P2P bytes
        tp = [c for c in self.collectives if "tp" in c.axes]
        if tp and self.time_ms:  # inline in the regions: all exposed
            d["tp_comm_ms"] = d["tp_exposed_comm_ms"] = sum(c.ms for c in tp)
        ep = [c for c in self.collectives if {"ep", "edp"} & set(c.axes)]
        if ep and self.time_ms:  # the MoE layers wait for their all-to-alls (planned as exposed), then the experts'
            d["ep_comm_ms"] = d["ep_exposed_comm_ms"] = sum(c.ms for c in ep)  # all-reduce after backward
        cp = [c for c in self.collectives if "cp" in c.axes]
        if cp:  # ring attention's sends per rank (overlapped with the blocks' attention: exposure in the notes)
            d["cp_ring_mib"] = sum(c.bytes_per_step for c in cp) / 2**20
            if self.time_ms:
                d["cp_comm_ms"] = sum(c.ms for c in cp)
        return _finite(d)

    def check_fits(self, cfg: Optional[DictConfig] = None) -> None:
        """Raise `ConfigError` when the predicted peak does not fit the device's memory (the CPU: what the machine
        has available, shared by every rank), naming the keys that set it and the fixes.
        `planner.check_fit=false` in `cfg` skips the check."""
        if cfg is not None and OmegaConf.select(cfg, "planner.check_fit", default=True) is False:
            return
        if self.device_memory_gib is None or not math.isfinite(self.device_memory_gib):
            return
        need = self.peak_gib * self.ranks_per_memory
        if need <= self.device_memory_gib:
            return
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(self.memory.items(), key=lambda kv: -kv[1]) if v)
        fixes = []
        if self.checkpointed_blocks == 0:
            fixes.append("activation_checkpointing=1" + (" with parallelism=torch_fsdp2 (our fsdp cannot recompute)"
                                                          if self.strategy == "fsdp" else ""))
        if self.strategy not in ("fsdp", "torch_fsdp2"):
            fixes.append("a sharded strategy (parallelism=fsdp, torch_fsdp2 or zero1) over more ranks")
        fixes += ["a smaller train.batch_size or more train.grad_accum_steps", "a smaller model=",
                  "planner.device=... if the run is meant for another device",
                  "planner.check_fit=false to run anyway"]
        ranks = f" x {self.ranks_per_memory} ranks" if self.ranks_per_memory > 1 else ""
        raise ConfigError("model/precision/mesh", f"model={self.model} precision={self.precision} "
                          f"parallelism={self.strategy} mesh={self.mesh} needs a predicted {self.peak_gib:.1f} GiB "
                          f"per rank{ranks} at {self.peak_moment} but {self.device} has {self.device_memory_gib:.1f} "
                          f"GiB{' available' if self.device == 'cpu' else ''} ({parts} GiB per rank)",
                          "; or ".join(fixes))

    def format(self) -> str:
        g = lambda b: f"{b / GIB:8.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:8.2f} MiB"  # noqa: E731
        lines = [
            f"plan: {self.model} ({self.params / 1e6:.1f}M params) | {self.strategy} on {self.mesh} "
            f"(world {self.world_size}) | {self.precision}",
            f"  device: {self.device_note}",
            f"  tokens/step {self.tokens_per_step:,} = dp {self.dp} x micro-batch {self.micro_batch} x "
            f"accum {self.grad_accum} x seq {self.seq_len}; checkpointed blocks {self.checkpointed_blocks}",
            f"  model FLOPs/step {self.model_flops_per_step / 1e12:10.3f} TFLOP   (6N + 12LdT, all ranks)",
            f"  matmul FLOPs/step {self.matmul_flops_per_step / 1e12:9.3f} TFLOP   (executed, + recompute "
            f"{self.recompute_flops_per_step / 1e12:.3f})",
            "  memory per rank:",
        ]
        for k, v in self.memory.items():
            lines.append(f"    {k:<24}{g(v)}")
        lines.append(f"    {'activations (no ckpt)':<24}{g(self.activations_no_ckpt)}")
        lines.append(f"    {'activations (ckpt every)':<24}{g(self.activations_with_ckpt)}")
        for k, v in self.moments.items():
            lines.append(f"    at {k:<21}{g(v)}")
        cap = ""
        if self.device_memory_gib and math.isfinite(self.device_memory_gib):
            shared = f" x {self.ranks_per_memory} ranks" if self.ranks_per_memory > 1 else ""
            cap = f"{shared} of {self.device_memory_gib:.1f} GiB{' available' if self.device == 'cpu' else ''}"
        lines.append(f"    {'PEAK':<24}{g(self.peak_bytes)}{cap} ({self.peak_moment})")
        if self.collectives:
            lines.append("  communication per step:")
            for c in self.collectives:
                lines.append(f"    {c.name:<15}{c.what:<11}{c.bytes_per_step / 1e9:9.3f} GB in {c.calls:4d} calls "
                             f"over {c.ranks} ranks {c.ms:9.2f} ms{' (overlappable)' if c.overlappable else ''}")
        if self.step_time_ms is not None:
            lines.append("  time per step (roofline):")
            for k, v in self.time_ms.items():
                lines.append(f"    {k:<24}{v:10.2f}")
            lines.append(f"    => step {self.step_time_ms:.1f} ms, {self.tokens_per_s:,.0f} tokens/s"
                         + (f", MFU {self.mfu:.1%}" if self.mfu is not None else ""))
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


# ---- pieces (public: the tests check each against exact counts) ----------------------------------
def ffn_hidden(m) -> int:
    """Feed-forward hidden units one token computes: d_ff, or a MoE's top_k experts plus its shared expert."""
    return m.d_ff if not getattr(m, "n_experts", 0) else (m.top_k + int(m.shared_expert)) * m.expert_d_ff


def expert_numel(m) -> int:
    """Parameters of one block's routed experts (0 for a dense model): 3-D weights, not nn.Linear ones."""
    return 3 * m.n_experts * m.d_model * m.expert_d_ff if getattr(m, "n_experts", 0) else 0


def linear_shapes(m) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every matmul weight, in forward order. A MoE block lists its router,
    its routed experts as one token's share (`ffn.experts.*`: the top_k experts' hidden units side by side,
    dropless; what the matmuls compute, not what is stored: `expert_numel`) and its shared expert."""
    d, e, f = m.d_model, m.head_dim, m.d_ff
    out = []
    for i in range(m.n_layers):
        out += [(f"blocks.{i}.attn.qkv_proj", d, (m.n_heads + 2 * m.kv_heads) * e),
                (f"blocks.{i}.attn.output_proj", m.n_heads * e, d)]
        if getattr(m, "n_experts", 0):
            kf, fe = m.top_k * m.expert_d_ff, m.expert_d_ff
            out += [(f"blocks.{i}.ffn.router", d, m.n_experts), (f"blocks.{i}.ffn.experts.w1", d, kf),
                    (f"blocks.{i}.ffn.experts.w3", d, kf), (f"blocks.{i}.ffn.experts.w2", kf, d)]
            if m.shared_expert:
                out += [(f"blocks.{i}.ffn.shared.w1", d, fe), (f"blocks.{i}.ffn.shared.w3", d, fe),
                        (f"blocks.{i}.ffn.shared.w2", fe, d)]
        else:
            out += [(f"blocks.{i}.ffn.w1", d, f), (f"blocks.{i}.ffn.w3", d, f), (f"blocks.{i}.ffn.w2", f, d)]
    out.append(("lm_head", d, m.vocab_size))
    return out


def matmul_flops(m, batch: int, seq: int) -> dict[str, float]:
    """Forward and backward matmul FLOPs of one micro-batch, counted the way FlopCounterMode does
    (attention scores over the full T x T, backward = 2x forward)."""
    tokens = batch * seq
    lin = sum(2 * tokens * i * o for _, i, o in linear_shapes(m))
    attn = m.n_layers * 2 * 2 * batch * m.n_heads * seq * seq * m.head_dim  # QK^T and PV
    return {"forward": float(lin + attn), "backward": float(2 * (lin + attn)), "attention_forward": float(attn),
            "linear_forward": float(lin)}


def block_activation_bytes(m, batch: int, seq: int, autocast: bool) -> int:
    """Bytes autograd saves for one TransformerBlock forward (see the module docstring)."""
    B, T, D, F, H = batch, seq, m.d_model, m.d_ff, m.n_heads
    r = m.kv_heads / H
    a = 2 if autocast else 4
    bt, btd, btf = B * T, B * T * D, B * T * F
    norms = 2 * (8 * btd + 4 * bt)
    lin_inputs = 3 * a * btd if autocast else 2 * 4 * btd
    rope = 2 * T * m.head_dim * a
    # q and k after RoPE (new tensors), v is a view that keeps the whole fused qkv output alive
    attn = a * btd + int(r * a * btd) + int((1 + 2 * r) * a * btd) + a * btd + 4 * B * H * T
    oproj = a * btd
    ffn = 4 * a * btf
    if getattr(m, "n_experts", 0):
        ffn = moe_activation_bytes(m, B, T, autocast)
    return int(norms + lin_inputs + rope + attn + oproj + ffn)


def moe_activation_bytes(m, batch: int, seq: int, autocast: bool) -> int:
    """An estimate of what a dropless MoE feed-forward saves beyond its input norm (tested within 10%): per token
    the router's fp32 probabilities and top-k weights, the k copies' int64 indices, each copy's expert input (twice
    cast under autocast), its SwiGLU hidden units (4 tensors like the dense SwiGLU) and output; the shared
    expert like a dense SwiGLU."""
    bt, D, E, k, Fe = batch * seq, m.d_model, m.n_experts, m.top_k, m.expert_d_ff
    a = 2 if autocast else 4
    router = (a * D if autocast else 0) + 4 * E + (4 + 8) * k + 4
    copies = k * ((2 * a if autocast else 4) * D + 4 * a * Fe + a * D + 4 + 2 * 8)
    shared = (2 * a * D if autocast else 0) + 4 * a * Fe if m.shared_expert else 0
    return int(bt * (router + copies + shared))


def head_activation_bytes(m, batch: int, seq: int, autocast: bool, loss_chunk: int = 0) -> int:
    """Saved outside the blocks: token ids, final norm, lm_head input, log-softmax output, the loss's divisor; with
    the chunked head (`loss_chunk` > 0, core/loss.py) one fp32 log-sum-exp per token instead of the last two."""
    B, T, D = batch, seq, m.d_model
    a = 2 if autocast else 4
    loss = 4 * B * T if loss_chunk else 4 * B * T * m.vocab_size + 4
    return 8 * B * T + (8 * B * T * D + 4 * B * T) + a * B * T * D + loss


def tp_block_activation_bytes(m, batch: int, seq: int, autocast: bool, tp: int, sp: bool) -> int:
    """One block's saved bytes on one tensor-parallel rank: what lives inside the attention and MLP regions
    (q, k, v, the attention output, the SwiGLU hidden units, the row-parallel inputs) is split tp ways; the
    region inputs the column-parallel Linears save are whole sequences (gathered); the norms hold T / tp tokens
    with sequence parallelism, all T without."""
    if tp == 1:
        return block_activation_bytes(m, batch, seq, autocast)
    B, T, D = batch, seq, m.d_model
    a = 2 if autocast else 4
    whole = block_activation_bytes(m, batch, seq, autocast)
    norms = 2 * (8 * B * T * D + 4 * B * T)
    region_inputs = 2 * a * B * T * D  # ln1 and ln2 outputs as the qkv and w1/w3 inputs
    rope = 2 * T * m.head_dim * a
    inside = whole - norms - region_inputs - rope
    return int(inside // tp + region_inputs + rope + (norms // tp if sp else norms))


def activation_bytes(m, batch: int, seq: int, autocast: bool, checkpointed_blocks: int = 0, tp: int = 1,
                     sp: bool = False, loss_chunk: int = 0) -> int:
    """Saved-activation bytes at the end of forward (checkpointed blocks keep only their fp32 input), per
    tensor-parallel rank: the LM head's logits split over the vocabulary, checkpointed inputs over the sequence
    with sequence parallelism."""
    blk = tp_block_activation_bytes(m, batch, seq, autocast, tp, sp)
    n_ck = checkpointed_blocks
    seq_part = tp if sp else 1
    ck = n_ck * 4 * batch * seq * m.d_model // seq_part + (8 * seq if n_ck else 0)  # fp32 inputs + positions
    head = head_activation_bytes(m, batch, seq, autocast, loss_chunk)
    if tp > 1:
        logits = 0 if loss_chunk else 4 * batch * seq * m.vocab_size
        final_norm = 8 * batch * seq * m.d_model + 4 * batch * seq
        head += logits // tp - logits + (final_norm // seq_part - final_norm)
    return (m.n_layers - n_ck) * blk + ck + head


def checkpointed_count(n_layers: int, every: int) -> int:
    """Blocks `core.activation_checkpointing.apply` marks: i % every == 0."""
    return 0 if not every else len(range(0, n_layers, every))


def optimizer_state_bytes_per_param(cfg: DictConfig) -> tuple[int, int, str]:
    """(state bytes per fp32 parameter, optimizer-step traffic bytes per parameter, name)."""
    target = str(OmegaConf.select(cfg, "optimizer.factory._target_", default="torch.optim.AdamW"))
    name = target.rsplit(".", 1)[-1].lower()
    fused = OmegaConf.select(cfg, "optimizer.factory.fused", default=None)
    if "adam" in name:
        # fused: read p, g, m, v and write p, m, v; foreach adds intermediate passes
        return 8, (28 if fused is not False else 60), name
    if "sgd" in name:
        momentum = OmegaConf.select(cfg, "optimizer.factory.momentum", default=0.0) or 0.0
        return (4 if momentum else 0), (20 if momentum else 12), name
    return 8, 28, name


def ring_ms(kind: str, nbytes: float, p: int, busbw_gbps: float, latency_us: float) -> float:
    """Ring collective time: all-reduce moves 2(p-1)/p of the buffer per rank, all-gather and
    reduce-scatter (p-1)/p of the full buffer; bus bandwidth as nccl-tests reports it."""
    if p <= 1:
        return 0.0
    if kind == "send_recv":  # point to point (pipeline stages): each byte crosses one link once
        return latency_us / 1e3 + nbytes / (busbw_gbps * 1e9) * 1e3
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    return latency_us / 1e3 + factor * nbytes / (busbw_gbps * 1e9) * 1e3


# ---- plan() ------------------------------------------------------------------------------------
def _strategy(cfg: DictConfig) -> Strategy:
    from hydra.utils import instantiate

    return instantiate(cfg.parallelism)


def model_layout(m, pp: int = 1, pipeline: Any = None) -> ModelLayout:
    """The parameter layout of `TransformerLM(m)`, read off a meta-device instance (no memory); with `pp` > 1, of
    its largest pipeline stage (`pipeline`'s split: its schedule's chunks and its balance; else equal stages)."""
    import torch

    from core.distributed.pipeline import split_stage, uniform_pieces
    from core.model import TransformerLM

    if pp == 1:
        with torch.device("meta"):
            return ModelLayout.of(TransformerLM(m))
    v = getattr(pipeline, "virtual", 1)
    style = getattr(pipeline, "style", "loop")
    bounds = pipeline.piece_bounds(m, pp) if pipeline is not None else uniform_pieces(m.n_layers, pp)
    layouts = []
    for stage in range(pp):
        with torch.device("meta"):
            model = TransformerLM(m)
            split_stage(model, pp, stage, v, style, bounds)
            layouts.append(ModelLayout.of(model))
    return max(layouts, key=lambda lay: lay.numel)


@dataclass
class Job:
    """What the planner reads from a config: model, mesh, strategy and the shape of one step."""

    model: Any                 # core.model.ModelConfig
    mesh: Any                  # core.distributed.mesh.ParallelMesh
    strategy: Strategy
    layout: ModelLayout
    global_batch: int          # sequences per optimizer step, all ranks
    micro_batch: int           # sequences per rank per micro-step
    seq_len: int
    grad_accum: int
    precision: str             # fp32 | bf16 | fp16
    compute_dtype: str         # the dtype matmuls run in: bf16 | fp16 | tf32 | fp32
    checkpointed_blocks: int
    compiled: bool
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: the LM head + loss in chunks of this many tokens (0: off)
    tensor_parallel: Any = None  # core.distributed.tensor_parallel.TensorParallel: how mesh.tp splits the model
    context_parallel: Any = None  # core.distributed.context_parallel.ContextParallel under mesh.cp > 1
    expert_parallel: Any = None  # core.distributed.expert_parallel.ExpertParallel under mesh.ep > 1
    dense_layout: Optional[ModelLayout] = None  # under ep: `layout` without the routed experts (the strategy's part)
    pipeline: Any = None       # core.distributed.pipeline.PipelineParallel under mesh.pp > 1 (micro_batch, grad_accum:
                               # its micro-batches' rows and count)

    @property
    def stage_model(self):
        """The model config one pipeline stage runs (its share of the blocks; the model itself at pp=1)."""
        import dataclasses

        pp = self.mesh.pp
        if pp == 1:
            return self.model
        return dataclasses.replace(self.model, n_layers=self.layout.n_blocks)

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence one rank holds (seq_len / cp under context parallelism)."""
        return self.seq_len // self.mesh.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.mesh.tp > 1 and bool(getattr(self.tensor_parallel, "sequence_parallel", False))

    @property
    def autocast(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def linear_numel(self) -> int:
        # autocast casts a MoE's 3-D expert weights for its matmuls like the Linears' (per expert slice)
        return sum(self.layout.linear_weights) + self.local_expert_numel

    @property
    def local_expert_numel(self) -> int:
        """This rank's routed-expert parameters, all blocks (n_experts / ep of each layer's under ep)."""
        return expert_numel(self.model) * self.layout.n_blocks // self.mesh.ep

    @property
    def block_linear_numel(self) -> int:
        return sum(i * o for n, i, o in linear_shapes(self.model)
                   if n.startswith("blocks.0.") and ".experts." not in n) + expert_numel(self.model)


def read_job(cfg: DictConfig) -> Job:
    from hydra.utils import instantiate

    m = instantiate(cfg.model)
    mesh = instantiate(cfg.mesh)
    dp = mesh.dp_size
    seq = int(OmegaConf.select(cfg, "data.seq_len", default=m.context_length) or m.context_length)
    gbs = int(cfg.train.batch_size)
    accum = int(OmegaConf.select(cfg, "train.grad_accum_steps", default=1) or 1)
    require(gbs % (dp * accum) == 0, "train.batch_size",
            f"{gbs} sequences do not split over dp={dp} ranks x {accum} micro-steps",
            f"make train.batch_size a multiple of {dp * accum}")
    prec = str(OmegaConf.select(cfg, "precision.dtype", default="fp32"))
    tf32 = bool(OmegaConf.select(cfg, "precision.tf32", default=True))
    every = int(OmegaConf.select(cfg, "activation_checkpointing", default=0) or 0)
    tensor_parallel = instantiate(cfg.tensor_parallel) if "tensor_parallel" in cfg else None
    pipeline, micro = None, gbs // (dp * accum)
    if mesh.pp > 1 and "pipeline" in cfg:
        # the pipeline's micro-batches stand in for accumulation micro-steps (grad_accum_steps is 1 under pp)
        pipeline = instantiate(cfg.pipeline)
        pipeline.seq_len = seq  # the per-layer cost a balanced split weighs
        accum = int(pipeline.microbatches)
        require(micro % accum == 0, "pipeline.microbatches", f"{accum} micro-batches do not split {micro} sequences",
                f"choose pipeline.microbatches dividing {micro}")
        micro //= accum
    job = Job(model=m, mesh=mesh, strategy=_strategy(cfg),
               layout=model_layout(m, mesh.pp if pipeline else 1, pipeline).split_over_tp(mesh.tp), global_batch=gbs,
               micro_batch=micro, seq_len=seq, grad_accum=accum, precision=prec,
               compute_dtype=prec if prec in ("bf16", "fp16") else ("tf32" if tf32 else "fp32"),
               checkpointed_blocks=checkpointed_count(m.n_layers, every),
               compiled=bool(OmegaConf.select(cfg, "compile", default=False)), tensor_parallel=tensor_parallel,
               pipeline=pipeline,
               loss_chunk_tokens=int(OmegaConf.select(cfg, "train.loss_chunk_tokens", default=0) or 0))
    if mesh.cp > 1 and "context_parallel" in cfg:
        job.context_parallel = instantiate(cfg.context_parallel)
    if mesh.ep > 1 and m.n_experts and "expert_parallel" in cfg:  # each rank holds n_experts / ep experts per layer
        from core.distributed.expert_parallel import expert_layouts

        job.expert_parallel = instantiate(cfg.expert_parallel)
        job.layout, job.dense_layout = expert_layouts(m, mesh.ep)
    return job


def _per_rank(n: int, ways: int) -> int:
    return -(-n // ways)


@dataclass
class MemoryPrediction:
    components: dict[str, int]   # per rank, by component
    moments: dict[str, int]      # per rank total at end_of_forward, end_of_backward, optimizer_step
    activations_no_ckpt: int
    activations_with_ckpt: int


def predict_memory(job: Job, prof: StrategyProfile, cfg: DictConfig) -> MemoryPrediction:
    """Bytes per rank by component, and at each moment a step can peak."""
    m, mb, seq = job.model, job.micro_batch, job.local_seq  # a cp rank holds its tokens' activations only
    N = job.layout.numel
    st_bytes, opt_traffic, _ = optimizer_state_bytes_per_param(cfg)
    params_b = 4 * _per_rank(N, prof.shard_degree(job.mesh, "params"))
    grads_b = 4 * _per_rank(N, prof.shard_degree(job.mesh, "grads"))
    opt_local = _per_rank(N, prof.shard_degree(job.mesh, "optimizer"))
    if job.dense_layout is not None and prof.shard_degree(job.mesh, "optimizer") > 1:  # ZeRO-1 under ep: a rank
        opt_local = _per_rank(job.dense_layout.numel, prof.shard_degree(job.mesh, "optimizer")) + N \
            - job.dense_layout.numel  # steps its own experts whole
    opt_b = st_bytes * opt_local
    every = int(OmegaConf.select(cfg, "activation_checkpointing", default=0) or 0)
    tp, sp = job.mesh.tp, job.sequence_parallel
    # a pipeline stage saves its blocks' activations for every micro-batch in flight (GPipe m, 1F1B at most p)
    sm, held = job.stage_model, _in_flight(job)
    lc = job.loss_chunk_tokens
    act_full = held * activation_bytes(sm, mb, seq, job.autocast, 0, tp, sp, lc)
    act_ck = held * activation_bytes(sm, mb, seq, job.autocast, checkpointed_count(sm.n_layers, every or 1), tp, sp,
                                     lc)
    act = held * activation_bytes(sm, mb, seq, job.autocast, checkpointed_count(sm.n_layers, every), tp, sp, lc) \
        if job.pipeline is not None else activation_bytes(m, mb, seq, job.autocast, job.checkpointed_blocks, tp, sp,
                                                          lc)
    # vocabulary-parallel logits: of every token, or of one chunk of tokens with the chunked head
    BTV = min(lc or mb * seq, mb * seq) * m.vocab_size // tp
    loss_transient = (2 if job.autocast else 0) * BTV + 4 * BTV  # logits (compute dtype) + their fp32 copy
    if lc:  # the chunked backward also holds the head's fp32 weight-gradient sum and one chunk's product with h
        loss_transient += ((2 if job.autocast else 0) + 4) * m.vocab_size // tp * m.d_model
    # autocast's low-precision weight copies: the cache holds every cast weight until autocast exits
    # (end of forward); autograd keeps those of non-checkpointed blocks (and lm_head) until their backward.
    if job.autocast and prof.autocast_weight_copies:
        wcopy_fwd = 2 * job.linear_numel
        wcopy_saved = 2 * (job.linear_numel - job.checkpointed_blocks * job.block_linear_numel)
    else:
        wcopy_fwd = wcopy_saved = 0
    gather_b = prof.gathered_param_bytes
    static = params_b + opt_b + prof.comm_buffer_bytes + prof.compute_copy_bytes
    grads_during_fwd = grads_b if job.grad_accum > 1 else 0  # earlier micro-steps' gradients
    # a checkpointed block's backward first recomputes its forward: one block's activations on top of what is saved
    # (after the head's backward, so not at the same time as the loss's transient)
    n_ck_stage = checkpointed_count(sm.n_layers, every) if job.pipeline is not None else job.checkpointed_blocks
    recompute = tp_block_activation_bytes(sm, mb, seq, job.autocast, tp, sp) if n_ck_stage else 0
    end_fwd = static + grads_during_fwd + gather_b + max(wcopy_fwd + act,
                                                         wcopy_saved + act + max(loss_transient, recompute))
    grads_extra = 0 if prof.grads_in_comm_buffer else grads_b
    end_bwd = static + grads_extra + prof.backward_transient_bytes + gather_b
    opt_transient = 0 if opt_traffic <= 28 else 4 * opt_local  # foreach intermediates
    opt_step = static + grads_extra + opt_transient + prof.step_transient_bytes
    return MemoryPrediction(
        components={"parameters": params_b, "gradients": grads_b, "optimizer_state": opt_b, "activations": act,
                    "autocast_weight_copies": wcopy_fwd, "compute_weight_copies": prof.compute_copy_bytes,
                    "gathered_parameters": gather_b, "comm_buffers": prof.comm_buffer_bytes,
                    "transients": max(loss_transient, recompute, prof.backward_transient_bytes, opt_transient,
                                      prof.step_transient_bytes)},
        moments={"end_of_forward": int(end_fwd), "end_of_backward": int(end_bwd), "optimizer_step": int(opt_step)},
        activations_no_ckpt=act_full, activations_with_ckpt=act_ck)


def _in_flight(job: Job) -> int:
    if job.pipeline is None:
        return 1
    from core.distributed.pipeline import in_flight

    return in_flight(job.pipeline.schedule, job.mesh.pp, job.grad_accum, getattr(job.pipeline, "virtual", 1))


def stage_activation_bytes(job: Job, stage: int) -> int:
    """Saved-activation bytes of pipeline stage `stage` at its peak: its micro-batches in flight
    (`held_micro_batches`: GPipe m, 1F1B p - r, ...) times one micro-batch's bytes through its blocks, with the
    token ids on the stage that embeds and the final norm, head and loss on the one that has the head."""
    from core.distributed.pipeline import held_micro_batches, stage_layers, stage_of

    m, p, pipe = job.model, job.mesh.pp, job.pipeline
    v, style = getattr(pipe, "virtual", 1), getattr(pipe, "style", "loop")
    blocks = len(stage_layers(m.n_layers, p, stage, v, style, pipe.piece_bounds(m, p)))
    every = job.checkpointed_blocks and m.n_layers // max(job.checkpointed_blocks, 1)
    sm = dataclasses.replace(m, n_layers=blocks)
    mb, seq = job.micro_batch, job.local_seq  # a cp rank holds its seq/cp tokens
    one = activation_bytes(sm, mb, seq, job.autocast, checkpointed_count(blocks, every), job.mesh.tp,
                           job.sequence_parallel, job.loss_chunk_tokens)
    head = head_activation_bytes(m, mb, seq, job.autocast, job.loss_chunk_tokens)
    tokens = 8 * mb * seq
    if stage != stage_of(p * v - 1, p, style):
        one -= head - tokens
    if stage != stage_of(0, p, style):
        one -= tokens
    return int(one * held_micro_batches(pipe.schedule, p, job.grad_accum, v, stage))


def pipeline_bubble(job: Job) -> float:
    """The idle share of a step with equal stages (`core.distributed.pipeline.bubble_fraction`: GPipe / 1F1B
    (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1)); 0 without a pipeline."""
    if job.pipeline is None:
        return 0.0
    from core.distributed.pipeline import bubble_fraction

    return bubble_fraction(job.mesh.pp, job.grad_accum, job.pipeline.schedule, getattr(job.pipeline, "virtual", 1))


def predict_communication(job: Job, prof: StrategyProfile, spec: Optional[DeviceSpec]) -> list[Collective]:
    """The strategy's and the tensor parallelism's collectives per step, each timed on a ring when the device's
    bandwidths are known."""
    colls = []
    # stages pass seq/cp tokens under cp, and under sequence parallelism each tp rank passes its seq/tp of them
    stage_seq = job.local_seq // job.mesh.tp if job.sequence_parallel else job.local_seq
    p2p = [] if job.pipeline is None else job.pipeline.collectives(job.mesh, job.model, job.micro_batch * job.grad_accum,
                                                                    stage_seq)
    axes = tensor_parallel_collectives(job) + context_parallel_collectives(job) + expert_parallel_collectives(job)
    for c in list(prof.collectives) + axes + p2p:
        ranks = axes_degree(job.mesh, c.axes)
        coll = Collective(c.name, c.what, c.bytes_per_step, c.calls, ranks, overlappable=c.overlappable,
                          axes=tuple(c.axes))
        if spec is not None and spec.has_ceilings:
            nodes = max(1, math.ceil(job.mesh.world_size / spec.devices_per_node))
            busbw = spec.intra_busbw_gbps if nodes == 1 else spec.inter_busbw_gbps
            coll.ms = ring_ms(c.name, c.bytes_per_step / max(c.calls, 1), ranks, busbw,
                              spec.collective_latency_us) * c.calls
        colls.append(coll)
    return colls


def expert_parallel_collectives(job: Job) -> list:
    """The ep axis's all-to-alls (dispatch and combine, forward and backward) and the expert gradients' all-reduce
    over the ranks holding the same experts, as the plugin describes them (dropless, even routing)."""
    if job.expert_parallel is None:
        return []
    return job.expert_parallel.collectives(job.mesh, job.model, job.micro_batch, job.seq_len, 2 if job.autocast else 4,
                                           job.grad_accum, job.checkpointed_blocks)


def ring_attention_note(job: Job, colls: list[Collective], spec: Optional[DeviceSpec]) -> str:
    """Ring attention's bytes per step and whether one K/V block's transfer hides under the block attention a
    ring step computes beside it (an off-diagonal step: 2c queries x c keys, or c x 2c, with c = seq / 2cp)."""
    m, mesh = job.model, job.mesh
    ring = sum(c.bytes_per_step for c in colls if "cp" in c.axes)
    line = f"context parallelism: cp={mesh.cp} ring attention sends {ring / 2**20:.2f} MiB per rank per step"
    if spec is None or not spec.has_ceilings:
        return line
    c = job.seq_len // (2 * mesh.cp)
    kv_bytes = 2 * job.micro_batch * (m.kv_heads // mesh.tp) * 2 * c * m.head_dim * (2 if job.autocast else 4)
    send_ms = ring_ms("send_recv", kv_bytes, 2, spec.intra_busbw_gbps, spec.collective_latency_us)
    peak = spec.matmul_tflops.get(job.compute_dtype, spec.matmul_tflops.get("fp32")) * 1e12
    block_ms = 4 * job.micro_batch * (m.n_heads // mesh.tp) * 2 * c * c * m.head_dim \
        / (peak * spec.attention_efficiency) * 1e3
    verdict = "hidden" if send_ms <= block_ms else f"exposed ({send_ms - block_ms:.3f} ms per ring step)"
    return (f"{line}; one K/V block ({kv_bytes / 2**20:.2f} MiB) takes {send_ms:.3f} ms to send against "
            f"{block_ms:.3f} ms of forward block attention: {verdict}")


def context_parallel_collectives(job: Job) -> list:
    """The cp axis's ring-attention sends of one optimizer step per rank (the plugin describes them; under pipeline
    parallelism, of one stage's blocks)."""
    if job.context_parallel is None:
        return []
    return job.context_parallel.collectives(job.mesh, job.stage_model, job.micro_batch, job.seq_len,
                                            2 if job.autocast else 4, job.grad_accum, job.checkpointed_blocks)


def tensor_parallel_collectives(job: Job) -> list:
    """The tp axis's collectives of one optimizer step (the plugin describes them; under pipeline parallelism, of
    one stage's blocks)."""
    if job.mesh.tp == 1 or job.tensor_parallel is None:
        return []
    return job.tensor_parallel.collectives(job.mesh, job.stage_model, job.micro_batch, job.local_seq,
                                           2 if job.autocast else 4, job.grad_accum, job.checkpointed_blocks)


def head_recompute_flops(job: Job) -> float:
    """The chunked head's backward recomputes its logits: one more LM-head matmul per micro-step (0 without it)."""
    return 2.0 * job.micro_batch * job.seq_len * job.model.d_model * job.model.vocab_size if job.loss_chunk_tokens \
        else 0.0


def predict_time(job: Job, prof: StrategyProfile, colls: list[Collective], spec: DeviceSpec,
                 cfg: DictConfig) -> dict[str, float]:
    """The roofline step time, its parts and the exposed communication (ms); the device must have ceilings."""
    m, mb, seq, accum = job.model, job.micro_batch, job.seq_len, job.grad_accum
    N, dp = job.layout.numel, job.mesh.dp_size
    _, opt_traffic, _ = optimizer_state_bytes_per_param(cfg)
    fl = matmul_flops(m, mb, seq)
    n_ck = job.checkpointed_blocks
    blk_fwd = (fl["linear_forward"] - 2 * mb * seq * m.d_model * m.vocab_size) / m.n_layers \
        + fl["attention_forward"] / m.n_layers
    peak = spec.matmul_tflops.get(job.compute_dtype, spec.matmul_tflops.get("fp32")) * 1e12
    bw = spec.hbm_gbps * 1e9
    lin_fl = fl["linear_forward"] * 3
    attn_fl = fl["attention_forward"] * 3 * 0.5  # causal kernels skip the masked half
    tp = job.mesh.tp  # each tensor-parallel rank runs 1/tp of every matmul
    matmul_ms = (lin_fl + n_ck * blk_fwd + head_recompute_flops(job)) / peak * 1e3 * accum / tp
    attn_ms = attn_fl / (peak * spec.attention_efficiency) * 1e3 * accum / tp
    # elementwise traffic per block (bytes per BTD / BTF element, forward; backward ~2x):
    # norms 56, linear-input casts 18 (autocast), RoPE 32, residual adds 20, transposes 4; SwiGLU 10/BTF
    btd, btf = mb * seq * m.d_model, mb * seq * ffn_hidden(m)
    fwd_elem = (130 if job.autocast else 112) * btd + 10 * btf
    elem_bytes = m.n_layers * fwd_elem * 3 + n_ck * fwd_elem + 30 * mb * seq * m.vocab_size
    wcast = 0
    if job.autocast:
        n_lin = job.linear_numel
        # weights fp32->bf16 each forward, weight grads bf16->fp32 each backward; a strategy that casts its
        # own copies (sharded or compute_dtype) casts its shard once and the gradients up for the reduction
        wcast = 6 * n_lin * 2 if prof.autocast_weight_copies else 6 * _per_rank(n_lin, dp) + 6 * n_lin
    if job.compiled:
        elem_bytes *= 0.4
    if tp > 1:  # the regions' elementwise work splits tp ways; the norms' and residuals' only with SP (~half)
        elem_bytes *= 1 / tp if job.sequence_parallel else 0.5 + 0.5 / tp
    elem_ms = (elem_bytes + wcast) / bw * 1e3 * accum
    opt_ms = (opt_traffic * _per_rank(N, prof.shard_degree(job.mesh, "optimizer"))
              + 12 * _per_rank(N, prof.shard_degree(job.mesh, "grads"))) / bw * 1e3  # step + clip (norm, scale)
    kernels = m.n_layers * (170 if not job.compiled else 40) * accum + 50
    floor_ms = kernels * spec.kernel_floor_us / 1e3
    if job.pipeline is not None:
        # a stage runs 1/pp of every micro-batch's layers, and waits the bubble: busy m of m + p - 1 slots
        stretch = 1 / job.mesh.pp / (1 - pipeline_bubble(job))
        matmul_ms, attn_ms, elem_ms, floor_ms = (x * stretch for x in (matmul_ms, attn_ms, elem_ms, floor_ms))
    # context parallelism: a rank runs its seq/cp tokens' share of every matmul and (load-balanced) of attention
    matmul_ms, attn_ms, elem_ms = (x / job.mesh.cp for x in (matmul_ms, attn_ms, elem_ms))
    compute_ms = matmul_ms + attn_ms + elem_ms + opt_ms + floor_ms + prof.copy_bytes_per_step / bw * 1e3
    comm_ms = sum(c.ms for c in colls)
    # an overlapped collective runs beside compute: the compute stream waits only for what compute
    # cannot cover (at least the last call); the covered part still slows compute by (1 - efficiency)
    exposed = slowdown = 0.0
    cover = matmul_ms + attn_ms + elem_ms  # forward and backward compute (FSDP gathers overlap both)
    for c in colls:
        if c.overlappable:
            last = c.ms / max(c.calls, 1)
            covered = min(c.ms - last, cover)
            cover -= covered
            exposed += c.ms - covered
            slowdown += (1 - spec.overlap_efficiency) * covered
        else:
            exposed += c.ms
    return {"matmul_ms": matmul_ms, "attention_ms": attn_ms, "elementwise_ms": elem_ms, "optimizer_ms": opt_ms,
            "kernel_floor_ms": floor_ms, "compute_ms": compute_ms, "comm_ms": comm_ms, "exposed_comm_ms": exposed,
            "overlap_slowdown_ms": slowdown, "step_ms": compute_ms + exposed + slowdown,
            **({"pp_bubble_fraction": pipeline_bubble(job)} if job.pipeline is not None else {})}


def plan(cfg: DictConfig) -> Plan:
    """Predict memory, communication and step time for the composed config `cfg` (touches no GPU)."""
    job = read_job(cfg)
    m, mesh = job.model, job.mesh
    # under ep the strategy broadcasts and reduces the dense parameters only (the plugin reduces the experts)
    prof = job.strategy.profile(mesh, job.dense_layout or job.layout, job.grad_accum)
    notes: list[str] = []
    if type(job.strategy).profile is Strategy.profile and job.strategy.data_parallel and mesh.dp_size > 1:
        notes.append(f"strategy {job.strategy.name!r} does not describe itself (Strategy.profile): "
                     "planned without sharding or communication")
    memory = predict_memory(job, prof, cfg)
    spec, dev_note = device_spec(cfg, mesh.world_size)
    colls = predict_communication(job, prof, spec)
    fl = matmul_flops(m, job.micro_batch, job.seq_len)
    micro_steps = mesh.dp_size * job.grad_accum  # all ranks
    blk_fwd = (fl["linear_forward"] - 2 * job.micro_batch * job.seq_len * m.d_model * m.vocab_size) / m.n_layers \
        + fl["attention_forward"] / m.n_layers
    from core.metrics import model_flops_per_token

    causal = bool(OmegaConf.select(cfg, "metrics.causal_attention_flops", default=False))
    tokens = job.global_batch * job.seq_len
    model_flops = model_flops_per_token(m, job.seq_len, causal) * tokens
    time_ms: dict[str, float] = {}
    step_ms = tps = mfu = None
    if spec is not None and spec.has_ceilings:
        time_ms = predict_time(job, prof, colls, spec, cfg)
        step_ms = time_ms["step_ms"]
        tps = tokens / (step_ms / 1e3)
        pk = (spec.peak_tflops or {}).get(job.compute_dtype)
        mfu = model_flops / (step_ms / 1e3) / (pk * 1e12 * mesh.world_size) if pk else None
    elif spec is not None:
        notes.append(f"{spec.name}: the device table has no measured ceilings for it, so no step-time prediction "
                     "(planner.device_overrides can supply them)")
    else:
        notes.append(dev_note)
    if job.pipeline is not None:
        notes.append(f"pipeline: {mesh.pp} stages, {job.pipeline.schedule}, {job.grad_accum} micro-batches of "
                     f"{job.micro_batch} sequences: bubble {pipeline_bubble(job):.2f}; memory is the "
                     f"last stage's, activations of {_in_flight(job)} micro-batches in flight")
    if job.expert_parallel is not None:
        a2a = sum(c.bytes_per_step for c in colls if c.name == "all_to_all" and c.what != "expert counts")
        notes.append(f"expert parallelism: ep={mesh.ep}, each rank holds {m.n_experts // mesh.ep} of {m.n_experts} "
                     f"experts per layer; all-to-all {a2a / 2**20:.1f} MiB per rank per step (dispatch + combine, "
                     "forward + backward, dropless; under even routing each rank computes top_k experts' FLOPs for "
                     "as many copies as it routes)")
    if job.context_parallel is not None:
        notes.append(ring_attention_note(job, colls, spec))
    if job.autocast and prof.autocast_weight_copies:
        notes.append("autocast keeps a bf16 copy of every linear weight until its backward "
                     f"({2 * job.linear_numel / GIB:.2f} GiB)")
    peak_moment = max(memory.moments, key=memory.moments.get)
    on_cpu = spec is not None and spec.name == "cpu"
    return Plan(model=m.name, strategy=job.strategy.name, mesh=mesh.describe(), world_size=mesh.world_size,
                dp=mesh.dp_size, precision=job.precision, params=job.layout.numel, tokens_per_step=tokens,
                micro_batch=job.micro_batch, seq_len=job.seq_len, grad_accum=job.grad_accum,
                checkpointed_blocks=job.checkpointed_blocks, model_flops_per_step=model_flops,
                matmul_flops_per_step=(fl["forward"] + fl["backward"]) * micro_steps,
                recompute_flops_per_step=(job.checkpointed_blocks * blk_fwd + head_recompute_flops(job)) * micro_steps,
                memory=memory.components, activations_no_ckpt=memory.activations_no_ckpt,
                activations_with_ckpt=memory.activations_with_ckpt, moments=memory.moments,
                peak_bytes=max(memory.moments.values()), peak_moment=peak_moment, collectives=colls,
                device=None if spec is None else spec.name, device_note=dev_note,
                device_memory_gib=None if spec is None else spec.memory_gib,
                ranks_per_memory=mesh.world_size if on_cpu else 1, time_ms=time_ms, step_time_ms=step_ms,
                tokens_per_s=tps, mfu=mfu, notes=notes,
                pipeline={} if job.pipeline is None else {
                    "pp_bubble_fraction": pipeline_bubble(job),
                    "pp_activation_gib": max(stage_activation_bytes(job, r) for r in range(mesh.pp)) / GIB,
                    "pp_activation_gib_per_stage": [stage_activation_bytes(job, r) / GIB for r in range(mesh.pp)],
                    "pp_p2p_mib": sum(c.bytes_per_step for c in colls if c.name == "send_recv") / 2**20})


# ---- prediction against measurement ------------------------------------------------------------------
def relative_error(predicted: Any, measured: Any) -> Optional[float]:
    """(predicted - measured) / measured: positive when the planner over-predicts. The one sign everywhere."""
    if isinstance(predicted, (int, float)) and isinstance(measured, (int, float)) and measured:
        return (predicted - measured) / measured
    return None


def measured_peak_memory_gib(summary: dict[str, Any]) -> Optional[float]:
    """The run's peak tensor memory per rank (the GPU allocator's peak), or None on the CPU: there the only
    figure is the process's RSS (interpreter, libraries, allocator caches), which is not tensor bytes."""
    if str(summary.get("device", "cpu")) == "cpu" or "gpu_peak_allocated_gib" not in summary:
        return None
    return summary.get("peak_mem_gib")


def predicted_vs_measured(plan_dict: dict[str, Any], summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Side-by-side numbers for the end of a run (and the sweep report); error = `relative_error`."""
    out = {}
    keys = ("step_time_ms", "tokens_per_s", "peak_mem_gib", "mfu", "comm_ms", "exposed_comm_ms")
    # under pipeline parallelism: the bubble, the activations saved at once, the point-to-point bytes of a step
    keys += tuple(k for k in ("pp_bubble_fraction", "pp_activation_gib", "pp_p2p_mib") if plan_dict.get(k) is not None)
    for k in keys:
        p = plan_dict.get(k)
        meas = measured_peak_memory_gib(summary) if k == "peak_mem_gib" else summary.get(k)
        out[k] = {"predicted": p, "measured": meas, "error": relative_error(p, meas)}
    return out


def format_comparison(plan_dict: dict[str, Any], summary: dict[str, Any]) -> str:
    rows = ["predicted vs measured (error = (predicted - measured) / measured):"]
    for k, v in predicted_vs_measured(plan_dict, summary).items():
        f = lambda x: "-" if x is None else (f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}")  # noqa: E731
        e = "" if v["error"] is None else f"  ({v['error']:+.0%})"
        rows.append(f"  {k:<16}{f(v['predicted']):>14}{f(v['measured']):>14}{e}")
    if measured_peak_memory_gib(summary) is None:
        rows.append("  (peak memory is not measured on the CPU: process RSS is not tensor bytes)")
    return "\n".join(rows)


def plan_or_none(cfg: DictConfig) -> Optional[Plan]:
    """`plan(cfg)`, or None when the config is outside what the planner models (never blocks a run)."""
    try:
        return plan(cfg)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        print(f"[scalelab] planner skipped: {type(e).__name__}: {e}", flush=True)
        return None
