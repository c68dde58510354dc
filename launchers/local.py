"""Start one job's N worker ranks on this machine through torch.distributed's elastic launch API.

The Hydra job has already composed and resolved its config (one output directory, one `${now:}`);
each worker receives that resolved config, sets nothing but what elastic provides (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and calls `core.trainer.train(cfg)`.
Every job rendezvouses on its own free localhost port, so sweep jobs can run one after another.
If one rank fails, elastic stops the others (they are killed within `monitor_interval`) and we raise
one `WorkerFailedError` naming the first failed rank and its exception message.
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError

# NVLink SHARP / multicast is not available on the lent machines (see KINDS.md): keep NCCL off it.
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "TORCH_NCCL_ENABLE_TIMING": "1",  # per-collective durations for comm_ms
              "HYDRA_FULL_ERROR": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


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
    """`launcher.port` from the config or MASTER_PORT_OVERRIDE if set (must be free), else a free port."""
    requested = OmegaConf.select(cfg, "launcher.port", default=None) or os.environ.get("SCALELAB_MASTER_PORT")
    if requested in (None, "", 0, "0"):
        return free_port()
    port = int(requested)
    if not port_is_free(port):
        raise ConfigError("launcher.port", f"port {port} on 127.0.0.1 is already in use (another job or process)",
                          "leave launcher.port unset to pick a free port, or choose a free one")
    return port


def _worker_entry(cfg_container: dict[str, Any]) -> Any:
    """One rank: rebuild the resolved config and train. Wrapped by `record` so errors reach the agent."""
    import faulthandler
    import signal

    from core.trainer import train

    # `kill -USR2 <worker pid>` prints every thread's Python stack: where a stuck rank is waiting
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    cfg = OmegaConf.create(cfg_container)
    threads = os.environ.get("SCALELAB_WORKER_THREADS")
    if threads:  # CPU ranks share the cores instead of each taking all of them
        import torch

        torch.set_num_threads(int(threads))
    return train(cfg)


def _recorded_entry(cfg_container: dict[str, Any]) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_worker_entry)(cfg_container)


def _failure_message(failure: Any) -> str:
    msg = getattr(failure, "message", None)
    if isinstance(msg, dict):
        msg = msg.get("message", msg)
    if not msg or msg == "<N/A>":
        code = getattr(failure, "exitcode", None)
        sig = getattr(failure, "signal_name", lambda: "")()
        msg = f"exited with code {code}" + (f" ({sig})" if sig else "") + " without a Python exception (killed?)"
    return str(msg).strip().splitlines()[-1] if "\n" in str(msg).strip() else str(msg).strip()


def launch_workers(cfg: DictConfig, nproc: int) -> Any:
    """Run `core.trainer.train(cfg)` on `nproc` local ranks; return rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = choose_port(cfg)
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    os.environ["SCALELAB_WORKER_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    timeout_s = float(OmegaConf.select(cfg, "mesh.timeout_s", default=300))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"scalelab-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"timeout": int(max(60, timeout_s))}, max_restarts=0, monitor_interval=0.2,
                          start_method="spawn")
    container = OmegaConf.to_container(cfg, resolve=True)
    try:
        results = elastic_launch(config, _recorded_entry)(container)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise WorkerFailedError(f"rank {rank} of {nproc} failed: {_failure_message(failure)}") from None
    return results.get(0) if isinstance(results, dict) else results
