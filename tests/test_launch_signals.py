"""A sweep that is killed stops: the point in flight is marked killed and no further point starts."""
import os
import signal
import subprocess
import sys
import time

from tests.utils import ROOT


def test_sigterm_stops_a_multirun(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "mesh=dp2", "mesh.device=cpu", "parallelism=ddp_bucketed",
           "model=tiny", "data=synthetic", "logger=none", "train.max_steps=100000", "train.log_every=50",
           "seed=1,2,3", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(sweep.glob("0_*/metrics.jsonl")):
            time.sleep(0.5)
        assert list(sweep.glob("0_*/metrics.jsonl")), "the first point never started training"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:  # never leave a training sweep running behind a failed test
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out[-2000:]
    assert not list(sweep.glob("1_*")), "a killed sweep went on to the next point"
    assert '"killed"' in next(sweep.glob("0_*/summary.json")).read_text()
