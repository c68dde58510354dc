"""The named device mesh every run has, single-process runs included.

Axes follow torchtitan: pp, dp_replicate, dp_shard, cp, tp, ep (degree 1 where unused).
World size is pp * dp_replicate * dp_shard * cp * tp. The data-parallel axes (dp_replicate, dp_shard), tensor
parallelism (tp, `core.distributed.tensor_parallel`), pipeline parallelism (pp, `core.distributed.pipeline`) and expert
parallelism (ep, `core.distributed.expert_parallel`; it adds no ranks but splits dp_shard x cp into groups of ep) are
implemented: a degree above 1 on any other axis is refused
here, before anything runs, rather than trained silently as plain data parallelism. Context parallelism (cp,
`core.distributed.context_parallel`) splits each sequence over cp ranks; the strategies' data-parallel group
('dp') is then dp_replicate x dp_shard x cp (as torchtitan's dp_cp: the cp ranks' gradients of the replicated
weights are averaged with the others), while the batch is split over dp_replicate x dp_shard only (`dp_size`,
`dp_rank`).
One object knows the degrees and hands out sub-meshes and groups; nothing else
recomputes them.
"""
from __future__ import annotations

import datetime
import functools
import gc
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from core.distributed.heartbeat import Heartbeat, RankStalledError
from core.errors import ConfigError, require

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
NOT_IMPLEMENTED_AXES: tuple[str, ...] = ()  # axes no plugin implements yet (refused above 1)
_RANK_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def dist_env_present() -> bool:
    """True when this process was started by torchrun, our elastic launcher or SLURM+submitit."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


DEFAULT_JOIN_TIMEOUT_S = 600.0


def _timed_out(exc: BaseException) -> bool:
    """Whether a collective's error says it timed out. Gloo words it "Timed out waiting 20000ms for recv
    operation to complete", or "Application timeout caused pair closure" where the pair closed on the timeout
    first; NCCL's watchdog "... collective operation timeout ..."."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def init_process_group(backend: str, timeout_s: float, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
                       **kwargs) -> dist.Store:
    """`dist.init_process_group` for a process that will leave through `destroy_process_groups()`.

    Ranks meet through the env:// rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE; under torchrun or our
    launcher, the agent's store) and wait up to `join_timeout_s` for each other there: on a loaded machine
    a peer may start a minute late. Collectives then fail after `timeout_s` (a dead or stuck peer).
    `rank` and `world_size` may be given instead of RANK and WORLD_SIZE. Returns the rendezvous store.

    First imports the torch modules whose signatures say `group=group.WORLD`: those defaults are evaluated
    at import, and imported after the group exists (torch._dynamo imports them, and so does the first
    `normal_` on a meta tensor) they would hold the default group for the life of the process. Imported
    first, their default is None, which means the same thing.
    """
    import torch.distributed.nn.functional  # noqa: F401
    import torch.distributed.optim.zero_redundancy_optimizer  # noqa: F401

    store, rank, world_size = next(dist.rendezvous("env://", rank=kwargs.pop("rank", -1),
                                                   world_size=kwargs.pop("world_size", -1),
                                                   timeout=datetime.timedelta(seconds=join_timeout_s)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return store


def destroy_process_groups() -> None:
    """Leave every process group and free its backends while the interpreter is fully alive.

    A backend's worker threads (gloo's `pt_gloo_runloop`) end only when the last reference to its group
    goes. Left to interpreter shutdown, a worker still releasing a finished collective's tensors must take
    the GIL from a finalizing interpreter, and the process aborts ("terminate called without an active
    exception", pytorch/pytorch#190489); spawned workers and torchrun/SLURM ranks all go through that
    shutdown. Callers drop their own references to groups (DeviceMeshes, strategies) before calling this.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    _clear_dtensor_caches()
    gc.collect()  # groups held only by reference cycles (hooks -> wrapper -> group) go now, threads joined


def _clear_dtensor_caches() -> None:
    """Empty DTensor's memo caches, whose keys and values (sharding specs, mesh topologies, redistribute
    plans) hold DeviceMeshes and through them process groups. Which caches exist differs between torch
    releases, so every lru_cache defined under torch.distributed is cleared; they only memoise."""
    resources = getattr(sys.modules.get("torch.distributed.device_mesh"), "_mesh_resources", None)
    for value in vars(resources).values() if resources is not None else ():
        # DeviceMesh's registry of root, child and flattened meshes (more of it in torch 2.11 than later):
        # every entry holds a mesh and through it its process groups
        if isinstance(value, (dict, list)):
            value.clear()
    if "torch.distributed.tensor" not in sys.modules:
        return
    for obj in gc.get_objects():
        # type(), not isinstance(): some torch objects warn on any attribute access, __class__ included
        if type(obj) is functools._lru_cache_wrapper and str(obj.__module__).startswith("torch.distributed"):
            obj.cache_clear()
    for owner, name in ((torch._C, "_clear_DTensor_sharding_propagator_cache"),  # the C++ fast path's cache
                        (sys.modules.get("torch.distributed.tensor._redistribute"), "clear_redistribute_planner_cache")):
        clear = getattr(owner, name, None)
        if clear is not None:
            clear()


@dataclass
class ParallelMesh:
    """Degrees of every parallel axis plus the device kind; `init()` joins the process group."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0  # a dead or stuck rank ends collectives (and the job) within this
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S  # how long ranks wait for each other to start

    def __post_init__(self) -> None:
        for axis in AXES:
            n = getattr(self, axis)
            require(isinstance(n, int) and n >= 1, f"mesh.{axis}", f"degree must be a positive integer, got {n!r}",
                    f"set mesh.{axis}=1 or more")
        require(self.device in ("auto", "cpu", "cuda"), "mesh.device", f"unknown device {self.device!r}",
                "use mesh.device=auto, cpu or cuda")
        # expert parallelism adds no ranks: ep borrows them from dp_shard x cp (core/distributed/expert_parallel.py)
        require(self.ep == 1 or (self.dp_shard * self.cp) % self.ep == 0, "mesh.ep",
                f"ep={self.ep} does not divide dp_shard x cp = {self.dp_shard} x {self.cp}: expert parallelism "
                "borrows its ranks from those axes", f"set mesh.dp_shard to a multiple of {self.ep} (or mesh.ep=1)")
        for axis in NOT_IMPLEMENTED_AXES:
            n = getattr(self, axis)
            require(n == 1, f"mesh.{axis}", f"{axis}={n}: this parallel axis is not implemented yet",
                    f"set mesh.{axis}=1 and use mesh.dp_shard / mesh.dp_replicate (data), mesh.tp (tensor) or "
                    "mesh.pp (pipeline parallelism)")
        self._device_mesh = None
        self._flat: dict = {}
        self._rank = 0
        self._local_rank = 0
        self._dp_rank, self._cp_rank = 0, 0  # this rank's batch share (dp_replicate x dp_shard) and cp position
        self._initialized = False
        self._heartbeat: Heartbeat | None = None

    # ---- sizes -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        n = 1
        for axis in _RANK_AXES:
            n *= getattr(self, axis)
        return n

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """The mesh as its preset is named (dp1, dp2, ...; conf/mesh/), or its degrees where no preset matches."""
        name = f"dp{self.dp_shard}" if self.dp_replicate == 1 else f"dp_replicate{self.dp_replicate}xdp_shard{self.dp_shard}"
        name += f"_cp{self.cp}" if self.cp > 1 else ""
        return name + (f"_tp{self.tp}" if self.tp > 1 else "") + (f"_pp{self.pp}" if self.pp > 1 else "") \
            + (f"_ep{self.ep}" if self.ep > 1 else "")

    # ---- devices -------------------------------------------------------------
    def device_type(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("mesh.device", "cuda requested but no CUDA device is visible",
                              "run on a GPU machine or set mesh.device=cpu")
        return self.device

    def validate_devices(self) -> None:
        """Refuse meshes that do not fit this machine's GPUs (before any process starts)."""
        if self.device_type() == "cuda":
            have = torch.cuda.device_count()
            nodes = int(os.environ.get("SLURM_NNODES", os.environ.get("GROUP_WORLD_SIZE", "1")) or 1)
            per_node = -(-self.world_size // nodes)
            require(per_node <= have, "mesh", f"{self.describe()} needs {per_node} GPUs per node but {have} are visible",
                    f"use a mesh of at most {have} ranks per node, or mesh.device=cpu for gloo on the CPU")

    # ---- process group -------------------------------------------------------
    def init(self) -> "ParallelMesh":
        """Join the process group (if world > 1), pick this rank's device, build the DeviceMesh."""
        if self._initialized:
            return self
        dev = self.device_type()
        if self.world_size == 1:
            self._rank, self._local_rank = 0, 0
        else:
            require(dist_env_present(), "mesh", f"{self.describe()} has {self.world_size} ranks but this process has no "
                    "RANK/WORLD_SIZE", "start it through train.py (it launches the ranks) or torchrun")
            env_world = int(os.environ["WORLD_SIZE"])
            require(env_world == self.world_size, "mesh",
                    f"the mesh needs {self.world_size} ranks but WORLD_SIZE={env_world}",
                    "make torchrun --nproc_per_node (times nodes) equal the mesh's product of degrees")
            self._rank = int(os.environ["RANK"])
            self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank))
            if dev == "cuda":
                torch.cuda.set_device(self._local_rank)
            if not dist.is_initialized():
                backend = "nccl" if dev == "cuda" else "gloo"
                kw = {"device_id": torch.device("cuda", self._local_rank)} if dev == "cuda" else {}
                store = init_process_group(backend, self.timeout_s, self.join_timeout_s, **kw)
                self._heartbeat = Heartbeat(store, self._rank, self.world_size).start()
            from torch.distributed.device_mesh import init_device_mesh

            shape = tuple(getattr(self, a) for a in _RANK_AXES)
            self._device_mesh = init_device_mesh(dev, shape, mesh_dim_names=_RANK_AXES)
            # keep the flattened mesh: slicing a flattened dim from the root is deprecated (torch 2.11)
            self._flat = {"dp": self._device_mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp")}
            coords = self._device_mesh.get_coordinate()
            self._dp_rank, self._cp_rank = coords[1] * self.dp_shard + coords[2], coords[3]
        self._device = torch.device(dev, self._local_rank) if dev == "cuda" else torch.device("cpu")
        if dev == "cuda" and self.world_size == 1:
            torch.cuda.set_device(self._device)
        self._initialized = True
        return self

    def destroy(self) -> None:
        """Drop this mesh's DeviceMesh, then leave and free the process groups (`destroy_process_groups`)."""
        self._device_mesh, self._flat = None, {}
        self._initialized = False
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        destroy_process_groups()

    def blame_stalled_ranks(self, exc: BaseException) -> RankStalledError | None:
        """For a collective that timed out (`exc`), an error naming the ranks that stopped making progress
        (their heartbeats stood still), to raise instead of blaming this rank; None for other errors."""
        if self._heartbeat is None or not _timed_out(exc):
            return None
        stalled = self._heartbeat.stalled_ranks()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if stalled is None:
            return RankStalledError(f"rank 0 (which hosts the process group's store) of {self.world_size} stopped "
                                    f"answering: rank {self._rank} timed out after {self.timeout_s:g} s "
                                    f"(mesh.timeout_s): {first}")
        if not stalled:
            return None
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in sorted(stalled.items()))
        return RankStalledError(f"{names} of {self.world_size} stopped making progress: rank {self._rank} waited "
                                f"{self.timeout_s:g} s (mesh.timeout_s) for {'it' if len(stalled) == 1 else 'them'} "
                                f"in a collective: {first}")

    # ---- per-rank views --------------------------------------------------------
    @property
    def device_obj(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def is_main(self) -> bool:
        return self._rank == 0

    @property
    def device_mesh(self):
        """The torch DeviceMesh with dims (pp, dp_replicate, dp_shard, cp, tp) and a flattened 'dp' (x cp); None if single."""
        return self._device_mesh

    def submesh(self, name: str):
        """Sub-mesh of one named axis (or the flattened 'dp'); None in a single-process run."""
        if self._device_mesh is None:
            return None
        return self._flat[name] if name in self._flat else self._device_mesh[name]

    def group(self, name: str = "dp") -> Optional[dist.ProcessGroup]:
        """Process group of one axis; None in a single-process run."""
        sub = self.submesh(name)
        return None if sub is None else sub.get_group()

    def dp_group_ranks(self) -> list[list[int]]:
        """The global ranks of every data-parallel group (dp_replicate x dp_shard x cp, one per pp and tp position), in
        one order on every rank: what each rank must pass to `dist.new_group`, once per group, to make a copy of its
        own."""
        if self._device_mesh is None:
            return [[0]]
        grid = self._device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp)
        return grid.permute(0, 4, 1, 2, 3).reshape(-1, self.dp_size * self.cp).tolist()

    @property
    def edp(self) -> int:
        """Ranks holding the same experts under expert parallelism (dp_replicate x dp_shard x cp / ep)."""
        return self.dp_replicate * self.dp_shard * self.cp // self.ep

    def ep_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """The global ranks of every expert-parallel group and of every group holding the same experts (`edp`),
        in one order on every rank. An ep group is ep consecutive ranks of one dp_shard x cp slice."""
        if self._device_mesh is None:
            return [[0]], [[0]]
        grid = self._device_mesh.mesh.permute(0, 4, 1, 2, 3)  # (pp, tp, dp_replicate, dp_shard, cp)
        grid = grid.reshape(self.pp * self.tp, self.dp_replicate, -1, self.ep)  # (.., chunk, position in ep)
        return grid.reshape(-1, self.ep).tolist(), grid.permute(0, 3, 1, 2).reshape(-1, self.edp).tolist()

    @property
    def dp_rank(self) -> int:
        """This rank's share of the batch (its position on dp_replicate x dp_shard; cp ranks share one)."""
        return self._dp_rank

    @property
    def cp_rank(self) -> int:
        return self._cp_rank

    def broadcast_object(self, obj):
        """Rank 0's value of `obj` on every rank (identity on one rank)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
