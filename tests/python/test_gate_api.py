"""The Python gate API with a scripted fake probe: every reason, waking, preemption,
cancellation, leases, knobs, stats. Pure logic, no vLLM.

Geometry used throughout: the fake engine has 100 blocks of 16 tokens and the watermark is
0.85, so 85 blocks may be committed. Session "a" takes 60 blocks; a 40-block session then no
longer fits under the line and has to earn its admission.

Waiters are given ``wait_poll_sec=30``: a waiter admitted within a test's few seconds was woken
by the gate's notification, not by its own poll timer.
"""

from __future__ import annotations

import array
import asyncio
import gc
import math
import subprocess
import sys
import threading

import pytest
from session_gate import AdmissionPreempted, GateConfig, Lease, SessionGate, _native
from session_gate.lab.testing import ScriptedProbe
from session_gate.probes import pack_token_ids

BS = 16
PROMPT_TIMEOUT = 5.0


def prompt(blocks: int) -> list[int]:
    return [7] * (blocks * BS)


def make_gate(usage: float = 0.1, **knobs) -> tuple[SessionGate, ScriptedProbe]:
    knobs.setdefault("wait_poll_sec", 30.0)
    knobs.setdefault("idle_grace_sec", 60.0)
    knobs.setdefault("probe_timeout_sec", 1.0)
    probe = ScriptedProbe(usage, num_blocks=100, block_size=BS)
    return SessionGate(probe, GateConfig(**knobs)), probe


async def eventually(condition, timeout: float = PROMPT_TIMEOUT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.002)


def spawn(gate: SessionGate, session: str, blocks: int, **kw) -> asyncio.Task[Lease]:
    return asyncio.create_task(gate.acquire(session, prompt(blocks), 0, **kw))


async def waiting(gate: SessionGate, n: int) -> None:
    """Until exactly ``n`` attempts sit in the gate's queue."""
    await eventually(lambda: gate.stats()["waiting"] == n)


def assert_books_balance(gate: SessionGate) -> None:
    s = gate.stats()
    assert s["attempts"] == (
        s["admissions_total"] + s["preemptions"] + s["cancellations"] + s["pending"]
    )
    assert s["admissions_total"] == (
        s["leases_released"] + s["leases_dropped_unreleased"] + s["leases_active"]
    )


async def hold_a(gate: SessionGate) -> Lease:
    """Session "a" takes 60 of the 85 blocks under the line."""
    lease = await gate.acquire("a", prompt(60), 0, retain_session=False)
    assert lease.reason == "open"
    return lease


# ---- reasons --------------------------------------------------------------------------------


async def test_open_admission_reports_usage_and_takes_a_reservation():
    gate, probe = make_gate(usage=0.1)
    async with gate.admit("s1", prompt(10), max_tokens=32) as lease:
        assert lease.reason == "open"
        assert lease.session_id == "s1"
        assert lease.usage == pytest.approx(0.1)
        assert lease.hit_ratio is None
        assert lease.retain_session is True
        assert lease.reserved is True
        assert lease.working_set_blocks == 12  # (160 + 32) tokens / 16
        assert lease.pressure == pytest.approx(0.12)  # committed 12 of 100 blocks > usage
        assert 0.0 <= lease.wait_sec < 1.0
        assert gate.has_reservation("s1")
    assert probe.prefix_calls == 0
    assert gate.stats()["admissions"]["open"] == 1
    assert_books_balance(gate)


async def test_the_seeds_signature_counts_default_max_tokens():
    # admit(session_id, prompt_ids) / acquire(session_id, prompt_ids), as the seed calls them.
    gate, _ = make_gate()
    assert gate.config.default_max_tokens == 256
    async with gate.admit("seed", prompt(10)) as lease:
        assert lease.working_set_blocks == 26  # (160 + 256) tokens / 16
    gate, _ = make_gate(default_max_tokens=40)
    lease = await gate.acquire("seed", prompt(10))
    assert lease.working_set_blocks == 13  # (160 + 40) tokens / 16, rounded up
    lease.release()
    assert GateConfig(default_max_tokens=40).to_dict()["default_max_tokens"] == 40


