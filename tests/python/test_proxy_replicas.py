"""``session-gate proxy`` in front of two real ``vllm serve`` replicas (tiny dummy model on CPU,
loopback), driven by the official ``openai`` client: new sessions spread over both replicas and
stick to theirs across turns; when one replica goes away the proxy marks it unhealthy and its
sessions carry on, re-routed, on the other, while the other's sessions are untouched.

Where each turn went is read from each replica's own vLLM ``/metrics`` (finished requests), not
from the proxy. Every process is started in its own process group and always terminated."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import SERVE_TIMEOUT, get_text, metric, proxy_binary, word_ids
from session_gate.lab.engine.serve import start_proxy, start_vllm, stop

NUM_BLOCKS = 64
BLOCK = 32
MAX_MODEL_LEN = 2016
SESSIONS = 4


def vllm_served(url: str) -> float:
    """vLLM's own count of finished requests (all finish reasons)."""
    return metric(get_text(f"{url}/metrics", timeout=10), "vllm:request_success_total")


@pytest.fixture(scope="module")
def cluster():
    """Two replicas (started concurrently) and the proxy in front of both:
    ``(proxy_url, [replica_url, ...], [replica_proc, ...])``."""
    binary = proxy_binary()
    workdirs = [Path(tempfile.mkdtemp(prefix=f"session-gate-rep{i}-")) for i in range(2)]
    extra = ["--max-num-seqs", "4", "--max-num-batched-tokens", str(MAX_MODEL_LEN), "--seed", "0"]
    futures = []
    proxy = None
    try:
        # Concurrently; leaving the block waits for both (also on an interrupt), so the finally
        # below sees every replica that came up.
        with ThreadPoolExecutor(2) as pool:
            for w in workdirs:
                futures.append(
                    pool.submit(
                        start_vllm,
                        w,
                        num_blocks=NUM_BLOCKS,
                        block_size=BLOCK,
                        max_model_len=MAX_MODEL_LEN,
                        extra_args=extra,
                        timeout=SERVE_TIMEOUT,
                    )
                )
        started = [f.result() for f in futures]  # a replica that failed stopped itself
        procs = [p for p, _ in started]
        urls = [u for _, u in started]
        args = ["--replica", urls[1], "--idle-grace-sec", "300", "--wait-poll-sec", "0.5",
                "--health-interval-sec", "0.5"]  # fmt: skip
        proxy, proxy_url = start_proxy(binary, urls[0], workdirs[0], args)
        yield proxy_url, urls, procs
    finally:
        if proxy is not None:
            stop(proxy)
        for f in futures:
            if f.done() and f.exception() is None:
                stop(f.result()[0])
        for w in workdirs:
            shutil.rmtree(w, ignore_errors=True)


async def test_sessions_spread_stick_and_fail_over(cluster):
    from openai import AsyncOpenAI

    proxy_url, urls, procs = cluster
    clients = {
        f"s{k}": AsyncOpenAI(
            base_url=f"{proxy_url}/sess/s{k}/v1", api_key="unused", max_retries=0, timeout=60
        )
        for k in range(SESSIONS)
    }
    history = {s: word_ids(300 * k, 40) for k, s in enumerate(clients)}
    alive = list(range(len(urls)))

    async def turn(session: str) -> int:
        """One turn of ``session`` through the proxy; the index of the replica that served it
        (exactly one live replica's vLLM counts one more finished request)."""
        before = {i: vllm_served(urls[i]) for i in alive}
        r = await clients[session].completions.create(
            model="tiny", prompt=history[session], max_tokens=2
        )
        assert r.usage.prompt_tokens == len(history[session])
        assert r.usage.completion_tokens == 2
        history[session] = history[session] + word_ids(2000 + len(history[session]), 20)
        deadline = time.monotonic() + 5
        while True:
            delta = {i: vllm_served(urls[i]) - before[i] for i in alive}
            served = [i for i, d in delta.items() if d > 0]
            if served or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert sorted(delta.values()) == [0] * (len(alive) - 1) + [1], delta
        return served[0]

    # (1) New sessions spread over both replicas; each sticks to its own across turns.
    home = {s: await turn(s) for s in clients}
    assert set(home.values()) == {0, 1}, home
    for _ in range(2):
        for s in clients:
            assert await turn(s) == home[s], f"session {s} left replica {home[s]}"
    text = get_text(f"{proxy_url}/metrics", timeout=10)
    for i, url in enumerate(urls):
        assert metric(text, "session_gate_proxy_replica_healthy", replica=url) == 1
        on_it = sum(1 for s in clients if home[s] == i)
        assert (
            metric(text, "session_gate_proxy_requests_total", replica=url, outcome="completed")
            == 3 * on_it
        )
    assert metric(text, "session_gate_proxy_sessions") == SESSIONS

    # (2) Replica 1 goes away: the proxy marks it unhealthy within a few seconds...
    stop(procs[1])
    alive = [0]
    stopped_at = time.monotonic()

    def healthy(replica: str) -> float:
        text = get_text(f"{proxy_url}/metrics", timeout=10)
        return metric(text, "session_gate_proxy_replica_healthy", replica=replica)

    while healthy(urls[1]) != 0:
        assert time.monotonic() - stopped_at < 5, "replica 1 still healthy 5 s after it stopped"
        await asyncio.sleep(0.1)
    assert healthy(urls[0]) == 1
    with urllib.request.urlopen(f"{proxy_url}/health", timeout=10) as r:
        assert r.status == 200
    # ...its sessions' next turns succeed on replica 0, and stay there; replica 0's own
    # sessions keep working where they were.
    for _ in range(2):
        for s in clients:
            assert await turn(s) == 0, f"session {s} (home {home[s]}) not served by replica 0"
    text = get_text(f"{proxy_url}/metrics", timeout=10)
    assert metric(text, "session_gate_proxy_requests_total", replica=urls[1], status="502") == 0
    assert metric(text, "session_gate_proxy_requests_total", replica="none") == 0
    moved = sum(1 for s in clients if home[s] == 1)
    assert (
        metric(text, "session_gate_proxy_requests_total", replica=urls[0], outcome="completed")
        == 3 * (SESSIONS - moved) + 2 * SESSIONS
    )
    # Ungated requests skip the dead replica too.
    plain = AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(2):
        assert [m.id for m in (await plain.models.list()).data] == ["tiny"]
