"""Stage memory lines (JFP8RL_DEBUG_MEMORY=1): each names its own peak and where the main
thread was when the sampler saw it, and a transient between two lines is attributed to the
interval it lived in."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jfp8rl.observe import memory

SIZE = 256 << 20  # bytes of the transient


def hold_a_transient(sampler: memory.StagePeak, floor_gib: float) -> None:
    """Touches SIZE bytes and keeps them until the sampler has seen them, then frees them."""
    block = np.ones(SIZE, dtype=np.uint8)
    deadline = time.monotonic() + 60
    while sampler.top < floor_gib + 0.9 * SIZE / 2**30:
        assert time.monotonic() < deadline, "the sampler never saw the transient"
        time.sleep(0.005)
    del block


def test_the_line_after_a_transient_names_its_peak_and_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JFP8RL_DEBUG_MEMORY", "1")
    lines: list[str] = []
    memory.log_memory(lines.append, "before")
    sampler = memory._stage_peak()
    assert sampler is not None
    floor = memory.host_rss_gib()["rss"]
    hold_a_transient(sampler, floor)
    memory.log_memory(lines.append, "after")
    memory.log_memory(lines.append, "quiet")
    assert lines[0].startswith("memory: before rss ")
    after = lines[1].split(" stage peak ")[1]
    peak = float(after.split(" GiB at ")[0])
    assert peak >= floor + 0.9 * SIZE / 2**30 - 0.005  # the line prints GiB to 2 decimals
    assert after.split(" GiB at ")[1].startswith("tests/jfp8rl/observe/test_memory.py:")
    assert after.endswith(" hold_a_transient")
    quiet_peak = float(lines[2].split(" stage peak ")[1].split(" GiB at ")[0])
    assert quiet_peak < peak - 0.5 * SIZE / 2**30  # the next interval starts afresh


def test_no_line_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JFP8RL_DEBUG_MEMORY", raising=False)
    lines: list[str] = []
    memory.log_memory(lines.append, "x")
    assert lines == []
    memory.release_free_heap()  # harmless anywhere: glibc's trim, or nothing


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_objects_before_a_run_are_frozen_for_it_and_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc
    import weakref

    # Outside the test session's own freeze (tests/conftest.py), as a run in a fresh process.
    monkeypatch.setattr(memory, "_frozen_depth", 0)
    gc.unfreeze()
    before = _Cycle()
    dead_before = weakref.ref(before)
    del before  # cyclic garbage from before the run: collected, not frozen
    alive = _Cycle()
    with memory.objects_before_frozen():
        assert dead_before() is None
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with memory.objects_before_frozen():  # nested: the outer freeze holds
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
        made = _Cycle()
        made_ref = weakref.ref(made)
        del made
        memory.release_free_heap()  # the run's own cyclic garbage is still collected
        assert made_ref() is None
        alive_ref = weakref.ref(alive)
        del alive
        memory.release_free_heap()  # frozen: kept while the run runs
        assert alive_ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive_ref() is None  # given back to the collector after it
    with pytest.raises(RuntimeError), memory.objects_before_frozen():
        raise RuntimeError("a failed run")
    assert gc.get_freeze_count() == 0
