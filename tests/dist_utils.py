"""Multi-rank gloo tests: free port, per-test timeout, the failing rank's traceback (ranks start from a forkserver).

    run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) runs in each rank

Each rank joins a gloo process group (CPU) with a short collective timeout, so a broken
test fails within `timeout_s` instead of hanging CI; ranks wait for each other to start much
longer (`init_process_group`'s join timeout), since a loaded CI machine starts them late.
Several checks should share one run: starting a group costs seconds.
"""
from __future__ import annotations

import os
import random
import socket
import time
import traceback
from multiprocessing.context import BaseContext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.distributed.mesh import destroy_process_groups, init_process_group


_PORT_BAND = 2000  # ports per pytest-xdist worker
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port the kernel hands out on its own (to connections' local ends and to bind(0))."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port that is free now and stays free until a rendezvous binds it, maybe many seconds later.

    A port from bind(0) comes from the kernel's ephemeral range, which the kernel keeps handing out to other
    sockets (gloo's own connections among them): a port reserved for a later run was then taken by the time that
    run started (EADDRINUSE). So the port is chosen below that range, in a band of its own per xdist worker (no
    two workers pick the same one), and never twice in one process."""
    low = _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    start = 10000 + (int(worker) if worker.isdigit() else 0) * _PORT_BAND
    if start + _PORT_BAND > low:  # no room below the ephemeral range: let the kernel choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    for port in rng.sample(range(start, start + _PORT_BAND), _PORT_BAND):
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {start}-{start + _PORT_BAND - 1}")


def _worker(rank: int, world_size: int, port: int, fn, args, timeout_s: float, err_q, join_group: bool,
            env: dict[str, str]) -> None:
    os.environ.clear()  # the starting process's environment now, not the forkserver's from its start
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        if join_group:
            init_process_group("gloo", timeout_s, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        if join_group:
            dist.barrier()
        # a worker whose gloo threads still run when it exits can abort the process
        destroy_process_groups()
        left = backend_threads()
        assert not left, f"{len(left)} process-group threads outlived the group: something still holds it: {left}"
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        err_q.put((rank, traceback.format_exc()))
        raise
    finally:
        destroy_process_groups()


def backend_threads() -> list[str]:
    """Names of this process's gloo threads (Linux; empty elsewhere): they live as long as their group."""
    names = []
    if os.path.isdir("/proc/self/task"):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended while we looked
                pass
    return [n for n in names if n.startswith(("pt_gloo", "gloo"))]


# What every rank imports before it runs its function. Each rank forks from a forkserver that imported these once
# per test process, instead of being a fresh interpreter that imports torch and the trainer again: seconds of CPU per
# rank on a 2-core machine, and the suite starts well over a hundred ranks. The forkserver is a fresh interpreter of
# its own (no threads, no process group, no CUDA), started at the first run; the ranks still get this process's
# working directory, sys.path and environment as at their start, as spawned ones would.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "core.trainer", "tests.utils"]


def _rank_context() -> BaseContext:
    """The multiprocessing context the ranks start in: forkserver with `_PRELOAD` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn, world_size: int = 2, args: tuple = (), timeout_s: float = 60.0, join_group: bool = True,
              deadline_s: float = 600.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise with the first rank's traceback.

    `timeout_s` bounds each collective; `deadline_s` the whole run (a hang outside collectives).

    With `join_group=False` the ranks get only the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and
    `fn` joins and leaves the process group itself, as `core.trainer.train` does.
    """
    ctx = _rank_context()
    err_q = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, timeout_s, err_q, join_group, env),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not err_q.empty():
        errors.append(err_q.get())
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        raise AssertionError(f"{len(alive)} rank(s) still running after {deadline_s:.0f}s (hang)")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"rank(s) exited abnormally: {bad}")


# ---- CS336-style toy models ------------------------------------------------------------------
class ToyModel(torch.nn.Module):
    """CS336 section 5 toy model: Linear, LayerNorm, Linear, with a frozen parameter."""

    def __init__(self, d_in: int = 10, d_out: int = 5) -> None:
        super().__init__()
        nn = torch.nn
        self.fc1 = nn.Linear(d_in, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, d_out, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_fixed_param = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x):
        return self.fc2(self.relu(self.ln(self.fc1(x))))


class ToyTiedModel(torch.nn.Module):
    """Token embedding tied to the output head, a frozen Linear, a biased Linear, a norm."""

    def __init__(self, vocab: int = 37, d: int = 12) -> None:
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.fc1 = nn.Linear(d, 3 * d, bias=True)
        self.ln = nn.LayerNorm(3 * d)
        self.fc2 = nn.Linear(3 * d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        x = self.frozen(self.emb(tokens))
        x = x + self.fc2(self.ln(torch.relu(self.fc1(x))))
        return self.head(x)


def toy_batches(kind: str, steps: int, batch: int = 8, seed: int = 123):
    """Deterministic (input, target) batches, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "toy":
            out.append((torch.randn(batch, 10, generator=g), torch.randint(0, 5, (batch,), generator=g)))
        else:
            out.append((torch.randint(0, 37, (batch, 6), generator=g), torch.randint(0, 37, (batch, 6), generator=g)))
    return out


def toy_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_toy(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ToyModel() if kind == "toy" else ToyTiedModel()
