"""``gate_scheduler`` without an engine: the setting, the config it implies, and the scheduler
gate's bookkeeping over a stand-in book (held, admitted later, aborted, queued behind its own
session, refused ids, keep-alive). The real engine's tests are ``test_engine_gate_scheduler``."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from session_gate.engine import gate_scheduler
from session_gate.engine.gate_scheduler import SCHEDULER_CLIENT, SchedulerGate


@pytest.mark.parametrize("value", [None, "", " off ", "OFF"])
def test_the_setting_is_off_by_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SESSION_GATE_SCHEDULER", raising=False)
    else:
        monkeypatch.setenv("SESSION_GATE_SCHEDULER", value)
    assert gate_scheduler.mode_from_env() == "off"


def test_session_id_and_infer_modes_and_bad_values(monkeypatch):
    monkeypatch.setenv("SESSION_GATE_SCHEDULER", "Session-ID")
    assert gate_scheduler.mode_from_env() == "session-id"
    monkeypatch.setenv("SESSION_GATE_SCHEDULER", "infer")
    assert gate_scheduler.mode_from_env() == "infer"
    for bad in ("inferred", "on", "1"):
        monkeypatch.setenv("SESSION_GATE_SCHEDULER", bad)
        with pytest.raises(ValueError, match=f"SESSION_GATE_SCHEDULER.*{bad}"):
            gate_scheduler.mode_from_env()


def test_max_wait_defaults_to_two_hours_in_scheduler_mode_only(monkeypatch):
    native = pytest.importorskip("session_gate._native")
    unbounded = native.GateConfig()
    monkeypatch.setattr(gate_scheduler, "installed", False)
    assert gate_scheduler.gate_config(native, unbounded).max_wait_sec is None
    monkeypatch.setattr(gate_scheduler, "installed", True)
    config = gate_scheduler.gate_config(native, unbounded)
    assert config.max_wait_sec == gate_scheduler.DEFAULT_MAX_WAIT_SEC == 7200.0
    assert config.high_watermark == unbounded.high_watermark
    bounded = native.GateConfig(max_wait_sec=3.0)
    assert gate_scheduler.gate_config(native, bounded).max_wait_sec == 3.0


class Book:
    """Answers admits from ``answers`` (a dict, or a Future to resolve later)."""

    def __init__(self) -> None:
        self.answers: list = []
        self.admits: list[tuple] = []
        self.cancelled: list[str] = []
        self.renewed = 0

    def admit_trusted(self, session_id, tokens, max_tokens, ticket, client_id):
        if len(session_id) > 256:
            raise ValueError("invalid engine gate input: session_id is too long")
        self.admits.append((session_id, ticket, client_id, max_tokens))
        return self.answers.pop(0)

    def cancel(self, ticket, client_id, now):
        self.cancelled.append(ticket)
        return True

    def renew(self, client_id, now):
        assert client_id == SCHEDULER_CLIENT
        self.renewed += 1
        return (0, 0)

    def hold_in_queue(self, held) -> None:
        self.held_in_queue = held


class Driver:
    def __init__(self) -> None:
        self._book = Book()
        self.released: list[int] = []

    def release_bound(self, lease: int) -> bool:
        self.released.append(lease)
        return True


def request(rid: str, session: str | None = "s") -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        session_id=session,
        sampling_params=SimpleNamespace(max_tokens=16),
        prompt_token_ids=[5, 6, 7],
    )


def admitted(lease: int, reason: str = "open") -> dict:
    return {"status": "admitted", "lease": lease, "reason": reason}


def test_admitted_now_runs_now_and_its_lease_is_released_when_freed():
    driver = Driver()
    gate = SchedulerGate(driver)
    driver._book.answers.append(admitted(7))
    r = request("a")
    assert gate.ready(r) is True
    assert driver._book.admits == [("s", "sched:0", SCHEDULER_CLIENT, 16)]
    assert gate.ready(r) is True  # preempted and re-queued by vLLM: not gated again
    assert len(driver._book.admits) == 1
    gate.on_free(r)
    assert driver.released == [7]
    s = gate.stats()
    assert (s["gated"], s["admitted"], s["held"], s["leases"]) == (1, 1, 0, 0)


def test_a_hold_ends_when_the_admit_is_answered_and_counts_its_reason():
    driver = Driver()
    gate = SchedulerGate(driver)
    future: Future = Future()
    driver._book.answers.append(future)
    r = request("a")
    assert gate.ready(r) is False
    assert gate.ready(r) is False
    assert gate.stats()["holding"] == 1
    future.set_result(admitted(3, "max_wait"))
    assert gate.ready(r) is True
    s = gate.stats()
    assert (s["held"], s["holding"], s["max_wait"], s["leases"]) == (1, 0, 1, 1)
    assert s["admitted_by_reason"] == {"max_wait": 1}


def test_an_aborted_hold_cancels_its_admit_and_leaves_nothing():
    driver = Driver()
    gate = SchedulerGate(driver)
    driver._book.answers.append(Future())
    r = request("a")
    assert gate.ready(r) is False
    gate.on_free(r)
    assert driver._book.cancelled == ["sched:0"]
    assert driver.released == []
    s = gate.stats()
    assert (s["aborted_while_held"], s["holding"], s["leases"]) == (1, 0, 0)


def test_a_later_request_of_a_held_session_waits_behind_it_without_an_admit():
    driver = Driver()
    gate = SchedulerGate(driver)
    first: Future = Future()
    driver._book.answers += [first, admitted(2)]
    a, b = request("a"), request("b")
    assert gate.ready(a) is False
    assert gate.ready(b) is False
    assert len(driver._book.admits) == 1  # b did not take over a's attempt
    first.set_result(admitted(1))
    assert gate.ready(a) is True
    assert gate.ready(b) is True
    assert [t for _, t, _, _ in driver._book.admits] == ["sched:0", "sched:1"]
    assert gate.stats()["held_behind_session"] == 1


def test_refused_ids_and_requests_the_gate_cannot_size_run_ungated():
    driver = Driver()
    gate = SchedulerGate(driver)
    long_id = request("a", "x" * 10_000)
    assert gate.ready(long_id) is True
    embeds = request("b")
    embeds.prompt_token_ids = None
    assert gate.ready(embeds) is True
    gate.on_free(long_id)
    gate.on_free(embeds)
    s = gate.stats()
    assert (s["bad_session_ids"], s["ungated"], s["gated"], s["errors"]) == (1, 1, 0, 0)
    assert driver.released == []


def test_keep_alive_renews_only_while_something_is_held():
    driver = Driver()
    gate = SchedulerGate(driver)
    gate.keep_alive(1.0)
    assert driver._book.renewed == 0
    driver._book.answers.append(admitted(9))
    r = request("a")
    gate.ready(r)
    gate.keep_alive(2.0)
    assert driver._book.renewed == 1
    gate.on_free(r)
    gate.keep_alive(3.0)
    assert driver._book.renewed == 1


def test_prometheus_text_names_every_counter():
    driver = Driver()
    gate = SchedulerGate(driver)
    driver._book.answers.append(admitted(1, "open"))
    gate.ready(request("a"))
    text = gate.prometheus()
    assert 'session_gate_scheduler_admitted_total{reason="open"} 1' in text
    for name in ("gated_total", "held_total", "max_wait_total", "aborted_while_held_total"):
        assert f"session_gate_scheduler_{name} " in text


def test_tickets_do_not_depend_on_request_ids_clients_choose():
    driver = Driver()
    gate = SchedulerGate(driver)
    driver._book.answers += [admitted(1), admitted(2)]
    assert gate.ready(request("r" * 1000, "s1")) is True
    assert gate.ready(request("r", "s2")) is True
    assert [t for _, t, _, _ in driver._book.admits] == ["sched:0", "sched:1"]
    assert gate.stats()["bad_session_ids"] == 0


def hashed(rid: str, hashes: list[bytes], prompt: int) -> SimpleNamespace:
    """A request without an id whose first ``prompt`` block hashes are its prompt's."""
    r = request(rid, session=None)
    r.block_hashes = hashes[:prompt]
    return r


