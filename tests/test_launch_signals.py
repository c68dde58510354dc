"""A sweep that is signalled stops: the point in flight checkpoints and ends with a final status, and no
further point starts. A one-rank point trains in a spawned worker (as on a one-task Slurm job): the
signal reaches the sweep's process and must be forwarded to that worker."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.utils import ROOT


@pytest.mark.slow
def test_preemption_signal_stops_a_multirun_with_a_checkpoint(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "mesh=dp1", "mesh.device=cpu", "parallelism=ddp_bucketed",
           "model=tiny", "data=synthetic", "logger=none", "train.max_steps=100000", "train.log_every=1",
           "train.batch_size=4", "train.eval_every=0", "train.eval_batches=1", "seed=1,2,3", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not any(len(p.read_text().splitlines()) >= 2
                                                 for p in sweep.glob("0_*/metrics.jsonl")):
            time.sleep(0.5)
        assert list(sweep.glob("0_*/metrics.jsonl")), "the first point never started training"
        proc.send_signal(signal.SIGUSR2)
        out, _ = proc.communicate(timeout=120)
    finally:  # never leave a training sweep running behind a failed test
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGUSR2, out[-3000:]
    assert not list(sweep.glob("1_*")), "a stopped sweep went on to the next point"
    point = next(sweep.glob("0_*"))
    s = json.loads((point / "summary.json").read_text())
    assert s["status"] == "preempted" and s["signal"] == "SIGUSR2", s
    assert (point / "checkpoints" / f"step_{s['steps']:06d}").is_dir()
