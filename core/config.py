"""OmegaConf resolvers the configs use; imported by train.py before Hydra composes anything.

`${mul:a,b,...}` multiplies integers, so a preset can scale the global batch with the mesh
(weak scaling): `train.batch_size: ${mul:4,${mesh.dp_replicate},${mesh.dp_shard}}`.
"""
import math

from omegaconf import OmegaConf

if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs))