def test_infer_mode_keys_requests_without_an_id_by_the_session_they_continue():
    pytest.importorskip("session_gate._native")
    driver = Driver()
    gate = SchedulerGate(driver, infer=True)
    shared = [b"sys-prompt-0001", b"task-prompt-01"]
    # Two first turns from one task prompt: two sessions, never merged.
    a, b = hashed("a1", shared, 2), hashed("b1", shared, 2)
    driver._book.answers += [admitted(1), admitted(2)]
    assert gate.ready(a) and gate.ready(b)
    first = [adm[0] for adm in driver._book.admits]
    assert first[0] != first[1] and all(k.startswith("infer:") for k in first)
    # Each answers with a block of its own, then frees.
    a.block_hashes = shared + [b"answer-of-a-001"]
    b.block_hashes = shared + [b"answer-of-b-001"]
    gate.on_free(b)
    gate.on_free(a)
    assert driver.released == [2, 1]
    # Their second turns carry their answers: each continues its own session.
    driver._book.answers += [admitted(3), admitted(4)]
    a2 = hashed("a2", shared + [b"answer-of-a-001", b"tool-result-a01"], 4)
    b2 = hashed("b2", shared + [b"answer-of-b-001", b"tool-result-b01"], 4)
    assert gate.ready(b2) and gate.ready(a2)
    assert [adm[0] for adm in driver._book.admits[2:]] == [first[1], first[0]]
    # A request with an id keeps it; one with neither hashes nor an id is a new session.
    driver._book.answers += [admitted(5), admitted(6)]
    assert gate.ready(request("c1", session="explicit"))
    assert gate.ready(hashed("d1", [], 0))
    assert driver._book.admits[4][0] == "explicit"
    assert driver._book.admits[5][0] not in first
    stats = gate.stats()
    assert stats["mode"] == "infer"
    assert stats["inferred"]["continued"] == 2 and stats["inferred"]["new"] == 3
    text = gate.prometheus()
    assert 'session_gate_scheduler_inferred_total{kind="continued"} 2' in text


