"""``session-gate proxy`` placing sessions over a fleet whose list changes while it runs
(``--replicas-file``), and over a replica killed mid-run, against ONE real ``vllm serve`` (tiny
dummy model on CPU, loopback).

The other replicas are that same engine reached through TCP relays: each relay is a process
forwarding bytes to the engine on its own port, so the proxy sees a replica of its own there
(its own URL, gate, probe, health and sessions), every turn it sends there is served by the real
engine, and killing the relay's process is a replica lost (its connections cut, new ones
refused). Two real engines would not fit this VM's two cores. Where each turn went is read from
the proxy's ``session_gate_proxy_requests_total{replica=...}``; placement decisions from
``session_gate_proxy_placements_total{reason=...}``.

- A replica added to the file takes new sessions; one removed from it takes none, and its
  sessions move (``down_move``) at their next turn; a bad line at re-read keeps the last list.
- A replica killed while turns stream: every turn that had not started streaming completes
  (re-placed), its sessions' next turns complete elsewhere, and the moves are counted.
- Replicas behind a DNS name (``--replicas-dns localhost:PORT``) are listed and take sessions.
- A bad line in the file at startup is refused, naming the line.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import get_text, metric, proxy_binary, served_vllm
from session_gate.lab.engine.serve import start_proxy, stop

# A byte relay to the engine: prints its port, forwards every connection to argv[1]'s port.
RELAY = r"""
import socket, sys, threading
target = ("127.0.0.1", int(sys.argv[1]))
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
def pipe(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
def serve(client):
    try:
        upstream = socket.create_connection(target)
    except OSError:
        client.close()
        return
    threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
    pipe(upstream, client)
while True:
    client, _ = server.accept()
    threading.Thread(target=serve, args=(client,), daemon=True).start()
"""

PROMPT = "one two three four five six seven eight nine ten " * 6


@pytest.fixture(scope="module")
def engine():
    """The one engine, and a work directory for the proxies' files and logs."""
    extra = ["--max-num-seqs", "8", "--seed", "0"]
    with served_vllm("fleet", extra_args=extra, num_blocks=128, max_model_len=1024) as url:
        workdir = Path(tempfile.mkdtemp(prefix="session-gate-fleet-proxy-"))
        try:
            yield url, workdir
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def relay(engine_url: str) -> tuple[subprocess.Popen, str]:
    """A relay process to the engine and the replica URL it gives."""
    port = engine_url.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, "-c", RELAY, port], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def completed(proxy_url: str, replica: str) -> float:
    text = get_text(f"{proxy_url}/metrics")
    return metric(text, "session_gate_proxy_requests_total", replica=replica, outcome="completed")


def wait_listed(proxy_url: str, want: dict[str, int], timeout: float = 15) -> str:
    """Waits until the proxy's ``replica_listed`` gauge says ``want``; returns its metrics."""
    deadline = time.monotonic() + timeout
    while True:
        text = get_text(f"{proxy_url}/metrics")
        seen = {r: metric(text, "session_gate_proxy_replica_listed", replica=r) for r in want}
        if seen == want:
            return text
        assert time.monotonic() < deadline, f"replicas listed {seen}, want {want}"
        time.sleep(0.3)


