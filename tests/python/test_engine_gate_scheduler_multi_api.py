"""Scheduler mode behind ``vllm serve --api-server-count 2``: two API-server processes in front of
one engine core, the plugin, ``SESSION_GATE_SCHEDULER=session-id`` and nothing else (no
middleware, no proxy, no lease in the client). Requests sent with the official ``openai`` client
carrying a session id (the ``X-Session-ID`` header or the body field ``session_id``) are gated
in vLLM's scheduler whichever process they entered by, and the scheduler's counters show on
vLLM's own ``/metrics`` (``metrics_mirror``) with the engine's values, not one copy per process.

The server is started through the CLI's ``serve`` command as in ``test_engine_gate_multi_api``
(see there why: ``python -m session_gate.lab.engine.vllm_serve``). Each request uses a client of
its own, so a connection of its own: the kernel spreads them over the two processes
(``SO_REUSEPORT``). Sizes as in ``test_engine_gate_scheduler``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import (
    get_text,
    metric,
    scheduler_settled,
    served_multi_api,
    word_ids,
)
from session_gate.engine.metrics_mirror import INTERVAL_SEC

#: Turns sent: half name their session in the header, half in the body.
TURNS = 8


@pytest.fixture(scope="module")
def url():
    with served_multi_api(
        "scheduler-multi-api", env={"SESSION_GATE_SCHEDULER": "session-id"}, max_num_seqs=8
    ) as base:
        yield base


async def turn(url: str, i: int) -> None:
    """One completion of session ``multi-{i}`` on a client (and connection) of its own."""
    from openai import AsyncOpenAI

    session = f"multi-{i}"
    where = (
        {"extra_headers": {"X-Session-ID": session}}
        if i % 2
        else {"extra_body": {"session_id": session}}
    )
    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120
    ) as client:
        out = await client.completions.create(
            model="tiny", prompt=word_ids(100 * (i + 1), 40), max_tokens=4, **where
        )
    assert out.choices and out.choices[0].text is not None


def mirrored(url: str, expected: dict[str, float]) -> str:
    """vLLM's ``/metrics`` once every ``expected`` sample shows its value (the mirror lags by up
    to ``INTERVAL_SEC``)."""
    deadline = time.monotonic() + 10 * INTERVAL_SEC + 20
    while True:
        text = get_text(f"{url}/metrics")
        seen = {name: metric(text, name) for name in expected}
        if seen == expected:
            return text
        assert time.monotonic() < deadline, f"/metrics shows {seen}, the engine {expected}"
        time.sleep(0.2)


def test_turns_through_both_processes_are_gated_and_counted_once_on_metrics(url):
    before = scheduler_settled(url)["scheduler"]

    async def turns() -> None:
        await asyncio.gather(*(turn(url, i) for i in range(TURNS)))

    asyncio.run(turns())
    after = scheduler_settled(url)
    sched = after["scheduler"]
    assert sched["gated"] == before["gated"] + TURNS, sched
    assert sched["admitted"] == before["admitted"] + TURNS, sched
    assert sched["leases"] == 0 and sched["holding"] == 0, sched
    assert after["engine_gate"]["leases_held"] == 0, after

    expected = {
        "session_gate_scheduler_gated_total": float(sched["gated"]),
        "session_gate_scheduler_admitted_total": float(sched["admitted"]),
        "session_gate_scheduler_held_total": float(sched["held"]),
        "session_gate_scheduler_leases": 0.0,
        "session_gate_scheduler_holding": 0.0,
        "session_gate_leases_active": 0.0,
    }
    mirrored(url, expected)
    # Both processes keep mirroring the one engine: a value written by each must still read
    # as the engine's, not their sum, after every process has written it again.
    time.sleep(3 * INTERVAL_SEC)
    text = mirrored(url, expected)
    for reason, n in sched["admitted_by_reason"].items():
        assert metric(text, "session_gate_scheduler_admitted_total", reason=reason) == n
    # vLLM's own numbers are on the same page, and nothing is left running.
    assert metric(text, "vllm:num_requests_running") == 0


def test_vllm_routers_finish_session_call_ends_a_scheduler_session_in_either_process(url):
    """prime-rl ends each episode with vllm-router's ``POST /finish_session?session_id=``; sent
    straight to ``vllm serve`` it ends the session's idle room in the engine gate, whichever
    API-server process takes it, once (ending again answers false)."""
    session = "multi-finish"
    where = {"extra_headers": {"X-Session-ID": session}}

    async def one_turn() -> None:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120
        ) as client:
            await client.completions.create(
                model="tiny", prompt=word_ids(7000, 40), max_tokens=4, **where
            )

    asyncio.run(one_turn())
    assert scheduler_settled(url)["reservations_idle"] >= 1
    answers = []
    for _ in range(4):  # fresh connections: the kernel spreads them over both processes
        r = httpx.post(f"{url}/finish_session", params={"session_id": session}, timeout=60)
        assert r.status_code == 200, r.text
        answers.append(r.json()["finished"])
    # The first call ended the room the turn left; the others found nothing to end.
    assert answers == [True, False, False, False], answers
    # No id is a clear 400, never an engine error.
    r = httpx.post(f"{url}/finish_session", timeout=60)
    assert r.status_code == 400 and "session_id" in r.text, r.text
