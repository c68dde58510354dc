"""core.collector: a run's long-lived objects out of the garbage collector's full passes, checked against Python's
own collector (which objects its passes walk, which garbage it still frees)."""
import gc
import weakref

from core.benchmark import time_steps
from core.collector import FrozenHeap
from tests.utils import FAST, compose_cfg


class _Cycle:
    """Refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _walked(obj: object) -> bool:
    """Whether the collector's passes walk obj (frozen objects are in none of its generations)."""
    return any(o is obj for o in gc.get_objects())


def test_freeze_now_freezes_what_lives_and_new_cycles_are_still_freed():
    assert gc.get_freeze_count() == 0
    old = _Cycle()
    with FrozenHeap() as heap:
        heap.freeze_now()
        assert not _walked(old) and gc.get_freeze_count() > 0
        young = _Cycle()
        gone = weakref.ref(young)
        del young
        assert _walked(gone())
        gc.collect()
        assert gone() is None  # garbage made after the freeze is still freed
    assert gc.get_freeze_count() == 0 and _walked(old)  # everything back to the collector


def test_step_boundary_freezes_after_the_collectors_own_full_pass_and_not_the_last_steps_garbage():
    old = _Cycle()
    with FrozenHeap() as heap:
        heap.step_boundary()
        assert _walked(old) and gc.get_freeze_count() == 0  # no full pass yet: nothing frozen
        gc.collect(1)
        heap.step_boundary()
        assert gc.get_freeze_count() == 0  # a younger pass does not count
        gc.collect()  # the collector's full pass (here forced), in the middle of a step
        last_step = _Cycle()  # the step's garbage, made after that pass
        gone = weakref.ref(last_step)
        del last_step
        assert not gc.get_freeze_count()  # nothing frozen inside the step
        heap.step_boundary()
        assert gone() is None and not _walked(old)  # the step's cycle collected, the rest frozen
    assert _walked(old) and gc.get_freeze_count() == 0 and heap._observe not in gc.callbacks


def test_an_enclosing_heap_decides():
    old = _Cycle()
    with FrozenHeap() as outer:
        with FrozenHeap() as inner:
            inner.freeze_now()  # does nothing: the outer one owns the freeze
            assert _walked(old) and gc.get_freeze_count() == 0
        outer.freeze_now()
        with FrozenHeap():
            pass
        assert not _walked(old)  # the inner one's exit did not unfreeze
    assert _walked(old)


def test_objects_frozen_before_the_heap_stay_frozen():
    early = _Cycle()
    gc.freeze()  # as a library may, before the run
    try:
        late = _Cycle()
        with FrozenHeap() as heap:
            heap.freeze_now()
            assert not _walked(early) and not _walked(late)
        assert not _walked(early) and not _walked(late)  # gc cannot unfreeze only the heap's objects
    finally:
        gc.unfreeze()


def test_benchmark_steps_do_not_walk_the_model(tmp_path):
    from core.trainer import build

    run = build(compose_cfg(FAST + ["data=synthetic", "train.batch_size=2"], tmp_path))
    model, walked, loss = run.raw_model, [], run.loss

    def observed_loss(x, y):
        walked.append(_walked(model))
        return loss(x, y)

    run.loss = observed_loss
    assert len(time_steps(run, "forward", 1, 2)) == 2
    assert walked == [True, False, False]  # warm-up walked, timed steps not
    assert gc.get_freeze_count() == 0 and _walked(model)


def test_gc_pauses_experiment_runs_on_the_cpu(tmp_path, monkeypatch, capsys):
    """experiments/gc_pauses.py on the tiny model: its two rows, the frozen one walking a small part of what the
    other walks."""
    from experiments import gc_pauses

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["gc_pauses.py", "--steps", "2", "--warmup", "1", "data=synthetic",
                                     "train.batch_size=2"])
    gc_pauses.main()
    rows = {r.split("|")[1].strip(): r.split("|")[2:] for r in capsys.readouterr().out.splitlines()
            if r.startswith("| as they come") or r.startswith("| FrozenHeap")}
    walked = {name: int(cells[0].strip().replace(",", "")) for name, cells in rows.items()}
    assert walked.keys() == {"as they come", "FrozenHeap"} and walked["FrozenHeap"] < walked["as they come"] / 100
    assert gc.get_freeze_count() == 0