def test_default_max_tokens_comes_from_the_environment_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("SESSION_GATE_DEFAULT_MAX_TOKENS", "4096")
    assert GateConfig.from_env().default_max_tokens == 4096
    monkeypatch.setenv("SESSION_GATE_DEFAULT_MAX_TOKENS", "many")
    with pytest.raises(ValueError, match="default_max_tokens.*many"):
        GateConfig.from_env()
    with pytest.raises(OverflowError):
        GateConfig(default_max_tokens=-1)


async def test_an_oversize_session_is_admitted_when_nothing_else_is_committed():
    gate, _ = make_gate()
    async with gate.admit("huge", prompt(95), max_tokens=0) as lease:
        assert lease.reason == "open"  # 95 blocks > the 85-block line, but nobody else holds any
        assert lease.working_set_blocks == 95


async def test_a_packed_prompt_counts_four_bytes_a_token():
    gate, probe = make_gate()
    probe.set_hit("b", 0.9)
    a = await hold_a(gate)
    async with gate.admit("b", pack_token_ids(prompt(40)), max_tokens=0) as lease:
        assert lease.working_set_blocks == 40
        assert lease.reason == "resident_prefix"
    a.release()


async def test_reserved_session_reenters_under_pressure_without_a_prefix_probe():
    gate, probe = make_gate(usage=0.95)
    async with gate.admit("s1", prompt(20), max_tokens=0) as first:
        assert first.reason == "open"  # nothing committed yet: nobody waits forever
    # Released with retain_session: the reservation lives on as an idle grace window.
    assert gate.stats()["reservations_idle"] == 1
    async with gate.admit("s1", prompt(25), max_tokens=0) as lease:
        assert lease.reason == "reserved_session"
        assert lease.hit_ratio is None
    assert probe.prefix_calls == 0


async def test_prefix_probe_that_raises_is_a_miss_until_room_frees():
    gate, probe = make_gate()
    a = await hold_a(gate)
    probe.prefix_raises(RuntimeError("engine core died"))
    task = spawn(gate, "b", 40)
    # Committed mode counts blocks itself: no answer is a miss, and the turn waits for room.
    await waiting(gate, 1)
    assert gate.stats()["probes"]["prefix"]["failures"] == 1
    a.release()
    lease = await asyncio.wait_for(task, PROMPT_TIMEOUT)
    assert lease.reason == "open"
    assert "engine core died" in lease.probe_error
    assert gate.stats()["admissions"]["prefix_probe_unavailable"] == 0
    lease.release()


async def test_prefix_probe_that_raises_admits_as_unavailable_in_engine_mode():
    gate, probe = make_gate(usage=0.9, pressure="engine")
    probe.prefix_raises(RuntimeError("engine core died"))
    async with gate.admit("b", prompt(40), max_tokens=0) as lease:
        assert lease.reason == "prefix_probe_unavailable"
        assert "engine core died" in lease.probe_error
    assert gate.stats()["probes"]["prefix"]["failures"] == 1


async def test_prefix_probe_that_hangs_times_out_and_counts_as_unavailable():
    gate, probe = make_gate(usage=0.9, pressure="engine", probe_timeout_sec=0.05)
    probe.prefix_hangs()
    lease = await asyncio.wait_for(gate.acquire("b", prompt(40), 0), PROMPT_TIMEOUT)
    assert lease.reason == "prefix_probe_unavailable"
    assert "did not answer within 0.05 s" in lease.probe_error
    assert lease.wait_sec >= 0.05
    assert gate.stats()["probes"]["prefix"]["failures"] == 1
    lease.release()


async def test_prefix_probe_answering_unavailable_admits_with_its_reason():
    gate, probe = make_gate(usage=0.9, pressure="engine")
    probe.prefix_unavailable("prefix caching is disabled in this engine")
    async with gate.admit("b", prompt(40), max_tokens=0) as lease:
        assert lease.reason == "prefix_probe_unavailable"
        assert lease.probe_error == "prefix caching is disabled in this engine"
    # The engine answered: not a probe failure.
    assert gate.stats()["probes"]["prefix"]["failures"] == 0


async def test_prefix_answer_missing_a_key_counts_as_unavailable():
    probe = ScriptedProbe(0.9, num_blocks=100, block_size=BS)

    async def no_ratio(session_id, prompt_ids):
        return {"available": True, "hit_blocks": 1, "hit_tokens": 16, "prompt_tokens": 640}

    probe.prefix = no_ratio  # before the gate binds the probe's methods
    gate = SessionGate(probe, GateConfig(wait_poll_sec=30.0, pressure="engine"))
    async with gate.admit("b", prompt(40), max_tokens=0) as lease:
        assert lease.reason == "prefix_probe_unavailable"
        assert "hit_ratio" in lease.probe_error
    assert gate.stats()["probes"]["prefix"]["failures"] == 1


