"""summary.json, the one file that says how a run ended: written atomically (a reader never sees half of it)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def write_summary(run_dir: Path, summary: dict[str, Any], replace: bool = False) -> None:
    """Merge `summary` into the run's summary.json (keys written earlier, e.g. by the job, survive), or with
    `replace` start it anew."""
    path = Path(run_dir) / "summary.json"
    existing = {} if replace or not path.is_file() else json.loads(path.read_text())
    write_json_atomic(path, {**existing, **summary})
