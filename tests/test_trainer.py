"""The trainer end to end on the CPU: learning, exact resume, benchmark mode, loggers."""
import glob
import json
import statistics
import struct
from pathlib import Path

import pytest
import torch

from launchers.job import run_job
from tests.utils import FAST, compose_cfg, losses_by_step, read_metrics, read_summary, run_train


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """The default job (tiny model, embedded corpus) through the real entrypoint: the loss falls >= 30% (40 steps
    take it to about half its first value, validation to 55% of a uniform guess's)."""
    proc = run_train(["train.max_steps=40", "train.eval_every=20"], tmp_path)
    assert "step     40/40" in proc.stdout and "tok/s" in proc.stdout and "ETA" in proc.stdout  # progress line
    s = read_summary(tmp_path)
    assert s["status"] == "ok" and s["steps"] == 40
    assert s["final_loss"] <= 0.7 * s["first_loss"], (s["first_loss"], s["final_loss"])
    assert s["final_val_loss"] < 0.7 * 5.545  # below 70% of ln(256), the loss of a uniform guess
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "loss" in r][:3] == [1, 10, 20]
    assert any("val_loss" in r for r in rows)
    for key in ("lr", "grad_norm", "step_time_ms", "tokens_per_s", "peak_mem_gib"):
        assert key in rows[-2], key


def test_resume_continues_exactly(tmp_path):
    """N steps, stop, resume N more == 2N uninterrupted steps, loss for loss (bitwise)."""
    common = FAST + ["train.max_steps=8", "train.log_every=1", "train.eval_every=0", "train.batch_size=4",
                     "data.max_bytes=200000", "optimizer.warmup_steps=2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_job(compose_cfg(common, whole))
    run_job(compose_cfg(common + ["train.stop_at_step=4"], parts))
    assert read_summary(parts)["status"] == "stopped"
    assert (parts / "checkpoints" / "step_000004" / "trainer.pt").is_file()
    run_job(compose_cfg(common + ["resume=auto"], parts))
    a, b = losses_by_step(whole), losses_by_step(parts)
    assert sorted(a) == list(range(1, 9))
    assert [b[s] for s in range(5, 9)] == [a[s] for s in range(5, 9)]


def test_checkpoints_keep_last_k_and_are_atomic(tmp_path):
    cfg = compose_cfg(FAST + ["train.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=2",
                              "train.batch_size=2", "data.max_bytes=100000", "train.eval_every=0"], tmp_path)
    run_job(cfg)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_000004", "step_000006"]
    # a half-written checkpoint (crash while saving) is ignored; the newest good one is used
    (tmp_path / "checkpoints" / ".tmp_step_000008").mkdir()
    (tmp_path / "checkpoints" / "step_000010").mkdir()  # no trainer.pt: incomplete
    from core.checkpoint import Checkpointer

    assert Checkpointer(tmp_path / "checkpoints").latest().name == "step_000006"


def test_benchmark_mode_returns_timings(tmp_path):
    cfg = compose_cfg(FAST + ["benchmark.enabled=true", "benchmark.mode=forward_backward", "benchmark.warmup=1",
                              "benchmark.steps=3", "data=synthetic", "train.batch_size=2"], tmp_path)
    row = run_job(cfg)
    assert row["benchmark_mode"] == "forward_backward" and len(row["times_ms"]) == 3
    assert row["attention"] == "sdpa"
    assert all(t > 0 for t in row["times_ms"])
    assert row["std_ms"] == pytest.approx(statistics.stdev(row["times_ms"]), rel=1e-9)  # the sample deviation
    assert abs(row["mean_ms"] - sum(row["times_ms"]) / 3) < 1e-6
    assert "| forward_backward |" in (tmp_path / "benchmark.md").read_text()


def test_activation_checkpointing_gives_same_gradients(tmp_path):
    from core.trainer import build

    grads = []
    for every in (0, 1):
        run = build(compose_cfg(FAST + [f"activation_checkpointing={every}", "train.batch_size=2",
                                        "data.max_bytes=100000"], tmp_path))
        run.forward_backward(0)
        grads.append({n: p.grad.clone() for n, p in run.raw_model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7)


def _wandb_records(path: str) -> list:
    """Read a .wandb file: a LevelDB-style log (32 KiB blocks, 7-byte record headers) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2, 3, 4):
            chunks = payload if kind in (1, 2) else chunks + payload
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(chunks)
                records.append(rec)
        elif kind == 0:
            break
    return records


def test_wandb_offline_and_jsonl_hold_the_metrics(tmp_path):
    proc = run_train(["logger=wandb", "logger.wandb.mode=offline", "train.max_steps=6", "train.log_every=2",
                      "train.eval_every=0", "train.batch_size=4", "data.max_bytes=100000"], tmp_path,
                     env={"WANDB_MODE": "offline"})
    jsonl = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in jsonl] == [1, 2, 4, 6]
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, proc.stdout[-2000:]
    offline_run = Path(files[0]).parent
    assert f"W&B offline run saved in {offline_run}; upload it with: wandb sync {offline_run}" in proc.stdout
    records = _wandb_records(files[0])
    history = {}
    config = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[items["_step"]] = items
        elif kind in ("config", "run"):
            updates = rec.config.update if kind == "config" else rec.run.config.update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in updates})
    for r in jsonl:
        assert history[r["step"]]["loss"] == pytest.approx(r["loss"])
    assert config["model"]["d_model"] == 128 and config["train"]["max_steps"] == 6  # the resolved config


def test_profile_mode_writes_a_trace(tmp_path):
    cfg = compose_cfg(FAST + ["profile.enabled=true", "profile.steps=1", "profile.warmup=1", "data=synthetic",
                              "train.batch_size=2"], tmp_path)
    result = run_job(cfg)
    assert result["peak_mem_forward_gib"] > 0 and result["peak_mem_train_step_gib"] >= result["peak_mem_forward_gib"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "train_step" in names and "aten::mm" in names  # the step and the matmuls inside it were recorded
    assert "aten::mm" in (tmp_path / "profile_table.txt").read_text()


def test_window_step_time_leaves_out_comm_timed_steps():
    """A logged window reports the median of its untimed steps (wall-clock marks on the CPU)."""
    from core.trainer import _window_step_seconds

    marks = [(0.0, 0.10, False), (0.2, 0.31, False), (0.4, 0.52, False), (0.6, 1.60, True)]  # timed step: 1 s
    assert _window_step_seconds(marks, wall_s=9.9) == pytest.approx(0.11)
    assert _window_step_seconds([(0.0, 0.5, True), (1.0, 1.7, True)], wall_s=9.9) == pytest.approx(0.6)
    assert _window_step_seconds([], wall_s=0.25) == 0.25
