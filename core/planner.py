"""The planner: a prediction for every run, made before anything starts.

`plan(cfg) -> Plan` reads the composed config and predicts, per rank:

  * parameter count and FLOPs per step (the PaLM model FLOPs that MFU uses, and the matmul
    FLOPs the hardware executes: what `torch.utils.flop_counter.FlopCounterMode` counts);
  * memory, broken into parameters, gradients, optimizer state, saved activations (with and
    without activation checkpointing), autocast's low-precision weight copies, communication
    buffers and transients, evaluated at the three moments a step can peak (end of forward,
    end of backward, optimizer step);
  * communication volume per step per collective and its time on a ring;
  * a step time from a roofline (matmul FLOPs at the measured matmul ceiling, elementwise
    traffic at the measured memory bandwidth, a per-kernel floor) plus the exposed part of
    the communication.

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
fused AdamW, eager. Measured: single 54.2 GiB / 138.5 ms, torch DDP 66.9 GiB / 174.4 ms,
torch FSDP2 28.6 GiB / 160.9 ms; and every strategy's step time in docs/results/dp_bench_xl_2xh200.md.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError, require

GIB = 2**30


# ---- device ceilings --------------------------------------------------------------------------
@dataclass
class DeviceSpec:
    """Ceilings one device reaches; every figure says where it came from (measured / datasheet / estimate)."""

    name: str
    memory_gib: float                  # what torch can allocate (total minus context), per device
    matmul_tflops: dict[str, float]    # dense matmul ceiling per compute dtype
    hbm_gbps: float                    # memory bandwidth reached by large copies
    intra_busbw_gbps: float            # NCCL all-reduce bus bandwidth between GPUs of one node
    inter_busbw_gbps: float            # ... across nodes (per GPU)
    collective_latency_us: float       # fixed cost of one collective
    kernel_floor_us: float             # fixed cost of one eager kernel (launch + tail)
    attention_efficiency: float        # fraction of the matmul ceiling fused attention reaches
    overlap_efficiency: float          # fraction of an overlapped collective's time that costs nothing
    #                                    (the rest slows the compute it runs beside: SMs and HBM are shared)
    gpus_per_node: int = 8
    sources: dict[str, str] = field(default_factory=dict)


DEVICES: dict[str, DeviceSpec] = {
    "h100_sxm": DeviceSpec(
        name="NVIDIA H100 80GB HBM3", memory_gib=79.1,
        matmul_tflops={"bf16": 760.0, "fp16": 760.0, "tf32": 378.0, "fp32": 51.0},
        hbm_gbps=3000.0, intra_busbw_gbps=340.0, inter_busbw_gbps=45.0, collective_latency_us=45.0,
        kernel_floor_us=3.0, attention_efficiency=0.5, overlap_efficiency=0.4,
        sources={"matmul_tflops.bf16": "measured 737-798 TFLOP/s (bf16 GEMM, 8k cube)",
                 "matmul_tflops.tf32": "estimate: datasheet 494.5 x 0.77 (bf16 measured/datasheet ratio)",
                 "matmul_tflops.fp32": "estimate: datasheet 66.9 x 0.77",
                 "hbm_gbps": "measured ~3.0 TB/s device copy (datasheet 3.35)",
                 "intra_busbw_gbps": "estimate: as the H200 pair's measured figure (NVLink4, 450 GB/s/direction)",
                 "inter_busbw_gbps": "datasheet 400 Gb/s InfiniBand NDR per GPU, x0.9",
                 "kernel_floor_us": "calibrated on the 2x H200 xl reference (see docs/planner.md)",
                 "overlap_efficiency": "calibrated: our ddp_bucketed on 2x H200 waited 1.1 ms but its step grew "
                                       "by ~35% of its isolated all-reduce time (docs/results/dp_bench_xl_2xh200.md)",
                 "collective_latency_us": "measured: ddp_naive's 291 all-reduces cost 14 ms more than ddp_flat's one"}),
    "h200": DeviceSpec(
        name="NVIDIA H200", memory_gib=139.8,
        matmul_tflops={"bf16": 788.0, "fp16": 788.0, "tf32": 394.0, "fp32": 52.0},
        hbm_gbps=4300.0, intra_busbw_gbps=350.0, inter_busbw_gbps=45.0, collective_latency_us=45.0,
        kernel_floor_us=3.0, attention_efficiency=0.5, overlap_efficiency=0.4,
        sources={"matmul_tflops.bf16": "measured 788 TFLOP/s (bf16 GEMM)",
                 "matmul_tflops.tf32": "estimate: half the bf16 figure",
                 "matmul_tflops.fp32": "estimate: datasheet 66.9 x 0.78",
                 "hbm_gbps": "measured ~4.3 TB/s device copy (datasheet 4.8)",
                 "intra_busbw_gbps": "measured: ddp_flat's 13.6 GB all-reduce in 38.9 ms (nccl-tests 360-400)",
                 "inter_busbw_gbps": "datasheet 400 Gb/s InfiniBand NDR per GPU, x0.9",
                 "kernel_floor_us": "calibrated on the 2x H200 xl reference (see docs/planner.md)",
                 "overlap_efficiency": "calibrated: our ddp_bucketed on 2x H200 waited 1.1 ms but its step grew "
                                       "by ~35% of its isolated all-reduce time (docs/results/dp_bench_xl_2xh200.md)",
                 "collective_latency_us": "measured: ddp_naive's 291 all-reduces cost 14 ms more than ddp_flat's one"}),
    "a100_80gb": DeviceSpec(
        name="NVIDIA A100-SXM4-80GB", memory_gib=79.1,
        matmul_tflops={"bf16": 312.0 * 0.8, "fp16": 312.0 * 0.8, "tf32": 156.0 * 0.8, "fp32": 19.5 * 0.8},
        hbm_gbps=1700.0, intra_busbw_gbps=230.0, inter_busbw_gbps=22.0, collective_latency_us=20.0,
        kernel_floor_us=3.0, attention_efficiency=0.5, overlap_efficiency=0.0,
        sources={"*": "estimate: datasheet x 0.8 (not measured here)"}),
    "cpu": DeviceSpec(
        name="cpu", memory_gib=float("inf"),
        matmul_tflops={"bf16": 0.05, "fp16": 0.05, "tf32": 0.1, "fp32": 0.1},
        hbm_gbps=10.0, intra_busbw_gbps=2.0, inter_busbw_gbps=1.0, collective_latency_us=200.0,
        kernel_floor_us=15.0, attention_efficiency=0.5, overlap_efficiency=0.0, gpus_per_node=1,
        sources={"*": "estimate: a 2-core CI machine, gloo over loopback; CPU predictions are rough"}),
}


def detect_device() -> tuple[Optional[str], str]:
    """(table key, description) of this machine's GPU, found through nvidia-smi (no CUDA context)."""
    if shutil.which("nvidia-smi") is None:
        return "cpu", "no nvidia-smi: planning for the CPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi failed: {e}"
    if not out:
        return "cpu", "nvidia-smi lists no GPU: planning for the CPU"
    name = out[0].strip().lower()
    if "h200" in name:
        return "h200", out[0].strip()
    if "h100" in name and "pcie" not in name:
        return "h100_sxm", out[0].strip()
    if "a100" in name and "80" in name:
        return "a100_80gb", out[0].strip()
    return None, out[0].strip()