async def test_resident_prefix_admits_a_session_whose_prefix_is_cached():
    gate, probe = make_gate()
    a = await hold_a(gate)
    probe.set_hit("b", 0.9)
    async with gate.admit("b", prompt(40), max_tokens=0) as lease:
        assert lease.reason == "resident_prefix"
        assert lease.hit_ratio == pytest.approx(0.9)
    assert probe.prefix_calls == 1
    a.release()


async def test_cold_session_waits_then_max_wait_admits_it():
    gate, probe = make_gate(max_wait_sec=0.1)
    a = await hold_a(gate)
    lease = await asyncio.wait_for(gate.acquire("b", prompt(40), 0), PROMPT_TIMEOUT)
    assert lease.reason == "max_wait"
    assert lease.wait_sec >= 0.1
    assert lease.hit_ratio == 0.0
    lease.release()
    a.release()


async def test_usage_probe_that_hangs_never_hangs_the_gate():
    gate, probe = make_gate(probe_timeout_sec=0.05)
    probe.usage_hangs()
    lease = await asyncio.wait_for(gate.acquire("s1", prompt(10), 0), PROMPT_TIMEOUT)
    # Unknown usage: the committed set alone decides, and nothing is committed.
    assert lease.reason == "open"
    assert lease.usage is None
    assert "did not answer" in lease.probe_error
    assert gate.stats()["probes"]["usage"]["failures"] == 1
    lease.release()


async def test_usage_answer_missing_a_key_counts_as_a_failed_probe():
    gate, probe = make_gate()
    probe.set_usage_answer({"kv_cache_usage": 0.2, "block_size": BS})
    async with gate.admit("s1", prompt(10), max_tokens=0) as lease:
        assert lease.usage is None
        assert "num_blocks" in lease.probe_error
    assert gate.stats()["probes"]["usage"]["failures"] == 1


# ---- waiting and waking ---------------------------------------------------------------------


async def test_a_cold_session_waits_while_the_committed_set_is_full():
    gate, _ = make_gate()
    a = await hold_a(gate)
    b = spawn(gate, "b", 40)
    await waiting(gate, 1)
    await asyncio.sleep(0.05)
    assert not b.done()
    assert gate.stats()["pending"] == 1
    a.release()
    (await asyncio.wait_for(b, PROMPT_TIMEOUT)).release()


async def test_a_waiter_is_admitted_when_another_session_releases():
    gate, _ = make_gate()
    a = await hold_a(gate)
    b = spawn(gate, "b", 40)
    await waiting(gate, 1)
    a.release()  # retain_session=False: the reservation is gone
    lease = await asyncio.wait_for(b, PROMPT_TIMEOUT)
    assert lease.reason == "open"
    assert lease.wait_sec > 0
    lease.release()
    assert_books_balance(gate)


async def test_a_waiter_is_admitted_when_a_session_finishes():
    gate, probe = make_gate()
    async with gate.admit("a", prompt(60), max_tokens=0) as a:
        assert a.retain_session
    assert gate.has_reservation("a")  # idle grace window, 60 s
    b = spawn(gate, "b", 40)
    await waiting(gate, 1)
    assert await gate.finish_session("a") is True
    lease = await asyncio.wait_for(b, PROMPT_TIMEOUT)
    assert lease.reason == "open"
    assert probe.forgotten == ["a"]
    assert not gate.has_reservation("a")
    assert gate.stats()["sessions_finished"] == 1
    lease.release()


async def test_an_expired_grace_window_lets_the_head_waiter_in():
    gate, _ = make_gate(idle_grace_sec=0.2)
    async with gate.admit("a", prompt(60), max_tokens=0):
        # A 0.05 s turn: 8 of them (0.4 s) outlast the window, so it never yields early.
        await asyncio.sleep(0.05)
    b = spawn(gate, "b", 40)
    lease = await asyncio.wait_for(b, PROMPT_TIMEOUT)
    assert lease.reason == "open"
    assert 0.1 <= lease.wait_sec < 10  # woke at the window's end, not at wait_poll_sec
    assert gate.stats()["grace_expired"] == 1
    lease.release()


