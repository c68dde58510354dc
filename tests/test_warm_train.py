"""The tests' warm `python train.py` (tests/warm_train.py) behaves as the command does."""
import os
import subprocess
import sys
import time

import pytest

from tests.utils import ROOT, _WARM, train_py


def test_a_forked_run_exits_and_reports_as_the_command_does(tmp_path):
    """A config mistake: the same exit code and the same one-line message as `python train.py`; a finished run: exit
    0, its output and files."""
    bad = ["model=tiny", "train.batch_size=0", f"hydra.run.dir={tmp_path}/bad"]
    assert _WARM.takes({**os.environ})
    warm = train_py(bad, timeout=120)
    cold = subprocess.run([sys.executable, "train.py", *bad], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert warm.returncode == cold.returncode == 2, (warm.stderr[-2000:], cold.stderr[-2000:])
    assert warm.stderr == cold.stderr and len(warm.stderr.strip().splitlines()) == 1, (warm.stderr, cold.stderr)
    ok = train_py(["model=tiny", "data=synthetic", "data.seq_len=32", "train.max_steps=2", "train.eval_every=0",
                   "train.eval_batches=1", "logger=none", f"hydra.run.dir={tmp_path}/ok"], timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "[scalelab]" in ok.stdout and (tmp_path / "ok" / "summary.json").is_file()


def test_a_run_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    """Past the timeout: TimeoutExpired, and the run's whole session (launcher, forkserver, ranks) is gone."""
    argv = ["model=tiny", "data=synthetic", "data.seq_len=32", "train.max_steps=1000000", "train.eval_every=0",
            "logger=none", "mesh=dp2", "mesh.device=cpu", "parallelism=ddp_bucketed", f"hydra.run.dir={tmp_path}/run"]
    with pytest.raises(subprocess.TimeoutExpired):
        train_py(argv, timeout=20)
    session = _WARM.last_pid
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # SIGKILLed processes leave once the kernel has reaped them
        left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _alive_in(pid, session)]
        if not left:
            break
        time.sleep(0.5)
    assert not left, left


def _alive_in(pid: int, session: int) -> bool:
    """Whether process `pid` is alive (not a zombie) in session `session`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[3]) == session
