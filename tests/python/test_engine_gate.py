"""``EngineGate`` against a real CPU engine: the gate core inside vLLM's engine core process.

One small engine for the module (64 blocks of 32 tokens, 63 usable; line = 0.85 × 63 = 53.55
blocks) with short knobs in its environment: idle grace 2 s, max wait 3 s, lease TTL 2 s. The
timers must fire while the engine is idle (blocked on its input queue) and while it is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import pytest
import pytest_asyncio
from conftest import environ
from session_gate import AdmissionPreempted, EngineGate
from session_gate.engine.gate_binding import LEASE_KEY
from session_gate.lab.engine.launch import make_async_llm
from session_gate.probes import pack_token_ids
from vllm import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GATE_ENV = {
    "SESSION_GATE_IDLE_GRACE_SEC": "2",
    "SESSION_GATE_MAX_WAIT_SEC": "3",
    "SESSION_GATE_WAIT_POLL_SEC": "0.5",
    "SESSION_GATE_LEASE_TTL_SEC": "2",
}
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    with environ(GATE_ENV):  # the engine core process inherits them
        llm = make_async_llm(num_blocks=64, block_size=32)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def gate(engine):
    g = EngineGate(engine)
    try:
        yield g
    finally:
        await g.aclose()


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i) % 4000 for i in range(n)]


async def generate(engine, token_ids: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    async for _ in engine.generate(
        {"prompt_token_ids": token_ids}, params, request_id=f"eg-{next(_ids)}"
    ):
        pass


async def test_a_lease_carries_the_gates_fields(gate):
    async with gate.admit("fields", prompt(1, 100), 28) as lease:
        assert lease.reason == "open" and lease.reserved and not lease.revoked
        assert lease.working_set_blocks == 4 and lease.wait_sec == 0.0
        assert isinstance(lease.lease_id, int) and lease.engine_us > 0
        assert (await gate.stats())["leases_active"] == 1
    await asyncio.sleep(0.2)  # the release is on its way
    s = await gate.stats()
    assert s["leases_active"] == 0 and s["reservations_idle"] == 1
    # The native calls time themselves: the engine-loop cost `make bench-engine-gate` reports.
    loop = s["engine_gate"]
    assert loop["admit_loop_calls"] >= 1 and loop["release_loop_calls"] >= 1
    assert 0 < loop["release_loop_us_last"] <= loop["release_loop_us_total"]
    assert await gate.finish_session("fields")
    assert "session_gate_admissions_total" in await gate.prometheus()


async def test_idle_grace_expiry_admits_a_waiter_while_the_engine_is_idle(gate):
    big = await gate.acquire("grace", prompt(2, 1200), 16)  # 38 blocks
    # A 0.6 s turn: 8 of them, and the 4 after which an idle engine lets it yield (2.4 s),
    # outlast the window, so it never yields to the waiter.
    await asyncio.sleep(0.6)
    await big.arelease()  # its reservation stays for idle_grace_sec (2 s)
    started = time.monotonic()
    lease = await gate.acquire("cold-1", prompt(3, 700), 16)  # 23 blocks: 61 > 53.55
    waited = time.monotonic() - started
    # Nothing called the engine meanwhile (the heartbeat is every TTL/3 and does not poll
    # waiters): only the gate's timer waking the idle busy loop admits it, at the grace's end.
    assert lease.reason == "open" and 1.5 <= waited < 2.9, waited
    await lease.arelease()
    assert await gate.finish_session("cold-1")
    assert not await gate.finish_session("grace")  # expired already


async def test_an_idle_engine_lets_an_idle_room_go_after_four_of_its_turns(gate):
    """The book reads vLLM's queues on every usage read: with nothing running or waiting, a
    session's idle room goes to the waiter once idle four of its turn times (this turn took
    milliseconds), long before half the 2 s window (the floor while the engine is busy)."""
    before = await gate.stats()
    quick = await gate.acquire("quick", prompt(11, 1200), 16)  # 38 blocks
    await quick.arelease()  # a turn of a few ms; its room stays, idle
    started = time.monotonic()
    lease = await gate.acquire("cold-idle", prompt(12, 700), 16)  # 23 blocks: 61 > 53.55
    waited = time.monotonic() - started
    assert lease.reason == "open" and waited < 0.9, waited
    after = await gate.stats()
    assert after["idle_engine_yields"] == before["idle_engine_yields"] + 1
    assert after["revocations"] == before["revocations"] + 1
    await lease.arelease()
    assert await gate.finish_session("cold-idle")
    assert not await gate.finish_session("quick")  # its room went to cold-idle


async def keep_busy(engine, token_ids: list[int], max_tokens: int) -> None:
    """Generates back to back until cancelled, so the engine steps throughout however fast this
    machine runs (one 1,900-token generation took under 4 s in a fast phase of the CI VM)."""
    while True:
        await generate(engine, token_ids, max_tokens)


async def test_max_wait_fires_while_the_engine_is_busy(engine, gate):
    hog = await gate.acquire("hog", prompt(4, 1500), 16)  # 48 blocks
    busy = asyncio.ensure_future(keep_busy(engine, prompt(5, 10), 1900))
    await asyncio.sleep(0.5)
    started = time.monotonic()
    lease = await gate.acquire("cold-2", prompt(6, 500), 16)  # 17 blocks: 65 > 53.55
    waited = time.monotonic() - started
    assert lease.reason == "max_wait" and 2.5 <= waited < 4.5, waited
    assert not busy.done(), "the engine was meant to be busy stepping throughout"
    busy.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await busy
    await lease.arelease()
    await hog.arelease()
    for s in ("hog", "cold-2"):
        assert await gate.finish_session(s)


async def test_a_newer_admit_preempts_the_older_waiting_one(gate):
    hog = await gate.acquire("hog-p", prompt(7, 1500), 16)
    older = asyncio.ensure_future(gate.acquire("retry", prompt(8, 500), 16))
    await asyncio.sleep(0.3)
    newer = asyncio.ensure_future(gate.acquire("retry", prompt(8, 520), 16))
    with pytest.raises(AdmissionPreempted) as err:
        await older
    assert err.value.num_preempted == 1
    await hog.arelease()
    assert await gate.finish_session("hog-p")
    lease = await newer
    assert lease.reason == "open" and lease.num_preempted == 1
    await lease.arelease()
    assert await gate.finish_session("retry")


async def test_cancelling_a_waiting_acquire_withdraws_it_in_the_engine(gate):
    hog = await gate.acquire("hog-c", prompt(9, 1500), 16)
    before = (await gate.stats())["cancellations"]
    waiter = asyncio.ensure_future(gate.acquire("quitter", prompt(10, 500), 16))
    await asyncio.sleep(0.3)
    assert (await gate.stats())["pending"] == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0.3)
    s = await gate.stats()
    assert s["pending"] == 0 and s["cancellations"] == before + 1
    await hog.arelease()
    assert await gate.finish_session("hog-c")


async def test_a_silent_clients_lease_is_freed_after_the_ttl(engine, gate):
    call = engine.engine_core.call_utility_async
    before = (await gate.stats())["engine_gate"]["leases_expired"]
    answer = await call(
        "session_gate_admit", "orphan", pack_token_ids(prompt(11, 1500)), 16, True, "t-1", "gone"
    )
    assert answer["status"] == "admitted"
    # Every field filled in (the answer is a copy of a template dict of its keys); hit_ratio is
    # None because no prefix probe ran.
    assert [k for k, v in answer.items() if v is None] == ["hit_ratio"]
    assert answer["engine_us"] > 0
    started = time.monotonic()
    lease = await gate.acquire("heir", prompt(12, 500), 16)  # waits for the orphan's room
    assert lease.reason == "open" and 1.5 <= time.monotonic() - started < 3.0
    engine_stats = (await gate.stats())["engine_gate"]
    assert engine_stats["clients_expired"] >= 1 and engine_stats["leases_expired"] == before + 1
    assert not await call("session_gate_release", answer["lease"], None)  # gone already
    await lease.arelease()
    assert await gate.finish_session("heir")


async def test_vllm_reads_each_bound_methods_signature_without_recomputing_it():
    """vLLM runs ``inspect.signature`` on the method of every utility call; the engine gate's
    bound methods carry one computed once (``gate_methods._Utility``), cached on the engine."""
    import inspect

    from session_gate.engine import gate_methods
    from vllm.v1.engine.core import EngineCoreProc

    class Core:
        pass

    core = Core()
    utility = gate_methods._Utility(gate_methods.session_gate_finish)
    bound = utility.__get__(core)
    assert core.__dict__["session_gate_finish"] is bound
    assert inspect.signature(bound) is utility.signature
    assert list(utility.signature.parameters) == ["session_id", "client_id"]
    assert EngineCoreProc._convert_msgspec_args(bound, ("s", "c")) == ("s", "c")


@pytest.mark.parametrize(
    ("method", "args", "fragment"),
    [
        ("session_gate_admit", (5, b"\x05\x00\x00\x00", 4, True, "t", "c"), "session_id must"),
        ("session_gate_admit", ("s", "abc", 4, True, "t", "c"), "token_ids"),
        ("session_gate_admit", ("s", b"\x05\x00\x00", 4, True, "t", "c"), "multiple of 4"),
        ("session_gate_admit", ("s", [5] * 5000, 4, True, "t", "c"), "max_model_len"),
        ("session_gate_admit", ("s", [5], -1, True, "t", "c"), "max_tokens"),
        ("session_gate_admit", ("s", [5], 4, "yes", "t", "c"), "retain_session"),
        ("session_gate_admit", ("s", [5], 4, True, None, "c"), "ticket must"),
        ("session_gate_admit", ("s", [5], 4, True, "t", None), "client_id must"),
        ("session_gate_admit", ("s", [5]), "got 2 arguments"),
        ("session_gate_release", ("x",), "lease must be an int"),
        ("session_gate_release", (), "got 0 arguments"),
        ("session_gate_cancel", (5,), "ticket must"),
        ("session_gate_finish", (None,), "session_id must"),
        ("session_gate_renew", ("",), "client_id must"),
        ("session_gate_stats", ("xml",), "fmt must be"),
    ],
)
async def test_bad_input_to_every_method_is_a_clear_error(engine, method, args, fragment):
    with pytest.raises(Exception, match="invalid engine gate input") as err:
        await engine.engine_core.call_utility_async(method, *args)
    assert fragment in str(err.value)


async def test_a_reused_ticket_is_refused_and_the_engine_keeps_serving(engine, gate):
    call = engine.engine_core.call_utility_async
    first = await call("session_gate_admit", "dup", [5, 6], 4, False, "same", "dup-client")
    with pytest.raises(Exception, match="already in use"):
        await call("session_gate_admit", "dup", [5, 6], 4, False, "same", "dup-client")
    assert await call("session_gate_release", first["lease"], "dup-client")
    await generate(engine, prompt(13, 20), 2)
    assert (await gate.stats())["engine_gate"]["tick_errors"] == 0


# -- a lease bound to the vLLM request it admitted (gate_binding) ------------------------------


def bound(lease_id: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        extra_args={LEASE_KEY: lease_id},
    )


async def engine_counters(gate) -> tuple[dict, dict]:
    s = await gate.stats()
    return s, s["engine_gate"]


async def test_a_bound_lease_is_released_by_the_engine_when_its_request_ends(engine, gate):
    """No release call: the request's end in the scheduler releases it; a later release of the
    same lease (by its client) changes nothing and says so."""
    release = engine.engine_core.call_utility_async
    s0, e0 = await engine_counters(gate)
    lease = await gate.acquire("bound-end", prompt(40, 100), 8)
    assert (await gate.stats())["leases_active"] == 1
    async for _ in engine.generate(
        {"prompt_token_ids": prompt(40, 100)}, bound(lease.lease_id, 8), request_id="bound-1"
    ):
        pass
    s1, e1 = await engine_counters(gate)
    assert s1["leases_active"] == 0 and s1["leases_released"] == s0["leases_released"] + 1
    assert e1["leases_released_by_request"] == e0["leases_released_by_request"] + 1
    assert e1["release_loop_calls"] == e0["release_loop_calls"] + 1  # the engine's, no call
    # Released again, by its client: the second release finds nothing, counts nothing.
    assert await release("session_gate_release", lease.lease_id) is False
    await lease.arelease()
    s2, _ = await engine_counters(gate)
    assert s2["leases_released"] == s1["leases_released"]
    assert s2["leases_dropped_unreleased"] == s1["leases_dropped_unreleased"]
    assert await gate.finish_session("bound-end")


async def test_a_bound_lease_its_client_released_first_is_not_released_again(engine, gate):
    s0, e0 = await engine_counters(gate)
    lease = await gate.acquire("bound-first", prompt(41, 100), 4)
    assert await lease.arelease()
    async for _ in engine.generate(
        {"prompt_token_ids": prompt(41, 100)}, bound(lease.lease_id, 4), request_id="bound-2"
    ):
        pass
    s1, e1 = await engine_counters(gate)
    assert s1["leases_released"] == s0["leases_released"] + 1 and s1["leases_active"] == 0
    assert e1["bound_releases_unknown"] == e0["bound_releases_unknown"] + 1
    assert e1["leases_released_by_request"] == e0["leases_released_by_request"]
    assert await gate.finish_session("bound-first")


async def test_an_aborted_request_releases_its_bound_lease(engine, gate):
    """The request's client goes away mid-generation: vLLM aborts it, which frees the lease."""
    s0, e0 = await engine_counters(gate)
    lease = await gate.acquire("bound-abort", prompt(42, 100), 2000)
    outputs = engine.generate(
        {"prompt_token_ids": prompt(42, 100)}, bound(lease.lease_id, 2000), request_id="bound-3"
    )
    first = await outputs.__anext__()
    assert not first.finished
    await outputs.aclose()  # what a cancelled handler does: AsyncLLM aborts the request
    deadline = time.monotonic() + 10
    while (await gate.stats())["leases_active"] != 0:
        assert time.monotonic() < deadline, "the aborted request's lease was never released"
        await asyncio.sleep(0.05)
    s1, e1 = await engine_counters(gate)
    assert e1["leases_released_by_request"] == e0["leases_released_by_request"] + 1
    assert e1["release_loop_calls"] == e0["release_loop_calls"] + 1
    assert s1["leases_released"] == s0["leases_released"] + 1
    await lease.arelease()  # a no-op now
    assert await gate.finish_session("bound-abort")


