"""MFU's peak FLOP/s: from the device table, an explicit number, or refused (never guessed)."""
from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.metrics import FlopCounter, peak_flops


def test_unknown_gpu_gets_no_mfu_and_says_how_to_set_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    peak, why = peak_flops(torch.device("cuda", 0), "bf16", True, None)
    assert peak is None and "'Some Future GPU' is not in the peak-FLOPS table" in why and "metrics.peak_tflops" in why
    assert FlopCounter(1e12, 1e12, peak, why).mfu(1.0) is None


def test_cpu_gets_no_mfu_unless_given_a_peak():
    peak, why = peak_flops(torch.device("cpu"), "fp32", True, None)
    assert peak is None and "no MFU on the CPU" in why
    peak, why = peak_flops(torch.device("cpu"), "fp32", True, 2.0)
    assert peak == 2e12 and FlopCounter(1e12, 1e12, peak, why, world_size=2).mfu(0.5) == pytest.approx(0.5)  # 2 TFLOP/s done of 4 available


def test_known_gpu_and_table_keys_use_the_datasheet_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0), "bf16", True, None)[0] == 989e12
    assert peak_flops(torch.device("cuda", 0), "fp32", True, None)[0] == 494.5e12  # TF32 tensor cores
    assert peak_flops(torch.device("cuda", 0), "fp32", False, None)[0] == pytest.approx(66.9e12)
    assert peak_flops(torch.device("cpu"), "bf16", True, "a100")[0] == 312e12


def test_unknown_table_key_is_a_config_error():
    with pytest.raises(ConfigError, match="metrics.peak_tflops: no peak-FLOPS entry named 'h300'"):
        peak_flops(torch.device("cpu"), "bf16", True, "h300")
    with pytest.raises(ConfigError):  # the CPU has no datasheet peak to look up
        peak_flops(torch.device("cpu"), "bf16", True, "cpu")