async def test_waiters_are_admitted_first_in_first_out():
    gate, _ = make_gate()
    a = await hold_a(gate)
    b = spawn(gate, "b", 40)
    await waiting(gate, 1)
    c = spawn(gate, "c", 10)  # would fit beside "a", but "b" came first
    await waiting(gate, 2)
    await asyncio.sleep(0.05)
    assert not c.done()
    a.release()
    lb = await asyncio.wait_for(b, PROMPT_TIMEOUT)
    lc = await asyncio.wait_for(c, PROMPT_TIMEOUT)
    assert lb.wait_sec <= lc.wait_sec + 0.05
    lb.release()
    lc.release()


# ---- preemption and cancellation ------------------------------------------------------------


async def test_a_newer_attempt_preempts_the_waiting_one_of_the_same_session():
    gate, _ = make_gate()
    a = await hold_a(gate)
    old = spawn(gate, "b", 40)
    await waiting(gate, 1)
    new = spawn(gate, "b", 40)
    with pytest.raises(AdmissionPreempted) as info:
        await asyncio.wait_for(old, PROMPT_TIMEOUT)
    assert info.value.session_id == "b"
    assert info.value.num_preempted == 1
    assert gate.num_preempted("b") == 1
    assert gate.stats()["preemptions"] == 1
    await waiting(gate, 1)  # only the newest attempt competes
    a.release()
    lease = await asyncio.wait_for(new, PROMPT_TIMEOUT)
    assert lease.num_preempted == 1
    lease.release()
    assert_books_balance(gate)


async def test_an_admitted_attempt_is_not_preempted():
    gate, _ = make_gate()
    first = await gate.acquire("s1", prompt(5), 0)
    second = await gate.acquire("s1", prompt(6), 0)
    assert gate.stats()["preemptions"] == 0
    assert first.reason == "open" and second.reason == "open"
    first.release()
    second.release()


async def test_cancelling_a_waiting_admit_leaves_no_trace_and_the_next_waiter_proceeds():
    gate, _ = make_gate()
    a = await hold_a(gate)
    b = spawn(gate, "b", 40)
    await waiting(gate, 1)
    c = spawn(gate, "c", 40)
    await waiting(gate, 2)
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    s = gate.stats()
    assert s["pending"] == 1 and s["waiting"] == 1
    assert s["cancellations"] == 1
    a.release()
    lease = await asyncio.wait_for(c, PROMPT_TIMEOUT)
    assert lease.reason == "open"
    lease.release()
    s = gate.stats()
    assert s["pending"] == 0 and s["waiting"] == 0
    assert_books_balance(gate)


async def test_cancelling_during_a_hanging_probe_leaves_no_trace():
    gate, probe = make_gate(probe_timeout_sec=30.0)
    a = await hold_a(gate)
    probe.prefix_hangs()
    b = spawn(gate, "b", 40)
    await eventually(lambda: probe.prefix_calls == 1)
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert gate.stats()["pending"] == 0
    a.release()
    assert_books_balance(gate)


# ---- leases ---------------------------------------------------------------------------------


async def test_double_release_is_a_no_op():
    gate, _ = make_gate()
    lease = await gate.acquire("s1", prompt(5), 0)
    assert lease.release() is True
    assert lease.release() is False
    assert lease.released
    s = gate.stats()
    assert s["leases_released"] == 1 and s["leases_active"] == 0


async def test_admit_releases_the_lease_when_the_block_raises():
    gate, _ = make_gate()
    with pytest.raises(ZeroDivisionError):
        async with gate.admit("s1", prompt(5), max_tokens=0):
            1 / 0  # noqa: B018
    s = gate.stats()
    assert s["leases_released"] == 1 and s["leases_active"] == 0


async def test_a_garbage_collected_lease_is_released_counted_and_wakes_waiters():
    gate, _ = make_gate()
    a = await hold_a(gate)
    b = spawn(gate, "b", 40)
    await waiting(gate, 1)
    del a
    gc.collect()
    lease = await asyncio.wait_for(b, PROMPT_TIMEOUT)
    assert lease.reason == "open"
    s = gate.stats()
    assert s["leases_dropped_unreleased"] == 1
    lease.release()
    assert_books_balance(gate)


