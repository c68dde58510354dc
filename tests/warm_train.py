"""`python train.py ...` for the tests, forked from an interpreter that imported torch, Hydra and the trainer once.

Why: the suite runs train.py many times, and a fresh interpreter spends about 4 s of CPU importing torch, Hydra and
the trainer and more than 1 s tearing them down, most of a small run's time on the 2-core CI machine.

Run as a script (`tests/utils.py` starts one per test process), it reads one request a line on stdin, JSON:
{"argv": [...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path, "timeout": seconds}. For each it forks a
child that runs train.py as `python train.py argv...` does: as `__main__`, with that argv, working directory and
environment, stdin from /dev/null, stdout and stderr into the two files, in a session of its own; the atexit
handlers run at its end, and its exit code is train.py's (SystemExit's code; 1 and the traceback for an uncaught
exception, as the interpreter does). The server answers with one JSON line, {"pid": ..., "returncode": ...,
"timed_out": ...}: the exit status as `subprocess` reports it (-N: killed by signal N); past the timeout it SIGKILLs
the child's process group (its ranks and their forkserver with it).

What a fresh interpreter would read at its start (PYTHON*, the thread pools' and Triton's variables) is this
server's, so `tests/utils.py` sends only runs whose environment agrees with the server's on those; the tests about
the process itself (signals, the command line) start `python train.py` themselves.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

TRAIN_PY = str(Path(__file__).resolve().parents[1] / "train.py")
# what every run imports besides the modules its ranks' forkserver does (`main` imports those too, except the
# forkserver's own exit: `os._exit(0)` at exit would end every run with 0)
PRELOAD = ["hydra", "omegaconf", "core.config", "core.errors", "launchers.job", "launchers.preflight"]


def _exit_code(e: SystemExit) -> int:
    """The interpreter's exit code for an uncaught SystemExit (a message is printed, and the code is 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _run_train() -> int:
    try:
        runpy.run_path(TRAIN_PY, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - the interpreter's own report of an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what interpreter shutdown runs first
    return code


def _child(request: dict[str, Any]) -> NoReturn:
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # not the server's request pipe
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [TRAIN_PY, *request["argv"]]
        if request["env"].get("PYTHONWARNINGS"):  # the interpreter applies it at its start (the server has none)
            sys.warnoptions[:] = request["env"]["PYTHONWARNINGS"].split(",")
            warnings._processoptions(sys.warnoptions)
        code = _run_train()
    except BaseException:  # noqa: BLE001 - setting up the child failed: say why in its stderr
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout: float) -> dict[str, Any]:
    watch = os.pidfd_open(pid)
    try:
        ended, _, _ = select.select([watch], [], [], timeout)
    finally:
        os.close(watch)
    if not ended:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    return {"pid": pid, "returncode": os.waitstatus_to_exitcode(status), "timed_out": not ended}


def main() -> None:
    import importlib

    from launchers.local import FORKSERVER_PRELOAD

    for name in [m for m in FORKSERVER_PRELOAD if m != "launchers.forkserver_exit"] + PRELOAD:
        importlib.import_module(name)
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        answers.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        answers.write(json.dumps(_wait(pid, float(request["timeout"]))) + "\n")
        answers.flush()


if __name__ == "__main__":
    sys.path[0] = str(Path(TRAIN_PY).parent)  # train.py's directory in place of tests/, as `python train.py` has it
    main()
