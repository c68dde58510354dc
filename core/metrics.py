"""Every number the trainer reports, computed in one place: FLOPs, MFU/HFU, memory, throughput.

FLOP convention (PaLM, appendix B): per token, model FLOPs = 6 N + 12 L d T, where N is
every parameter (embedding and LM head included; for a mixture of experts the parameters one token uses,
`ModelConfig.active_params`: top_k experts, router, shared expert and the rest), L layers, d = d_model, T the sequence
length. The 12 L d T term counts attention's two T x T matmuls forward and backward as
if non-causal (PaLM's choice, used by the reference anchors); `causal=True` halves it
(6 L d T), counting only the lower triangle a causal kernel computes.
MFU uses model FLOPs; HFU adds what activation checkpointing recomputes (one more
forward of every checkpointed block: 2 N_block + 4 L_ckpt d T per token, halved for causal).
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from core.errors import ConfigError
from core.hardware import DEVICES, key_for_name
from core.model import ModelConfig


def peak_flops(device: torch.device, dtype: str, tf32: bool, override: float | str | None) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU, and where it came from; (None, why) when it cannot be known.

    `override` (config `metrics.peak_tflops`) is a number of TFLOP/s or a table key; an
    unknown key is an error, never a guess. The table is core/hardware.py's `DEVICES`.
    """
    compute_dtype = "tf32" if dtype == "fp32" and tf32 else dtype
    if override is not None:
        if isinstance(override, (int, float)):
            return float(override) * 1e12, f"metrics.peak_tflops={override}"
        known = [k for k, d in DEVICES.items() if d.peak_tflops]
        if override not in known:
            raise ConfigError("metrics.peak_tflops", f"no peak-FLOPS entry named {override!r}",
                              f"give a number of TFLOP/s or one of {', '.join(known)}")
        return DEVICES[override].peak_tflops[compute_dtype] * 1e12, f"table[{override}][{compute_dtype}]"
    if device.type != "cuda":
        return None, "no MFU on the CPU: its peak FLOP/s is not in the table (set metrics.peak_tflops to report one)"
    name = torch.cuda.get_device_name(device)
    key = key_for_name(name)
    if key is None or not DEVICES[key].peak_tflops:
        return None, f"no MFU: {name!r} is not in the peak-FLOPS table (set metrics.peak_tflops)"
    return DEVICES[key].peak_tflops[compute_dtype] * 1e12, f"table[{key}][{compute_dtype}] for {name}"


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """PaLM model FLOPs per token, forward + backward: 6 N + 12 L d T (6 L d T if causal)."""
    attn = 12 * cfg.n_layers * cfg.d_model * seq_len
    return 6.0 * cfg.active_params() + (attn / 2 if causal else attn)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, checkpointed_blocks: int, causal: bool = False) -> float:
    """Extra forward FLOPs per token spent recomputing `checkpointed_blocks` blocks in backward."""
    per_block_params = (cfg.active_params(include_embedding=False) - cfg.d_model - cfg.vocab_size * cfg.d_model) / cfg.n_layers
    attn = 4 * cfg.d_model * seq_len
    return checkpointed_blocks * (2.0 * per_block_params + (attn / 2 if causal else attn))


@dataclass
class FlopCounter:
    """Model and hardware FLOPs per step for one run, and MFU/HFU from a step time."""

    model_flops_per_step: float
    hardware_flops_per_step: float
    peak_flops_per_device: float | None
    peak_source: str
    world_size: int = 1

    def mfu(self, step_time_s: float) -> float | None:
        if self.peak_flops_per_device is None or step_time_s <= 0:
            return None
        return self.model_flops_per_step / step_time_s / (self.peak_flops_per_device * self.world_size)

    def hfu(self, step_time_s: float) -> float | None:
        if self.peak_flops_per_device is None or step_time_s <= 0:
            return None
        return self.hardware_flops_per_step / step_time_s / (self.peak_flops_per_device * self.world_size)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak GPU allocated/reserved since the last reset (GiB) and the process's peak CPU RSS (GiB)."""
    out = {"cpu_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if device.type == "cuda":
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        out["gpu_allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
    return out


def peak_memory_gib(device: torch.device) -> float:
    """The one peak-memory figure for tables: GPU peak allocated, or CPU peak RSS."""
    stats = memory_stats(device)
    return stats.get("gpu_peak_allocated_gib", stats["cpu_rss_peak_gib"])


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