def device_spec(cfg: DictConfig) -> tuple[Optional[DeviceSpec], str]:
    """The device table entry the plan uses: `planner.device` (auto | a key), then `planner.device_overrides`."""
    pcfg = OmegaConf.select(cfg, "planner", default=None) or {}
    want = pcfg.get("device", "auto") if pcfg else "auto"
    mesh_dev = OmegaConf.select(cfg, "mesh.device", default="auto")
    if want in (None, "auto"):
        if mesh_dev == "cpu":
            key, why = "cpu", "mesh.device=cpu"
        else:
            key, why = detect_device()
    else:
        require(want in DEVICES, "planner.device", f"no device-table entry {want!r}",
                f"use planner.device=auto or one of {', '.join(DEVICES)}")
        key, why = want, "planner.device"
    if key is None:
        return None, (f"{why!r} is not in the planner's device table: no time or fit prediction "
                      f"(set planner.device to one of {', '.join(DEVICES)})")
    spec = dataclasses.replace(DEVICES[key], matmul_tflops=dict(DEVICES[key].matmul_tflops),
                               sources=dict(DEVICES[key].sources))
    overrides = pcfg.get("device_overrides", None) if pcfg else None
    if overrides:
        for k, v in OmegaConf.to_container(overrides, resolve=True).items():
            if k == "matmul_tflops" and isinstance(v, dict):
                spec.matmul_tflops.update({kk: float(vv) for kk, vv in v.items()})
            else:
                require(hasattr(spec, k), f"planner.device_overrides.{k}", "is not a device figure",
                        f"use one of {', '.join(f.name for f in dataclasses.fields(DeviceSpec))}")
                setattr(spec, k, type(getattr(spec, k))(v))
            spec.sources[k] = "config override"
    return spec, f"{key} ({why})"


