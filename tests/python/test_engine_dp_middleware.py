"""The middleware on a real ``vllm serve --data-parallel-size 2``: a plain client that sends only
``x-session-id`` is gated by the engine gate of the rank its session lives on.

vLLM's CPU backend runs two engine cores (one per DP rank, each with its own KV cache and its own
engine gate) behind two API-server processes. The middleware (no scheduler mode here) admits each
turn on its session's rank through the lease doors, and the session's pin sends the request
there; which rank served a request is read from vLLM's own metrics (``dp_ranks``), which rank's
gate admitted it from the stats' ``ranks``.
"""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import gate_stats, served_multi_api
from dp_ranks import complete, history

MIDDLEWARE = "session_gate.engine.gate_middleware.SessionGateMiddleware"
SESSIONS = [f"dp-plain-{i}" for i in range(6)]
TURNS = 3


@pytest.fixture(scope="module")
def url():
    with served_multi_api(
        "dp-middleware",
        extra_args=["--data-parallel-size", "2", "--max-num-seqs", "8", "--middleware", MIDDLEWARE],
    ) as base:
        yield base


def admitted_by_rank(url: str) -> list[int]:
    return [rank["admissions_total"] for rank in gate_stats(url)["ranks"]]


def test_each_ranks_gate_admits_the_turns_of_the_sessions_on_it(url):
    before = admitted_by_rank(url)
    ranks: dict[str, list[int]] = {s: [] for s in SESSIONS}
    for turn in range(TURNS):
        for session in SESSIONS:
            ranks[session].append(complete(url, history(session, turn), session))
    assert all(len(set(r)) == 1 for r in ranks.values()), ranks
    homes = {s: r[0] for s, r in ranks.items()}
    assert set(homes.values()) == {0, 1}, homes  # new sessions went to both ranks
    admitted = [a - b for a, b in zip(admitted_by_rank(url), before, strict=True)]
    on_rank = [sum(TURNS for h in homes.values() if h == k) for k in (0, 1)]
    assert admitted == on_rank, (admitted, homes)
    # Every lease is released once its answer ended: nothing is left held on either rank.
    deadline = time.monotonic() + 10
    while (held := [rank["leases_active"] for rank in gate_stats(url)["ranks"]]) != [0, 0]:
        assert time.monotonic() < deadline, f"leases still held: {held}"
        time.sleep(0.1)


def test_a_request_without_a_session_id_is_not_gated(url):
    before = admitted_by_rank(url)
    for _ in range(4):
        complete(url, history("no id", 1))
    assert admitted_by_rank(url) == before


def test_finish_session_ends_the_window_on_the_sessions_rank(url):
    complete(url, history("dp-plain-finish", 0), "dp-plain-finish")
    r = httpx.post(f"{url}/finish_session", params={"session_id": "dp-plain-finish"}, timeout=60)
    assert r.status_code == 200, r.text
    assert gate_stats(url)["dp_pins"].get("forgotten", 0) >= 1
