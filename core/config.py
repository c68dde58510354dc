"""OmegaConf resolvers the configs use; imported by train.py before Hydra composes anything.

`${mul:a,b,...}` multiplies integers, so a preset can scale the global batch with the mesh
(weak scaling): `train.batch_size: ${mul:4,${mesh.dp_replicate},${mesh.dp_shard}}`.

`${unique_dir:path}` is `path`, or `path_2`, `path_3`, ... when that is taken: the run directory's
name has a one-second clock, and two runs started in the same second must not share a directory.
"""
import itertools
import math
import os
from pathlib import Path

from omegaconf import OmegaConf

_claimed: dict[str, str] = {}  # requested path -> the directory this process claimed for it


def unique_dir(path: str) -> str:
    """Create and return a directory no other process has: `path`, else the first free `path_N`.

    `os.mkdir` fails if the directory exists, so of two processes asking at the same instant only
    one gets each name. Resolving the same `path` again in this process returns the directory it
    claimed (Hydra resolves `hydra.run.dir` from copies of the config).
    """
    if path not in _claimed:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            candidate = path if n == 1 else f"{path}_{n}"
            try:
                os.mkdir(candidate)
            except FileExistsError:
                continue
            _claimed[path] = candidate
            break
    return _claimed[path]


if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs))
if not OmegaConf.has_resolver("unique_dir"):
    OmegaConf.register_new_resolver("unique_dir", unique_dir)
