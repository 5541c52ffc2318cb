"""What the DP tests read of a real ``vllm serve --data-parallel-size 2``: which rank served a
request (``vllm:request_success_total``, labelled by engine = DP rank; requests are sent one at
a time, so the engine whose count rose served it) and what each rank's own gate counted."""

from __future__ import annotations

import re
import time

import httpx
from conftest import gate_stats


def served_by_rank(url: str) -> dict[int, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    counts = {0: 0.0, 1: 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            rank = int(re.search(r'engine="(\d+)"', line).group(1))
            counts[rank] += float(line.rsplit(" ", 1)[1])
    return counts


def complete(
    url: str, prompt: str, session_id: str | None = None, in_body: bool = False, **headers: str
) -> int:
    """One completion on a new connection, its session id in the ``x-session-id`` header (or
    the body's ``session_id``); returns the DP rank that served it."""
    before = served_by_rank(url)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    if session_id is not None and in_body:
        body["session_id"] = session_id
    elif session_id is not None:
        headers["x-session-id"] = session_id
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return served_rank(url, before)


def served_rank(url: str, before: dict[int, float]) -> int:
    """The rank whose ``vllm:request_success_total`` rose by the one request sent since
    ``before`` was read."""
    deadline = time.monotonic() + 30
    while True:
        after = served_by_rank(url)
        grew = [rank for rank in after if after[rank] > before[rank]]
        if sum(after.values()) - sum(before.values()) >= 1:
            assert len(grew) == 1, (before, after)
            return grew[0]
        assert time.monotonic() < deadline, f"no engine counted the request: {after}"
        time.sleep(0.05)


def history(session: str, turn: int) -> str:
    """A session's prompt at ``turn``: its earlier turns' text, then the new one."""
    return " ".join(f"{session} turn {t} says hello to the tools" for t in range(turn + 1))


def gated_by_rank(url: str) -> list[int]:
    """Session turns each rank's own gate (scheduler mode) gated, from the stats' ``ranks``."""
    return [rank["scheduler"]["gated"] for rank in gate_stats(url)["ranks"]]
