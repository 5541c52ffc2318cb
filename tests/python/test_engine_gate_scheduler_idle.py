"""Scheduler mode on a real CPU ``vllm serve``: the step that empties the engine reads idle.

vLLM frees a finished request (where the engine gate releases its lease and its waiters look
again) before it takes it off ``scheduler.running``. The book's request counts leave finished
requests out, so a request held behind the finishing session's room learns at that free that the
engine has nothing to do, and the room, idle, yields to it after ``idle_engine_turns`` (4) of
that session's turn times. Counted as listed, the engine would read busy there and the held
request would wait for its next poll: ``wait_poll_sec`` is 600 s here, and the yield floor
(half of the 1,200 s ``idle_grace_sec``) as long, so the test tells the two apart by minutes.

127 usable blocks of 32 tokens; the line (0.85) is at 107.95 blocks. Session A's turn (2,600
prompt and 600 output tokens, 100 blocks) leaves no room for B's (300 + 16 tokens, 10 blocks).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import eventually, gate_stats, scheduler_settled, served_vllm, word_ids

ENV = {
    "SESSION_GATE_SCHEDULER": "session-id",
    "SESSION_GATE_WAIT_POLL_SEC": "600",
    "SESSION_GATE_IDLE_GRACE_SEC": "1200",
    "SESSION_GATE_MAX_WAIT_SEC": "1800",
    "SESSION_GATE_IDLE_ENGINE_TURNS": "4",
}


@pytest.fixture(scope="module")
def url():
    extra = ["--max-num-seqs", "8", "--max-num-batched-tokens", "4064", "--seed", "0"]
    with served_vllm("engine-gate-scheduler-idle", extra_args=extra, env=ENV) as base:
        yield base


async def complete(url: str, session: str, start: int, prompt: int, max_tokens: int):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800
    ) as client:
        return await client.completions.create(
            model="tiny",
            prompt=word_ids(start, prompt),
            max_tokens=max_tokens,
            extra_headers={"X-Session-ID": session},
        )


def test_a_held_request_takes_the_room_of_a_session_whose_turn_emptied_the_engine(url):
    before = gate_stats(url)

    async def scenario() -> tuple[float, float]:
        a = asyncio.create_task(complete(url, "idle-a", 100, 2600, 600))
        # B goes in while A's turn runs, so it is held behind A's room.
        await eventually(
            lambda: gate_stats(url)["scheduler"]["leases"] >= 1,
            120.0,
            "A's turn scheduled",
            poll=0.02,
        )
        sent = time.monotonic()
        b = asyncio.create_task(complete(url, "idle-b", 9000, 300, 16))
        await a
        a_done = time.monotonic()
        await b
        return a_done - sent, time.monotonic() - sent

    a_left, b_took = asyncio.run(scenario())
    after = scheduler_settled(url)
    held = after["scheduler"]["held"] - before["scheduler"]["held"]
    assert held == 1, "B was not held behind A's room"
    assert after["idle_engine_yields"] == before["idle_engine_yields"] + 1, after
    # A's turn is its only one: B goes in four of A's turn times after A ends, far inside the
    # 600 s the next poll (or the yield floor) would have taken.
    assert b_took < a_left + 120, (a_left, b_took)