async def test_a_lease_dropped_on_another_thread_is_released_on_the_loop():
    gate, _ = make_gate()
    box = [await gate.acquire("s1", prompt(5), 0)]
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()
    await eventually(lambda: gate.stats()["leases_dropped_unreleased"] == 1)
    assert gate.stats()["leases_active"] == 0


async def test_finish_session_swallows_and_counts_forget_errors():
    gate, probe = make_gate()
    async with gate.admit("s1", prompt(5), max_tokens=0):
        pass
    probe.forget_raises(RuntimeError("engine gone"))
    assert await gate.finish_session("s1") is True
    assert gate.stats()["probes"]["forget"]["failures"] == 1
    assert await gate.finish_session("s1") is False  # nothing left to end


# ---- knobs ----------------------------------------------------------------------------------


def test_config_defaults_are_the_seeds():
    c = GateConfig()
    assert (c.high_watermark, c.hit_threshold, c.wait_poll_sec, c.idle_grace_sec) == (
        0.85,
        0.80,
        5.0,
        60.0,
    )
    assert c.pressure == "committed"
    assert c.max_wait_sec is None
    assert c.probe_timeout_sec > 0
    assert "high_watermark=0.85" in repr(c) and "pressure='committed'" in repr(c)
    assert GateConfig(high_watermark=0.9) == GateConfig(high_watermark=0.9)
    assert c.to_dict()["pressure"] == "committed"


@pytest.mark.parametrize(
    ("knob", "value", "shown"),
    [
        ("high_watermark", 1.5, "1.5"),
        ("high_watermark", math.nan, "NaN"),
        ("hit_threshold", -0.1, "-0.1"),
        ("wait_poll_sec", 0.0, "0"),
        ("idle_grace_sec", -1.0, "-1"),
        ("max_wait_sec", -2.0, "-2"),
        ("probe_timeout_sec", math.inf, "inf"),
        ("pressure", "usage", "usage"),
    ],
)
def test_invalid_knobs_are_refused_naming_knob_and_value(knob, value, shown):
    with pytest.raises(ValueError) as info:
        GateConfig(**{knob: value})
    assert knob in str(info.value)
    assert shown in str(info.value)


def test_unknown_knob_is_refused():
    with pytest.raises(TypeError, match="high_watermak"):
        GateConfig(high_watermak=0.9)


def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("SESSION_GATE_HIGH_WATERMARK", "0.7")
    monkeypatch.setenv("SESSION_GATE_PRESSURE", "engine")
    monkeypatch.setenv("SESSION_GATE_MAX_WAIT_SEC", "3")
    monkeypatch.setenv("SESSION_GATE_IDLE_GRACE_SEC", "12.5")
    c = GateConfig.from_env()
    assert c.high_watermark == 0.7
    assert c.pressure == "engine"
    assert c.max_wait_sec == 3.0
    assert c.idle_grace_sec == 12.5
    assert c.hit_threshold == 0.8  # untouched knobs keep their defaults


def test_gate_config_is_the_native_knob_tables_gate_rows():
    rows = _native.knobs()
    gate_rows = [r for r in rows if r["home"] == "gate_config"]
    c = GateConfig()
    assert list(c.to_dict()) == [r["name"] for r in gate_rows]
    for r in gate_rows:
        assert getattr(c, r["name"]) == r["default"], r["name"]
        assert r["env"] == "SESSION_GATE_" + r["name"].upper()
        assert r["doc"] and r["rule"]
    engine = {r["name"] for r in rows if r["home"] == "engine_core"}
    assert engine == {"lease_ttl_sec", "chain_cache_bytes", "finished_blocks", "scheduler"}
    with pytest.raises(AttributeError, match="lease_ttl_sec"):
        c.lease_ttl_sec  # noqa: B018 - an engine knob is no GateConfig attribute
    with pytest.raises(TypeError, match="lease_ttl_sec"):
        GateConfig(lease_ttl_sec=3.0)


