"""What a Slurm partition's nodes hold (from `sinfo`), and the check of a job's request against it.

Slurm takes an impossible request in one of two ways: `sbatch` refuses it (GPUs asked of nodes without
them: a gres error deep in submitit) or, worse, accepts it and leaves the job pending forever
(8 CPUs per task on 2-CPU nodes: reason PartitionConfig). Checking the request against the partition
before submitting turns both into one line naming the launcher key and the value that fits.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Optional

from core.errors import ConfigError, require

_GPU_GRES = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")  # gpu:8, gpu:h100:8(S:0-1)


@dataclass(frozen=True)
class Partition:
    """The largest node of a partition, per resource, and how many nodes it has."""

    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    mem_mb: int


def parse_sinfo(text: str, name: Optional[str]) -> Optional[Partition]:
    """Read `sinfo -h -N -o '%P|%N|%c|%G|%m'`: the partition `name`, else the default one (marked '*')."""
    rows = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        part, node, cpus, gres, mem = fields
        is_default = part.endswith("*")
        part = part.rstrip("*")
        if (name is None and is_default) or part == name:
            gpus = sum(int(n) for n in _GPU_GRES.findall(gres))
            rows.append((part, node, _number(cpus), gpus, _number(mem)))
    if not rows:
        return None
    return Partition(name=rows[0][0], nodes=len({r[1] for r in rows}), cpus_per_node=max(r[2] for r in rows),
                     gpus_per_node=max(r[3] for r in rows), mem_mb=max(r[4] for r in rows))


def _number(field: str) -> int:
    digits = re.match(r"\d+", field)
    return int(digits.group()) if digits else 0


def read_partition(name: Optional[str]) -> Optional[Partition]:
    """The partition `name` (None: the cluster's default) as `sinfo` describes it.

    Raises ConfigError if sinfo answers but has no such partition; returns None if sinfo cannot answer.
    """
    command = ["sinfo", "--noheader", "--Node", "--format=%P|%N|%c|%G|%m"]
    try:
        answer = subprocess.run(command + ([f"--partition={name}"] if name else []), capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if answer.returncode != 0:
        return None
    part = parse_sinfo(answer.stdout, name)
    if part is None and name:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
        names = sorted({line.split("|")[0].rstrip("*") for line in listed.splitlines() if "|" in line})
        raise ConfigError("hydra.launcher.partition", f"Slurm has no partition {name!r}",
                          f"choose one of: {', '.join(names) or 'none listed by sinfo'}")
    return part


def choose_gpus(gpus: object, part: Optional[Partition]) -> bool:
    """`hydra.launcher.gpus`: true, false, or auto (GPUs when the partition's nodes have any)."""
    if str(gpus).lower() == "auto":
        return part is None or part.gpus_per_node > 0
    return bool(gpus)


def choose_cpus_per_task(cpus_per_task: object, tasks_per_node: int, part: Optional[Partition]) -> Optional[int]:
    """`hydra.launcher.cpus_per_task`: a number, null (Slurm's default, 1), or auto (up to 8, as the node allows)."""
    if str(cpus_per_task).lower() != "auto":
        return None if cpus_per_task is None else int(cpus_per_task)
    if part is None:
        return 8
    return max(1, min(8, part.cpus_per_node // tasks_per_node))


def check_request(part: Partition, world: int, nodes: int, tasks_per_node: int, cpus_per_task: Optional[int],
                  gpus_per_node: Optional[int], mem_gb: Optional[float]) -> None:
    """Raise ConfigError, naming the launcher key and a value that fits, if no node of `part` can run the job."""
    where = f"partition {part.name!r}"
    require(nodes <= part.nodes, "hydra.launcher.ranks_per_node",
            f"{world} ranks as {nodes} nodes x {tasks_per_node} tasks, but {where} has {part.nodes} node(s)",
            f"use a mesh of at most {part.nodes * tasks_per_node} ranks, or more ranks per node")
    cpus = tasks_per_node * (cpus_per_task or 1)
    if cpus > part.cpus_per_node:
        if tasks_per_node > part.cpus_per_node:
            raise ConfigError("hydra.launcher.ranks_per_node",
                              f"{tasks_per_node} tasks per node, but the nodes of {where} have at most "
                              f"{part.cpus_per_node} CPUs",
                              f"set hydra.launcher.ranks_per_node={part.cpus_per_node} (more nodes) "
                              "or use a smaller mesh")
        raise ConfigError("hydra.launcher.cpus_per_task",
                          f"{tasks_per_node} tasks x {cpus_per_task} CPUs = {cpus} CPUs per node, but the nodes of "
                          f"{where} have at most {part.cpus_per_node} (the job would pend forever)",
                          f"set hydra.launcher.cpus_per_task={part.cpus_per_node // tasks_per_node} "
                          "(or auto)")
    if gpus_per_node:
        require(part.gpus_per_node > 0, "hydra.launcher.gpus", f"the nodes of {where} have no GPUs (no gpu gres)",
                "set hydra.launcher.gpus=false (or auto) for CPU ranks, or choose a GPU partition")
        require(gpus_per_node <= part.gpus_per_node, "hydra.launcher.ranks_per_node",
                f"{gpus_per_node} GPUs per node, but the nodes of {where} have at most {part.gpus_per_node}",
                f"set hydra.launcher.ranks_per_node={part.gpus_per_node}")
    if mem_gb:
        require(mem_gb * 1024 <= part.mem_mb, "hydra.launcher.mem_gb",
                f"{mem_gb} GB per node, but the nodes of {where} have at most {part.mem_mb / 1024:.0f} GB",
                f"set hydra.launcher.mem_gb to at most {part.mem_mb // 1024} (or null)")
