"""Imported by the local launcher's forkserver only, as the last of its preloads
(`launchers.local.FORKSERVER_PRELOAD`): the forkserver then ends without the interpreter's shutdown.

Why: the forkserver holds the launcher's stdout and stderr (the ranks it forks write there), so whoever reads them
(a pipe, `subprocess.run(capture_output=True)`) sees their end only once the forkserver has exited, and with torch
loaded an interpreter's shutdown takes about 2 s. It has nothing to flush or release: it only forks ranks, and
those end through `os._exit` themselves (multiprocessing's forkserver child).
"""
import atexit
import os

atexit.register(os._exit, 0)  # atexit runs last-registered first: before any slower handler and the teardown
