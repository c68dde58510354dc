"""Hydra instantiates sweepers and launchers only from classes defined under the `hydra_plugins`
namespace package: these subclasses are the names `hydra/sweeper=validated` and `hydra/launcher=slurm`
use. The code lives in launchers/sweeper.py and launchers/slurm.py."""
from launchers.slurm import ScalelabSlurmLauncher as _ScalelabSlurmLauncher
from launchers.sweeper import ValidatedSweeper as _ValidatedSweeper


class ValidatedSweeper(_ValidatedSweeper):
    __doc__ = _ValidatedSweeper.__doc__


class ScalelabSlurmLauncher(_ScalelabSlurmLauncher):
    __doc__ = _ScalelabSlurmLauncher.__doc__
