"""Two ``session-gate proxy`` processes in front of the same TWO real ``vllm serve`` replicas
(tiny dummy model on CPU, loopback), both with ``--gate-at engine``: each replica's engine gate is
the one book both proxies admit through.

- A session's turns entered alternately through proxy A and proxy B all land on one replica: a
  proxy that has not seen a session finds its home by the replicas' prefix probes (``found``).
  Where each turn went is the change of the proxies' ``session_gate_proxy_requests_total
  {replica=...}`` across it (turns are sent one at a time).
- Both proxies sending at once never commit a replica past its line: each engine gate's
  ``committed_blocks`` is sampled from its stats route during the run.
- ``--placement hash`` keeps a session on one replica whichever proxy it enters (both compute the
  same ring); an unknown ``--placement`` is refused, naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import gate_stats, get_text, metric, proxy_binary, served_vllm, word_ids
from session_gate.lab.engine.serve import start_proxy, stop

NUM_BLOCKS = 128  # 127 usable
BLOCK = 32
#: The engine gate's line with its default ``high_watermark`` 0.85.
LINE = 0.85 * (NUM_BLOCKS - 1)
#: A turn of the concurrent run: 1200 prompt tokens and 256 out, 46 blocks; two fit under the
#: line, three do not. The long answer keeps a turn running for over a second, so turns sent
#: together overlap even when the proxies forward them hundreds of milliseconds apart.
BIG_PROMPT = 1200
BIG_OUT = 256
GATE_ENV = {"SESSION_GATE_WAIT_POLL_SEC": "0.5", "SESSION_GATE_IDLE_GRACE_SEC": "5"}


@pytest.fixture(scope="module")
def replicas():
    """The two engines (both started here, always stopped) and a work directory."""
    extra = ["--max-num-seqs", "8", "--seed", "0"]
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(
                served_vllm(
                    f"two-proxies-{k}",
                    extra_args=extra,
                    env=GATE_ENV,
                    num_blocks=NUM_BLOCKS,
                    block_size=BLOCK,
                    max_model_len=2048,
                )
            )
            for k in range(2)
        ]
        workdir = Path(tempfile.mkdtemp(prefix="session-gate-two-proxies-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        yield urls, workdir


@contextlib.contextmanager
def two_proxies(urls: list[str], workdir: Path, name: str, *args: str):
    """Proxies A and B, each in front of both replicas with the engine's gate."""
    procs = []
    try:
        bases = []
        for side in "ab":
            d = workdir / f"{name}-{side}"
            d.mkdir()
            extra = ["--replica", urls[1], "--gate-at", "engine", *args]
            proc, base = start_proxy(proxy_binary(), urls[0], d, extra)
            procs.append(proc)
            bases.append(base)
        yield bases
    finally:
        for proc in procs:
            stop(proc)


def completed(proxies: list[str], replica: str) -> float:
    """Turns completed on ``replica`` through either proxy."""
    return sum(
        metric(
            get_text(f"{p}/metrics"),
            "session_gate_proxy_requests_total",
            replica=replica,
            outcome="completed",
        )
        for p in proxies
    )