def test_session_id_mode_never_infers():
    driver = Driver()
    gate = SchedulerGate(driver)
    assert gate.ready(hashed("x", [b"h"], 1))
    assert driver._book.admits == [] and "inferred" not in gate.stats()


class Status:
    """Stand-ins for vLLM's ``RequestStatus`` members (compared by identity)."""

    WAITING = object()
    PREEMPTED = object()
    WAITING_FOR_REMOTE_KVS = object()
    RUNNING = object()
    FINISHED_STOPPED = object()


def native_look(
    gate: SchedulerGate, vllm_says: list[bool], calls: list, sink: type = gate_scheduler._Held
) -> object:
    native = pytest.importorskip("session_gate._native")

    def vllm_check(request) -> bool:
        calls.append(("vllm", request.request_id))
        return vllm_says[0]

    python_ready = gate.ready

    def ready(request) -> bool:
        calls.append(("ready", getattr(request, "request_id", None)))
        return python_ready(request)

    gate.ready = ready  # what the native look calls for the looks it hands on
    book = gate._book if isinstance(gate._book, native.EngineGateBook) else None
    gate.look = native.SchedulerLook(
        vllm_check,
        [Status.WAITING, Status.PREEMPTED],
        gate,
        SCHEDULER_CLIENT,
        book,
        sink=sink,
    )
    gate.free = gate.look.free  # as gate_scheduler._install_look does
    return gate.look.look


def test_the_native_look_answers_looks_that_decide_nothing_and_hands_on_the_rest():
    driver = Driver()
    gate = SchedulerGate(driver)
    calls: list = []
    vllm_says = [True]
    look = native_look(gate, vllm_says, calls)
    future: Future = Future()
    driver._book.answers += [future, admitted(4)]
    held, plain = request("a"), request("p", None)
    held.status = plain.status = Status.WAITING
    assert look(plain) is True  # no id: never gated, no Python
    assert look(held) is False  # first look: the gate admits (held)
    assert calls == [("ready", "a")] and gate.look.holding == 1
    held.status = Status.WAITING_FOR_REMOTE_KVS  # (cannot happen: shows what is not read)
    for _ in range(3):
        assert look(held) is False  # held, no answer yet: answered natively, nothing called
    assert calls == [("ready", "a")] and len(driver._book.admits) == 1
    held.status = Status.WAITING
    future.set_result(admitted(9))
    assert gate.look.holding == 0  # the answer let it go
    assert look(held) is True  # the answer: the gate takes it
    assert look(held) is True  # decided: natively
    assert calls == [("ready", "a"), ("ready", "a")]
    assert gate.stats()["leases"] == 1
    # vLLM's own check runs for the statuses where it does something, and its no wins.
    blocked = request("b")
    blocked.status = Status.WAITING_FOR_REMOTE_KVS
    vllm_says[0] = False
    assert look(blocked) is False
    assert calls[-1] == ("vllm", "b") and len(driver._book.admits) == 1
    vllm_says[0] = True
    assert look(blocked) is True  # then the gate's first look (admitted now)
    assert calls[-2:] == [("vllm", "b"), ("ready", "b")]
    assert gate.stats()["leases"] == 2


