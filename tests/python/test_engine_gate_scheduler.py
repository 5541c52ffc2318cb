"""Scheduler mode of the engine gate on a real CPU ``vllm serve`` (tiny dummy model, the plugin,
``SESSION_GATE_SCHEDULER=session-id`` and nothing else: no middleware, no proxy, no lease in the
client): requests that carry a session id (the ``X-Session-ID`` header or the body field) are
decided by the engine gate's book inside vLLM's scheduler.

Pressure is made deterministic with a *blocker*: a lease taken through the gate's own admit route
(another door of the same book) whose working set (16 + 75 blocks) leaves less than a turn's
room under the line (0.85 x 127 usable blocks = 107.95). A turn of 300 prompt and 600 output
tokens (29 blocks) is then held in vLLM's waiting queue until the blocker is released or
``max_wait`` (8 s here) passes. Idle grace is 0: a finished turn leaves no reservation behind.
The same counters show on vLLM's own ``/metrics`` (``metrics_mirror``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from conftest import (
    ROOT,
    eventually,
    gate_stats,
    get_text,
    metric,
    scheduler_settled,
    served_vllm,
    word_ids,
)
from session_gate.engine.metrics_mirror import INTERVAL_SEC

NUM_BLOCKS = 128  # 127 usable
BLOCK = 32
MAX_MODEL_LEN = 4064
MAX_WAIT = 8.0
ENV = {
    "SESSION_GATE_SCHEDULER": "session-id",
    "SESSION_GATE_MAX_WAIT_SEC": str(MAX_WAIT),
    "SESSION_GATE_WAIT_POLL_SEC": "0.5",
    "SESSION_GATE_IDLE_GRACE_SEC": "0",
    "SESSION_GATE_LEASE_TTL_SEC": "60",
}
#: A turn the blocker leaves no room for: 300 + 600 tokens = 29 blocks (91 + 29 > 107.95).
TURN_PROMPT, TURN_MAX_TOKENS = 300, 600


@pytest.fixture(scope="module")
def url():
    extra = ["--max-num-seqs", "8", "--max-num-batched-tokens", str(MAX_MODEL_LEN), "--seed", "0"]
    with served_vllm(
        "engine-gate-scheduler",
        extra_args=extra,
        env=ENV,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
    ) as base:
        yield base


def sched(url: str) -> dict:
    return gate_stats(url)["scheduler"]


def openai_client(url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


async def complete(url: str, start: int, *, max_tokens: int = 4, prompt: int = 40, **kw):
    """One completion over ``prompt`` word ids from ``start`` with the official client."""
    async with openai_client(url) as client:
        return await client.completions.create(
            model="tiny", prompt=word_ids(start, prompt), max_tokens=max_tokens, **kw
        )


class Blocker:
    """A lease of 16 + 75 blocks taken through the gate's admit route (a lease door of the
    same book), released on exit."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> Blocker:
        r = httpx.post(
            f"{self.url}/session_gate/v1/admit",
            json={
                "session_id": f"blocker-{time.monotonic_ns()}",
                "token_ids": word_ids(9000, 500),
                "max_tokens": 2400,
                "retain_session": False,
                "client_id": "blocker",
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["status"] == "admitted", r.text
        self.lease = r.json()["lease"]
        self.released = False
        return self

    def release(self) -> None:
        if not self.released:
            r = httpx.post(
                f"{self.url}/session_gate/v1/release",
                json={"lease": self.lease, "client_id": "blocker"},
                timeout=60,
            )
            assert r.status_code == 200 and r.json()["released"] is True, r.text
            self.released = True

    def __exit__(self, *exc) -> None:
        self.release()


def test_header_and_body_ids_are_gated_and_requests_without_one_are_not(url):
    before = scheduler_settled(url)["scheduler"]
    asyncio.run(complete(url, 100, extra_headers={"X-Session-ID": "hdr-1"}))
    asyncio.run(complete(url, 200, extra_body={"session_id": "body-1"}))
    mid = sched(url)
    assert mid["gated"] == before["gated"] + 2, mid
    assert mid["admitted"] == before["admitted"] + 2, mid
    # No id: scheduled as vLLM would, the gate is not asked.
    asyncio.run(complete(url, 300))
    after = scheduler_settled(url)
    assert after["scheduler"]["gated"] == mid["gated"], after
    # Each admitted turn's lease was released when vLLM freed its request.
    assert after["engine_gate"]["leases_held"] == 0, after
    assert after["engine_gate"]["attempts_pending"] == 0, after
    # The same counters in the gate's Prometheus text.
    text = httpx.get(f"{url}/session_gate/v1/stats?format=prometheus", timeout=60).text
    assert metric(text, "session_gate_scheduler_gated_total") == after["scheduler"]["gated"]
    assert metric(text, "session_gate_scheduler_admitted_total") == after["scheduler"]["admitted"]


def test_a_held_request_waits_in_the_queue_and_runs_once_admitted(url):
    before = scheduler_settled(url)["scheduler"]

    async def scenario() -> None:
        with Blocker(url) as blocker:
            turn = asyncio.ensure_future(
                complete(
                    url,
                    400,
                    prompt=TURN_PROMPT,
                    max_tokens=TURN_MAX_TOKENS,
                    extra_headers={"X-Session-ID": "held-1"},
                )
            )
            await eventually(lambda: sched(url)["holding"] == 1, what="the turn held")
            await asyncio.sleep(1.0)
            assert not turn.done(), "a held turn ran"
            # Held, looked at on every step by the native look (no Python frame).
            assert (sched(url)["holding"], sched(url)["native_holding"]) == (1, 1)
            blocker.release()
            out = await asyncio.wait_for(turn, 120)
            assert out.choices[0].text is not None
            assert sched(url)["native_holding"] == 0

    asyncio.run(scenario())
    after = scheduler_settled(url)["scheduler"]
    assert after["held"] == before["held"] + 1, after
    assert after["admitted"] == before["admitted"] + 1, after
    assert after["max_wait"] == before["max_wait"], f"admitted by max_wait, not release: {after}"


def test_a_hold_past_max_wait_is_scheduled_with_reason_max_wait(url):
    before = scheduler_settled(url)["scheduler"]

    async def scenario() -> float:
        with Blocker(url):
            started = time.monotonic()
            await complete(
                url,
                500,
                prompt=TURN_PROMPT,
                max_tokens=TURN_MAX_TOKENS,
                extra_body={"session_id": "starved-1"},
            )
            return time.monotonic() - started

    took = asyncio.run(scenario())
    after = scheduler_settled(url)["scheduler"]
    assert took >= MAX_WAIT - 0.5, f"answered after {took:.1f} s, before max_wait"
    assert after["max_wait"] == before["max_wait"] + 1, after
    assert after["admitted_by_reason"].get("max_wait", 0) == (
        before["admitted_by_reason"].get("max_wait", 0) + 1
    )


def test_a_held_request_aborted_by_its_client_leaves_nothing(url):
    before = scheduler_settled(url)

    async def scenario() -> None:
        with Blocker(url):
            body = {
                "model": "tiny",
                "prompt": word_ids(600, TURN_PROMPT),
                "max_tokens": TURN_MAX_TOKENS,
                "stream": True,
            }
            async with httpx.AsyncClient(timeout=120) as http:
                turn = asyncio.ensure_future(
                    http.post(
                        f"{url}/v1/completions",
                        json=body,
                        headers={"X-Session-ID": "aborted-1"},
                    )
                )
                await eventually(lambda: sched(url)["holding"] == 1, what="the turn held")
                turn.cancel()  # the client goes away: vLLM aborts the request
                with pytest.raises(asyncio.CancelledError):
                    await turn
            await eventually(lambda: sched(url)["holding"] == 0, what="the hold ended")
            assert sched(url)["native_holding"] == 0
            s = gate_stats(url)
            # Only the blocker's lease is left; the held turn took none and waits no more.
            assert s["engine_gate"]["leases_held"] == 1, s
            assert s["engine_gate"]["attempts_pending"] == 0, s

    asyncio.run(scenario())
    after = scheduler_settled(url)
    assert after["scheduler"]["aborted_while_held"] == (
        before["scheduler"]["aborted_while_held"] + 1
    ), after
    assert after["scheduler"]["admitted"] == before["scheduler"]["admitted"], after
    assert after["engine_gate"]["leases_held"] == 0, after
    # No request is stuck in vLLM either.
    text = httpx.get(f"{url}/metrics", timeout=60).text
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:num_requests_waiting") == 0


def test_bad_session_ids_pass_ungated_and_never_break_the_engine(url):
    before = scheduler_settled(url)["scheduler"]
    long_id = "x" * 10_000
    # Empty ids: vLLM's server drops them (no id, nothing asked of the gate).
    asyncio.run(complete(url, 700, extra_headers={"X-Session-ID": ""}))
    asyncio.run(complete(url, 710, extra_body={"session_id": ""}))
    mid = sched(url)
    assert mid["gated"] == before["gated"] and mid["bad_session_ids"] == before["bad_session_ids"]
    # 10 KB ids (header and body): the book refuses them, the request runs ungated.
    asyncio.run(complete(url, 720, extra_headers={"X-Session-ID": long_id}))
    asyncio.run(complete(url, 730, extra_body={"session_id": long_id}))
    mid = sched(url)
    assert mid["bad_session_ids"] == before["bad_session_ids"] + 2, mid
    assert mid["gated"] == before["gated"], mid
    # Non-UTF-8 bytes in the header: the server decodes them as latin-1, a valid id.
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": word_ids(740, 40), "max_tokens": 4},
        headers={"X-Session-ID": b"\xff\xfe\x80-s"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    after = scheduler_settled(url)
    assert after["scheduler"]["gated"] == before["gated"] + 1, after
    assert after["scheduler"]["errors"] == 0, after
    # The engine core still serves.
    assert asyncio.run(complete(url, 750, extra_headers={"X-Session-ID": "ok"})).choices


def test_the_scheduler_metrics_show_on_vllms_own_metrics(url):
    """``metrics_mirror``: the scheduler's and the engine gate's metrics on ``/metrics``, as the
    engine counts them (one API server: counters stay counters), and every scheduler metric the
    dashboard queries among them."""
    asyncio.run(complete(url, 800, extra_headers={"X-Session-ID": "metrics-1"}))
    s = scheduler_settled(url)
    expected = {
        "session_gate_scheduler_gated_total": s["scheduler"]["gated"],
        "session_gate_scheduler_admitted_total": s["scheduler"]["admitted"],
        "session_gate_scheduler_aborted_while_held_total": s["scheduler"]["aborted_while_held"],
        "session_gate_scheduler_leases": 0,
        "session_gate_leases_active": 0,
    }
    deadline = time.monotonic() + 10 * INTERVAL_SEC + 20
    while True:
        text = get_text(f"{url}/metrics")
        seen = {name: metric(text, name) for name in expected}
        if seen == expected:
            break
        assert time.monotonic() < deadline, f"/metrics shows {seen}, the engine {expected}"
        time.sleep(0.2)
    assert "# TYPE session_gate_scheduler_gated_total counter" in text
    assert "# TYPE session_gate_wait_seconds histogram" in text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    dashboard = json.loads((ROOT / "dashboards" / "session-gate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {n for e in exprs for n in re.findall(r"\bsession_gate_scheduler_[a-z_]+", e)}
    assert len(queried) >= 7, queried
    # The inference's counts exist only with SESSION_GATE_SCHEDULER=infer (checked there).
    queried.discard("session_gate_scheduler_inferred_total")
    assert not queried - exported, f"the dashboard queries {sorted(queried - exported)}"
