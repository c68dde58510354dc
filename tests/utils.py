"""Helpers for composing configs and running train.py in tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import core.config  # noqa: F401 - the resolvers train.py registers

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# small, fast defaults for test runs (quiet logger, synthetic-free corpus stays the default)
FAST = ["logger=none", "train.eval_batches=1"]
# the tiny model's first loss on `data=synthetic`, batch 4, trained in one process: every strategy starts there
TINY_SYNTHETIC_FIRST_LOSS = 5.570815086364746


def compose_cfg(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    """The composed config for `overrides` (no Hydra run: paths point at `run_dir`)."""
    extra = [f"paths.run_dir={run_dir}", f"paths.output_root={run_dir}"] if run_dir is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides) + extra)


class _WarmTrain:
    """This test process's `tests/warm_train.py`: train.py runs forked from an interpreter that imported torch, Hydra
    and the trainer once. Started on first use, with the environment this module was imported with (after
    conftest's); it ends when this process does (its request pipe closes)."""

    # variables a fresh interpreter reads at its start (or when torch, OpenMP or Triton load): a run that sets them
    # otherwise than the server has them starts `python train.py` itself
    STARTUP = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "TRITON_", "CUDA_", "TORCH", "LD_")

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.server: subprocess.Popen | None = None
        self.last_pid: int | None = None  # the last run's process, the leader of its session
        self.lock = threading.Lock()  # the server takes one request at a time

    def takes(self, env: dict[str, str]) -> bool:
        # PYTHONWARNINGS the forked run applies itself, on the server's filters (which then must be the defaults).
        # TORCHINDUCTOR_CACHE_DIR torch sets in this process when it first needs the directory (an earlier test), to
        # the default it would compute anyway.
        own = {"TORCHINDUCTOR_CACHE_DIR"} | ({"PYTHONWARNINGS"} if "PYTHONWARNINGS" not in self.env else set())
        return all(env.get(k) == self.env.get(k) for k in set(env) | set(self.env)
                   if k.startswith(self.STARTUP) and k not in own)

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        with self.lock:
            return self._run(argv, env, timeout)

    def _run(self, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "warm_train.py")], cwd=ROOT,
                                           env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, text=True)
        with tempfile.TemporaryDirectory(prefix="warm_train_") as io_dir:
            stdout, stderr = Path(io_dir) / "stdout", Path(io_dir) / "stderr"
            request = {"argv": argv, "cwd": str(ROOT), "env": env, "stdout": str(stdout), "stderr": str(stderr),
                       "timeout": timeout}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            answer = self.server.stdout.readline()
            if not answer:
                raise RuntimeError("tests/warm_train.py ended without answering (run it by hand to see why)")
            result = json.loads(answer)
            self.last_pid = result["pid"]
            out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(["train.py", *argv], timeout, out, err)
        return result["returncode"], out, err


_WARM = _WarmTrain()


def train_py(argv: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python train.py argv...` in the repository, its output captured, as a user would run it: forked from a warm
    interpreter (`tests/warm_train.py`), or a fresh one where `env` sets what an interpreter reads at its start."""
    cmd = [sys.executable, str(ROOT / "train.py"), *argv]
    full_env = {**os.environ, **(env or {})}
    if not _WARM.takes(full_env):
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    code, out, err = _WARM.run(list(argv), full_env, timeout)
    return subprocess.CompletedProcess(cmd, code, out, err)


def run_train(overrides: list[str], run_dir: Path, timeout: float = 300, env: dict | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """`train_py(overrides + [hydra.run.dir=run_dir])`; with `check`, an AssertionError with its output unless it
    ends with 0."""
    proc = train_py([*overrides, f"hydra.run.dir={run_dir}"], timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each logged training step's loss by step number (rows without a loss, e.g. evaluations, are skipped; a step
    logged twice keeps its last row's loss)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def resume_test_overrides(output_root: Path, *extra: str) -> list[str]:
    """The checkpoint-resume tests' shared overrides: the tiny model on synthetic 32-token sequences, every step's
    loss logged, no evaluation, one warm-up step, CPU ranks, quiet; then `extra` (layers, batch, steps, strategy)
    and `output_root`."""
    return ["model=tiny", "data=synthetic", "data.seq_len=32", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=1", "optimizer.warmup_steps=1", "logger=none", "mesh.device=cpu", "mesh.timeout_s=120",
            *extra, f"paths.output_root={output_root}"]


def checkpoint_at_step_2(overrides: list[str], run_dir: Path, require_dcp: bool = True) -> Path:
    """Train `overrides` (via train.py) into `run_dir`, saving every 2 steps; the step-2 checkpoint's directory,
    asserted to hold a torch.distributed.checkpoint (`dcp/`) when `require_dcp`."""
    run_train(overrides + ["checkpoint.every=2"], run_dir, timeout=600)
    step2 = run_dir / "checkpoints" / "step_000002"
    if require_dcp:
        assert (step2 / "dcp").is_dir(), sorted(p.name for p in step2.iterdir())
    return step2


def assert_resumes_like(whole: dict[int, float], checkpoint: Path, common: list[str],
                        targets: dict[str, list[str]], tmp_path: Path, steps: tuple[int, ...], rtol: float,
                        exact: tuple[str, ...] = ("same",)) -> None:
    """Resume `checkpoint` once per target (`common` + its overrides, mesh and world size allowed to change, in
    `tmp_path / name`): each run ends ok, logs exactly `steps`, and has the uninterrupted run's losses `whole` on
    them: bit for bit for the targets named in `exact` (the same ranks doing the same arithmetic), within `rtol`
    relative for the others."""
    for name, overrides in targets.items():
        run_dir = tmp_path / name
        run_train(common + overrides + [f"resume={checkpoint}", "resume_allow_changes=[mesh,world_size]"], run_dir,
                  timeout=600)
        assert read_summary(run_dir)["status"] == "ok"
        resumed = losses_by_step(run_dir)
        assert sorted(resumed) == list(steps), resumed
        for step in steps:
            if name in exact:
                assert resumed[step] == whole[step], (name, step, resumed[step], whole[step])
            else:
                assert abs(resumed[step] - whole[step]) <= rtol * whole[step], (name, step, resumed[step], whole[step])


def assert_refused_in_one_line(overrides: list[str], output_root: Path, starts: str, *words: str) -> None:
    """`python train.py model=tiny data=synthetic mesh.device=cpu logger=none overrides...` exits 2 with one stderr
    line that starts with `starts` and contains every one of `words`, before any run directory is written under
    `output_root`."""
    cmd = [sys.executable, "train.py", "model=tiny", "data=synthetic", "mesh.device=cpu", "logger=none", *overrides,
           f"paths.output_root={output_root}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(starts) and all(w in lines[0] for w in words), proc.stderr
    assert not list(output_root.rglob("summary.json"))  # refused before any run directory