async def test_a_request_without_a_bound_lease_releases_nothing(engine, gate):
    _, e0 = await engine_counters(gate)
    await generate(engine, prompt(43, 50), 2)
    params = SamplingParams(max_tokens=2, extra_args={"other": 1})
    async for _ in engine.generate({"prompt_token_ids": prompt(44, 50)}, params, "unbound-2"):
        pass
    _, e1 = await engine_counters(gate)
    for key in ("leases_released_by_request", "bound_releases_unknown", "release_loop_calls"):
        assert e1[key] == e0[key], key


async def test_bind_puts_the_lease_in_a_new_extra_args_dict_of_one_engine_request():
    # (async only because the module marks every test asyncio; it awaits nothing)
    from session_gate.engine.gate_binding import bind

    theirs = {"other": 1}
    params = SamplingParams(max_tokens=4, extra_args=theirs)
    assert bind(params, 7)
    assert params.extra_args == {"other": 1, LEASE_KEY: 7} and theirs == {"other": 1}
    plain = SamplingParams(max_tokens=4)
    assert bind(plain, 8) and plain.extra_args == {LEASE_KEY: 8}
    # n > 1: vLLM fans the turn out into n engine requests, the first of which to end would
    # release the lease while the others still run: not bound.
    fanned = SamplingParams(max_tokens=4, n=2, temperature=1.0)
    assert not bind(fanned, 9) and not fanned.extra_args