def test_engine_knobs_come_from_the_environment_through_the_table(monkeypatch):
    monkeypatch.delenv("SESSION_GATE_LEASE_TTL_SEC", raising=False)
    assert _native.knob_from_env("lease_ttl_sec") == 30.0
    monkeypatch.setenv("SESSION_GATE_LEASE_TTL_SEC", " 4.5 ")
    assert _native.knob_from_env("lease_ttl_sec") == 4.5
    monkeypatch.setenv("SESSION_GATE_LEASE_TTL_SEC", "0")
    with pytest.raises(ValueError, match="lease_ttl_sec.*0"):
        _native.knob_from_env("lease_ttl_sec")
    monkeypatch.setenv("SESSION_GATE_CHAIN_CACHE_BYTES", "1024")
    assert _native.knob_from_env("chain_cache_bytes") == 1024
    monkeypatch.setenv("SESSION_GATE_CHAIN_CACHE_BYTES", "-1")
    with pytest.raises(ValueError, match="chain_cache_bytes.*-1"):
        _native.knob_from_env("chain_cache_bytes")
    monkeypatch.setenv("SESSION_GATE_FINISHED_BLOCKS", "lru")
    assert _native.knob_from_env("finished_blocks") == "lru"
    monkeypatch.setenv("SESSION_GATE_FINISHED_BLOCKS", "last")
    with pytest.raises(ValueError, match="finished_blocks.*last"):
        _native.knob_from_env("finished_blocks")
    with pytest.raises(KeyError):
        _native.knob_from_env("no_such_knob")


def test_invalid_environment_value_is_refused_naming_the_knob(monkeypatch):
    monkeypatch.setenv("SESSION_GATE_HIT_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="hit_threshold.*lots"):
        GateConfig.from_env()


async def test_engine_pressure_compares_vllm_usage_only():
    gate, probe = make_gate(usage=0.5, pressure="engine")
    a = await gate.acquire("a", prompt(60), 0)
    # 60 + 40 blocks would cross the line, but the seed's gate looks at vLLM's usage only.
    async with gate.admit("b", prompt(40), max_tokens=0) as lease:
        assert lease.reason == "open"
    probe.set_usage(0.9)
    probe.set_hit("c", 0.95)
    async with gate.admit("c", prompt(10), max_tokens=0) as lease:
        assert lease.reason == "resident_prefix"
    a.release()


# ---- stats and metrics ----------------------------------------------------------------------


async def test_stats_and_prometheus_report_admissions_by_reason():
    gate, probe = make_gate()
    a = await hold_a(gate)
    probe.set_hit("b", 0.9)
    async with gate.admit("b", prompt(40), max_tokens=0):
        s = gate.stats()
        assert s["leases_active"] == 2
        assert s["reservations_held"] == 2
        assert s["committed_blocks"] == 100
    a.release()
    s = gate.stats()
    assert s["admissions"] == {
        "open": 1,
        "reserved_session": 0,
        "prefix_probe_unavailable": 0,
        "resident_prefix": 1,
        "max_wait": 0,
        "offloaded_prefix": 0,
    }
    assert s["attempts"] == 2 and s["pending"] == 0
    assert s["wait_sec"]["count"] == 2
    assert s["probes"]["usage"]["count"] == 2
    assert s["probes"]["prefix"]["count"] == 1
    assert s["wait_sec"]["buckets"][-1] == (math.inf, 2)
    text = gate.prometheus()
    assert 'session_gate_admissions_total{reason="open"} 1' in text
    assert 'session_gate_admissions_total{reason="resident_prefix"} 1' in text
    assert "session_gate_sessions_pending 0" in text
    assert "# TYPE session_gate_wait_seconds histogram" in text
    assert 'session_gate_probe_seconds_count{probe="prefix"} 1' in text
    assert_books_balance(gate)


# ---- probes ---------------------------------------------------------------------------------


def test_token_ids_are_packed_as_little_endian_uint32():
    packed = pack_token_ids([1, 2, 4095, 2**32 - 1])
    assert packed == b"\x01\0\0\0\x02\0\0\0\xff\x0f\0\0\xff\xff\xff\xff"
    assert pack_token_ids(array.array("I", [5, 6])) == pack_token_ids([5, 6])
    assert pack_token_ids(packed) is packed
    with pytest.raises(OverflowError):
        pack_token_ids([-1])


def test_the_gate_side_never_imports_vllm():
    code = (
        "import sys, session_gate, session_gate.gate, session_gate.probes, "
        "session_gate.lab.testing\n"
        "from session_gate import SessionGate, GateConfig, EngineProbe, AdmissionPreempted\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
