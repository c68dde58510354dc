"""Where the benchmark scripts write their raw results: `outputs/bench/<script>/<timestamp><suffix>` under the
current directory by default (git-ignored, like train.py's run directories), never into the source tree.
Every script's `--out` overrides it."""
from __future__ import annotations

import datetime
from pathlib import Path


def default_out(script: str, suffix: str = ".md") -> Path:
    """A new file for one run of `script`, named after the local time it started."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return Path("outputs") / "bench" / script / f"{stamp}{suffix}"


def write_result(path: str | Path, text: str) -> Path:
    """Write `text` to `path`, creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
