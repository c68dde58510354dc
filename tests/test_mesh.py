"""Mesh axes: the implemented ones are accepted and named as their presets; ep borrows its ranks from dp_shard x cp
(train.py's refusals of expert parallelism: tests/test_expert_parallel.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from core.distributed.mesh import ParallelMesh
from core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_expert_axis_borrows_data_parallel_ranks():
    """ep adds no ranks (it splits dp_shard x cp into groups of ep); one that does not divide them is refused."""
    m = ParallelMesh(dp_shard=4, ep=2)
    assert (m.world_size, m.dp_size, m.edp, m.describe()) == (4, 4, 2, "dp4_ep2")
    with pytest.raises(ConfigError) as e:
        ParallelMesh(dp_shard=2, ep=4)
    assert str(e.value).startswith("mesh.ep: ep=4 does not divide dp_shard x cp = 2 x 1")


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