async def turn(client, proxy_url: str, session: str, max_tokens: int = 4) -> None:
    body = {"model": "tiny", "prompt": PROMPT + session, "max_tokens": max_tokens}
    r = await client.post(f"{proxy_url}/sess/{session}/v1/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("gate_at", ["proxy", "engine"])
async def test_a_replica_added_takes_new_sessions_and_a_removed_one_none(engine, gate_at):
    import httpx

    url, workdir = engine
    (r1, r1_url), (r2, r2_url) = relay(url), relay(url)
    listing = workdir / f"replicas-{gate_at}.txt"
    listing.write_text(f"# the fleet\n{r2_url}\n")
    args = ["--replicas-file", str(listing), "--gate-at", gate_at, "--health-interval-sec", "0.5"]
    proxy, proxy_url = start_proxy(proxy_binary(), url, workdir, args)
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            old = [f"{gate_at}-old{k}" for k in range(4)]
            for s in old:
                await turn(client, proxy_url, s)
            on_r2 = completed(proxy_url, r2_url)
            assert completed(proxy_url, url) + on_r2 == 4
            assert on_r2 >= 1, "new sessions spread over both replicas"

            # r1 in, r2 out.
            listing.write_text(f"{r1_url}  # added\n")
            wait_listed(proxy_url, {url: 1, r1_url: 1, r2_url: 0})
            for s in old:
                await turn(client, proxy_url, s)
            new = [f"{gate_at}-new{k}" for k in range(4)]
            for s in new:
                await turn(client, proxy_url, s)
            text = get_text(f"{proxy_url}/metrics")
            assert completed(proxy_url, r2_url) == on_r2, "an unlisted replica takes nothing"
            assert completed(proxy_url, r1_url) >= 1, "the added replica takes new sessions"
            moves = metric(text, "session_gate_proxy_placements_total", reason="down_move")
            assert moves == on_r2, text
            assert metric(text, "session_gate_proxy_placements_total", reason="new") == 8
            assert metric(text, "session_gate_proxy_replica_list_changes_total") == 1

            # A bad line at re-read: logged, the last good list kept.
            listing.write_text(f"{r1_url}\nnot-a-url\n")
            time.sleep(4.5)
            wait_listed(proxy_url, {url: 1, r1_url: 1, r2_url: 0}, timeout=1)
            log = (workdir / "proxy.log").read_text()
            assert "line 2" in log and "keeping the last good list" in log, log[-2000:]
    finally:
        stop(proxy)
        kill(r1)
        kill(r2)


@pytest.mark.parametrize("gate_at", ["proxy", "engine"])
async def test_a_killed_replica_loses_no_turn_that_had_not_started_streaming(engine, gate_at):
    import httpx

    url, workdir = engine
    r1, r1_url = relay(url)
    listing = workdir / f"replicas-kill-{gate_at}.txt"
    listing.write_text(f"{r1_url}\n")
    args = ["--replicas-file", str(listing), "--gate-at", gate_at, "--health-interval-sec", "0.5"]
    proxy, proxy_url = start_proxy(proxy_binary(), url, workdir, args)
    sessions = [f"{gate_at}-k{k}" for k in range(6)]
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            for s in sessions:
                await turn(client, proxy_url, s)
            homed_on_r1 = completed(proxy_url, r1_url)
            assert homed_on_r1 >= 1, "sessions spread over both replicas"

            # Every session streams its second turn; r1 is killed once streams are flowing. A
            # turn started streaming when its answer began (vLLM had it: it is never replayed).
            streamed = dict.fromkeys(sessions, False)
            done = dict.fromkeys(sessions, False)
            failures: dict[str, str] = {}

            async def streaming(s: str) -> None:
                body = {"model": "tiny", "prompt": PROMPT + s, "max_tokens": 48,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                url_s = f"{proxy_url}/sess/{s}/v1/completions"
                try:
                    async with client.stream("POST", url_s, json=body) as r:
                        if r.status_code != 200:
                            failures[s] = f"{r.status_code}: {(await r.aread()).decode()}"
                            return
                        streamed[s] = True
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                done[s] = True
                except httpx.HTTPError as e:
                    failures[s] = repr(e)  # a stream cut with its replica (if it streamed)

            # Killed once at least one of its turns streams (all the others' answers began).
            tasks = [asyncio.create_task(streaming(s)) for s in sessions]
            while sum(streamed.values()) < len(sessions) - homed_on_r1 + 1:
                await asyncio.sleep(0.02)
            kill(r1)
            await asyncio.gather(*tasks)
            lost = [s for s in sessions if not done[s] and not streamed[s]]
            assert not lost, f"turns lost before they streamed: {lost} {failures}"

            # Every session's next turn completes, on the live replica.
            before = completed(proxy_url, url)
            for s in sessions:
                await turn(client, proxy_url, s)
            assert completed(proxy_url, url) - before == len(sessions)
            text = get_text(f"{proxy_url}/metrics")
            assert metric(text, "session_gate_proxy_replica_healthy", replica=r1_url) == 0
            # Each of its sessions moved: down; slow, when a health check that could not finish
            # saw it first; or cold, when its prefix probe failed before anything marked it.
            moves = metric(text, "session_gate_proxy_placement_moves_total")
            assert moves >= homed_on_r1, text
            reasons = {
                reason: metric(text, "session_gate_proxy_placements_total", reason=reason)
                for reason in ["down_move", "slow_move", "cold_move"]
            }
            assert sum(reasons.values()) == moves, text
            for reason in ["new", "held", "resident", "cold_stay", "cold_move", "slow_move"]:
                assert f'session_gate_proxy_placements_total{{reason="{reason}"}}' in text
            print(
                f"gate_at={gate_at}: {homed_on_r1:.0f} of {len(sessions)} sessions on the killed "
                f"replica, {sum(not v for v in done.values())} streams cut, moves {reasons}"
            )
    finally:
        stop(proxy)
        kill(r1)


async def test_replicas_behind_a_dns_name_are_listed_and_take_sessions(engine):
    import httpx

    url, workdir = engine
    r1, r1_url = relay(url)
    port = url.rsplit(":", 1)[1]
    # The static replica is the relay; the engine itself comes from the name `localhost`.
    args = ["--replicas-dns", f"localhost:{port}", "--health-interval-sec", "0.5"]
    proxy, proxy_url = start_proxy(proxy_binary(), r1_url, workdir, args)
    try:
        wait_listed(proxy_url, {r1_url: 1, f"http://127.0.0.1:{port}": 1})
        async with httpx.AsyncClient(timeout=120) as client:
            for k in range(4):
                await turn(client, proxy_url, f"dns{k}")
        by_name = completed(proxy_url, f"http://127.0.0.1:{port}")
        assert by_name >= 1 and by_name + completed(proxy_url, r1_url) == 4
        log = (workdir / "proxy.log").read_text()
        assert f"re-reading localhost:{port}" in log, log[-2000:]
    finally:
        stop(proxy)
        kill(r1)


def test_a_bad_line_at_startup_is_refused_naming_it(tmp_path):
    listing = tmp_path / "fleet.txt"
    listing.write_text("# fleet\nhttp://127.0.0.1:9\nhttps://127.0.0.1:10\n")
    result = subprocess.run(
        [str(proxy_binary()), "proxy", "--replicas-file", str(listing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"{listing} line 3" in result.stderr, result.stderr
    assert "must start with http://" in result.stderr, result.stderr
    assert json.dumps("https://127.0.0.1:10") in result.stderr, result.stderr