# ---- strategy profiles -------------------------------------------------------------------------
@dataclass(frozen=True)
class StrategyProfile:
    """What a parallelism scheme shards, what it sends, and whether its sends overlap backward."""

    shard_params: bool = False
    shard_grads: bool = False
    shard_optimizer: bool = False
    grad_comm: str = "none"            # none | all_reduce | reduce_scatter
    param_comm: str = "none"           # none | all_gather_after_step | all_gather_per_layer
    per_tensor: bool = False           # one collective per parameter tensor
    bucketed: bool = False             # buckets of `bucket_size_mb` (ours) or 25 MB (torch DDP)
    overlaps: bool = False             # communication launched during backward
    persistent_grad_buffer: bool = False  # a full-size gradient buffer that stays allocated (torch DDP)
    flat_transient: bool = False       # a full-size flat copy of the gradients at the end of backward
    mixed_precision_params: bool = False  # all-gathers compute-dtype params (no autocast weight copies)


PROFILES: dict[str, StrategyProfile] = {
    "none": StrategyProfile(),
    "ddp_naive": StrategyProfile(grad_comm="all_reduce", per_tensor=True),
    "ddp_flat": StrategyProfile(grad_comm="all_reduce", flat_transient=True),
    "ddp_overlap": StrategyProfile(grad_comm="all_reduce", per_tensor=True, overlaps=True),
    "ddp_bucketed": StrategyProfile(grad_comm="all_reduce", bucketed=True, overlaps=True),
    "zero1": StrategyProfile(shard_optimizer=True, grad_comm="all_reduce", param_comm="all_gather_after_step",
                             bucketed=True, overlaps=True),
    "zero1_rs": StrategyProfile(shard_optimizer=True, shard_grads=True, grad_comm="reduce_scatter",
                                param_comm="all_gather_after_step"),
    "fsdp": StrategyProfile(shard_params=True, shard_grads=True, shard_optimizer=True, grad_comm="reduce_scatter",
                            param_comm="all_gather_per_layer", overlaps=True),
    "torch_ddp": StrategyProfile(grad_comm="all_reduce", bucketed=True, overlaps=True, persistent_grad_buffer=True),
    "torch_fsdp2": StrategyProfile(shard_params=True, shard_grads=True, shard_optimizer=True,
                                   grad_comm="reduce_scatter", param_comm="all_gather_per_layer", overlaps=True,
                                   mixed_precision_params=True),
}


def strategy_name(cfg: DictConfig) -> str:
    """The strategy's `name` (from its class, without instantiating it)."""
    pcfg = cfg.parallelism
    if "name" in pcfg and pcfg.name:
        return str(pcfg.name)
    from hydra.utils import get_class

    name = str(getattr(get_class(pcfg._target_), "name", pcfg._target_.rsplit(".", 1)[-1]))
    if name == "zero1" and pcfg.get("grad_reduction", "all_reduce") == "reduce_scatter":
        name = "zero1_rs"  # one class, named per instance
    return name


