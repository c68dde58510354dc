"""Every bad input gives one clear line naming the key and the fix: no traceback, exit code 2."""
import numpy as np
import pytest

from launchers.job import run_job
from tests.utils import FAST, compose_cfg, read_summary, run_train

BASE = FAST + ["train.max_steps=2", "train.batch_size=2", "train.eval_every=0"]
SMALL = BASE + ["data.max_bytes=100000"]


def _token_file(path, ids, dtype=np.uint16):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


@pytest.mark.parametrize("case,overrides,key", [
    ("heads do not divide d_model", ["model.n_heads=5"], "model.n_heads"),
    ("GQA groups do not divide heads", ["model.n_kv_heads=3"], "model.n_kv_heads"),
    ("sequence longer than the context", ["data.seq_len=256"], "data.seq_len"),
    ("fp16 on a device that cannot run it", ["precision=fp16"], "precision"),
    ("missing token file", ["data=tokens", "data.path=/nonexistent/train.bin"], "data.path"),
    ("batch not divisible by accumulation", ["train.batch_size=16", "train.grad_accum_steps=3"],
     "train.grad_accum_steps"),
    ("unknown peak FLOPS requested explicitly", ["metrics.peak_tflops=h999"], "metrics.peak_tflops"),
    ("unknown SDPA backend", ["attention_impl.backend=fastest"], "attention_impl.backend"),
    ("unknown flash_triton backward variant", ["attention_impl=flash_triton", "attention_impl.config.backward=bogus"],
     "attention_impl.config.backward"),
])
def test_bad_input_is_one_clear_line(case, overrides, key, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_job(compose_cfg((BASE if "data=tokens" in overrides else SMALL) + overrides, tmp_path))
    assert exc.value.code == 2, case
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}:") and "Fix:" in err[0], err
    assert read_summary(tmp_path)["status"] == "failed"


def test_malformed_token_file(tmp_path, capsys):
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\x01\x02\x03")  # 3 bytes: not a whole number of uint16 tokens
    with pytest.raises(SystemExit):
        run_job(compose_cfg(BASE + ["data=tokens", f"data.path={bad}"], tmp_path / "run"))
    assert "data.path" in capsys.readouterr().err and "uint16" in read_summary(tmp_path / "run")["error"]


def test_vocab_smaller_than_data(tmp_path, capsys):
    path = _token_file(tmp_path / "t.bin", np.r_[np.arange(200), 300, np.arange(5000) % 200])
    with pytest.raises(SystemExit):
        run_job(compose_cfg(BASE + ["data=tokens", f"data.path={path}", "data.seq_len=32"], tmp_path / "run"))
    err = capsys.readouterr().err
    assert "model.vocab_size" in err and "300" in err


def test_token_file_trains(tmp_path):
    """The valid case of the same format: a uint32 file of ids < vocab trains."""
    path = _token_file(tmp_path / "t.bin", np.arange(20000) % 250, np.uint32)
    run_job(compose_cfg(BASE + ["data=tokens", f"data.path={path}", "data.dtype=uint32", "data.seq_len=32"],
                        tmp_path / "run"))
    assert read_summary(tmp_path / "run")["status"] == "ok"


def test_incompatible_checkpoint(tmp_path, capsys):
    run_job(compose_cfg(SMALL + ["checkpoint.at_end=true"], tmp_path))
    with pytest.raises(SystemExit):
        run_job(compose_cfg(SMALL + ["resume=auto", "model.n_layers=2", "train.max_steps=4"], tmp_path))
    err = capsys.readouterr().err
    assert "error: resume:" in err and "n_layers" in err
    assert (tmp_path / "checkpoints" / "step_000002" / "trainer.pt").is_file()  # nothing written is lost


def test_cli_prints_one_line_not_a_traceback(tmp_path):
    proc = run_train(["model.n_heads=6"], tmp_path, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.n_heads: 6 heads do not divide d_model=128")


@pytest.mark.parametrize("overrides,key,hint", [
    (["parallelism=zero2"], "parallelism", "did you mean zero1?"),                      # unknown group option
    (["train.batchsize=4"], "train.batchsize", "did you mean train.batch_size?"),       # unknown key
    (["data=tokens"], "data.path", "set data.path="),                                   # mandatory value not given
    (["train.batch_size=-4"], "train.batch_size", "got -4"),
    (["train.batch_size=0"], "train.batch_size", "got 0"),
    (["benchmark=on"], "benchmark", "benchmark.enabled"),                               # a group of settings replaced
])
def test_config_mistake_is_one_line_before_anything_is_written(overrides, key, hint, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(FAST + overrides, run_dir, check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}:") and "Fix:" in lines[0] and hint in lines[0], lines
    assert not run_dir.exists()  # refused before Hydra creates the run directory


def test_plan_only_writes_no_run_directory(tmp_path):
    proc = run_train(["plan=true"], tmp_path / "run")
    assert "tokens/s" in proc.stdout.splitlines()[-1]  # the plan's last line, then nothing ran
    assert not (tmp_path / "run").exists()