def test_the_native_look_hands_a_look_it_cannot_read_to_the_gate():
    driver = Driver()
    gate = SchedulerGate(driver)
    calls: list = []
    look = native_look(gate, [True], calls)
    odd = SimpleNamespace(status=Status.WAITING, session_id="s")  # no request_id
    with pytest.raises(AttributeError):  # the gate's own look raises, as vLLM's would
        look(odd)
    assert calls == [("ready", None)]


def test_an_aborted_hold_leaves_nothing_in_the_native_look():
    driver = Driver()
    gate = SchedulerGate(driver)
    look = native_look(gate, [True], [])
    driver._book.answers.append(Future())
    r = request("a")
    r.status = Status.WAITING
    assert look(r) is False and gate.look.holding == 1
    gate.free(r)  # no native book: the Python gate's on_free
    assert gate.look.holding == 0 and driver._book.cancelled == ["sched:0"]
    assert gate.stats()["holding"] == 0


class NativeDriver(Driver):
    """The real native book over a stand-in block pool of ``blocks`` blocks of 16 tokens."""

    def __init__(self, blocks: int = 64, free: int = 64, scheduler: object = None) -> None:
        from session_gate.engine.gate_driver import native_book

        native = pytest.importorskip("session_gate._native")
        pool = SimpleNamespace(
            num_gpu_blocks=blocks + 1, free_block_queue=SimpleNamespace(num_free_blocks=free)
        )
        state = SimpleNamespace(
            block_pool=pool,
            block_size=16,
            vocab_size=1000,
            max_model_len=4096,
            scheduler=scheduler,
            running_status=Status.RUNNING,
        )
        self._probes = state

        def walk(session_id, token_ids) -> dict:  # nothing resident: a cold prompt
            n = len(token_ids)
            return {"hit_ratio": 0.0, "hit_blocks": 0, "hit_tokens": 0, "prompt_tokens": n}

        config = native.GateConfig(high_watermark=0.9)
        self._book = native_book(native, config, 30.0, state, walk, lambda at: None)
        self.released = []

    def release_bound(self, lease: int) -> bool:
        self.released.append(lease)
        return self._book.release_bound(lease)

    def bound_releases(self) -> dict[str, int]:
        """The book's counts of releases of leases bound to requests, by kind."""
        e = self._book.stats()["engine_gate"]
        return {k: e[k] for k in ("leases_released_by_request", "bound_releases_unknown")}


def prompt_request(rid: str, session: str | None, tokens: int, max_tokens: int = 16):
    r = request(rid, session)
    r.prompt_token_ids = list(range(1, tokens + 1))
    r.sampling_params = SimpleNamespace(max_tokens=max_tokens)
    r.status = Status.WAITING
    return r


