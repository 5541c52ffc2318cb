"""The bench's turns over HTTP, for benches whose sessions reach ``vllm serve`` (or
``session-gate proxy`` in front of it) over the network instead of an in-process engine:
:class:`HttpEngine` sends a turn and ends a session the way ``run_mode`` asks, and
:class:`PlainClient` is the admission of a client that gates nothing itself and only names each
turn's session (:data:`SESSION`), for whatever reads the header on the other side."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from session_gate.lab.bench.admission import Admission
from session_gate.modes import Mode

#: The session whose turn the current task is sending (set by :class:`PlainClient`), for the
#: ``x-session-id`` header and for routing a turn by its session.
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("session", default=None)

#: Seconds an idle pooled connection is reused: under the 5 s after which ``vllm serve``
#: (uvicorn, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) closes it. httpx's default is those same 5 s, so
#: a request could be written on a connection the server was closing and fail with a
#: ``ReadError`` (the proxy's pool, ``POOL_IDLE``, has the same bound for the same reason).
KEEPALIVE_SEC = 4.0


class HttpEngine:
    """What ``run_mode`` needs from an engine, over ``/v1/completions`` with token ids. With
    ``session_header`` each request carries ``x-session-id`` (the turn's session, tagged with
    ``run`` so sessions of an earlier mode on the same server are not continued); with
    ``request_ids``, vLLM's ``X-Request-Id`` naming the run, session and turn (for the audit of
    the session inference, ``infer_audit``)."""

    def __init__(
        self, url: str, session_header: bool = False, run: str = "", request_ids: bool = False
    ) -> None:
        import httpx

        self.url = url
        self.session_header = session_header
        self.request_ids = request_ids
        self.run = run
        limits = httpx.Limits(max_connections=64, keepalive_expiry=KEEPALIVE_SEC)
        self.http = httpx.AsyncClient(timeout=None, limits=limits)

    async def generate(self, _: Any, prompt: list[int], max_tokens: int, request_id: str):
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        headers = {}
        if self.session_header:
            headers["x-session-id"] = f"{SESSION.get()}@{self.run}"
        if self.request_ids:
            # request_id is "<mode>-<session>-<turn>.<attempt>"
            turn = request_id.rsplit("-", 1)[1].split(".")[0]
            headers["x-request-id"] = f"{self.run}|{SESSION.get()}|{turn}"
        r = await self.http.post(f"{self.url}/v1/completions", json=body, headers=headers)
        if r.is_error:
            # The answer's body says why (the proxy's and vLLM's errors are JSON).
            raise RuntimeError(
                f"{request_id}: POST {self.url}/v1/completions answered {r.status_code}: "
                f"{r.text[:1000]}"
            )
        out = r.json()
        details = out["usage"].get("prompt_tokens_details") or {}
        return list(out["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)

    async def finish(self, session_id: str) -> None:
        """Ends a session the way prime-rl ends an episode at its router: vllm-router's
        ``POST /finish_session?session_id=<id>``, which the plugin serves on ``vllm serve`` and
        ``session-gate proxy`` serves too."""
        tagged = f"{session_id}@{self.run}"
        r = await self.http.post(f"{self.url}/finish_session", params={"session_id": tagged})
        r.raise_for_status()

    async def aclose(self) -> None:
        await self.http.aclose()


class PlainClient(Admission):
    """No admission in the client: it only names each turn's session (:data:`SESSION`), which
    the other side reads from the header (the engine's middleware, vLLM's server in the
    scheduler mode, the proxy). Its turns are recorded under ``label`` (the mode): the other
    side decides, the client never learns the reason."""

    def __init__(self, label: str) -> None:
        super().__init__(Mode("none", "none"), None)
        self.label = label

    @contextlib.asynccontextmanager
    async def turn(self, session_id: str, prompt: list[int], max_tokens: int):  # type: ignore[override]
        token = SESSION.set(session_id)
        try:
            yield self.label, 0.0
        finally:
            SESSION.reset(token)
