"""Python's cyclic garbage collector in long runs.

A compiled model keeps some 500k Python objects alive for the whole run (modules, Dynamo's guards and graphs,
Inductor's kernels, the optimizer's state). Every full (generation 2) pass of the collector walks all of them: on a
compiled medium model one step in a few hundred took ~0.9 s longer, with either attention, and in a multi-rank run
every other rank waits for that one at its next collective. Objects moved into the collector's permanent generation
(`gc.freeze`) are not walked; a pass then costs what the objects created since cost. Objects frozen still die as
soon as nothing refers to them; only garbage in reference cycles among them stays until they are unfrozen.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Iterator


def _freeze_after_full_pass(phase: str, info: dict[str, Any]) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()  # what survived a full pass is long-lived: later passes skip it


@contextmanager
def long_lived_frozen(collect_now: bool = False) -> Iterator[None]:
    """Within the block, the objects alive after a full pass of the collector are frozen out of later passes.

    collect_now: run that full pass at entry (for a caller with an untimed moment to spend it in: a benchmark's
    warm-up is over); otherwise the collector's own next full pass is the one, and only it walks everything.
    At exit the frozen objects go back to the collector (`gc.unfreeze`), unless some were frozen before entry
    (a library's or the interpreter's `gc.freeze`: the collector cannot unfreeze only the block's, so all stay
    frozen). Inside an enclosing block it changes nothing: the outermost decides.
    """
    if _freeze_after_full_pass in gc.callbacks:
        yield
        return
    frozen_before = gc.get_freeze_count()
    if collect_now:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(_freeze_after_full_pass)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_full_pass)
        if not frozen_before:
            gc.unfreeze()
