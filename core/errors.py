"""One exception type for every bad-input error, so `train.py` can print it as one line."""


class ConfigError(ValueError):
    """A config or input that cannot work. The message names the offending key and the fix."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}. Fix: {fix}")


def require(condition: bool, key: str, problem: str, fix: str) -> None:
    """Raise `ConfigError(key, problem, fix)` unless `condition` holds."""
    if not condition:
        raise ConfigError(key, problem, fix)
