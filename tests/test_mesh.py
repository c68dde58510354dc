"""Mesh axes: those no strategy implements yet are refused with one line, by the mesh and by train.py; the
implemented ones are accepted and named as their presets."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.distributed.mesh import ParallelMesh
from core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("axis", ["cp", "ep"])
def test_unimplemented_axes_are_refused(axis):
    with pytest.raises(ConfigError) as e:
        ParallelMesh(dp_shard=2, **{axis: 2})
    assert str(e.value).startswith(f"mesh.{axis}: {axis}=2: this parallel axis is not implemented yet. Fix: "
                                   f"set mesh.{axis}=1")


def test_data_parallel_axes_are_accepted_and_named_as_presets():
    assert ParallelMesh(dp_shard=2).describe() == "dp2" and ParallelMesh().describe() == "dp1"
    hsdp = ParallelMesh(dp_replicate=2, dp_shard=2)
    assert hsdp.world_size == hsdp.dp_size == 4 and hsdp.describe() == "dp_replicate2xdp_shard2"


def test_tensor_parallel_axis_is_accepted_and_named_as_presets():
    """tp multiplies the world but not the data-parallel ranks; the name is the preset's (conf/mesh/dp2_tp2.yaml)."""
    m = ParallelMesh(dp_shard=2, tp=2)
    assert (m.world_size, m.dp_size, m.describe()) == (4, 2, "dp2_tp2")
    assert ParallelMesh(tp=2).describe() == "dp1_tp2"
    for preset in ("dp1_tp2", "dp2_tp2"):
        assert (ROOT / "conf" / "mesh" / f"{preset}.yaml").is_file()


def test_pipeline_axis_is_accepted_and_named_as_presets():
    """pp multiplies the world but not the data-parallel ranks; the name is the preset's (conf/mesh/dp2_pp2.yaml)."""
    m = ParallelMesh(dp_shard=2, pp=2)
    assert (m.world_size, m.dp_size, m.describe()) == (4, 2, "dp2_pp2")
    assert ParallelMesh(pp=2).describe() == "dp1_pp2"
    for preset in ("dp1_pp2", "dp2_pp2"):
        assert (ROOT / "conf" / "mesh" / f"{preset}.yaml").is_file()


def test_train_py_refuses_expert_parallelism_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "model=tiny", "mesh=dp2", "mesh.ep=2", "mesh.device=cpu",
                        "parallelism=ddp_bucketed", f"paths.output_root={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "mesh.ep: ep=2: this parallel axis is not implemented yet" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))
