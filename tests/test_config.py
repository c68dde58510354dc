"""Every config option composes and builds its plugin."""
from pathlib import Path

import pytest
from hydra.utils import instantiate

from tests.utils import CONF, compose_cfg

GROUPS = ["model", "precision", "attention_impl", "parallelism", "mesh", "data", "optimizer", "logger",
          "experiment", "debug"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option, tmp_path):
    cfg = compose_cfg([f"{group}={option}"] + (["data.path=/dev/null"] if option == "tokens" else []), tmp_path)
    assert cfg.paths.run_dir == str(tmp_path)
    node = cfg.get(group) if group not in ("experiment", "debug") else None
    if group in ("model", "precision", "mesh", "parallelism"):
        obj = instantiate(node)
        assert obj is not None
    elif group == "attention_impl" and option != "compiled" and option != "flash_triton":
        assert callable(instantiate(node))
    elif group == "logger":
        for sub in node.values():
            assert "_target_" in sub


def test_groups_listed_in_defaults_exist():
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"


def test_cs336_model_sizes():
    from core.model import ModelConfig

    sizes = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16), "large": (1280, 5120, 36, 20),
             "xl": (2560, 10240, 32, 32), "10b": (4608, 12288, 50, 36), "leaderboard_8b": (4096, 11008, 34, 32)}
    for name, (d, dff, layers, heads) in sizes.items():
        m: ModelConfig = instantiate(compose_cfg([f"model={name}"]).model)
        assert (m.d_model, m.d_ff, m.n_layers, m.n_heads) == (d, dff, layers, heads)
        assert m.context_length == 512
        assert m.vocab_size == (151936 if name == "leaderboard_8b" else 10000)
    xl = instantiate(compose_cfg(["model=xl"]).model)
    assert 3.39e9 < xl.num_params() < 3.42e9  # the reference's "3.4B params"
