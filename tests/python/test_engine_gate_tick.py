"""The engine gate's post-step tick waits for vLLM's input queue to drain (pure logic: a stand-in
driver with only what ``tick_when_settled`` reads, and a real ``queue.Queue`` as vLLM's)."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
from session_gate.engine import gate_driver
from session_gate.engine.gate_driver import MAX_TICK_DEFER_SEC, EngineGateDriver


class StandIn(SimpleNamespace):
    def tick(self) -> None:
        self.ticks += 1
        self.due = False
        self._due_since = None


def driver(pending: int) -> StandIn:
    inputs: queue.Queue = queue.Queue()
    for i in range(pending):
        inputs.put_nowait(("renew", i))
    return StandIn(_engine=SimpleNamespace(input_queue=inputs), due=True, _due_since=None, ticks=0)


def settle(d: StandIn) -> None:
    EngineGateDriver.tick_when_settled(d)  # type: ignore[arg-type]


def test_a_due_tick_waits_for_queued_requests_then_runs(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(gate_driver, "_now", lambda: now[0])
    d = driver(pending=2)
    settle(d)
    assert d.ticks == 0 and d.due  # a renewal may be queued: handle it first
    while not d._engine.input_queue.empty():  # vLLM drains the queue before its next step
        d._engine.input_queue.get_nowait()
    now[0] += 0.01
    settle(d)
    assert d.ticks == 1 and not d.due


def test_a_queue_that_never_drains_puts_the_tick_off_only_so_long(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(gate_driver, "_now", lambda: now[0])
    d = driver(pending=1)
    settle(d)
    now[0] += MAX_TICK_DEFER_SEC / 2
    settle(d)
    assert d.ticks == 0
    now[0] += MAX_TICK_DEFER_SEC / 2
    settle(d)
    assert d.ticks == 1


@pytest.mark.parametrize("pending", [0, 3])
def test_nothing_runs_when_nothing_is_due(pending):
    d = driver(pending)
    d.due = False
    settle(d)
    assert d.ticks == 0


def test_after_a_step_a_passed_deadline_ticks_and_the_timer_thread_never_fires():
    import time

    native = pytest.importorskip("session_gate._native")
    from session_gate.engine.gate_driver import DRIVER_ATTR
    from session_gate.engine.gate_methods import _wrap_post_step

    fired: list[int] = []
    timer = native.WakeTimer(lambda: fired.append(1))
    try:
        d = driver(pending=0)
        d.due = False
        d.take_due = timer.take_due
        core = SimpleNamespace(**{DRIVER_ATTR: d})
        d.tick_when_settled = lambda: settle(d)
        steps: list[bool] = []
        post_step = _wrap_post_step(lambda self, executed: steps.append(executed))
        timer.arm(time.monotonic() + 3600.0)
        post_step(core, True)
        assert steps == [True] and d.ticks == 0  # not due yet
        timer.arm(time.monotonic() - 0.001)  # passed (earlier than the armed one)
        post_step(core, True)
        assert d.ticks == 1 and not d.due and timer.deadline is None  # taken
        time.sleep(0.1)  # past the thread's re-check: nothing left for it to fire
        assert fired == []
        post_step(core, True)
        assert d.ticks == 1
    finally:
        timer.stop()
