"""Mixed precision: the `precision` plugins (fp32, bf16 autocast, fp16 autocast + loss scaling)."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from core.dtypes import parse_dtype
from core.errors import ConfigError, require

_NAMES = ("fp32", "bf16", "fp16")


class Precision:
    """Autocast context, loss scaling and the optimizer step for one numeric format.

    Master weights, optimizer state and the loss stay fp32; with fp16 a dynamic
    `GradScaler` skips steps whose gradients overflow and counts them.
    """

    def __init__(self, dtype: str = "fp32", tf32: bool = True, init_scale: float = 65536.0,
                 growth_interval: int = 2000) -> None:
        require(dtype in _NAMES, "precision.dtype", f"unknown precision {dtype!r}", "use precision=fp32, bf16 or fp16")
        self.name = dtype
        self.dtype = parse_dtype(dtype, "precision.dtype")
        self.tf32 = tf32
        self.init_scale, self.growth_interval = init_scale, growth_interval
        self.scaler: torch.amp.GradScaler | None = None
        self.skipped_steps = 0
        self.device_type = "cpu"

    def setup(self, device: torch.device) -> "Precision":
        """Check the device can run this format and prepare the scaler."""
        self.device_type = device.type
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
            if self.dtype == torch.bfloat16:
                require(torch.cuda.is_bf16_supported(), "precision", f"{torch.cuda.get_device_name()} cannot run bf16",
                        "use precision=fp16 or fp32 on this GPU")
        elif self.dtype == torch.float16:
            raise ConfigError("precision", "fp16 autocast with loss scaling needs a CUDA device, and this run is on the CPU",
                              "use precision=bf16 or precision=fp32 on the CPU")
        if self.dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(device.type, init_scale=self.init_scale,
                                               growth_interval=self.growth_interval)
        return self

    def autocast(self) -> ContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to true scale before clipping or measuring their norm."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return False (and count it) if fp16 gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= scale_before
        if not stepped:
            self.skipped_steps += 1
        return stepped

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
