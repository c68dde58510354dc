"""`hydra/sweeper=validated`: Hydra's basic sweeper that first checks every point of the sweep.

Before any job starts, each point's config is composed and checked: the model and mesh build, the
mesh fits this machine's GPUs (skipped under a SLURM launcher: the cluster's nodes decide), the
strategy can run on the mesh, the batch splits over the data-parallel ranks, and the planner's
predicted peak memory fits the device. Every bad point is listed at once and nothing runs.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.errors import ConfigError
from launchers.preflight import composition_error


def check_point(cfg: DictConfig, check_devices: bool = True) -> None:
    """Raise ConfigError if this composed job config cannot run (no process is started)."""
    from launchers.job import validate

    validate(cfg, check_devices)  # the same checks a single job runs before it starts
    if check_devices or OmegaConf.select(cfg, "planner.device", default="auto") not in (None, "auto"):
        from core.planner import plan

        try:
            prediction = plan(cfg)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a config the planner does not model is not an invalid point
            return
        prediction.check_fits(cfg)


def invalid_points(config_loader, config: DictConfig, job_overrides: List[List[str]],
                   check_devices: bool = True) -> list[str]:
    """One line per point that cannot run: '#i key=v ...: <the ConfigError>'."""
    bad = []
    for i, overrides in enumerate(job_overrides):
        try:
            cfg = config_loader.load_sweep_config(config, list(overrides))
            check_point(cfg, check_devices)
        except ConfigError as e:
            bad.append(f"#{i} {' '.join(overrides)}: {e}")
        except (HydraException, OmegaConfBaseException) as e:  # a point Hydra cannot compose
            bad.append(f"#{i} {' '.join(overrides)}: {composition_error(e)}")
        except Exception as e:  # noqa: BLE001 - a point that cannot even be composed is invalid too
            bad.append(f"#{i} {' '.join(overrides)}: {type(e).__name__}: {e}")
    return bad


class ValidatedSweeper(BasicSweeper):
    """BasicSweeper that refuses the whole sweep, listing every invalid point, before launching any."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[dict] = None,
                 check_devices: Optional[bool] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.check_devices = check_devices

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        # Hydra sets HydraConfig only per job; the sweep dir (and paths.*) may use ${hydra:runtime.cwd}
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        assert self.config is not None and self.hydra_context is not None
        params_conf = self._parse_config() + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(params_conf), None)
        jobs = [job for batch in batches for job in batch]
        check_devices = self.check_devices
        if check_devices is None:  # under SLURM the login node's GPUs say nothing about the compute nodes
            check_devices = "slurm" not in str(OmegaConf.select(self.config, "hydra.launcher._target_", default=""))
        bad = invalid_points(self.hydra_context.config_loader, self.config, jobs, check_devices)
        if bad:
            print(f"error: {len(bad)} of {len(jobs)} sweep points cannot run; nothing was started:", file=sys.stderr)
            for line in bad:
                print(f"  {line}", file=sys.stderr)
            sys.stderr.flush()
            raise SystemExit(2)
        return super().sweep(arguments)
