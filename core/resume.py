"""The resume fingerprint: which config values a checkpoint may only be resumed under.

A checkpoint records the fingerprint of the config that wrote it: every value that changes the
training trajectory (model, data and sequence length, global batch and accumulation, the schedule's
length, optimizer and its hyper-parameters, precision, attention, parallelism, mesh shape, seed,
compile). A resume under a config whose fingerprint differs is refused, naming each differing key,
unless the run lists the key (or a group prefix of it) in `resume_allow_changes`, e.g.
`resume_allow_changes=[train.max_steps]` to lengthen the schedule. Keys that decide the shape or
format of the saved state (`FIXED`) cannot be allowed: that state would not load.
Logging, evaluation, checkpointing and path settings are not part of it.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError

# config groups compared as a whole (every key inside, flattened to dotted names)
_GROUPS = ("model", "data", "optimizer", "precision", "attention_impl", "parallelism", "tensor_parallel")
_TRAIN_KEYS = ("batch_size", "grad_accum_steps", "max_steps")
_MESH_KEYS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
# the saved tensors' shapes and layout depend on these: no override can make such a checkpoint load
FIXED = ("model.d_model", "model.d_ff", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.vocab_size",
         "optimizer.factory._target_", "parallelism._target_", "tensor_parallel._target_")
# the mesh shape too, unless the checkpoint's format reads on any mesh (`reshardable`: tensor-parallel checkpoints)
MESH_FIXED = ("world_size",) + tuple(f"mesh.{k}" for k in _MESH_KEYS)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = tuple(value) if isinstance(value, list) else value


def fingerprint(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """Flat {dotted config key: resolved value} of everything that changes the trajectory."""
    picked = {g: OmegaConf.to_container(cfg[g], resolve=True) for g in _GROUPS}
    picked["train"] = {k: cfg.train[k] for k in _TRAIN_KEYS}
    picked["mesh"] = {k: cfg.mesh[k] for k in _MESH_KEYS}
    picked.update(seed=cfg.seed, compile=bool(cfg.compile), world_size=world_size)
    out: dict[str, Any] = {}
    _flatten("", picked, out)
    return out


def _covers(entry: str, key: str) -> bool:
    return key == entry or key.startswith(entry + ".")


def check_allowed_keys(allowed: Iterable[str], current: dict[str, Any]) -> list[str]:
    """`resume_allow_changes` as a list, every entry naming a fingerprint key or a group of them."""
    entries = [str(e) for e in allowed]
    for e in entries:
        if not any(_covers(e, k) for k in current):
            groups = sorted({k.split(".")[0] for k in current})
            raise ConfigError("resume_allow_changes", f"{e!r} is not a key the resume check compares",
                              "name keys such as train.max_steps or optimizer.lr, or a whole group "
                              f"({', '.join(groups)})")
    return entries


def check_resumable(saved: dict[str, Any], current: dict[str, Any], allowed: Iterable[str], path: Path,
                    reshardable: bool = False) -> None:
    """Refuse (ConfigError) a resume whose config differs from the checkpoint's in keys not allowed.

    Keys the checkpoint does not record (written by an older version) are not compared. The mesh shape may
    change (when allowed) only for a `reshardable` checkpoint."""
    allowed = check_allowed_keys(allowed, current)
    saved_flat: dict[str, Any] = {}
    _flatten("", saved, saved_flat)
    changed = sorted(k for k in saved_flat if k in current and _normal(saved_flat[k]) != _normal(current[k]))
    fixed_keys = FIXED + (() if reshardable else MESH_FIXED)
    fixed = [k for k in changed if k in fixed_keys]
    refused = [k for k in changed if k not in fixed_keys and not any(_covers(e, k) for e in allowed)]
    if not fixed and not refused:
        return
    listing = ", ".join(f"{k} {saved_flat[k]!r} -> {current[k]!r}" for k in fixed + refused)
    if fixed:
        fix = (f"resume with the config that wrote it, or start fresh (resume=null); {', '.join(fixed)} "
               "cannot be changed on resume (the saved state would not fit)")
    else:
        fix = (f"resume with the config that wrote it, start fresh (resume=null), or, if the change is intended, "
               f"allow it: resume_allow_changes=[{','.join(sorted(set(allowed) | set(refused)))}]")
    raise ConfigError("resume", f"checkpoint {path} was written by a different config: {listing}", fix)


def _normal(value: Any) -> Any:
    """Lists and tuples compare alike (checkpoints store lists as tuples)."""
    return tuple(value) if isinstance(value, list) else value