def test_the_native_look_admits_first_looks_through_the_real_book():
    driver = NativeDriver()
    gate = SchedulerGate(driver)
    calls: list = []
    look = native_look(gate, [True], calls)
    r = prompt_request("a", "s1", 100)
    assert look(r) is True  # admitted in the look: no Python frame
    assert calls == [] and isinstance(gate._decided["a"], int)
    s = gate.stats()
    assert (s["gated"], s["admitted"], s["leases"], s["held"]) == (1, 1, 1, 0)
    assert sum(s["admitted_by_reason"].values()) == 1
    assert look(r) is True and calls == []  # re-queued after a preemption: decided
    gate.free(r)  # released by the native free through the book: no Python frame
    assert driver.released == [] and "a" not in gate._decided
    assert driver.bound_releases() == {"leases_released_by_request": 1, "bound_releases_unknown": 0}
    s = gate.stats()
    assert (s["leases"], s["admitted"]) == (0, 1)
    assert driver._book.stats()["engine_gate"]["leases_held"] == 0
    gate.free(r)  # freed twice (cannot happen in vLLM): nothing left to release
    assert driver.bound_releases() == {"leases_released_by_request": 1, "bound_releases_unknown": 0}
    assert gate.stats()["leases"] == 0
    # Looks the native look hands on: no id, a bad id, no prompt.
    for odd in (
        prompt_request("n", None, 10),
        prompt_request("x", "x" * 300, 10),
        prompt_request("e", "s2", 0),
    ):
        assert look(odd) is True
    assert [rid for _, rid in calls] == ["x", "e"]  # the no-id request never reaches Python
    s = gate.stats()
    assert (s["gated"], s["bad_session_ids"], s["ungated"]) == (1, 1, 1)


def test_a_first_look_the_book_holds_is_kept_by_the_python_gate_and_then_admitted():
    driver = NativeDriver(blocks=64, free=64)
    gate = SchedulerGate(driver)
    calls: list = []
    look = native_look(gate, [True], calls)
    big = prompt_request("a", "s1", 16 * 40, max_tokens=16 * 10)  # 50 of 64 blocks
    other = prompt_request("b", "s2", 16 * 40, max_tokens=16 * 10)
    assert look(big) is True
    assert look(other) is False  # no room under the line: held
    assert gate.look.holding == 1 and "b" in gate._held and calls == []
    assert look(other) is False and calls == []  # later looks: the native map
    gate.free(big)  # the first turn ends; its session keeps its room while idle ...
    assert gate.look.holding == 1
    driver._book.finish("s1", None, time.monotonic())  # ... until it ends: b is admitted
    assert gate.look.holding == 0
    assert look(other) is True  # the answer is taken by the Python gate
    assert calls == [("ready", "b")]
    s = gate.stats()
    assert (s["gated"], s["held"], s["admitted"], s["leases"], s["holding"]) == (2, 1, 2, 1, 0)
    gate.free(other)  # a lease the Python gate granted, released by the native free
    assert gate.stats()["leases"] == 0 and driver.released == []
    assert driver.bound_releases() == {"leases_released_by_request": 2, "bound_releases_unknown": 0}
    driver._book.check_invariants()


def test_the_native_free_hands_held_and_ungated_requests_to_the_python_gate():
    driver = NativeDriver(blocks=64, free=64)
    gate = SchedulerGate(driver)
    look = native_look(gate, [True], [])
    big = prompt_request("a", "s1", 16 * 40, max_tokens=16 * 10)
    held = prompt_request("b", "s2", 16 * 40, max_tokens=16 * 10)
    behind = prompt_request("c", "s2", 16 * 41, max_tokens=16)
    plain = prompt_request("n", "x" * 300, 10)  # an id the book refuses: ungated
    assert look(big) is True and look(held) is False and look(behind) is False
    assert look(plain) is True and gate._decided["n"] is None
    gate.free(plain)  # scheduled ungated: nothing to release, and nothing counted
    assert "n" not in gate._decided
    assert driver.bound_releases() == {"leases_released_by_request": 0, "bound_releases_unknown": 0}
    gate.free(behind)  # queued behind its session's hold: the Python gate's
    gate.free(held)  # held: its admit is withdrawn, no reservation left
    s = gate.stats()
    assert (s["aborted_while_held"], s["holding"], s["native_holding"]) == (2, 0, 0)
    gate.free(big)
    assert gate.stats()["leases"] == 0
    assert driver._book.stats()["engine_gate"]["leases_held"] == 0
    driver._book.check_invariants()


