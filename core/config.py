"""OmegaConf resolvers the configs use; imported by train.py before Hydra composes anything.

`${mul:a,b,...}` multiplies integers, so a preset can scale the global batch with the mesh
(weak scaling): `train.batch_size: ${mul:4,${mesh.dp_replicate},${mesh.dp_shard}}`.

`${unique_dir:path}` is `path`, or `path_2`, `path_3`, ... when that is taken: run and sweep directories'
names have a one-second clock, and two runs (or sweeps) started in the same second must not share one.

`${path_safe:text}` is `text` with each `/` replaced by `∕` (U+2215): a sweep point's directory is named after
its overrides, and a value that is a path (`data.path=/data/x.bin`) must not nest directories.
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


def path_safe(text: str) -> str:
    """`text` usable as one directory name: its path separators replaced by a look-alike."""
    return str(text).replace(os.sep, "\u2215")


if not OmegaConf.has_resolver("path_safe"):
    OmegaConf.register_new_resolver("path_safe", path_safe)
if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs))
if not OmegaConf.has_resolver("unique_dir"):
    # cached: Hydra copies a config's resolver cache into each sweep point's config, and submitit pickles it
    # with the job, so a point (on this host or a Slurm node) gets the directory this process claimed
    OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True)
