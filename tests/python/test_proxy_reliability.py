"""API keys, body limits and re-routing, against one real ``vllm serve --api-key`` (tiny dummy
model on CPU, loopback) and ``session-gate proxy`` in front of it.

- The plugin's ``/session_gate/v1/*`` routes (probes and engine gate) require vLLM's key exactly
  as vLLM's own ``/v1`` routes do: same 401 body, same bearer rule; ``/health`` stays open.
- The proxy's own routes require its ``--api-key``; a forwarded request's ``Authorization``
  reaches vLLM untouched (vLLM accepts or refuses it); the proxy's own calls to the replica use
  ``--replica-api-key`` (both ``--gate-at proxy`` and ``--gate-at engine``).
- A body over ``--max-body-bytes`` gets 413 with a JSON error naming the flag.
- A replica the proxy still believes healthy but that refuses connections, or that drops the
  connection of its ``/tokenize`` call (nothing a turn changes is sent before the tokens come
  back): the turn goes to the live replica (the session re-pinned there), never a 502, and the
  proxy counts it rerouted.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import SERVE_TIMEOUT, get_text, metric, proxy_binary, word_ids
from session_gate.lab.engine.serve import start_proxy, start_vllm, stop
from session_gate.lab.engine.tiny_tokenizer import words

KEY = "vllm-secret"
PROXY_KEY = "proxy-secret"


def call(
    url: str, body: bytes | None = None, auth: str | None = None, method: str | None = None
) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one request; HTTP errors are answers, not exceptions."""
    headers = {"content-type": "application/json"}
    if auth is not None:
        headers["authorization"] = auth
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class _HealthOnly(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class _DropsPosts(_HealthOnly):
    """Passes health checks; reads a POST (``/tokenize``, the engine gate's admit) and closes
    the connection unanswered, as a replica killed mid-call does."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.close_connection = True


@pytest.fixture(scope="module")
def server():
    workdir = Path(tempfile.mkdtemp(prefix="session-gate-apikey-"))
    proc = None
    try:
        proc, url = start_vllm(
            workdir,
            num_blocks=64,
            max_model_len=1024,
            extra_args=["--api-key", KEY, "--max-num-seqs", "4"],
            timeout=SERVE_TIMEOUT,
        )
        yield url, workdir
    finally:
        if proc is not None:
            stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


PLUGIN_ROUTES = [
    ("/session_gate/v1/usage", b"{}"),
    ("/session_gate/v1/probe", json.dumps({"token_ids": [5, 6, 7]}).encode()),
    ("/session_gate/v1/forget", json.dumps({"session_id": "s"}).encode()),
    ("/session_gate/v1/stats", b"{}"),
    ("/session_gate/v1/finish", json.dumps({"session_id": "s"}).encode()),
    ("/session_gate/v1/renew", json.dumps({"client_id": "c"}).encode()),
    ("/finish_session?session_id=s", b""),
]


def test_plugin_routes_require_vllms_key_like_v1(server):
    url, _ = server
    # vLLM's own rule, for comparison: /v1 refuses without the key, /health is open.
    v1 = call(f"{url}/v1/models")
    assert v1 == (401, {"error": "Unauthorized"})
    assert call(f"{url}/health")[0] == 200
    for route, body in PLUGIN_ROUTES:
        for auth in (None, f"Bearer {KEY}x", f"Basic {KEY}", KEY):
            assert call(f"{url}{route}", body, auth) == v1, (route, auth)
        status, answer = call(f"{url}{route}", body, f"bearer {KEY}")
        assert status == 200, (route, answer)
    status, answer = call(f"{url}/session_gate/v1/usage", b"{}", f"Bearer {KEY}")
    assert answer["num_blocks"] > 0  # the usage answer itself, past the key check


@pytest.mark.parametrize("gate_at", ["proxy", "engine"])
def test_proxy_keys_pass_through_and_body_limit(server, gate_at):
    url, workdir = server
    args = ["--api-key", PROXY_KEY, "--replica-api-key", KEY, "--max-body-bytes", "100000",
            "--gate-at", gate_at, "--health-interval-sec", "0.5"]  # fmt: skip
    proxy, proxy_url = start_proxy(proxy_binary(), url, workdir, args)
    try:
        # The proxy's own routes: its key.
        assert call(f"{proxy_url}/health")[0] == 200
        assert call(f"{proxy_url}/metrics")[0] == 401
        assert call(f"{proxy_url}/metrics", auth=f"Bearer {KEY}")[0] == 401
        status, text = call(f"{proxy_url}/metrics", auth=f"Bearer {PROXY_KEY}")
        assert status == 200 and "session_gate_proxy_requests_total" in text
        finish = f"{proxy_url}/sess/s1/finish"
        assert call(finish, b"", method="POST")[0] == 401
        # A gated turn: the client's Authorization goes to vLLM as it is.
        body = json.dumps({"model": "tiny", "prompt": word_ids(0, 40), "max_tokens": 2}).encode()
        turn = f"{proxy_url}/sess/s1/v1/completions"
        status, answer = call(turn, body, f"Bearer {KEY}")
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 2
        # Text prompts are tokenized by the replica (the proxy's own call, with its key).
        text_body = json.dumps({"model": "tiny", "prompt": "w10 w11 w12", "max_tokens": 1})
        assert call(turn, text_body.encode(), f"Bearer {KEY}")[0] == 200
        assert call(turn, body, None) == (401, {"error": "Unauthorized"})
        assert call(turn, body, f"Bearer {PROXY_KEY}") == (401, {"error": "Unauthorized"})
        status, answer = call(finish, b"", f"Bearer {PROXY_KEY}", method="POST")
        assert status == 200 and answer["session_id"] == "s1"
        # vllm-router's release call, as prime-rl sends it: the same, under the proxy's key.
        status, answer = call(f"{proxy_url}/sess/s2/v1/completions", body, f"Bearer {KEY}")
        assert status == 200, answer
        router_finish = f"{proxy_url}/finish_session?session_id=s2"
        assert call(router_finish, b"", method="POST")[0] == 401
        status, answer = call(router_finish, b"", f"Bearer {PROXY_KEY}", method="POST")
        assert status == 200 and answer["session_id"] == "s2", answer
        assert answer["finished"] is True and "replica" in answer, answer
        status, answer = call(f"{proxy_url}/finish_session", b"", f"Bearer {PROXY_KEY}", "POST")
        assert status == 400 and "session_id" in answer["error"]["message"], answer
        # Over the body limit: 413 naming the flag, before anything is forwarded.
        big = json.dumps({"model": "tiny", "prompt": "x" * 200_000}).encode()
        status, answer = call(turn, big, f"Bearer {KEY}")
        assert status == 413, answer
        assert "--max-body-bytes" in answer["error"]["message"]
        # Wrong types get a JSON 400, not a dropped connection.
        for bad in (b"[1, 2]", b"{not json", b'{"prompt": {"a": 1}}', b'{"prompt": [-1]}'):
            status, answer = call(turn, bad, f"Bearer {KEY}")
            assert status == 400 and "error" in answer, (bad, status, answer)
    finally:
        stop(proxy)


def _turns_go_to_the_live_replica(server, ghost_handler, prompt, gate_at="proxy") -> None:
    """Four sessions' turns through a proxy whose first replica (where ties send new sessions)
    is a ghost it believes healthy: all answered 200 by the live replica, every ghost failure
    counted rerouted (none answered 502), the ghost marked unhealthy."""
    url, workdir = server
    ghost = ThreadingHTTPServer(("127.0.0.1", 0), ghost_handler)
    ghost_url = f"http://127.0.0.1:{ghost.server_address[1]}"
    thread = threading.Thread(target=ghost.serve_forever, daemon=True)
    thread.start()
    args = ["--replica", url, "--replica-api-key", KEY, "--health-interval-sec", "3600",
            "--gate-at", gate_at]  # fmt: skip
    proxy, proxy_url = start_proxy(proxy_binary(), ghost_url, workdir, args)
    try:
        if ghost_handler is _HealthOnly:
            # Gone after its health check: connections are refused.
            ghost.shutdown()
            ghost.server_close()
            thread.join(5)
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1})
        for k in range(4):
            status, answer = call(
                f"{proxy_url}/sess/r{k}/v1/completions", body.encode(), f"Bearer {KEY}"
            )
            assert status == 200, answer
        text = get_text(f"{proxy_url}/metrics")
        assert metric(text, "session_gate_proxy_requests_total", replica=ghost_url) >= 1
        assert metric(
            text, "session_gate_proxy_requests_total", replica=ghost_url, status="502"
        ) == metric(
            text, "session_gate_proxy_requests_total", replica=ghost_url, outcome="rerouted"
        )
        assert metric(text, "session_gate_proxy_replica_healthy", replica=ghost_url) == 0
        assert (
            metric(text, "session_gate_proxy_requests_total", replica=url, outcome="completed") == 4
        )
    finally:
        stop(proxy)
        if ghost_handler is not _HealthOnly:
            ghost.shutdown()
            ghost.server_close()


def test_refused_connection_goes_to_the_live_replica(server):
    """A replica that passed its health check and then went away (connection refused) before
    the next check: turns pinned to it go to the live replica, not 502."""
    _turns_go_to_the_live_replica(server, _HealthOnly, word_ids(500, 30))


@pytest.mark.parametrize("gate_at", ["proxy", "engine"])
def test_dropped_connection_goes_to_the_live_replica(server, gate_at):
    """A replica whose connection breaks after the request was written (the soak run's killed
    replica: hyper's ``SendRequest`` on a pooled connection), at ``/tokenize`` (a text prompt)
    or at the engine gate's admit (token ids, ``--gate-at engine``): neither starts anything
    in vLLM, so the turn is served on the live replica, not 502."""
    prompt = words(500, 30) if gate_at == "proxy" else word_ids(500, 30)
    _turns_go_to_the_live_replica(server, _DropsPosts, prompt, gate_at)
