"""The devices scalelab knows, in one table: datasheet peaks for MFU, and the ceilings the planner predicts with.

Two kinds of figures live side by side on purpose:

  * `peak_tflops`: the vendor's dense peak per compute dtype (no sparsity). MFU divides by it, so it must be
    the datasheet number, never a measured one (core/metrics.py).
  * the planner's ceilings (`matmul_tflops`, `hbm_gbps`, bus bandwidths, latencies, efficiencies): what this
    hardware actually reaches, measured where `sources` says so. A device without them gets memory
    predictions but no step-time prediction (core/planner.py).

`fp32` in `peak_tflops` means plain FP32; `tf32` is the tensor-core figure the trainer uses when TF32 is on.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

_H_SOURCES = {
    "peak_tflops": "datasheet, dense",
    "hbm_gbps": "measured: large device copies",
    "inter_busbw_gbps": "datasheet 400 Gb/s InfiniBand NDR per GPU, x0.9",
    "kernel_floor_us": "fitted to the single-GPU xl step on 2x H200 (docs/planner.md)",
    "overlap_efficiency": "fitted: ddp_bucketed on 2x H200 waited 1.1 ms but its step grew by ~35% of its "
                          "isolated all-reduce time (docs/data_parallel.md)",
    "collective_latency_us": "measured: ddp_naive's 291 all-reduces cost 14 ms more than ddp_flat's one",
}


@dataclass
class DeviceSpec:
    """One device: its datasheet peak (MFU) and, where measured, the ceilings it reaches (the planner)."""

    name: str                                   # as the driver reports it, for people
    peak_tflops: Optional[dict[str, float]]     # datasheet dense peak per compute dtype; None: no MFU
    memory_gib: Optional[float] = None          # what torch can allocate per device (None: unknown, no fit check)
    matmul_tflops: Optional[dict[str, float]] = None  # dense matmul ceiling reached, per compute dtype
    hbm_gbps: Optional[float] = None            # memory bandwidth reached by large copies
    intra_busbw_gbps: Optional[float] = None    # collective bus bandwidth between devices of one node
    inter_busbw_gbps: Optional[float] = None    # ... across nodes (per device)
    collective_latency_us: Optional[float] = None  # fixed cost of one collective
    kernel_floor_us: Optional[float] = None     # fixed cost of one eager kernel (launch + tail)
    attention_efficiency: float = 0.5           # fraction of the matmul ceiling fused attention reaches
    overlap_efficiency: float = 0.0             # fraction of an overlapped collective's time that costs nothing
    #                                             (the rest slows the compute it runs beside: SMs and HBM are shared)
    devices_per_node: int = 8
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def has_ceilings(self) -> bool:
        """True when every figure a step-time prediction needs is known."""
        return None not in (self.matmul_tflops, self.hbm_gbps, self.intra_busbw_gbps, self.inter_busbw_gbps,
                            self.collective_latency_us, self.kernel_floor_us)

    def copy(self) -> "DeviceSpec":
        return dataclasses.replace(self, peak_tflops=None if self.peak_tflops is None else dict(self.peak_tflops),
                                   matmul_tflops=None if self.matmul_tflops is None else dict(self.matmul_tflops),
                                   sources=dict(self.sources))


def _peak(bf16: float, tf32: float, fp32: float) -> dict[str, float]:
    return {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32}


DEVICES: dict[str, DeviceSpec] = {
    "h200": DeviceSpec(
        "NVIDIA H200", _peak(989.0, 494.5, 66.9), memory_gib=139.8,
        matmul_tflops={"bf16": 788.0, "fp16": 788.0, "tf32": 394.0, "fp32": 52.0}, hbm_gbps=4300.0,
        intra_busbw_gbps=350.0, inter_busbw_gbps=45.0, collective_latency_us=45.0, kernel_floor_us=3.0,
        overlap_efficiency=0.4,
        sources={**_H_SOURCES, "matmul_tflops.bf16": "measured 788 TFLOP/s (bf16 GEMM)",
                 "matmul_tflops.tf32": "estimate: half the bf16 figure",
                 "matmul_tflops.fp32": "estimate: datasheet 66.9 x 0.78",
                 "hbm_gbps": "measured ~4.3 TB/s device copy (datasheet 4.8)",
                 "intra_busbw_gbps": "measured: ddp_flat's 13.6 GB all-reduce in 38.9 ms (nccl-tests 360-400)"}),
    "h100_sxm": DeviceSpec(
        "NVIDIA H100 80GB HBM3", _peak(989.0, 494.5, 66.9), memory_gib=79.1,
        matmul_tflops={"bf16": 760.0, "fp16": 760.0, "tf32": 378.0, "fp32": 51.0}, hbm_gbps=3000.0,
        intra_busbw_gbps=340.0, inter_busbw_gbps=45.0, collective_latency_us=45.0, kernel_floor_us=3.0,
        overlap_efficiency=0.4,
        sources={**_H_SOURCES, "matmul_tflops.bf16": "measured 737-798 TFLOP/s (bf16 GEMM, 8k cube)",
                 "matmul_tflops.tf32": "estimate: datasheet 494.5 x 0.77 (bf16 measured/datasheet ratio)",
                 "matmul_tflops.fp32": "estimate: datasheet 66.9 x 0.77",
                 "hbm_gbps": "measured ~3.0 TB/s device copy (datasheet 3.35)",
                 "intra_busbw_gbps": "estimate: as the H200 pair's measured figure (NVLink4, 450 GB/s/direction)"}),
    "h100_pcie": DeviceSpec("NVIDIA H100 PCIe", _peak(756.0, 378.0, 51.2), memory_gib=79.1,
                            sources={"*": "datasheet; ceilings not measured"}),
    "a100_80gb": DeviceSpec(
        "NVIDIA A100-SXM4-80GB", _peak(312.0, 156.0, 19.5), memory_gib=79.1,
        matmul_tflops={"bf16": 312.0 * 0.8, "fp16": 312.0 * 0.8, "tf32": 156.0 * 0.8, "fp32": 19.5 * 0.8},
        hbm_gbps=1700.0, intra_busbw_gbps=230.0, inter_busbw_gbps=22.0, collective_latency_us=20.0,
        kernel_floor_us=3.0, sources={"*": "estimate: datasheet x 0.8 (not measured here)"}),
    "a100": DeviceSpec("NVIDIA A100 (40 GB)", _peak(312.0, 156.0, 19.5), memory_gib=39.4,
                       sources={"*": "datasheet; ceilings not measured"}),
    "l40s": DeviceSpec("NVIDIA L40S", _peak(362.0, 183.0, 91.6), sources={"*": "datasheet"}),
    "a10g": DeviceSpec("NVIDIA A10G", _peak(125.0, 62.5, 31.2), sources={"*": "datasheet"}),
    "rtx_4090": DeviceSpec("NVIDIA GeForce RTX 4090", _peak(165.0, 82.6, 82.6), sources={"*": "datasheet"}),
    "b200": DeviceSpec("NVIDIA B200", _peak(2250.0, 1100.0, 80.0), sources={"*": "datasheet"}),
    # no datasheet peak (so no MFU); memory is what the machine has available when the plan is made
    "cpu": DeviceSpec(
        "cpu", None, matmul_tflops={"bf16": 0.05, "fp16": 0.05, "tf32": 0.1, "fp32": 0.1}, hbm_gbps=10.0,
        intra_busbw_gbps=2.0, inter_busbw_gbps=1.0, collective_latency_us=200.0, kernel_floor_us=15.0,
        devices_per_node=1,
        sources={"*": "estimate: a 2-core CI machine, gloo over loopback; CPU predictions are rough",
                 "memory_gib": "MemAvailable of this machine when the plan is made"}),
}


def key_for_name(name: str) -> Optional[str]:
    """The `DEVICES` key of a device name as CUDA or nvidia-smi reports it ('NVIDIA H100 80GB HBM3'), or None."""
    n = name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100_pcie" if "pcie" in n else "h100_sxm"
    if "a100" in n:
        return "a100_80gb" if "80" in n else "a100"
    for key, pattern in (("l40s", "l40s"), ("a10g", "a10g"), ("rtx_4090", "4090"), ("b200", "b200")):
        if pattern in n:
            return key
    return None


def visible_gpus() -> list[str]:
    """Names of this machine's GPUs, found through nvidia-smi (no CUDA context is created); [] if none."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def cpu_memory_available_gib() -> float:
    """Memory this machine can still give (Linux MemAvailable; else its total physical memory), GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
