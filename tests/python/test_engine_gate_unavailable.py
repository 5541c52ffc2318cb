"""The engine gate when the engine cannot answer the prefix probe: a real ``vllm serve`` on CPU
with prefix caching off (the probe then answers ``available: false``), gating through the
middleware with the official ``openai`` client. Committed mode counts blocks itself, so a turn
that does not fit waits for room instead of being admitted blind.

127 usable blocks of 32 tokens; with ``high_watermark`` 0.85 the line is 107.95 blocks.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import eventually, gate_stats, served_vllm, word_ids
from session_gate import HttpGate, HttpProbe

MIDDLEWARE = "session_gate.engine.gate_middleware.SessionGateMiddleware"


@pytest.fixture(scope="module")
def url():
    extra = ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--seed", "0",
             "--middleware", MIDDLEWARE]  # fmt: skip
    with served_vllm(
        "engine-gate-nocache", extra_args=extra, env={"SESSION_GATE_IDLE_GRACE_SEC": "300"}
    ) as base:
        yield base


async def test_an_unanswerable_prefix_probe_waits_through_the_middleware(url):
    from openai import AsyncOpenAI

    async with HttpProbe(url) as probe:
        answer = await probe.prefix("cold", word_ids(1000, 400))
    assert answer["available"] is False and "prefix caching" in answer["reason"]
    client = AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0,
        default_headers={"x-session-id": "mw-cold"},
    )  # fmt: skip
    async with HttpGate(url) as gate:
        hog = await gate.acquire("hog-u", word_ids(500, 3136), 64)  # 100 blocks
        assert hog.reason == "open"
        # 13 more blocks do not fit under the line and the engine cannot say what is resident:
        # a miss, so the turn waits until the hog's room frees.
        request = asyncio.create_task(
            client.completions.with_raw_response.create(
                model="tiny", prompt=word_ids(1000, 400), max_tokens=4
            )
        )
        await eventually(lambda: gate_stats(url)["waiting"] == 1, 60.0, "the turn waiting")
        assert not request.done()
        await hog.arelease()
        assert await gate.finish_session("hog-u")
        raw = await asyncio.wait_for(request, 120)
        assert raw.headers.get("x-session-gate-reason") == "open"
        assert raw.parse().usage.completion_tokens == 4
        stats = await gate.stats()
        assert stats["admissions"]["prefix_probe_unavailable"] == 0
        assert stats["engine_gate"]["tick_errors"] == 0
        assert await gate.finish_session("mw-cold")
    r = httpx.get(f"{url}/session_gate/v1/stats", timeout=30).json()
    assert r["leases_active"] == 0
