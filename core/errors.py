"""One exception type for every bad-input error, so `train.py` can print it as one line."""
from __future__ import annotations

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A config or input that cannot work. The message names the offending key and the fix."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}. Fix: {fix}")


def config_error_from(text: str) -> ConfigError | None:
    """The ConfigError whose message is `text` (as another process printed it), or None if `text` is not one."""
    key, sep, rest = text.partition(": ")
    problem, fix_sep, fix = rest.rpartition(". Fix: ")
    if not (sep and fix_sep) or " " in key:
        return None
    return ConfigError(key, problem, fix)


def require(condition: bool, key: str, problem: str, fix: str) -> None:
    """Raise `ConfigError(key, problem, fix)` unless `condition` holds."""
    if not condition:
        raise ConfigError(key, problem, fix)


def exit_on(error: ConfigError) -> NoReturn:
    """Print `error` as the one line a config mistake gets, and exit with code 2."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)
