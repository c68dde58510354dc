"""core.collector: a run's long-lived objects out of the garbage collector's full passes, checked against Python's
own collector (which objects its passes walk, which garbage it still frees)."""
import gc
import weakref

from core.benchmark import time_steps
from core.collector import long_lived_frozen
from tests.utils import FAST, compose_cfg


class _Cycle:
    """Refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _walked(obj: object) -> bool:
    """Whether the collector's passes walk obj (frozen objects are in none of its generations)."""
    return any(o is obj for o in gc.get_objects())


def test_collect_now_freezes_what_lives_and_still_frees_new_cycles():
    assert gc.get_freeze_count() == 0
    old = _Cycle()
    with long_lived_frozen(collect_now=True):
        assert not _walked(old) and gc.get_freeze_count() > 0
        young = _Cycle()
        gone = weakref.ref(young)
        del young
        assert _walked(gone())
        gc.collect()
        assert gone() is None  # garbage made inside the block is still freed
    assert gc.get_freeze_count() == 0 and _walked(old)  # everything back to the collector


def test_without_collect_now_the_collectors_own_full_pass_freezes():
    old = _Cycle()
    with long_lived_frozen():
        assert _walked(old)  # nothing frozen before a full pass
        gc.collect(1)
        assert _walked(old) and gc.get_freeze_count() == 0  # a younger pass freezes nothing
        gc.collect()
        assert not _walked(old)
    assert _walked(old) and gc.get_freeze_count() == 0 and not any(
        getattr(cb, "__module__", "") == "core.collector" for cb in gc.callbacks)


def test_an_enclosing_block_decides():
    old = _Cycle()
    with long_lived_frozen():
        with long_lived_frozen(collect_now=True):  # changes nothing: the enclosing block freezes at its full pass
            assert _walked(old) and gc.get_freeze_count() == 0
        gc.collect()
        with long_lived_frozen():
            pass
        assert not _walked(old)  # the inner block's exit did not unfreeze
    assert _walked(old)


def test_objects_frozen_before_the_block_stay_frozen():
    early = _Cycle()
    gc.freeze()  # as a library may, before the run
    try:
        late = _Cycle()
        with long_lived_frozen(collect_now=True):
            assert not _walked(early) and not _walked(late)  # the block still freezes what lived at its start
        assert not _walked(early) and not _walked(late)  # gc cannot unfreeze only the block's objects
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
