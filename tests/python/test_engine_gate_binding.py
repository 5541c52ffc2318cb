"""Through the gating middleware on a real CPU ``vllm serve``: a lease bound to the vLLM request
it admitted is released by the engine core when that request ends or is aborted, with no
release call; the middleware still releases (exactly once) what never reached the engine.

Who released is read from the engine gate's own counters: ``release_loop_calls`` counts every
native release (a client's call or the engine's own, even a no-op second one) and
``leases_released_by_request`` the engine's own releases, so equal deltas mean no client call.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import MID_STREAM_SAMPLES, generated_when_idle, served_vllm, word_ids
from session_gate import HttpGate

MIDDLEWARE = "session_gate.engine.gate_middleware.SessionGateMiddleware"
STREAM_TOKENS = 3000
GATE_ENV = {"SESSION_GATE_LEASE_TTL_SEC": "30", "SESSION_GATE_IDLE_GRACE_SEC": "300"}


@pytest.fixture(scope="module")
def url():
    extra = ["--max-num-seqs", "8", "--seed", "0", "--middleware", MIDDLEWARE]
    with served_vllm("engine-gate-binding", extra_args=extra, env=GATE_ENV) as base:
        yield base


def stats(url: str) -> dict:
    r = httpx.get(f"{url}/session_gate/v1/stats", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def counters(url: str) -> dict:
    s = stats(url)
    e = s["engine_gate"]
    return {
        "admitted": s["admissions_total"],
        "active": s["leases_active"],
        "pending": s["pending"],
        "released": s["leases_released"],
        "calls": e["release_loop_calls"],
        "by_request": e["leases_released_by_request"],
        "unknown": e["bound_releases_unknown"],
    }


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if k not in ("active", "pending")}


def gated(url: str, sid: str, body: dict) -> httpx.Response:
    full = {"model": "tiny", "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/completions", json=full, headers={"x-session-id": sid}, timeout=60)


async def settled(url: str, timeout: float = 20.0) -> dict:
    """The counters once no lease is held and no admit is pending."""
    deadline = time.monotonic() + timeout
    while True:
        c = counters(url)
        if c["active"] == 0 and c["pending"] == 0:
            return c
        assert time.monotonic() < deadline, f"leases still held: {c}"
        await asyncio.sleep(0.05)


async def finish(url: str, *sessions: str) -> None:
    async with HttpGate(url) as gate:
        for sid in sessions:
            await gate.finish_session(sid)


async def test_a_gated_completion_is_released_by_the_engine_with_no_call(url):
    # The first gated request starts the API server's heartbeat, whose answer tells the
    # middleware the engine releases bound leases; from then on every turn is bound.
    assert gated(url, "bind-warm", {"prompt": word_ids(1, 40)}).status_code == 200
    before = await settled(url)
    for turn in range(3):
        r = gated(url, "bind-a", {"prompt": word_ids(10 + turn, 40)})
        assert r.status_code == 200 and r.headers["x-session-gate-reason"], r.text
    d = delta(await settled(url), before)
    assert d == {"admitted": 3, "released": 3, "calls": 3, "by_request": 3, "unknown": 0}, d
    # Streamed chat: the same.
    before = counters(url)
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}],
                "max_tokens": 3, "stream": True}  # fmt: skip
        async with http.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": "bind-c"}
        ) as response:
            assert response.status_code == 200
            chunks = [line async for line in response.aiter_lines() if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]"
    d = delta(await settled(url), before)
    assert d == {"admitted": 1, "released": 1, "calls": 1, "by_request": 1, "unknown": 0}, d
    await finish(url, "bind-warm", "bind-a", "bind-c")


async def test_a_client_leaving_mid_stream_frees_its_lease_through_vllms_abort(url):
    """The client closes its stream after the first chunk: vLLM aborts the request (its
    generation is cut short) and the engine frees the lease bound to it, with no call. A sample
    where vLLM's API server sent nothing until the whole generation ended (see
    ``test_engine_gate_http.leaves_mid_stream``) cannot show a cut: it is retried, never a pass,
    and its lease must still have been released by the engine alone."""
    body = {"model": "tiny", "prompt": word_ids(3910, 50), "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "stream": True}  # fmt: skip
    whole: list[float] = []
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(MID_STREAM_SAMPLES):
            before = counters(url)
            tokens_before = await generated_when_idle(http, url)
            async with http.stream(
                "POST", f"{url}/v1/completions", json=body, headers={"x-session-id": "bind-m"}
            ) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break
                del lines
            d = delta(await settled(url, 60.0), before)
            assert d == {"admitted": 1, "released": 1, "calls": 1, "by_request": 1, "unknown": 0}, d
            cut = await generated_when_idle(http, url) - tokens_before
            if cut < STREAM_TOKENS:
                break
            whole.append(cut)
        else:
            pytest.fail(f"vLLM generated every token of each left stream: {whole}")
    await finish(url, "bind-m")


async def test_the_middleware_releases_what_never_reached_the_engine(url):
    # Rejected by vLLM before generate (a bad sampling parameter): no engine request to end.
    before = counters(url)
    r = gated(url, "bind-r", {"prompt": word_ids(20, 40), "temperature": -1.0})
    assert r.status_code == 400, r.text
    after = await settled(url)
    d = delta(after, before)
    assert d["by_request"] == 0 and d["unknown"] == 0, d
    # Admitted, then released by the middleware's call; or withdrawn before its answer.
    assert d["calls"] == d["released"] == d["admitted"] <= 1, d
    # Several engine requests for one turn (n=2): not bound, released by the middleware.
    before = counters(url)
    r = gated(url, "bind-n", {"prompt": word_ids(21, 40), "n": 2, "temperature": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    d = delta(await settled(url), before)
    assert d == {"admitted": 1, "released": 1, "calls": 1, "by_request": 0, "unknown": 0}, d
    await finish(url, "bind-r", "bind-n")
