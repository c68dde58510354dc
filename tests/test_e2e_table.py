"""The end-to-end benchmark table: its ratio cells, and a run of two attention implementations' tiny models."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from experiments.e2e_table import attention_overrides, ratio_cell

ROOT = Path(__file__).resolve().parents[1]


def test_ratio_cell_takes_medians_of_round_ratios():
    """Interleaved: the median of the rounds' ratios and their range, so one slow round of the baseline moves the
    median little (a ratio of means would move with it); one model after the other: the ratio of the median steps;
    a point one of them did not measure (out of memory): "-"."""
    point = ("medium", "bf16", "train_step")
    medians = {(*point, "sdpa"): 100.0, (*point, "flash"): 99.0}
    rounds = {(*point, "sdpa"): [100.0, 100.0, 150.0], (*point, "flash"): [99.0, 101.0, 100.0]}
    assert ratio_cell(medians, rounds, point, "sdpa", "flash") == "0.990 [0.667-1.010]"
    assert ratio_cell(medians, {}, point, "sdpa", "flash") == "0.990"
    assert ratio_cell(medians, rounds, point, "sdpa", "naive") == "-"


def test_attention_entry_sets_its_kernel_config():
    """`name@key=value;key=value` composes the named attention with those keys of its config set (mapping values
    merged as Hydra merges them); a plain name changes nothing else."""
    from hydra import compose, initialize_config_dir
    assert attention_overrides("sdpa") == ["attention_impl=sdpa"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=attention_overrides("flash_triton@ws_min_rows={64:2048};backward=two_pass"))
    assert cfg.attention_impl.name == "flash_triton"
    assert cfg.attention_impl.config.backward == "two_pass"
    assert dict(cfg.attention_impl.config.ws_min_rows) == {64: 2048, 80: 2048, 96: 1024, 128: 512}


def test_interleaved_run_writes_a_ratio_with_its_range(tmp_path):
    """Two attention implementations' tiny models on the CPU, two interleaved rounds: both rows (with their median
    step) and the ratio table with a range in the file written."""
    out = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "e2e_table.py"), "--sizes", "tiny", "--precisions", "fp32",
                           "--modes", "train_step", "--attention", "sdpa,flash_torch", "--interleave", "2",
                           "--steps", "2", "--warmup", "1", "--seq", "64", "--batch", "2", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert re.search(r"\| tiny \| .* \| sdpa \| train_step \|( [\d.,]+ \|){4}", text)
    assert re.search(r"\| tiny \| .* \| flash_torch \| train_step \|( [\d.,]+ \|){4}", text)
    # (the ratio's size is the machine's business: on a busy CPU one round of either model can take 10x the other)
    assert re.search(r"\| tiny \| fp32 \| train_step \| \d+\.\d{3} \[\d+\.\d{3}-\d+\.\d{3}\] \|", text), text
