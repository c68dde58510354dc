"""Start one job's N worker ranks on this machine through torch.distributed's elastic launch API.

The Hydra job has already composed and resolved its config (one output directory, one `${now:}`);
each worker receives that resolved config and its thread count as arguments, reads nothing but what
elastic provides (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and calls `core.trainer.train(cfg)`.
Every job rendezvouses on its own free localhost port, so sweep jobs can run one after another.

Ranks fork from a forkserver that imported torch and the trainer once (`FORKSERVER_PRELOAD`; one per launching
process, so a local sweep's points share it) instead of each being a fresh interpreter that imports them again:
seconds of CPU per rank, most of a small run's time. The forkserver never initialises CUDA or joins a process group,
and a rank takes the launching process's environment and working directory as they are at its launch
(`_adopt_launch_state`), as a spawned one would.

Signals: the parent records a stop signal (`core.stop`) and forwards it to every worker; the workers
checkpoint at the next step boundary and return, and the parent returns rank 0's summary. Elastic
itself keeps only SIGHUP and SIGQUIT (stop the workers at once; SIGQUIT first prints each worker's stacks).
If one rank fails, the others are stopped (SIGTERM from elastic, SIGKILL from us `_KILL_AFTER_S` later) and
we raise one `WorkerFailedError` naming the failed rank, its exception and its last frames; a rank that
stopped making progress is named as the culprit, not the peer that timed out waiting for it.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core import stop
from core.distributed.heartbeat import RankStalledError
from core.errors import ConfigError, config_error_from

# NVLink SHARP (multicast) is kept off: not every NVLink machine provides it, and NCCL fails where it is missing
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "TORCH_NCCL_ENABLE_TIMING": "1",  # per-collective durations for comm_ms
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


class WorkerFailedError(RuntimeError):
    """A worker rank raised or died; the message names the rank and its error."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(cfg: DictConfig) -> int:
    """`launcher.port` from the config if set (it must be free), else a free port."""
    requested = OmegaConf.select(cfg, "launcher.port", default=None)
    if requested in (None, "", 0, "0"):
        return free_port()
    port = int(requested)
    if not port_is_free(port):
        raise ConfigError("launcher.port", f"port {port} on 127.0.0.1 is already in use (another job or process)",
                          "leave launcher.port unset to pick a free port, or choose a free one")
    return port


# What the forkserver imports before it forks the first rank (what it cannot import, a rank imports itself).
# Besides the trainer, what every rank imports anyway, seconds of CPU each: torch._dynamo (the optimizer's
# `__init__` is wrapped in `_disable_dynamo`) and the two modules `init_process_group` imports first
# (torch.distributed.optim scripts its functional optimizers with TorchScript at import). Last, the
# forkserver's own fast exit.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo",
                      "torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer",
                      "core.trainer", "launchers.local", "launchers.forkserver_exit"]
# The environment this module was imported with, and where. Imported in the forkserver, that is the environment
# every rank inherits (the preloads change none), so in a rank what differs from it is what elastic set for the
# rank (RANK, MASTER_PORT, ...).
_IMPORTED_IN, _IMPORT_ENV = os.getpid(), dict(os.environ)

# After a rank failed, its peers wait on it and cannot finish: SIGKILL them this long after (time to report
# an error of their own).
_KILL_AFTER_S = 2
# A failed worker ends within this of reporting its error, or is killed (before its peers).
_EXIT_GRACE_S = 5
# Signals elastic's agent keeps for itself in the parent; the stop signals are `core.stop`'s.
_ELASTIC_SIGNALS = "SIGHUP,SIGQUIT"
# Lines of a failed rank's exception message relayed in `WorkerFailedError` (DCP's carry every rank's traceback).
_MESSAGE_LINES = 40


def threads_per_rank(nproc: int) -> int:
    """CPU threads for each of `nproc` ranks started here: OMP_NUM_THREADS where it is set (a per-process count, as
    torchrun reads it), else the CPUs this process may run on shared among the ranks: its affinity mask, and in a
    Slurm task no more than the task's cpus-per-task (Slurm need not pin a task to them). More busy threads than
    CPUs leave OpenMP's threads spinning for each other: a one-rank Slurm task taking the node's every core for its
    one-CPU share trained 11 times slower on a busy node."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if "SLURM_JOB_ID" in os.environ and per_task.isdigit() and int(per_task) > 0:
        cpus = min(cpus, int(per_task))
    return max(1, cpus // nproc)


def _worker_entry(cfg_container: dict[str, Any], threads: int, events: Any) -> Any:
    """One rank: record stop signals, report its pid on `events`, rebuild the resolved config and train with
    `threads` CPU threads."""
    import faulthandler

    with stop.handling_stop_signals():
        events.put(("started", os.getpid()))  # from now on the parent may forward stop signals here
        # `kill -QUIT <worker pid>` (or Ctrl-\\) prints every thread's Python stack, then ends the worker
        faulthandler.register(signal.SIGQUIT, all_threads=True, chain=True)
        import torch

        from core.trainer import train

        torch.set_num_threads(threads)  # CPU ranks share the cores instead of each taking all of them
        return train(OmegaConf.create(cfg_container))


def _end_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this rank as soon as the launching process ends. Ranks are the forkserver's children, and it stays
    up while they do (each holds its liveness pipe), so nothing else ends them when the launcher is killed
    outright (SIGKILL, a Slurm job cancelled or requeued): they would train on, or wait forever for it to read
    their results. Watches a pidfd (Linux 5.3+); elsewhere does nothing."""
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # it has already ended
        os._exit(1)
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([launcher], [], [])  # readable once the launcher has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="scalelab-launcher-watch", daemon=True).start()