def test_a_hold_of_the_native_look_is_answered_through_the_gates_held_not_a_future():
    made: list = []

    class Sink(gate_scheduler._Held):
        __slots__ = ()

        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    driver = NativeDriver(blocks=64, free=64)
    gate = SchedulerGate(driver)
    look = native_look(gate, [True], [], sink=Sink)
    big = prompt_request("a", "s1", 16 * 40, max_tokens=16 * 10)
    other = prompt_request("b", "s2", 16 * 40, max_tokens=16 * 10)
    assert look(big) is True and made == []  # admitted now: no sink made
    assert look(other) is False
    assert len(made) == 1 and gate._held["b"] is made[0] and made[0].ticket == "sched:1"
    assert not made[0].done() and gate.look.holding == 1
    gate.free(big)
    driver._book.finish("s1", None, time.monotonic())  # the book answers through the sink
    assert made[0].done() and made[0].answer["status"] == "admitted"
    assert gate.look.holding == 0
    assert look(other) is True and gate.stats()["leases"] == 1


def big_turn_running():
    """A scheduler gate with the native look over the real book (64 blocks) and a stand-in
    vLLM scheduler that runs s1's turn of 50 blocks, admitted at its first look: returns
    ``(scheduler, driver, gate, look, big, other)``, ``other`` being s2's turn of the same
    size, not yet in any queue."""
    scheduler = SimpleNamespace(running=[], waiting=[])
    driver = NativeDriver(blocks=64, free=64, scheduler=scheduler)
    gate = SchedulerGate(driver)
    look = native_look(gate, [True], [])
    big = prompt_request("a", "s1", 16 * 40, max_tokens=16 * 10)  # 50 of 64 blocks
    other = prompt_request("b", "s2", 16 * 40, max_tokens=16 * 10)
    scheduler.waiting.append(big)
    assert look(big) is True
    scheduler.waiting.remove(big)
    big.status = Status.RUNNING
    scheduler.running.append(big)
    return scheduler, driver, gate, look, big, other


@pytest.mark.parametrize("busy", [False, True])
def test_an_idle_engine_lets_a_held_request_take_an_idle_rooms_place(busy):
    """The book counts vLLM's queues on every usage read, less the requests held in the
    waiting queue and the one being decided: with nothing else running or waiting the engine
    is idle, and an idle session's room goes to the held request after four of that session's
    turn times (here milliseconds), not half of the 60 s grace window. A waiting request that
    is not held is work: then the room stays."""
    scheduler, driver, gate, look, big, other = big_turn_running()
    assert driver._probes.held_in_queue == (gate._held, gate._queued)
    time.sleep(0.005)
    scheduler.running.remove(big)
    gate.free(big)  # a turn of ~5 ms; s1 keeps its room while idle
    scheduler.waiting.append(other)
    if busy:
        scheduler.waiting.append(prompt_request("n", None, 10))  # ungated: the engine's work
    assert look(other) is False  # held: s1's room does not yield yet (idle under 4 turns)
    time.sleep(0.1)
    driver._book.tick(time.monotonic())
    stats = driver._book.stats()
    if busy:
        assert gate.look.holding == 1 and stats["idle_engine_yields"] == 0
    else:
        assert gate.look.holding == 0 and look(other) is True
        assert (stats["idle_engine_yields"], stats["revocations"]) == (1, 1)
    driver._book.check_invariants()


def test_the_step_that_empties_the_engine_reads_idle_while_it_frees_its_last_request():
    """vLLM frees a finished request (and so releases its lease, where the waiters look again)
    before it takes it off ``scheduler.running``: the book's counts leave out running requests
    that have finished, so the held request learns at that free that the engine is idle, and
    the idle room yields four turn times later instead of at the next poll (``wait_poll_sec``,
    5 s)."""
    scheduler, driver, gate, look, big, other = big_turn_running()
    scheduler.waiting.append(other)
    assert look(other) is False  # held: s1's turn is in flight
    time.sleep(0.005)
    big.status = Status.FINISHED_STOPPED
    gate.free(big)  # vLLM's order: freed while still in `running`...
    scheduler.running.remove(big)  # ...and taken off it at the end of the step
    time.sleep(0.1)
    driver._book.tick(time.monotonic())
    stats = driver._book.stats()
    assert gate.look.holding == 0 and look(other) is True
    assert stats["idle_engine_yields"] == 1
    driver._book.check_invariants()
