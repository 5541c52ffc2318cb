"""The gate against a real CPU vLLM engine with the engine-half plugin (``EngineProbe``).

One small engine for the module: 64 blocks of 32 tokens (63 usable), so a few sessions fill it.
With ``high_watermark=0.85`` the gate lets 53.5 blocks be committed. Working sets below are
prompt + ``MAX_TOKENS`` (16) tokens, in blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
import pytest_asyncio
from conftest import random_prompt
from session_gate import EngineProbe, GateConfig, SessionGate
from session_gate.lab.engine.launch import make_async_llm
from vllm import SamplingParams

BLOCK = 32
NUM_BLOCKS = 64
MAX_TOKENS = 16

pytestmark = pytest.mark.asyncio(loop_scope="module")

_request_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    llm = make_async_llm(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    try:
        yield llm
    finally:
        llm.shutdown()


async def run(engine, token_ids: list[int]) -> int:
    """One short greedy request; returns the ``num_cached_tokens`` vLLM reports for it."""
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    final = None
    async for out in engine.generate(
        {"prompt_token_ids": token_ids}, params, request_id=f"gate-{next(_request_ids)}"
    ):
        final = out
    assert final is not None and final.finished
    return int(final.num_cached_tokens)


async def eventually(condition, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


async def test_engine_probe_answers_with_the_engine_halfs_keys(engine):
    probe = EngineProbe(engine)
    usage = await probe.usage()
    assert usage["num_blocks"] == NUM_BLOCKS - 1
    assert usage["block_size"] == BLOCK
    tokens = random_prompt(random.Random(3), 6 * BLOCK + 5)
    await run(engine, tokens)
    # Sent packed as little-endian uint32: the engine reads the same prompt.
    answer = await probe.prefix("probe-keys", tokens)
    assert answer["available"] is True
    assert answer["prompt_tokens"] == len(tokens)
    assert answer["hit_tokens"] == 6 * BLOCK
    assert answer["hit_ratio"] == pytest.approx(6 * BLOCK / len(tokens))
    assert await probe.forget("probe-keys") is True


async def test_a_full_cache_holds_the_cold_session_and_admits_the_resident_one(engine):
    await engine.reset_prefix_cache()
    gate = SessionGate(
        EngineProbe(engine),
        GateConfig(
            high_watermark=0.85,
            wait_poll_sec=30.0,
            idle_grace_sec=600.0,
            probe_timeout_sec=10.0,
            # The tool sessions' rooms are to outlast this test's waits on an idle engine.
            idle_engine_turns=0,
        ),
    )
    rng = random.Random(5)

    # Turn 1 of "warm": 20 blocks of prompt, run through the engine, reservation not kept.
    warm = random_prompt(rng, 20 * BLOCK)
    async with gate.admit("warm", warm, max_tokens=MAX_TOKENS, retain_session=False) as lease:
        assert lease.reason == "open"
        await run(engine, warm)
    assert not gate.has_reservation("warm")

    # Three sessions run a turn and go off to their tools, keeping their reservations:
    # 3 x 13 blocks committed, while the engine still holds warm's prefix in its cache.
    for i in range(3):
        tokens = random_prompt(rng, 12 * BLOCK)
        async with gate.admit(f"tool-{i}", tokens, max_tokens=MAX_TOKENS) as lease:
            assert lease.reason == "open"
            await run(engine, tokens)
    assert gate.stats()["committed_blocks"] == 39

    # A cold session (21 blocks) no longer fits under the line: 39 + 21 > 53.5. Its prefix
    # probe finds nothing resident, so it waits.
    cold = asyncio.create_task(gate.acquire("cold", random_prompt(rng, 20 * BLOCK), MAX_TOKENS))
    await eventually(lambda: gate.stats()["waiting"] == 1)
    assert not cold.done()

    # Warm's next turn (history + 2 new blocks, 23 blocks) does not fit under the line either,
    # but its prefix is still in vLLM's cache: it goes ahead of the waiting cold session.
    warm2 = warm + random_prompt(rng, 2 * BLOCK)
    async with gate.admit("warm", warm2, max_tokens=MAX_TOKENS) as lease:
        assert lease.reason == "resident_prefix"
        assert lease.hit_ratio == pytest.approx(20 * BLOCK / len(warm2))
        # vLLM agrees: the 20 blocks the probe found are the 20 it reused.
        assert await run(engine, warm2) == 20 * BLOCK
    await asyncio.sleep(0.1)
    assert not cold.done()

    # The tool sessions finish their rollouts: their reservations end and the cold session,
    # woken by the gate, is let in.
    for i in range(3):
        assert await gate.finish_session(f"tool-{i}") is True
    lease = await asyncio.wait_for(cold, 30.0)
    assert lease.reason == "open"
    assert lease.wait_sec > 0.1
    lease.release()

    stats = gate.stats()
    assert stats["admissions"]["resident_prefix"] == 1
    assert stats["probes"]["prefix"]["failures"] == 0
    assert stats["pending"] == 0


async def test_an_idle_engines_counts_reach_the_client_gate_and_free_an_idle_room(engine):
    """The usage probe carries vLLM's running and waiting counts to a gate in the client: with
    the engine idle, a session's idle room goes to the waiter after four of its turn times (a
    few milliseconds here), not after half of the 600 s window."""
    gate = SessionGate(
        EngineProbe(engine),
        GateConfig(wait_poll_sec=30.0, idle_grace_sec=600.0, probe_timeout_sec=10.0),
    )
    rng = random.Random(8)
    async with gate.admit("idle-room", random_prompt(rng, 40 * BLOCK), max_tokens=MAX_TOKENS):
        pass  # a turn of a few ms: its room stays while idle
    started = time.monotonic()
    lease = await asyncio.wait_for(
        gate.acquire("idle-cold", random_prompt(rng, 20 * BLOCK), MAX_TOKENS), 10.0
    )
    assert lease.reason == "open" and time.monotonic() - started < 5.0
    lease.release()
    stats = gate.stats()
    assert (stats["idle_engine_yields"], stats["revocations"]) == (1, 1)
    assert not gate.has_reservation("idle-room")
