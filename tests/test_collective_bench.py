"""experiments/collective_bench.py runs under torchrun (2 gloo ranks) and reports bus bandwidth by the ring factor."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.collective_bench import bus_factor

ROOT = Path(__file__).resolve().parents[1]


def test_bus_factor_is_the_ring_traffic_per_rank():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 3 / 4


def test_runs_under_torchrun_on_gloo(tmp_path):
    out = tmp_path / "coll.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "experiments" / "collective_bench.py"), "--sizes-mib", "0.25,1",
                           "--iters", "2", "--warmup", "1", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| all_")
            or line.startswith("| reduce_")]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [
        (k, s) for k in ("all_reduce", "all_gather", "reduce_scatter") for s in ("0.25", "1")]
    for r in rows:
        kind, mib, ms, algbw, busbw = r[0].strip(), float(r[2]), float(r[3]), float(r[4]), float(r[5])
        assert ms > 0
        # the table's bandwidths follow from its own size and time (to the printed rounding): algbw is the
        # buffer over the time, busbw that times the ring factor (2 ranks: 1 for all-reduce, 1/2 otherwise)
        assert algbw == pytest.approx(mib * 2**20 / (ms / 1e3) / 1e9, rel=0.02, abs=0.06), r
        assert busbw == pytest.approx(algbw * (1.0 if kind == "all_reduce" else 0.5), abs=0.06), r
