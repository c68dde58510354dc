"""Checkpoints and resume when things go wrong: a kill inside the re-save window, a changed config,
unreadable checkpoint files, a full disk, read-only directories, resuming a finished run."""
import errno
import multiprocessing
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launchers.job import run_job
from tests.dist_utils import run_ranks
from tests.utils import FAST, compose_cfg, read_metrics, read_summary, train_py

# max_steps a multiple of checkpoint.every: the end-of-run save re-saves the last periodic checkpoint
COMMON = FAST + ["train.max_steps=4", "checkpoint.every=2", "train.batch_size=2", "train.eval_every=0",
                 "train.log_every=1", "data=synthetic"]
ZERO1 = ["mesh=dp2", "mesh.device=cpu", "mesh.timeout_s=30", "parallelism=zero1", "model=tiny", "data=synthetic",
         "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=1", "train.batch_size=4",
         "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "logger=none"]
KILLED = 9  # the exit code of a process killed inside the window (os._exit: no cleanup runs)


def _kill_inside_republish(window: str, marker: Path, step_dir: str = "step_000004") -> None:
    """Make this process die (os._exit, no handler or `finally` runs) when `step_dir` is published the second
    time (the end-of-run re-save), either just before the new copy is renamed into place ("before_rename_in":
    the old copy has left) or just after ("after_rename_in": the old copy is not deleted yet)."""
    real = os.replace
    published = []

    def replace(src, dst, *args, **kwargs):
        src, dst = Path(src), Path(dst)
        into_place = dst.name == step_dir and src.name == f".tmp_{step_dir}"
        if into_place:
            published.append(src)
        resave = into_place and len(published) == 2
        if resave and window == "before_rename_in":
            assert not dst.exists(), "the old copy should have left step_N before the new one is renamed in"
            marker.write_text(window)
            os._exit(KILLED)
        real(src, dst, *args, **kwargs)
        if resave and window == "after_rename_in":
            marker.write_text(window)
            os._exit(KILLED)

    os.replace = replace


def _killed_single_process_run(run_dir: Path, window: str) -> None:
    _kill_inside_republish(window, run_dir / "killed")
    run_job(compose_cfg(COMMON + ["checkpoint.keep_last=1"], run_dir))


@pytest.mark.parametrize("window", ["before_rename_in", "after_rename_in"])
def test_kill_during_resave_leaves_a_loadable_newest_checkpoint(window, tmp_path, capsys):
    """A kill at each point of re-publishing step 4 (single file format, keep_last=1 so step 4 is the only
    checkpoint): resume=auto resumes from step 4, leftovers are cleaned, nothing is trained again."""
    proc = multiprocessing.get_context("spawn").Process(target=_killed_single_process_run, args=(tmp_path, window))
    proc.start()
    proc.join(240)
    assert proc.exitcode == KILLED and (tmp_path / "killed").read_text() == window, proc.exitcode
    before = read_metrics(tmp_path)
    capsys.readouterr()
    run_job(compose_cfg(COMMON + ["checkpoint.keep_last=1", "resume=auto"], tmp_path))
    out = capsys.readouterr().out
    assert f"resumed at step 4 from {tmp_path / 'checkpoints' / 'step_000004'}" in out, out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]
    assert read_metrics(tmp_path) == before  # the run was finished: nothing trained or logged again
    s = read_summary(tmp_path)
    assert s["status"] == "ok" and s["steps"] == 4
    assert s["final_loss"] == [r["loss"] for r in before if "loss" in r][-1]


