"""The engine gate's HTTP routes on ``vllm serve`` (attached by the ``session_gate`` endpoint
plugin beside the probe routes, ``http_routes``). All POST, all JSON; errors in vLLM's shape.

``/session_gate/v1/admit`` (long-poll: answers when the engine gate decides)
    The prompt as for ``/probe``: an octet-stream of packed uint32 ids with the other fields as
    query parameters, or JSON with ``token_ids`` / ``prompt`` / ``messages``. Fields:
    ``session_id`` (required), ``max_tokens`` (default 512), ``retain_session`` (default true),
    ``client_id`` and ``ticket`` (optional). Answers 200 ``{"status": "admitted", "lease", "reason",
    "wait_sec", ...}``, 409 ``{"status": "preempted", ...}`` when a newer admit of the session
    took over, 410 ``cancelled``/``expired``. A client that disconnects while it waits cancels its
    attempt (and releases the lease if the admission raced the disconnect).
``/session_gate/v1/release``  ``{"lease": id}`` → ``{"released": bool}``
``/session_gate/v1/cancel``   ``{"ticket": t}`` → ``{"cancelled": bool}``
``/session_gate/v1/finish``   ``{"session_id": s}`` → ``{"finished": bool}``
``/session_gate/v1/renew``    ``{"client_id": c}`` → ``{"lease_ttl_sec", "leases", "pending"}``
``/session_gate/v1/stats``    the gate's counters; ``?format=prometheus`` for text;
                              ``?format=inferred``: the scheduler mode's recent inferences.
                              With data parallelism each rank has its own gate: the JSON is
                              rank 0's with ``ranks`` (every rank's, in rank order), the text
                              labels each sample with its ``rank``.
``/finish_session?session_id=s``  ``/session_gate/v1/finish`` in the fleet routers' convention:
    vllm-router's ``POST /finish_session?session_id=<id>`` (empty body), which prime-rl and SkyRL
    send at each episode's end. A client pointed straight at ``vllm serve`` (no router) thus
    ends its sessions in the engine gate, scheduler mode included, with nothing changed.
    → 200 ``{"finished": bool}`` (false: the gate held nothing for it; ending is idempotent).

Leases and clients: a lease belongs to its ``client_id``; the engine frees it when that client
has not called for ``lease_ttl_sec`` (``SESSION_GATE_LEASE_TTL_SEC``). ``HttpGate`` sends a
``client_id`` and renews it. An admit without one gets a fresh id (in the answer): its lease then
lasts one TTL unless released or renewed under that id. While a long-poll waits, the route renews
its client itself: the open connection is the sign of life.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from session_gate.engine import metrics_mirror
from session_gate.engine.http_routes import (
    PREFIX,
    ProbeError,
    _json_body,
    _Routes,
    _routes,
    read_prompt,
)

#: ``max_tokens`` of an admit that names none (it sizes the turn's working set).
DEFAULT_MAX_TOKENS = 512
#: How often a waiting long-poll renews its client before the engine told it the TTL.
_FIRST_RENEW_SEC = 1.0
#: An admit not answered within this long gets a disconnect watcher (see ``long_poll_admit``).
_WATCH_AFTER_SEC = 0.05

_STATUS_CODES = {"admitted": 200, "preempted": 409, "cancelled": 410, "expired": 410}


def _int_field(fields: Any, name: str, default: int) -> int:
    value = fields.get(name, default)
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ProbeError(400, f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProbeError(400, f"{name} must be a non-negative integer, got {value!r}")
    return value


def _bool_field(fields: Any, name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if isinstance(value, str) and value.lower() in ("true", "1", "false", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ProbeError(400, f"{name} must be true or false, got {value!r}")
    return value


def _str_field(fields: Any, name: str) -> str | None:
    value = fields.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ProbeError(400, f"{name} must be a non-empty string, got {value!r}")
    return value


async def _disconnected(receive: Any) -> None:
    """Returns when the HTTP client goes away (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def long_poll_admit(
    routes: _Routes,
    receive: Any,
    session_id: str,
    packed: bytes,
    max_tokens: int,
    retain_session: bool,
    client_id: str,
    ticket: str,
) -> dict[str, Any] | None:
    """``session_gate_admit`` for an HTTP client that may go away while it waits: returns the
    engine's answer, or None when the client disconnected (the attempt is then cancelled, and a
    lease won in the race released). Renews ``client_id`` while it waits."""
    call = asyncio.ensure_future(
        routes.call(
            "session_gate_admit",
            session_id,
            packed,
            max_tokens,
            retain_session,
            ticket,
            client_id,
        )
    )
    gone: asyncio.Future[None] | None = None
    try:
        # Most admits are answered at once: no disconnect watcher for them (a task and a
        # receive() per request). A client that leaves meanwhile is seen when the watcher
        # starts, _WATCH_AFTER_SEC later.
        done, _ = await asyncio.wait({call}, timeout=_WATCH_AFTER_SEC)
        if done:
            return call.result()
        gone = asyncio.ensure_future(_disconnected(receive))
        while True:
            renew_every = routes.lease_ttl_sec / 3 if routes.lease_ttl_sec else _FIRST_RENEW_SEC
            done, _ = await asyncio.wait(
                {call, gone}, timeout=renew_every, return_when=asyncio.FIRST_COMPLETED
            )
            if gone in done:
                call.cancel()
                await routes.call("session_gate_cancel", ticket, client_id)
                return None
            if call in done:
                return call.result()
            answer = await routes.call("session_gate_renew", client_id)
            routes.lease_ttl_sec = float(answer["lease_ttl_sec"])
    except asyncio.CancelledError:
        # The server cancelled us (shutdown, or the client went away under another layer).
        call.cancel()
        asyncio.ensure_future(routes.call("session_gate_cancel", ticket, client_id))
        raise
    finally:
        if gone is not None:
            gone.cancel()


async def admit(request: Request) -> Response:
    try:
        routes = _routes(request)
        prompt = await read_prompt(routes, request)
        fields = prompt.fields
        if not isinstance(prompt.session_id, str) or not prompt.session_id:
            raise ProbeError(400, "session_id is required (a non-empty string)")
        client_id = _str_field(fields, "client_id") or f"http-{uuid.uuid4().hex}"
        ticket = _str_field(fields, "ticket") or f"{client_id}:{uuid.uuid4().hex[:12]}"
        answer = await long_poll_admit(
            routes,
            request.receive,
            prompt.session_id,
            prompt.packed,
            _int_field(fields, "max_tokens", DEFAULT_MAX_TOKENS),
            _bool_field(fields, "retain_session", True),
            client_id,
            ticket,
        )
        if answer is None:  # nobody is listening any more
            return Response(status_code=499)
        answer["client_id"] = client_id
        return JSONResponse(answer, status_code=_STATUS_CODES.get(answer.get("status"), 500))
    except ProbeError as err:
        return err.response()


def _simple(method: str, key: str, answer_key: str, *, optional_client: bool = True):
    async def route(request: Request) -> Response:
        try:
            routes = _routes(request)
            body = await _json_body(request, required=True)
            if key not in body:
                raise ProbeError(400, f"the body needs {key!r}")
            args = [body[key]]
            if optional_client:
                args.append(body.get("client_id"))
            answer = await routes.call(method, *args)
            return JSONResponse({answer_key: answer} if answer_key else answer)
        except ProbeError as err:
            return err.response()

    route.__name__ = f"session_gate_{answer_key or 'renew'}"
    return route


async def stats(request: Request) -> Response:
    try:
        routes = _routes(request)
        fmt = request.query_params.get("format", "json")
        if fmt not in ("json", "prometheus", "inferred"):
            raise ProbeError(400, f'format must be "json", "prometheus" or "inferred", got {fmt!r}')
        if fmt == "prometheus":
            text = await metrics_mirror.fetch(routes)
            return PlainTextResponse(text or "", media_type="text/plain; version=0.0.4")
        answers = await routes.call_each("session_gate_stats", fmt)
        answer = answers[0]
        if len(answers) > 1:  # DP: the first rank's, as before, and every rank's
            answer = {**answer, "ranks": answers} if fmt == "json" else answers
        return JSONResponse(_json_safe(answer))
    except ProbeError as err:
        return err.response()


#: vllm-router's session-release route (its ``/finish_session``), served as the engine gate's
#: ``finish``.
FINISH_SESSION_PATH = "/finish_session"


async def finish_session(request: Request) -> Response:
    """vllm-router's ``POST /finish_session?session_id=<id>``; a JSON body's ``session_id`` is
    read when the query names none."""
    try:
        routes = _routes(request)
        session_id = request.query_params.get("session_id")
        if session_id is None:
            session_id = (await _json_body(request, required=False)).get("session_id")
        if not isinstance(session_id, str) or not session_id:
            raise ProbeError(400, "session_id is required (a non-empty query parameter)")
        finished = await routes.call("session_gate_finish", session_id)
        return JSONResponse({"finished": finished})
    except ProbeError as err:
        return err.response()


def _json_safe(value: Any) -> Any:
    """JSON has no infinity: the histograms' last bucket bound becomes "+Inf" (Prometheus's
    spelling)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "+Inf" if value > 0 else ("-Inf" if value < 0 else "NaN")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def attach(router: APIRouter) -> None:
    """Adds the engine gate's routes to the endpoint plugin's router."""
    router.add_api_route(f"{PREFIX}/admit", admit, methods=["POST"])
    router.add_api_route(
        f"{PREFIX}/release", _simple("session_gate_release", "lease", "released"), methods=["POST"]
    )
    router.add_api_route(
        f"{PREFIX}/cancel", _simple("session_gate_cancel", "ticket", "cancelled"), methods=["POST"]
    )
    router.add_api_route(
        f"{PREFIX}/finish",
        _simple("session_gate_finish", "session_id", "finished"),
        methods=["POST"],
    )
    router.add_api_route(
        f"{PREFIX}/renew",
        _simple("session_gate_renew", "client_id", "", optional_client=False),
        methods=["POST"],
    )
    router.add_api_route(f"{PREFIX}/stats", stats, methods=["GET", "POST"])
    router.add_api_route(FINISH_SESSION_PATH, finish_session, methods=["POST"])
