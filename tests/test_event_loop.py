"""The simulator's event loop (sim/loop.py): time order, same-time events in the order they were scheduled, and
Python's cyclic garbage collector paused while it runs, its state restored after (also when an event raises)."""

from __future__ import annotations

import gc

import pytest

from kvbalance.sim.loop import EventLoop


def test_events_run_in_time_then_schedule_order():
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")]:
        loop.at(t, lambda n=name: seen.append((loop.now, n)))
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]


def test_run_until_stops_and_resumes():
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        loop.at_quiet(t, lambda: seen.append(loop.now))
    loop.run(until=2.5)
    assert seen == [1.0, 2.0] and loop.now == 2.5
    loop.run()
    assert seen == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_while_running_and_restored(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        loop = EventLoop()
        inside: list[bool] = []
        loop.at(1.0, lambda: inside.append(gc.isenabled()))
        loop.run()
        assert inside == [False]
        assert gc.isenabled() is enabled

        def boom() -> None:
            raise RuntimeError("boom")

        loop.at(2.0, boom)
        with pytest.raises(RuntimeError, match="boom"):
            loop.run()
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
