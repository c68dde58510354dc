"""Config mistakes caught before anything runs: one line naming the key and the fix, exit code 2.

A config is checked at two points, both before a run directory exists:

- `check_command_line(argv)`, called by train.py before Hydra starts: the command line composes.
  Hydra's own errors (an unknown group option, a misspelt key, a malformed override) become one
  `ConfigError` listing the valid options or the closest key, instead of Hydra's multi-line report.
- `PreflightCallback.on_run_start` (`hydra.callbacks.preflight`): the composed config of a single run
  passes the job's checks (`launchers.job.validate`, which starts with `check_complete`: every
  mandatory value given, no group of settings replaced by a value); `plan=true` prints its plan and
  ends here.
  Hydra calls it before it creates the run directory, so a refused or plan-only run writes nothing.

A multirun's points are checked by the validated sweeper (launchers/sweeper.py) with the same checks.
"""
from __future__ import annotations

import difflib
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from core.errors import ConfigError, exit_on


def _closest(word: str, choices: list[str]) -> str | None:
    near = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return near[0] if near else None


def composition_error(exc: Exception) -> ConfigError:
    """The one-line ConfigError for a mistake Hydra found while composing a config."""
    if isinstance(exc, MissingConfigException) and exc.options and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        near = _closest(option, list(exc.options))
        return ConfigError(group, f"there is no option '{option}'" + (f" (did you mean {near}?)" if near else ""),
                           f"use one of {', '.join(exc.options)}")
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key and isinstance(cause.parent_node, DictConfig):
        # a key the config does not have (Hydra composes in struct mode): name the closest existing one
        parent = cause.full_key.rpartition(".")[0]
        siblings = [str(k) for k in cause.parent_node.keys() if k != "hydra"]
        near = _closest(str(cause.key), siblings)
        where = f"{parent}." if parent else ""
        fix = (f"did you mean {where}{near}?" if near else f"the keys of {parent or 'the config'} are {', '.join(siblings)}")
        return ConfigError(cause.full_key, "the config has no such key",
                           f"{fix} (a new key needs a leading +: +{cause.full_key}=...)")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if "Config search path:" in lines:  # Hydra appends where it looked; the options above are what matters
        lines = lines[:lines.index("Config search path:")]
    problem = lines[0].rstrip(".") if lines else type(exc).__name__
    fix = " ".join(lines[1:]) or "check the command line; python train.py --help lists the config groups and options"
    return ConfigError("command line", problem, fix)


def check_command_line(argv: list[str], config_dir: str, config_name: str) -> None:
    """Raise ConfigError if the command line `argv` does not compose, as Hydra would compose it.

    Only runs and multiruns are checked (`--help`, `--cfg`, `--info`... are Hydra's own business,
    as is a command that adds a config directory). For a multirun the sweep's fixed overrides are
    composed here; each point is composed and checked by the validated sweeper.
    """
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses

    args = get_args_parser().parse_args(argv)
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun
            or args.config_dir or args.config_path):
        return
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
        fixed = [o.input_line for o in overrides if not (args.multirun and o.is_sweep_override())]
        with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="train"):
            compose(args.config_name or config_name, fixed)
    except (HydraException, OmegaConfBaseException) as e:
        raise composition_error(e) from None


class PreflightCallback(Callback):
    """Checks a single run's config before Hydra creates the run directory; `plan=true` ends the run here."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from launchers.job import config_error_in, plan_only, validate

        try:
            validate(config)
            if config.plan:
                plan_only(config)
        except Exception as e:  # noqa: BLE001 - only bad input is reported here
            error = config_error_in(e)
            if error is None:
                return  # not bad input: the job meets it again and reports it with its traceback
            exit_on(error)
        if config.plan:
            raise SystemExit(0)  # the plan was the whole run: Hydra must not create a run directory for it
