"""train.py started by the user under torchrun: no second spawn, one shared output directory."""
import os
import signal
import subprocess
import sys

from tests.utils import ROOT, read_summary


def test_torchrun_two_ranks_share_rank0_directory(tmp_path):
    run_dir = tmp_path / "run"
    from launchers.local import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "train.py"), "parallelism=zero1", "mesh=dp2", "mesh.device=cpu", "train.max_steps=3",
           "train.log_every=1", "logger=none", "data.max_bytes=100000", "train.batch_size=4",
           "checkpoint.at_end=true", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    finally:  # a hang must fail the test, not leave ranks running
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    s = read_summary(run_dir)
    assert s["status"] == "ok" and s["world_size"] == 2 and s["parallelism"] == "zero1"
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_000003" / "dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote into rank 0's run directory
    assert not (tmp_path / "scalelab_rank1" / "metrics.jsonl").exists()  # rank 1 logged nothing