# ---- the plan ------------------------------------------------------------------------------------
@dataclass
class Collective:
    name: str          # all_reduce | reduce_scatter | all_gather
    what: str          # gradients | parameters
    bytes: int         # payload per call (the full, unsharded tensor size for all-gather / reduce-scatter)
    calls: int         # per optimizer step
    ms: float = float("nan")
    overlappable: bool = False

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.calls


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
    device_memory_gib: Optional[float]
    time_ms: dict[str, float]    # compute parts, comm, exposed comm, step
    step_time_ms: Optional[float]
    tokens_per_s: Optional[float]
    mfu: Optional[float]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["collectives"] = [{**dataclasses.asdict(c), "bytes_per_step": c.bytes_per_step} for c in self.collectives]
        d["peak_mem_gib"] = self.peak_gib
        d["memory_gib"] = {k: v / GIB for k, v in self.memory.items()}
        d["comm_bytes_per_step"] = sum(c.bytes_per_step for c in self.collectives)
        d["comm_ms"] = self.time_ms.get("comm_ms")
        d["exposed_comm_ms"] = self.time_ms.get("exposed_comm_ms")
        return _finite(d)

    def check_fits(self) -> None:
        """Raise `ConfigError` when the predicted peak does not fit the device, naming the number that overflows."""
        if self.device_memory_gib is None or not math.isfinite(self.device_memory_gib):
            return
        if self.peak_gib <= self.device_memory_gib:
            return
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(self.memory.items(), key=lambda kv: -kv[1]) if v)
        fixes = []
        if self.checkpointed_blocks == 0:
            fixes.append("activation_checkpointing=1")
        if self.strategy not in ("fsdp", "torch_fsdp2"):
            fixes.append("a sharded strategy (parallelism=fsdp or zero1)")
        fixes.append("a smaller train.batch_size or more train.grad_accum_steps")
        raise ConfigError("memory", f"{self.model} with {self.strategy} on {self.mesh} needs a predicted "
                          f"{self.peak_gib:.1f} GiB per rank at {self.peak_moment} but {self.device} has "
                          f"{self.device_memory_gib:.1f} GiB ({parts} GiB)", "; or ".join(fixes))

    def format(self) -> str:
        g = lambda b: f"{b / GIB:8.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:8.2f} MiB"  # noqa: E731
        lines = [
            f"plan: {self.model} ({self.params / 1e6:.1f}M params) | {self.strategy} on {self.mesh} "
            f"(world {self.world_size}) | {self.precision} | device {self.device_note}",
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
        cap = f" of {self.device_memory_gib:.1f} GiB" if self.device_memory_gib and math.isfinite(
            self.device_memory_gib) else ""
        lines.append(f"    {'PEAK':<24}{g(self.peak_bytes)}{cap} ({self.peak_moment})")
        if self.collectives:
            lines.append("  communication per step:")
            for c in self.collectives:
                lines.append(f"    {c.name:<15}{c.what:<11}{c.bytes_per_step / 1e9:9.3f} GB in {c.calls:4d} calls "
                             f"{c.ms:9.2f} ms{' (overlappable)' if c.overlappable else ''}")
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
def linear_shapes(m) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every matmul weight, in forward order."""
    d, e, f = m.d_model, m.head_dim, m.d_ff
    out = []
    for i in range(m.n_layers):
        out += [(f"blocks.{i}.attn.qkv_proj", d, (m.n_heads + 2 * m.kv_heads) * e),
                (f"blocks.{i}.attn.output_proj", m.n_heads * e, d),
                (f"blocks.{i}.ffn.w1", d, f), (f"blocks.{i}.ffn.w3", d, f), (f"blocks.{i}.ffn.w2", f, d)]
    out.append(("lm_head", d, m.vocab_size))
    return out


def param_tensors(m) -> list[tuple[str, int]]:
    """(name, numel) of every parameter in `TransformerLM.parameters()` order."""
    d = m.d_model
    out = [("token_embeddings.weight", m.vocab_size * d)]
    lin = {n: i * o for n, i, o in linear_shapes(m)}
    for i in range(m.n_layers):
        p = f"blocks.{i}."
        out += [(p + "ln1.weight", d)]
        out += [(p + f"attn.{k}.weight", lin[p + f"attn.{k}"]) for k in ("qkv_proj", "output_proj")]
        out += [(p + "ln2.weight", d)]
        out += [(p + f"ffn.{k}.weight", lin[p + f"ffn.{k}"]) for k in ("w1", "w2", "w3")]
    out += [("final_norm.weight", d), ("lm_head.weight", lin["lm_head"])]
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
    return int(norms + lin_inputs + rope + attn + oproj + ffn)


def head_activation_bytes(m, batch: int, seq: int, autocast: bool) -> int:
    """Saved outside the blocks: token ids, final norm, lm_head input, log-softmax output, the loss's divisor."""
    B, T, D = batch, seq, m.d_model
    a = 2 if autocast else 4
    return 8 * B * T + (8 * B * T * D + 4 * B * T) + a * B * T * D + 4 * B * T * m.vocab_size + 4


def activation_bytes(m, batch: int, seq: int, autocast: bool, checkpointed_blocks: int = 0) -> int:
    """Saved-activation bytes at the end of forward (checkpointed blocks keep only their fp32 input)."""
    blk = block_activation_bytes(m, batch, seq, autocast)
    n_ck = checkpointed_blocks
    ck = n_ck * 4 * batch * seq * m.d_model + (8 * seq if n_ck else 0)  # fp32 inputs + the shared positions
    return (m.n_layers - n_ck) * blk + ck + head_activation_bytes(m, batch, seq, autocast)


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


def bucket_layout(m, bucket_mb: float, first_bucket_mb: Optional[float]) -> list[list[int]]:
    """Parameter sizes (bytes, fp32) per bucket, built like `core.distributed.ddp.BucketedDDP`."""
    sizes = [n * 4 for _, n in reversed(param_tensors(m))]
    cap_all = int(bucket_mb * 2**20)
    cap_first = cap_all if first_bucket_mb is None else min(cap_all, int(first_bucket_mb * 2**20))
    buckets: list[list[int]] = []
    cur: list[int] = []
    for s in sizes:
        cap = cap_first if not buckets else cap_all
        if cur and sum(cur) + s > cap:
            buckets.append(cur)
            cur = []
        cur.append(s)
    if cur:
        buckets.append(cur)
    return buckets


def ring_ms(kind: str, nbytes: float, p: int, busbw_gbps: float, latency_us: float) -> float:
    """Ring collective time: all-reduce moves 2(p-1)/p of the buffer per rank, all-gather and
    reduce-scatter (p-1)/p of the full buffer; bus bandwidth as nccl-tests reports it."""
    if p <= 1:
        return 0.0
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    return latency_us / 1e3 + factor * nbytes / (busbw_gbps * 1e9) * 1e3


# ---- plan() ------------------------------------------------------------------------------------
def _model_cfg(cfg: DictConfig):
    from hydra.utils import instantiate

    return instantiate(cfg.model)


def _mesh(cfg: DictConfig):
    from hydra.utils import instantiate

    return instantiate(cfg.mesh)


def plan(cfg: DictConfig) -> Plan:
    """Predict memory, communication and step time for the composed config `cfg` (touches no GPU)."""
    m = _model_cfg(cfg)
    mesh = _mesh(cfg)
    sname = strategy_name(cfg)
    prof = PROFILES.get(sname)
    notes: list[str] = []
    if prof is None:
        prof = PROFILES["none"] if mesh.world_size == 1 else PROFILES["ddp_bucketed"]
        notes.append(f"strategy {sname!r} has no planner profile; predicted as "
                     f"{'none' if mesh.world_size == 1 else 'ddp_bucketed'}")
    world, dp = mesh.world_size, mesh.dp_size
    unmodelled = [f"{a}={getattr(mesh, a)}" for a in ("pp", "cp", "tp") if getattr(mesh, a) > 1]
    if unmodelled:
        notes.append(f"{', '.join(unmodelled)}: not modelled; the plan treats the mesh as data-parallel "
                     f"{mesh.dp_size} (memory and communication of those axes are missing)")
    par = lambda key, default=None: OmegaConf.select(cfg, f"parallelism.{key}", default=default)  # noqa: E731
    low = ("bfloat16", "bf16", "float16", "fp16", "half")
    if prof.shard_params:
        # gathers in the compute dtype (FSDP2 MixedPrecisionPolicy / our compute_dtype): autocast finds bf16
        # weights and keeps no copies of its own. Our fsdp's saved-tensor hook drops gathered weights either way.
        prof = dataclasses.replace(prof, mixed_precision_params=str(par("compute_dtype")) in low or sname == "fsdp")
    grad_comm_bytes = 2 if str(par("reduce_dtype", par("comm_dtype"))) in low else 4
    # ddp_bucketed / zero1 compute_dtype: the Linear layers run on persistent bf16 copies (autocast then makes
    # none of its own) and their bf16 gradients are all-reduced as they are
    bf16_leaves = sname in ("ddp_bucketed", "zero1") and str(par("compute_dtype")) in low and world > 1
    if bf16_leaves:
        prof = dataclasses.replace(prof, mixed_precision_params=True)
        grad_comm_bytes = 2
    # our fsdp gathers one transformer block per collective (group_by=block) or one weight (group_by=weight)
    fsdp_blocks = sname == "fsdp" and str(par("group_by", "block")) == "block"
    if world == 1:
        prof = PROFILES["none"] if not prof.persistent_grad_buffer else prof

    seq = int(OmegaConf.select(cfg, "data.seq_len", default=m.context_length) or m.context_length)
    gbs = int(cfg.train.batch_size)
    accum = int(OmegaConf.select(cfg, "train.grad_accum_steps", default=1) or 1)
    require(gbs % (dp * accum) == 0, "train.batch_size",
            f"{gbs} sequences do not split over dp={dp} ranks x {accum} micro-steps",
            f"make train.batch_size a multiple of {dp * accum}")
    mb = gbs // (dp * accum)
    prec = str(OmegaConf.select(cfg, "precision.dtype", default="fp32"))
    autocast = prec in ("bf16", "fp16")
    tf32 = bool(OmegaConf.select(cfg, "precision.tf32", default=True))
    compute_dtype = prec if autocast else ("tf32" if tf32 else "fp32")
    every = int(OmegaConf.select(cfg, "activation_checkpointing", default=0) or 0)
    n_ck = checkpointed_count(m.n_layers, every)
    compiled = bool(OmegaConf.select(cfg, "compile", default=False))

    # ---- counts ----
    N = m.num_params()
    lin = linear_shapes(m)
    n_lin = sum(i * o for _, i, o in lin)
    block_lin = sum(i * o for n, i, o in lin if n.startswith("blocks.0."))
    block_params = block_lin + 2 * m.d_model
    shard = lambda n, on: int(math.ceil(n / dp)) if on and dp > 1 else n  # noqa: E731
    fl = matmul_flops(m, mb, seq)
    micro_steps_all_ranks = dp * accum
    matmul_step = (fl["forward"] + fl["backward"]) * micro_steps_all_ranks
    blk_fwd = (fl["linear_forward"] - 2 * mb * seq * m.d_model * m.vocab_size) / m.n_layers \
        + fl["attention_forward"] / m.n_layers
    recompute = n_ck * blk_fwd * micro_steps_all_ranks
    try:
        from core.metrics import model_flops_per_token

        causal = bool(OmegaConf.select(cfg, "metrics.causal_attention_flops", default=False))
        model_flops = model_flops_per_token(m, seq, causal) * gbs * seq
    except ImportError:  # pragma: no cover
        model_flops = (6.0 * N + 12 * m.n_layers * m.d_model * seq) * gbs * seq

    # ---- memory per rank ----
    st_bytes, opt_traffic, opt_name = optimizer_state_bytes_per_param(cfg)
    params_b = 4 * shard(N, prof.shard_params)
    grads_b = 4 * shard(N, prof.shard_grads)
    opt_b = st_bytes * shard(N, prof.shard_optimizer)
    act_full = activation_bytes(m, mb, seq, autocast, 0)
    act_ck = activation_bytes(m, mb, seq, autocast, checkpointed_count(m.n_layers, every or 1))
    act = activation_bytes(m, mb, seq, autocast, n_ck)
    BTV = mb * seq * m.vocab_size
    loss_transient = (2 if autocast else 0) * BTV + 4 * BTV  # logits (compute dtype) + their fp32 copy

    # autocast's low-precision weight copies: the cache holds every cast weight until autocast exits
    # (end of forward); autograd keeps those of non-checkpointed blocks (and lm_head) until their backward.
    if autocast and not prof.mixed_precision_params:
        wcopy_fwd = 2 * n_lin
        wcopy_saved = 2 * (n_lin - n_ck * block_lin)
    else:
        wcopy_fwd = wcopy_saved = 0
    # parameters all-gathered for the layers in flight (FSDP: current + prefetched block, plus the root's
    # embedding/lm_head, which stay unsharded between forward and backward)
    gather_b = 0
    gather_dtype_bytes = 2 if str(par("compute_dtype")) in low else 4
    if prof.shard_params and dp > 1:
        if fsdp_blocks:  # the running block (or embedding / lm_head) + `prefetch` in flight
            gather_b = gather_dtype_bytes * (int(par("prefetch", 1)) + 1) * max(block_params, m.vocab_size * m.d_model)
        elif sname == "fsdp":  # one weight per unit: the running unit + `prefetch` in flight
            gather_b = gather_dtype_bytes * (int(par("prefetch", 1)) + 1) * max(i * o for _, i, o in lin)
        else:  # fully_shard per block: current + prefetched block, plus the root's embedding/lm_head
            gather_b = gather_dtype_bytes * (2 * block_params + 2 * m.vocab_size * m.d_model)
    comm_buf = 0
    grads_in_buffer = False
    if prof.persistent_grad_buffer and world > 1:
        comm_buf = 4 * N  # torch DDP's buckets, allocated at wrap time and kept
        grads_in_buffer = bool(par("gradient_as_bucket_view", True))  # then .grad are views into them
    elif prof.bucketed and world > 1 and sname == "ddp_bucketed":
        bmb = float(OmegaConf.select(cfg, "parallelism.bucket_size_mb", default=25.0))
        first = OmegaConf.select(cfg, "parallelism.first_bucket_size_mb", default=1.0)
        comm_buf = sum(sum(b) for b in bucket_layout(m, bmb, first) if len(b) > 1)
    elif sname in ("zero1", "zero1_rs") and world > 1:
        if sname == "zero1":
            bmb = float(par("bucket_size_mb", 25.0))
            comm_buf = sum(sum(b) for b in bucket_layout(m, bmb, par("first_bucket_size_mb", 1.0)) if len(b) > 1)
    static = params_b + opt_b + comm_buf + (2 * n_lin if bf16_leaves else 0)
    grads_during_fwd = grads_b if accum > 1 else 0
    end_fwd = static + grads_during_fwd + gather_b + max(wcopy_fwd + act, wcopy_saved + act + loss_transient)
    # end of backward: every gradient exists; FSDP's full-size gradient of one block before reduce-scatter
    bwd_transient = 0
    if prof.flat_transient and world > 1:
        bwd_transient = 4 * N
    if prof.shard_grads and dp > 1:
        # full-size gradients exist until reduce-scattered: per unit for FSDP, all of them for ZeRO-1 rs
        bwd_transient = 4 * N if not prof.shard_params else 4 * block_params * 2
    # the first block's backward still holds its recompute/activations (small); lm_head grads bf16 copy
    grads_extra = 0 if grads_in_buffer else grads_b
    end_bwd = static + grads_extra + bwd_transient + gather_b
    opt_transient = 0 if opt_traffic <= 28 else 4 * shard(N, prof.shard_optimizer)  # foreach intermediates
    zero_gather = 0
    if prof.param_comm == "all_gather_after_step" and dp > 1:
        zero_gather = min(4 * N, int(float(par("gather_bucket_mb", 256)) * 2**20))  # all-gather rounds' buffer
    opt_step = static + grads_extra + opt_transient + zero_gather
    moments = {"end_of_forward": int(end_fwd), "end_of_backward": int(end_bwd), "optimizer_step": int(opt_step)}
    peak_moment = max(moments, key=moments.get)
    memory = {"parameters": params_b, "gradients": grads_b, "optimizer_state": opt_b, "activations": act,
              "autocast_weight_copies": wcopy_fwd, "gathered_parameters": gather_b, "comm_buffers": comm_buf,
              "transients": max(loss_transient, bwd_transient, opt_transient)}

    # ---- communication per step ----
    spec, dev_note = device_spec(cfg)
    colls: list[Collective] = []
    if dp > 1:
        n_tensors = len(param_tensors(m))
        if prof.grad_comm == "all_reduce":
            if prof.per_tensor:
                colls.append(Collective("all_reduce", "gradients", grad_comm_bytes * N // n_tensors, n_tensors,
                                        overlappable=prof.overlaps))
            elif prof.bucketed:
                nb = len(bucket_layout(m, float(OmegaConf.select(cfg, "parallelism.bucket_size_mb", default=25.0)),
                                       OmegaConf.select(cfg, "parallelism.first_bucket_size_mb", default=1.0)))
                colls.append(Collective("all_reduce", "gradients", grad_comm_bytes * N // nb, nb,
                                        overlappable=prof.overlaps))
            else:
                colls.append(Collective("all_reduce", "gradients", grad_comm_bytes * N, 1))
        elif prof.grad_comm == "reduce_scatter":
            units = ((len(lin) + 1) if sname == "fsdp" else (m.n_layers + 1)) if prof.shard_params else 1
            calls = units * accum if prof.shard_params else 1
            colls.append(Collective("reduce_scatter", "gradients", grad_comm_bytes * N // units, calls,
                                    overlappable=prof.overlaps))
        if prof.param_comm == "all_gather_after_step":
            colls.append(Collective("all_gather", "parameters", 4 * N, 1))
        elif prof.param_comm == "all_gather_per_layer":
            units = (len(lin) + 1) if sname == "fsdp" and not fsdp_blocks else (m.n_layers + 1)
            calls = 2 * units * accum  # forward and backward, every micro-step
            colls.append(Collective("all_gather", "parameters", gather_dtype_bytes * N // units, calls,
                                    overlappable=True))
        if accum > 1 and prof.grad_comm != "none" and not prof.shard_params:
            pass  # no_sync: gradients reduced on the last micro-step only

    # ---- time ----
    time_ms: dict[str, float] = {}
    step_ms = tps = mfu = None
    dev_mem = None
    if spec is not None:
        dev_mem = spec.memory_gib
        nodes = max(1, math.ceil(world / spec.gpus_per_node)) if spec.name != "cpu" else 1
        busbw = spec.intra_busbw_gbps if nodes == 1 else spec.inter_busbw_gbps
        for c in colls:
            c.ms = c.calls * ring_ms(c.name, c.bytes, dp, busbw, spec.collective_latency_us)
        peak = spec.matmul_tflops.get(compute_dtype, spec.matmul_tflops.get("fp32")) * 1e12
        bw = spec.hbm_gbps * 1e9
        per_rank_micro = accum
        lin_fl = fl["linear_forward"] * 3
        attn_fl = fl["attention_forward"] * 3 * 0.5  # causal kernels skip the masked half
        rec_fl = n_ck * blk_fwd
        matmul_ms = (lin_fl + rec_fl) / peak * 1e3 * per_rank_micro
        attn_ms = attn_fl / (peak * spec.attention_efficiency) * 1e3 * per_rank_micro
        # elementwise traffic per block (bytes per BTD / BTF element, forward; backward ~2x):
        # norms 56, linear-input casts 18 (autocast), RoPE 32, residual adds 20, transposes 4; SwiGLU 10/BTF
        btd, btf = mb * seq * m.d_model, mb * seq * m.d_ff
        fwd_elem = (130 if autocast else 112) * btd + 10 * btf
        elem_bytes = m.n_layers * fwd_elem * 3 + n_ck * fwd_elem + 30 * BTV
        wcast = 0
        if autocast:
            wcast = 6 * n_lin * 2  # weights fp32->bf16 each forward, weight grads bf16->fp32 each backward
            if prof.mixed_precision_params:
                wcast = 6 * shard(n_lin, True) + 6 * n_lin  # cast the shard once; grads cast up for the fp32 reduce
        if compiled:
            elem_bytes *= 0.4
        if prof.shard_params and not prof.mixed_precision_params and autocast:
            wcast = 6 * n_lin * 2
        elem_ms = (elem_bytes + wcast) / bw * 1e3 * per_rank_micro
        n_local = shard(N, prof.shard_optimizer)
        opt_ms = (opt_traffic * n_local + 12 * shard(N, prof.shard_grads)) / bw * 1e3  # step + clip (norm, scale)
        kernels = m.n_layers * (170 if not compiled else 40) * per_rank_micro + 50
        floor_ms = kernels * spec.kernel_floor_us / 1e3
        compute_ms = matmul_ms + attn_ms + elem_ms + opt_ms + floor_ms
        comm_ms = sum(c.ms for c in colls)
        bwd_ms = (matmul_ms + attn_ms + elem_ms) * 2 / 3
        # an overlapped collective runs beside compute: the compute stream waits only for what compute
        # cannot cover (at least the last call); the covered part still slows compute by (1 - efficiency)
        exposed = slowdown = 0.0
        cover = bwd_ms * 3 / 2  # forward and backward compute (FSDP gathers overlap both)
        for c in colls:
            if c.overlappable:
                last = c.ms / max(c.calls, 1)
                covered = min(c.ms - last, cover)
                cover -= covered
                exposed += c.ms - covered
                slowdown += (1 - spec.overlap_efficiency) * covered
            else:
                exposed += c.ms
        if prof.flat_transient and world > 1:  # flatten + unflatten copies of every gradient
            compute_ms += 16 * N / bw * 1e3
        elif sname == "zero1_rs" and world > 1:  # gradients flattened into the reduce-scatter buffer
            compute_ms += 8 * N / bw * 1e3
        time_ms = {"matmul_ms": matmul_ms, "attention_ms": attn_ms, "elementwise_ms": elem_ms,
                   "optimizer_ms": opt_ms, "kernel_floor_ms": floor_ms, "compute_ms": compute_ms,
                   "comm_ms": comm_ms, "exposed_comm_ms": exposed, "overlap_slowdown_ms": slowdown}
        step_ms = compute_ms + exposed + slowdown
        time_ms["step_ms"] = step_ms
        tps = gbs * seq / (step_ms / 1e3)
        try:
            from core.metrics import PEAK_TFLOPS

            key = next((k for k in PEAK_TFLOPS if dev_note.startswith(k)), None)
            if key is not None:
                pk = PEAK_TFLOPS[key].get(compute_dtype)
                mfu = model_flops / (step_ms / 1e3) / (pk * 1e12 * world) if pk else None
        except ImportError:  # pragma: no cover
            pass
    else:
        notes.append(dev_note)
    if autocast and not prof.mixed_precision_params:
        notes.append("autocast keeps a bf16 copy of every linear weight until its backward "
                     f"({2 * n_lin / GIB:.2f} GiB)")
    return Plan(model=m.name, strategy=sname, mesh=mesh.describe(), world_size=world, dp=dp, precision=prec,
                params=N, tokens_per_step=gbs * seq, micro_batch=mb, seq_len=seq, grad_accum=accum,
                checkpointed_blocks=n_ck, model_flops_per_step=model_flops, matmul_flops_per_step=matmul_step,
                recompute_flops_per_step=recompute, memory=memory, activations_no_ckpt=act_full,
                activations_with_ckpt=act_ck, moments=moments, peak_bytes=max(moments.values()),
                peak_moment=peak_moment, collectives=colls, device=None if spec is None else spec.name,
                device_note=dev_note, device_memory_gib=dev_mem, time_ms=time_ms, step_time_ms=step_ms,
                tokens_per_s=tps, mfu=mfu, notes=notes)


def predicted_vs_measured(plan_dict: dict[str, Any], summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Side-by-side numbers for the end of a run (and the sweep report)."""
    pairs = {"step_time_ms": ("step_time_ms", "step_time_ms"), "tokens_per_s": ("tokens_per_s", "tokens_per_s"),
             "peak_mem_gib": ("peak_mem_gib", "peak_mem_gib"), "mfu": ("mfu", "mfu"),
             "comm_ms": ("comm_ms", "comm_ms"), "exposed_comm_ms": ("exposed_comm_ms", "exposed_comm_ms")}
    out = {}
    for k, (pk, mk) in pairs.items():
        p, m = plan_dict.get(pk), summary.get(mk)
        err = (m - p) / p if isinstance(p, (int, float)) and isinstance(m, (int, float)) and p else None
        out[k] = {"predicted": p, "measured": m, "error": err}
    return out


def format_comparison(plan_dict: dict[str, Any], summary: dict[str, Any]) -> str:
    rows = ["predicted vs measured:"]
    for k, v in predicted_vs_measured(plan_dict, summary).items():
        f = lambda x: "-" if x is None else (f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}")  # noqa: E731
        e = "" if v["error"] is None else f"  ({v['error']:+.0%})"
        rows.append(f"  {k:<16}{f(v['predicted']):>14}{f(v['measured']):>14}{e}")
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


if __name__ == "__main__":  # pragma: no cover
    print("use: python train.py ... plan=true", file=os.sys.stderr)