def _zero1_run(rank: int, world: int, run_dir: str, window: str | None) -> None:
    from core.errors import ConfigError
    from core.trainer import train

    run_dir = Path(run_dir)
    if window is None:  # the resume
        summary = train(compose_cfg(ZERO1 + ["resume=auto"], run_dir))
        assert summary["status"] == "ok" and summary["steps"] == 4, summary
        return
    if window == "shard_missing":  # every rank reports the unreadable shards as one line
        try:
            train(compose_cfg(ZERO1 + ["resume=auto"], run_dir))
        except ConfigError as e:
            assert str(e).startswith("resume: ") and "step_000004/dcp cannot be read" in str(e), e
            assert "\n" not in str(e) and "Fix: move" in str(e), e
            return
        raise AssertionError("resumed from a checkpoint with a missing shard")
    if rank == 0:
        _kill_inside_republish(window, run_dir / "killed")
    try:
        train(compose_cfg(ZERO1, run_dir))
    except Exception:  # noqa: BLE001 - rank 1 loses rank 0 inside the save: expected
        assert rank == 1
        return
    raise AssertionError(f"rank {rank} finished a run whose rank 0 was killed")


@pytest.mark.slow
def test_kill_during_sharded_resave_then_resume(tmp_path):
    """zero1 on 2 gloo ranks (DCP shards): rank 0 is killed after the old step_000004 left its name and before
    the new one is renamed in; resume=auto then loads step 4 whole (trainer.pt and its shards). With a shard
    deleted, every rank's error is one line naming the dcp directory."""
    window = "before_rename_in"
    with pytest.raises(AssertionError, match=r"exited abnormally: \[\(0, 9\)\]"):
        run_ranks(_zero1_run, 2, args=(str(tmp_path), window), timeout_s=30, join_group=False)
    assert (tmp_path / "killed").read_text() == window
    before = read_metrics(tmp_path)
    run_ranks(_zero1_run, 2, args=(str(tmp_path), None), timeout_s=30, join_group=False)
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000004"]
    assert len(list((ckpt / "step_000004" / "dcp").glob("*.distcp"))) == 2
    assert read_metrics(tmp_path) == before  # resumed at step 4 = max_steps: nothing trained again
    assert read_summary(tmp_path)["final_loss"] == [r["loss"] for r in before if "loss" in r][-1]
    (ckpt / "step_000004" / "dcp" / "__1_0.distcp").unlink()
    run_ranks(_zero1_run, 2, args=(str(tmp_path), "shard_missing"), timeout_s=30, join_group=False)


# ---- the resume fingerprint -------------------------------------------------------------------------------
BASE = FAST + ["train.max_steps=2", "checkpoint.at_end=true", "train.batch_size=2", "train.eval_every=0",
               "train.log_every=1", "data=synthetic"]


def _one_line_error(capsys, key: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}:") and "Fix:" in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run with its checkpoint at step 2 (copied by each test that changes it)."""
    run_dir = tmp_path_factory.mktemp("finished")
    run_job(compose_cfg(BASE, run_dir))
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


