"""Python's cyclic garbage collector in long runs.

A compiled model keeps some 500k Python objects alive for the whole run (modules, Dynamo's guards and graphs,
Inductor's kernels, the optimizer's state). Every full (generation 2) pass of the collector walks all of them: on a
compiled medium model one step in a few hundred took ~0.9 s longer, with either attention, and in a multi-rank run
every other rank waits for that one at its next collective. Objects moved into the collector's permanent generation
(`gc.freeze`) are not walked; a pass then costs what the objects created since cost. Objects frozen still die as
soon as nothing refers to them; only garbage in reference cycles among them stays until they are unfrozen, so the
freeze happens between steps, never inside one (a step's own objects would be frozen with the run's).
"""
from __future__ import annotations

import gc
from typing import Any


class FrozenHeap:
    """A context manager that freezes a run's long-lived objects out of the collector's full passes.

    `freeze_now()`: one full pass, then everything that survived is frozen (for a caller with an untimed moment to
    spend: a benchmark's warm-up is over). `step_boundary()`, called between steps: once the collector has run a full
    pass on its own, the young generations (the last step's cyclic garbage) are collected and everything else
    frozen; the collector's later passes then skip it. At exit the frozen objects go back to the collector
    (`gc.unfreeze`), unless some were frozen before entry (a library's or the interpreter's `gc.freeze`: the
    collector cannot unfreeze only these, so all stay frozen). Inside another FrozenHeap it does nothing: the
    outermost decides.
    """

    _active = False  # a FrozenHeap is open (one per process)

    def __init__(self) -> None:
        self._owner = False
        self._full_pass_seen = False
        self._frozen_before = 0

    def __enter__(self) -> FrozenHeap:
        if not FrozenHeap._active:
            FrozenHeap._active = self._owner = True
            self._frozen_before = gc.get_freeze_count()
            gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owner:
            gc.callbacks.remove(self._observe)
            FrozenHeap._active = self._owner = False
            if not self._frozen_before:
                gc.unfreeze()

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            self._full_pass_seen = True

    def freeze_now(self) -> None:
        if self._owner:
            gc.collect()
            gc.freeze()
            self._full_pass_seen = False

    def step_boundary(self) -> None:
        if self._owner and self._full_pass_seen:
            gc.collect(1)
            gc.freeze()
            self._full_pass_seen = False