def _adopt_launch_state(env: dict[str, str], cwd: str) -> None:
    """Give this rank the launching process's environment `env` and working directory `cwd` as they were at the
    launch, with the variables elastic set for the rank on top. A rank forked from the forkserver starts with the
    forkserver's, as they were when it started (for an earlier sweep point, which Hydra's `hydra.job.env_set`
    and `hydra.job.chdir` may have given others)."""
    if _IMPORTED_IN != os.getpid():  # imported in the forkserver, before elastic set this rank's variables
        rank_env = {k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(rank_env)
    else:  # imported in this rank, after them (a forkserver started elsewhere): add what is missing
        for k, v in env.items():
            os.environ.setdefault(k, v)
    os.chdir(cwd)


def _recorded_entry(cfg_container: dict[str, Any], threads: int, events: Any, env: dict[str, str], cwd: str,
                    launcher_pid: int) -> Any:
    """`_worker_entry` in the launching process's environment and directory (`_adopt_launch_state`), ending with
    the launcher (`_end_with_launcher`), and recording any failure (BaseExceptions such as DCP's
    CheckpointException included, which elastic's `record` lets pass) in the error file elastic reads back for the
    parent's message."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop.STOP_SIGNALS)  # blocked in the forkserver (`_start_forkserver`)
    _end_with_launcher(launcher_pid)
    _adopt_launch_state(env, cwd)
    handler = get_error_handler()
    handler.initialize()
    try:
        result = _worker_entry(cfg_container, threads, events)
        events.put(("finished", os.getpid()))
        return result
    except SystemExit as e:
        if not e.code:
            events.put(("finished", os.getpid()))
            return None
        handler.record_exception(e)
        events.put(("failed", os.getpid()))
        raise
    except BaseException as e:
        handler.record_exception(e)
        events.put(("failed", os.getpid()))
        raise


def _last_frames(callstack: str, n: int = 3) -> list[str]:
    """The last `n` frames of a formatted traceback, one line each: `file:line in function: code`."""
    lines = callstack.splitlines()
    frames = []
    for i, line in enumerate(lines):
        if line.startswith('  File "'):
            where = line.strip()[len('File "'):]
            path, _, rest = where.partition('", line ')
            lineno, _, func = rest.partition(", in ")
            code = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
            frames.append(f"{path}:{lineno} in {func}" + (f": {code}" if code else ""))
    return frames[-n:]


def failure_message(failure: Any) -> tuple[str, list[str]]:
    """A failed rank's exception type and message (up to `_MESSAGE_LINES` lines) and its last frames, or how
    its process ended when it left no exception (and no frames)."""
    data = getattr(failure, "message", None)
    text, callstack = (data.get("message", ""), data.get("extraInfo", {}).get("py_callstack", "")) \
        if isinstance(data, dict) else (str(data or ""), "")
    code = getattr(failure, "exitcode", None)
    if not text or getattr(failure, "error_file", "<N/A>") == "<N/A>":
        sig = failure.signal_name() if code is not None and code < 0 else ""
        return f"exited with code {code}" + (f" ({sig})" if sig else "") + " without a Python exception (killed?)", []
    lines = text.strip().splitlines()
    if len(lines) > _MESSAGE_LINES:
        lines = lines[:_MESSAGE_LINES] + [f"... ({len(lines) - _MESSAGE_LINES} more lines)"]
    return "\n".join(lines), _last_frames(callstack)


def _ended(pid: int) -> bool:
    """Whether a worker has ended. Workers are the forkserver's children, not this process's: it reaps each one as
    it ends, so the pid goes at once, and only elastic learns the exit code (through the forkserver)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        pass


def _supervise_workers(events: Any, done: threading.Event) -> None:
    """While the workers run: send the stop signal this process recorded to each worker once, and once a worker
    has failed and exited, SIGKILL the others `_KILL_AFTER_S` later.

    Workers report ("started", pid) on `events` once their own stop handlers are in place, so a forwarded
    signal never meets a worker still starting, ("failed", pid) when they raise, and ("finished", pid) when they
    return: one that ends without either was killed or exited without an exception. Elastic sends the
    other workers SIGTERM when one fails, but waits 30 s (fixed in torch.multiprocessing) before its
    SIGKILL: a stopped or wedged rank never reacts to SIGTERM, and the job would outlive its
    `mesh.timeout_s` by that much. The failed worker must be the first to end (elastic names the first
    one that ended): one that does not exit within `_EXIT_GRACE_S` of its report is killed first."""
    pids: list[int] = []
    signalled: set[int] = set()
    finished: set[int] = set()
    failed: dict[int, float] = {}  # reported failures: pid -> when
    ended_at = None  # when the first failed worker had ended

    def read_events() -> None:
        while not events.empty():
            event, pid = events.get()
            if event == "started":
                pids.append(pid)
            elif event == "finished":
                finished.add(pid)
            else:
                failed.setdefault(pid, time.monotonic())

    while not done.wait(0.1):
        read_events()
        ended = {pid for pid in (*pids, *failed) if _ended(pid)}
        read_events()  # a report sent just before its worker ended
        now = time.monotonic()
        for pid in ended - finished:
            failed.setdefault(pid, now)  # ended without returning: killed, no exception to report
        if ended_at is None:
            for pid, since in failed.items():
                if pid in ended:
                    ended_at = now
                elif now - since > _EXIT_GRACE_S:
                    _send(pid, signal.SIGKILL)
        sig = stop.requested()
        for pid in pids:
            if pid in ended:
                continue
            if ended_at is not None and now - ended_at > _KILL_AFTER_S:
                _send(pid, signal.SIGKILL)
            elif sig is not None and pid not in signalled:
                signalled.add(pid)
                _send(pid, sig)


def _start_forkserver() -> None:
    """Start this process's forkserver, unless it runs already (a local sweep's earlier point), importing
    `FORKSERVER_PRELOAD` from this process's `sys.path`: Python 3.11's forkserver imports its preloads from its own
    default path (the working directory, site-packages), which may hold another copy of this package, an installed
    one, or none. That path reaches it as PYTHONPATH, which the ranks do not keep (`_adopt_launch_state`).

    The forkserver and multiprocessing's resource tracker (started with it) start with the stop signals blocked (a
    signal mask survives exec): a signal sent to every process of the job (Slurm's `scancel --signal`, a terminal's
    `kill -- -PGID`) would otherwise end them, and the ranks' exit codes, which the forkserver relays, would read 255:
    a preempted run reported its rank 0 failed. Each rank unblocks them (`_recorded_entry`)."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop.STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def launch_workers(cfg: DictConfig, nproc: int) -> Any:
    """Run `core.trainer.train(cfg)` on `nproc` local ranks; return rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = choose_port(cfg)
    join_timeout_s = float(OmegaConf.select(cfg, "mesh.join_timeout_s", default=600))
    # torch 2.11's LaunchConfig has no shutdown_timeout (its agent then waits its own default before killing the
    # failed worker's peers): pass only the fields this torch has
    optional = {"signals_to_handle": _ELASTIC_SIGNALS, "shutdown_timeout": _KILL_AFTER_S}
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"scalelab-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"timeout": int(join_timeout_s), "join_timeout": int(join_timeout_s),
                                        "read_timeout": int(join_timeout_s)},
                          max_restarts=0, monitor_interval=0.2, start_method="forkserver",
                          **{k: v for k, v in optional.items() if k in fields})
    container = OmegaConf.to_container(cfg, resolve=True)
    threads = threads_per_rank(nproc)
    elastic_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    _start_forkserver()
    events, done = multiprocessing.get_context("forkserver").SimpleQueue(), threading.Event()
    supervisor = threading.Thread(target=_supervise_workers, args=(events, done), name="scalelab-worker-supervisor",
                                  daemon=True)
    supervisor.start()
    try:
        rank_env = {**WORKER_ENV, **os.environ}  # the ranks' only: the user's own settings win
        results = elastic_launch(config, _recorded_entry)(container, threads, events, rank_env, os.getcwd(),
                                                             os.getpid())
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message, frames = failure_message(failure)
        stalled, bad_input = f"{RankStalledError.__name__}: ", f"{ConfigError.__name__}: "
        if message.startswith(bad_input):  # bad input found in a rank (a checkpoint that does not fit): one line
            error = config_error_from(message[len(bad_input):].splitlines()[0])
            if error is not None:
                raise error from None
        if message.startswith(stalled):  # the culprit is the rank it names, not the one that timed out
            raise WorkerFailedError(f"{message[len(stalled):]} (reported by rank {rank})") from None
        raise WorkerFailedError(f"rank {rank} of {nproc} failed: {message}"
                                + "".join(f"\n    at {frame}" for frame in frames)) from None
    finally:
        done.set()
        supervisor.join()
        for sig, handler in elastic_handlers.items():  # elastic leaves its own handlers installed
            signal.signal(sig, handler)
    return results.get(0) if isinstance(results, dict) else results