@pytest.mark.parametrize("changes,listed", [
    (["train.batch_size=4", "data.seq_len=64"], ["data.seq_len 128 -> 64", "train.batch_size 2 -> 4"]),
    (["train.grad_accum_steps=2", "seed=1", "precision.tf32=false"],
     ["precision.tf32 True -> False", "seed 0 -> 1", "train.grad_accum_steps 1 -> 2"]),
    (["optimizer.lr=1e-3", "optimizer.factory.betas=[0.9,0.99]"],
     ["optimizer.factory.betas (0.9, 0.95) -> (0.9, 0.99)", "optimizer.lr 0.003 -> 0.001"]),
])
def test_resume_refuses_a_changed_trajectory(changes, listed, finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_job(compose_cfg(BASE + ["resume=auto"] + changes, run_dir))
    assert exc.value.code == 2
    line = _one_line_error(capsys, "resume")
    assert ", ".join(listed) in line, line
    keys = ",".join(sorted(item.split(" ")[0] for item in listed))
    assert f"resume_allow_changes=[{keys}]" in line, line
    assert read_summary(run_dir)["status"] == "failed"


def test_changed_optimizer_is_refused_before_load_even_if_allowed(finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    for allow in ([], ["resume_allow_changes=[optimizer]"]):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            run_job(compose_cfg(BASE + ["resume=auto", "optimizer=sgd"] + allow, run_dir))
        line = _one_line_error(capsys, "resume")
        assert "optimizer.factory._target_ 'torch.optim.AdamW' -> 'torch.optim.SGD'" in line, line
        assert "cannot be changed on resume" in line and "KeyError" not in line, line


def test_longer_schedule_resumes_with_the_override(finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    with pytest.raises(SystemExit):
        run_job(compose_cfg(BASE + ["resume=auto", "train.max_steps=4"], run_dir))
    assert "train.max_steps 2 -> 4" in _one_line_error(capsys, "resume")
    with pytest.raises(SystemExit):  # a misspelt key is named, not ignored
        run_job(compose_cfg(BASE + ["resume=auto", "train.max_steps=4", "resume_allow_changes=[train.max_step]"],
                            run_dir))
    assert "'train.max_step' is not a key" in _one_line_error(capsys, "resume_allow_changes")
    run_job(compose_cfg(BASE + ["resume=auto", "train.max_steps=4", "resume_allow_changes=[train.max_steps]"],
                        run_dir))
    assert "resumed at step 2" in capsys.readouterr().out
    s = read_summary(run_dir)
    assert s["status"] == "ok" and s["steps"] == 4
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]


def test_allowed_hyperparameter_change_takes_effect(finished_run, tmp_path):
    """Loading restores moments and step counts, not the checkpoint's hyper-parameters: an allowed change of
    weight decay is in force after the load."""
    from core.checkpoint import Checkpointer
    from core.resume import fingerprint
    from core.trainer import build

    cfg = compose_cfg(BASE + ["optimizer.weight_decay=0.25"], _copy(finished_run, tmp_path))
    run = build(cfg)
    ckpt = Checkpointer(cfg.checkpoint.dir, fingerprint=fingerprint(cfg, 1))
    ckpt.load(ckpt.latest(), run.strategy, run.raw_model, run.optimizer, ["optimizer.weight_decay"])
    decays = sorted({g["weight_decay"] for g in run.optimizer.param_groups})
    assert decays == [0.0, 0.25]  # norms and biases stay undecayed
    assert all(len(s) > 0 for s in run.optimizer.state.values()) and run.optimizer.state  # moments loaded


# ---- unreadable checkpoint files, full disk, read-only directories -------------------------------------------
@pytest.mark.parametrize("name", ["state.pt", "trainer.pt"])
@pytest.mark.parametrize("damage", ["missing", "empty", "truncated"])
def test_unreadable_checkpoint_file_is_one_line(name, damage, finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    step = run_dir / "checkpoints" / "step_000002"
    path = step / name
    if damage == "missing":
        path.unlink()
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # a directory without trainer.pt is not a checkpoint: resume=auto would not pick it, so name it
    resume = f"resume={step}" if (name, damage) == ("trainer.pt", "missing") else "resume=auto"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_job(compose_cfg(BASE + [resume], run_dir))
    assert exc.value.code == 2
    line = _one_line_error(capsys, "resume")
    assert name in line, line
    assert read_summary(run_dir)["status"] == "failed"


def test_full_disk_during_a_save(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing step 4: one line saying the disk is full, the partial .tmp_step_000004 removed,
    step 2 intact and resumable."""
    import core.checkpoint

    real = core.checkpoint._write

    def write(obj, path):
        if path.parent.name == ".tmp_step_000004":
            path.write_bytes(b"\0" * 4096)  # part of the file made it to disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(obj, path)

    monkeypatch.setattr(core.checkpoint, "_write", write)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_job(compose_cfg(COMMON, tmp_path))
    assert exc.value.code == 2
    line = _one_line_error(capsys, "checkpoint.dir")
    assert "no space left on the disk" in line and "step 4" in line and "step_000002, is intact" in line, line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    assert read_summary(tmp_path)["status"] == "failed"
    monkeypatch.setattr(core.checkpoint, "_write", real)
    run_job(compose_cfg(COMMON + ["resume=auto"], tmp_path))
    assert "resumed at step 2" in capsys.readouterr().out and read_summary(tmp_path)["status"] == "ok"


def _tmpfs(path: Path, options: str):
    """Mount a tmpfs with `options` at `path` for the test (root only), or skip the test."""
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        pytest.skip(f"needs root with permission to mount a tmpfs ({options})")
    yield path
    subprocess.run(["umount", "--lazy", str(path)], check=True)  # lazy: a failed test may hold a file open


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory no one can write to: permissions for a normal user; a read-only mount for root, whom
    permissions do not stop."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
    else:
        yield from _tmpfs(path, "ro,size=64k")


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB filesystem: the tiny model's first checkpoint (about 11 MB) does not fit."""
    path = tmp_path / "small_disk"
    path.mkdir()
    yield from _tmpfs(path, "size=4m")


def test_real_full_disk_is_named(small_disk, tmp_path, capsys):
    """The same line when torch.save itself meets ENOSPC (it raises a RuntimeError, the OSError behind it)."""
    with pytest.raises(SystemExit) as exc:
        run_job(compose_cfg(COMMON + [f"checkpoint.dir={small_disk}/checkpoints"], tmp_path / "run"))
    assert exc.value.code == 2
    assert "no space left on the disk" in _one_line_error(capsys, "checkpoint.dir")
    assert list((small_disk / "checkpoints").iterdir()) == []  # the partial .tmp_step_000002 is gone


def _zero1_on_full_disk(rank: int, world: int, run_dir: str, checkpoint_dir: str) -> None:
    from core.errors import ConfigError
    from core.trainer import train

    try:
        train(compose_cfg(ZERO1 + [f"checkpoint.dir={checkpoint_dir}"], Path(run_dir)))
    except ConfigError as e:
        assert str(e).startswith("checkpoint.dir: no space left on the disk") and "\n" not in str(e), e
        return
    raise AssertionError("a checkpoint larger than the disk was saved")


@pytest.mark.slow
def test_real_full_disk_during_a_sharded_save(small_disk, tmp_path):
    """DCP meets ENOSPC (inside its CheckpointException): every rank raises the same line, nothing is left."""
    run_ranks(_zero1_on_full_disk, 2, args=(str(tmp_path / "run"), str(small_disk / "checkpoints")), timeout_s=30,
              join_group=False)
    assert list((small_disk / "checkpoints").iterdir()) == []


def test_readonly_checkpoint_dir_found_before_training(readonly_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        run_job(compose_cfg(COMMON + [f"checkpoint.dir={readonly_dir}/checkpoints"], run_dir))
    assert exc.value.code == 2
    assert "not writable" in _one_line_error(capsys, "checkpoint.dir")
    assert not (run_dir / "metrics.jsonl").exists()  # nothing was trained
    assert read_summary(run_dir)["status"] == "failed"


def test_readonly_run_dir_is_one_line(readonly_dir):
    proc = train_py([f"hydra.run.dir={readonly_dir}/run", "train.max_steps=1"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: hydra.run.dir:") and "not writable" in err[0], err


# ---- resume=auto without a checkpoint; resuming a finished run -------------------------------------------------
def test_resume_auto_without_checkpoint_says_so(tmp_path, capsys):
    run_job(compose_cfg(BASE + ["train.max_steps=1", "resume=auto"], tmp_path))
    out = capsys.readouterr().out
    assert f"resume=auto: no checkpoint in {tmp_path / 'checkpoints'}, starting fresh" in out, out
    assert read_summary(tmp_path)["status"] == "ok"


def test_resuming_a_finished_run_keeps_its_summary(finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    first = read_summary(run_dir)
    run_job(compose_cfg(BASE + ["resume=auto"], run_dir))
    assert "the run was finished, nothing to train" in capsys.readouterr().out
    again = read_summary(run_dir)
    assert again["status"] == "ok" and again["steps"] == 2
    for key in ("first_loss", "final_loss", "final_val_loss"):
        assert again[key] == first[key] and first[key] is not None, key
    assert again["step_time_ms"] == pytest.approx(first["step_time_ms"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002"]