async def turn(http: httpx.AsyncClient, proxy: str, session: str, ids: list[int], out: int) -> None:
    body = {"model": "tiny", "prompt": ids, "max_tokens": out, "ignore_eos": True}
    r = await http.post(f"{proxy}/sess/{session}/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def turns_alternating(urls: list[str], proxies: list[str], prefix: str) -> dict[str, set]:
    """Six sessions, four turns each, entered through A, B, A, B; every turn alone, so the
    replica whose completed count rose served it. Returns each session's replicas."""
    where: dict[str, set] = {}
    async with httpx.AsyncClient(timeout=120) as http:
        for k in range(6):
            session = f"{prefix}{k}"
            ids = word_ids(1000 * k, 300)  # a prompt of its own: no prefix shared with others
            where[session] = set()
            for t in range(4):
                before = [completed(proxies, u) for u in urls]
                await turn(http, proxies[t % 2], session, ids, 2)
                after = [completed(proxies, u) for u in urls]
                rose = [u for u, b, a in zip(urls, before, after, strict=True) if a > b]
                assert len(rose) == 1, (before, after)
                where[session].add(rose[0])
                ids = ids + word_ids(1000 * k + 500 + 40 * t, 40)  # the next turn extends it
    return where


async def test_a_sessions_turns_land_on_one_replica_whichever_proxy_they_enter(replicas):
    urls, workdir = replicas
    with two_proxies(urls, workdir, "gate") as proxies:
        where = await turns_alternating(urls, proxies, "g")
        split = {s: sorted(r) for s, r in where.items() if len(r) != 1}
        assert not split, f"sessions whose turns went to two replicas: {split}"
        homes = [next(iter(r)) for r in where.values()]
        assert set(homes) == set(urls), f"sessions not spread on both replicas: {homes}"
        texts = [get_text(f"{p}/metrics") for p in proxies]
        found = sum(metric(t, "session_gate_proxy_placements_total", reason="found") for t in texts)
        new = sum(metric(t, "session_gate_proxy_placements_total", reason="new") for t in texts)
        # Each session is new to A at its first turn and found by B at its second.
        assert (new, found) == (6, 6), texts
        for t in texts:
            assert 'session_gate_proxy_placement_info{policy="gate"} 1' in t


async def test_two_proxies_sending_at_once_never_commit_a_replica_past_its_line(replicas):
    urls, workdir = replicas
    samples: dict[str, list[dict]] = {u: [] for u in urls}
    done = threading.Event()

    def sample() -> None:
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                for u in urls:
                    samples[u].append(http.get(f"{u}/session_gate/v1/stats").json())
                time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    waits_before = [long_waits(u) for u in urls]
    # Hash placement hands every session to its replica at once, never holding one in a proxy
    # (gate placement does: late binding), and puts at least four of the eight on one replica,
    # where two fit under the line: the engine gates alone must keep it.
    with two_proxies(urls, workdir, "line", "--placement", "hash") as proxies:
        sampler.start()
        try:
            async with httpx.AsyncClient(timeout=300) as http:

                async def session(k: int) -> None:
                    name = f"line{k}"
                    proxy = proxies[k % 2]
                    await turn(http, proxy, name, word_ids(3000 + 1300 * k, BIG_PROMPT), BIG_OUT)
                    r = await http.post(f"{proxy}/sess/{name}/finish")
                    assert r.status_code < 300, r.text

                await asyncio.gather(*(session(k) for k in range(8)))
        finally:
            done.set()
            sampler.join()
    for u in urls:
        committed = [s["committed_blocks"] for s in samples[u]]
        assert committed, "no stats sampled"
        assert max(committed) <= LINE, f"{u}: committed {max(committed)} > line {LINE}"
    # The engine gates were the limit: some turn waited there (seen waiting in a sample, or
    # admitted after a wait longer than any admission's own round trip).
    peaks = {u: max(s["committed_blocks"] for s in samples[u]) for u in urls}
    waited = {u: max(s["waiting"] for s in samples[u]) for u in urls}
    long = {u: long_waits(u) - b for u, b in zip(urls, waits_before, strict=True)}
    print(f"peak committed per replica {peaks} (line {LINE:.2f}), most waiting {waited}, "
          f"admissions after a wait over {LONG_WAIT_SEC} s {long}")  # fmt: skip
    assert max(peaks.values()) >= 46
    assert max(waited.values()) >= 1 or max(long.values()) >= 1, (waited, long)


#: A wait no admission's own round trip (usage probe between engine steps) comes near.
LONG_WAIT_SEC = 0.5


def long_waits(url: str) -> int:
    """Admissions of ``url``'s engine gate that waited over :data:`LONG_WAIT_SEC`, from its
    ``wait_sec`` histogram."""
    hist = gate_stats(url)["wait_sec"]
    under = next(n for le, n in hist["buckets"] if le == LONG_WAIT_SEC)
    return hist["count"] - under


async def test_hash_keeps_a_session_on_one_replica_through_either_proxy(replicas):
    urls, workdir = replicas
    with two_proxies(urls, workdir, "hash", "--placement", "hash") as proxies:
        where = await turns_alternating(urls, proxies, "h")
        split = {s: sorted(r) for s, r in where.items() if len(r) != 1}
        assert not split, f"sessions whose turns went to two replicas: {split}"
        for p in proxies:
            text = get_text(f"{p}/metrics")
            assert 'session_gate_proxy_placement_info{policy="hash"} 1' in text
            # Hash asks no replica: a session each proxy had not seen is new to it.
            assert metric(text, "session_gate_proxy_placements_total", reason="found") == 0
            assert metric(text, "session_gate_proxy_placements_total", reason="new") == 6


def test_an_unknown_placement_is_refused_naming_the_field():
    result = subprocess.run(
        [str(proxy_binary()), "proxy", "--replica", "http://127.0.0.1:9", "--placement", "rr"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "`placement`" in result.stderr, result.stderr
    assert "hash, sticky-least-loaded, gate" in result.stderr, result.stderr
