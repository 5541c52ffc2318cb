"""``_native.WakeTimer``, the engine gate's timer (a native thread): it fires once per deadline,
an earlier deadline moves it, a later one does not, a failing ``fire`` does not end it, and
``stop`` ends its thread. Deadlines are ``time.monotonic()`` seconds. No timed assertions
beyond "it fired within a generous bound"."""

from __future__ import annotations

import threading
import time

import pytest

native = pytest.importorskip("session_gate._native")


def test_it_fires_at_the_earliest_deadline_and_once_per_deadline():
    fired: list[float] = []
    event = threading.Event()

    def fire() -> None:
        fired.append(time.monotonic())
        event.set()

    timer = native.WakeTimer(fire)
    try:
        assert timer.alive and timer.deadline is None
        now = time.monotonic()
        timer.arm(now + 60.0)
        timer.arm(now + 0.05)  # earlier: moves it
        timer.arm(now + 30.0)  # later: ignored
        timer.arm(float("nan"))  # ignored
        assert timer.deadline == pytest.approx(now + 0.05)
        assert event.wait(10.0)
        assert fired[0] >= now + 0.05
        time.sleep(0.2)
        assert len(fired) == 1 and timer.deadline is None  # cleared when it fired
        event.clear()
        timer.arm(time.monotonic() - 1.0)  # already due: fires at once
        assert event.wait(10.0) and len(fired) == 2
    finally:
        timer.stop()
    assert not timer.alive
    timer.stop()  # idempotent


def test_a_failing_fire_is_reported_and_the_timer_goes_on(monkeypatch):
    unraisable: list = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    calls: list[int] = []
    event = threading.Event()

    def fire() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        event.set()

    timer = native.WakeTimer(fire)
    try:
        timer.arm(time.monotonic())
        deadline = time.monotonic() + 10.0
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        timer.arm(time.monotonic())
        assert event.wait(10.0) and len(calls) == 2
    finally:
        timer.stop()
    assert len(unraisable) == 1 and "boom" in repr(unraisable[0].exc_value)


def test_a_stopped_timer_never_fires():
    fired: list[int] = []
    timer = native.WakeTimer(lambda: fired.append(1))
    timer.arm(time.monotonic() + 0.05)
    timer.stop()
    time.sleep(0.2)
    assert fired == [] and not timer.alive


def test_a_forked_child_stops_its_copy_without_joining_the_parents_thread():
    import os

    timer = native.WakeTimer(lambda: None)
    try:
        pid = os.fork()
        if pid == 0:  # the child: no timer thread here; stop must neither hang nor raise
            code = 0
            try:
                if timer.alive:
                    code = 2
                timer.stop()
            except BaseException:  # noqa: BLE001 - report through the exit code
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert timer.alive  # the parent's thread is untouched
    finally:
        timer.stop()
