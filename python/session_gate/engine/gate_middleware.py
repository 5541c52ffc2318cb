"""Gating inside ``vllm serve``, no proxy: an ASGI middleware over the engine gate.

    VLLM_PLUGINS=session_gate vllm serve MODEL \\
        --middleware session_gate.engine.gate_middleware.SessionGateMiddleware

A ``POST /v1/chat/completions`` or ``/v1/completions`` carrying an ``x-session-id`` header waits
for the engine gate (the one in the engine core, shared by every API-server process of
``--api-server-count`` and by every other client of the engine) before vLLM sees it:

- the prompt is tokenized exactly as the route will (the endpoint plugin's tokenizer path), its
  working set is the prompt plus ``max_completion_tokens``/``max_tokens`` (512 when absent);
- admitted: the request goes on, with ``x-session-gate-reason``, ``x-session-gate-wait-ms`` and
  ``x-session-gate-client`` (the API-server process's client id the lease is held under) response
  headers; the lease is released when the response ends — streamed or not, finished, failed or
  abandoned by its client: by the engine core itself when the request reached it (the lease is
  bound to the vLLM request it admitted, ``gate_binding``: no release call), else by this
  middleware's release call;
- while the admit call travels to the engine core and back, vLLM already parses and renders the
  request: the server's ``engine_client.generate`` is wrapped so that a gated request reaches the
  engine only once admitted, and its response starts only once the gate has answered (a refused
  request's response is replaced by the refusal). This hides most of the round trip, the bulk
  of the middleware's cost. Where the completion and chat handlers do not generate through that
  client, the middleware admits first and calls the app after;
- a newer request of the same session arrives while this one waits: this one is answered 409
  (vLLM's error shape, ``type`` ``"Conflict"``);
- the client disconnects while waiting: its attempt is cancelled in the engine;
- no ``x-session-id``, another route, or a body the gate cannot size (a batch of prompts): passed
  through untouched. Bad gate input (e.g. an over-long session id) is answered 400; if the gate
  itself is unavailable the request passes through ungated (logged once), so serving never stops.

The endpoint plugin must be enabled (``VLLM_PLUGINS=session_gate``): the middleware reaches the
engine through its per-app state. Leases are held under this API-server process's client id and
renewed by a heartbeat, so if the process dies the engine frees them after ``lease_ttl_sec``
(a lease bound to a request that reached the engine is freed when that request ends, sooner).
Leases are bound only once the engine said it releases bound leases (the heartbeat's answer),
and only on an engine without data parallelism. With it, each rank has its own gate: the admit
goes to the session's rank and pins the session there (``dp_leases``), the request follows the
pin, and this middleware releases the lease.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
from typing import Any

from starlette.requests import Request

from session_gate.engine import gate_binding
from session_gate.engine.gate_routes import DEFAULT_MAX_TOKENS, long_poll_admit
from session_gate.engine.http_routes import (
    _STATE_ATTR,
    ProbeError,
    _token_ids,
    prompt_ids,
)
from session_gate.probes import pack_token_ids
from session_gate.remote_gate import new_client_id

logger = logging.getLogger("session_gate")

GATED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
SESSION_HEADER = b"x-session-id"


class SessionGateMiddleware:
    """Pure ASGI middleware (``app.add_middleware``, as vLLM's ``--middleware`` does)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.client_id = new_client_id("serve")
        self._tickets = itertools.count()
        self._heartbeat: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        self._client_header = (b"x-session-gate-client", self.client_id.encode())
        #: Whether the engine releases leases bound to requests (its renewals say so) and this
        #: server can bind them (one engine core, no data parallelism): see ``gate_binding``.
        self.engine_binds = False
        self._can_bind: bool | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GATED_PATHS:
            return await self.app(scope, receive, send)
        session_id = _header(scope, SESSION_HEADER)
        if not session_id:
            return await self.app(scope, receive, send)
        routes = getattr(scope["app"].state, _STATE_ATTR, None) if "app" in scope else None
        if routes is None:
            self._warn_once("routes", "the session_gate endpoint plugin is not loaded")
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if body is None:  # the client left before sending its body
            return
        replay = _replay(body, receive)
        try:
            packed, max_tokens, bindable = await self._size(routes, scope, body)
        except ProbeError as err:
            if err.status == 400 and err.message.startswith("cannot tokenize"):
                # vLLM's own route will answer this malformed request better than we can.
                return await self.app(scope, replay, send)
            return await err.response()(scope, replay, send)
        except _Ungateable:
            return await self.app(scope, replay, send)
        self._beat(routes)
        ticket = f"{self.client_id}:{next(self._tickets)}"
        admission = _Admission(
            long_poll_admit(
                routes, receive, session_id, packed, max_tokens, True, self.client_id, ticket
            ),
            session_id,
            bindable,
        )
        # The admit's round trip to the engine core (most of this middleware's cost) overlaps
        # vLLM's own request handling, which is held at engine_client.generate until the gate
        # admits (see _hook). Without that hook, the admission comes first, as a whole.
        if not self._hook(routes):
            answer = await admission.answer()
            refusal = admission.refusal(answer)
            if refusal is not None:
                return await refusal.response()(scope, replay, send)
            if answer is None and admission.error is None:  # the client left while it waited
                return
        token = _ADMISSION.set(admission)
        try:
            await self.app(scope, replay, admission.wrap(send, self._client_header))
        finally:
            _ADMISSION.reset(token)
            if admission.task.done():
                lease = admission.lease()
                # A lease bound to a request the engine had is released by the engine when that
                # request ends (or is aborted): no call. Anything else is released here.
                if lease is not None and not admission.reached_engine:
                    # Its own task: a cancelled handler (client gone) must still release.
                    release = asyncio.ensure_future(
                        routes.call("session_gate_release", lease, self.client_id)
                    )
                    release.add_done_callback(_log_failure)
            else:
                # The app ended without the answer (its client left): withdraw the attempt.
                admission.task.cancel()
            if admission.error is not None and admission.error.status != 400:
                self._warn_once(
                    str(admission.error.status),
                    f"engine gate unavailable, not gating: {admission.error.message}",
                )

    def _hook(self, routes: Any) -> bool:
        """Holds this server's ``engine_client.generate`` until the request's admission (if it
        has one) lets it go. False when the completion and chat handlers do not generate
        through that client: then the middleware admits before the app runs."""
        client = routes.engine_client
        if getattr(client, _HOOKED, False):
            return True
        original = getattr(client, "generate", None)
        if original is None:
            return False
        for name in ("openai_serving_completion", "openai_serving_chat"):
            serving = getattr(routes.state, name, None)
            if serving is not None and getattr(serving, "engine_client", None) is not client:
                return False

        async def generate(*args: Any, **kwargs: Any) -> Any:
            admission = _ADMISSION.get()
            bound = False
            if admission is not None:
                await admission.go_ahead()
                # Decided now, not when the request came: the heartbeat started with this
                # server's first gated request has answered by the time the admit has.
                bound = self.engine_binds and self._binds(routes) and admission.bind(args, kwargs)
            async for output in original(*args, **kwargs):
                if bound:
                    # The engine core has the request: its end releases the bound lease there.
                    admission.reached_engine = True
                yield output

        client.generate = generate
        setattr(client, _HOOKED, True)
        return True

    def _binds(self, routes: Any) -> bool:
        """Whether this server's engine has a single engine core (no data parallelism): a bound
        lease must be released by the gate that issued it."""
        if self._can_bind is None:
            try:
                parallel = routes.engine_client.vllm_config.parallel_config
                self._can_bind = int(parallel.data_parallel_size) == 1
            except (AttributeError, TypeError, ValueError):
                self._can_bind = False
        return self._can_bind

    async def _size(self, routes: Any, scope: dict, body: bytes) -> tuple[bytes, int, bool]:
        """The prompt's packed ids, the turn's ``max_tokens`` and whether its lease can be
        bound to its request (one engine request: no beam search, ``n`` 1)."""
        try:
            parsed = json.loads(body)
        except ValueError:
            raise _Ungateable from None
        if not isinstance(parsed, dict):
            raise _Ungateable
        if scope["path"] == "/v1/completions":
            prompt = parsed.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                ids = _token_ids(prompt)  # nothing to tokenize; checked as prompt_ids would
            elif isinstance(prompt, str):
                fields = {k: v for k, v in parsed.items() if k not in ("messages", "token_ids")}
                ids = await prompt_ids(routes, fields, Request(scope))
            else:
                raise _Ungateable  # a batch of prompts: several sessions' worth, not one turn
        else:
            fields = {k: v for k, v in parsed.items() if k not in ("prompt", "token_ids")}
            ids = await prompt_ids(routes, fields, Request(scope))
        max_tokens = parsed.get("max_completion_tokens") or parsed.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            max_tokens = DEFAULT_MAX_TOKENS
        bindable = not parsed.get("use_beam_search") and parsed.get("n") in (None, 1)
        try:
            return pack_token_ids(ids), max_tokens, bindable
        except OverflowError as exc:
            raise ProbeError(400, f"token ids must fit in uint32: {exc}") from exc

    def _beat(self, routes: Any) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.ensure_future(self._renew_forever(routes))

    async def _renew_forever(self, routes: Any) -> None:
        """This process's heartbeat: keeps its leases alive while it lives. The period runs
        from each renewal's start, so a slow answer (a busy engine) does not stretch the gap
        between renewals towards the TTL."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                answer = await routes.call("session_gate_renew", self.client_id)
                routes.lease_ttl_sec = float(answer["lease_ttl_sec"])
                self.engine_binds = answer.get("binds_requests") is True
            except Exception as exc:  # noqa: BLE001 - keep beating
                logger.debug("session_gate: middleware heartbeat failed: %r", exc)
            period = (routes.lease_ttl_sec or 3.0) / 3
            await asyncio.sleep(max(0.0, started + period - loop.time()))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("session_gate middleware: %s", message)


#: The admission of the request this task serves (read by the hooked ``generate``).
_ADMISSION: contextvars.ContextVar[_Admission | None] = contextvars.ContextVar(
    "session_gate_admission", default=None
)
_HOOKED = "_session_gate_generate_hooked"


class NotAdmitted(ValueError):
    """Stops vLLM's handler of a request the gate did not admit; the middleware answers in its
    place (a ``ValueError``, which vLLM's handlers answer quietly, without a traceback)."""


class _Admission:
    """One request's admit call, answered while vLLM already handles the request."""

    def __init__(self, admit: Any, session_id: str, bindable: bool = False) -> None:
        self.task: asyncio.Task[dict[str, Any] | None] = asyncio.ensure_future(admit)
        self.session_id = session_id
        #: Whether the lease may still be bound to a request (the first generate only).
        self._bindable = bindable
        #: The lease is bound to a request whose generate yielded: the engine releases it.
        self.reached_engine = False
        #: The gate's failure (bad input: 400; else unavailable, and the request goes ungated).
        self.error: ProbeError | None = None

    async def answer(self) -> dict[str, Any] | None:
        """The engine's answer; None if the client left or the gate is unavailable."""
        try:
            return await asyncio.shield(self.task)
        except ProbeError as err:
            self.error = err
            return None

    def lease(self) -> int | None:
        if self.task.cancelled() or self.task.exception() is not None:
            return None
        answer = self.task.result()
        return answer["lease"] if answer and answer.get("status") == "admitted" else None

    def bind(self, args: tuple, kwargs: dict) -> bool:
        """Binds the lease to the request ``generate(*args, **kwargs)`` will add (its sampling
        parameters, second argument); once per admission. False if nothing was bound."""
        if not self._bindable:
            return False
        self._bindable = False  # a second generate (not one engine request): release here
        lease = self.lease()
        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        return lease is not None and params is not None and gate_binding.bind(params, lease)

    async def go_ahead(self) -> None:
        """Returns when the request may reach the engine; raises NotAdmitted otherwise."""
        answer = await self.answer()
        if answer is not None and answer.get("status") == "admitted":
            return
        if answer is None and self.error is not None and self.error.status != 400:
            return  # the gate is unavailable: serving goes on, ungated
        raise NotAdmitted(f"session {self.session_id!r} was not admitted by the engine gate")

    def refusal(self, answer: dict[str, Any] | None) -> ProbeError | None:
        """What to answer instead of the app's response, if anything."""
        if answer is None:
            return self.error if self.error is not None and self.error.status == 400 else None
        status = answer.get("status")
        if status == "admitted":
            return None
        if status == "preempted":
            return ProbeError(
                409,
                f"session {self.session_id!r}: this request was preempted by a newer request "
                "of the same session",
            )
        return ProbeError(
            503,
            f"session {self.session_id!r}: the engine gate ended this request's wait ({status})",
        )

    def wrap(self, send: Any, client_header: tuple[bytes, bytes]) -> Any:
        """The app's ``send``: its response starts once the gate has answered, with the gate's
        headers; a refused request gets the refusal instead, a departed client nothing."""
        verdict: str | None = None  # "send", "drop"

        async def gated_send(message: dict) -> None:
            nonlocal verdict
            if verdict is None:
                answer = await self.answer()
                refusal = self.refusal(answer)
                if refusal is not None:
                    verdict = "drop"
                    response = refusal.response()
                    await send(
                        {
                            "type": "http.response.start",
                            "status": response.status_code,
                            "headers": response.raw_headers,
                        }
                    )
                    await send({"type": "http.response.body", "body": response.body})
                    return
                if answer is None and self.error is None:  # the client left while it waited
                    verdict = "drop"
                    return
                verdict = "send"
                if answer is not None and message["type"] == "http.response.start":
                    extra = [
                        (b"x-session-gate-reason", str(answer["reason"]).encode()),
                        (b"x-session-gate-wait-ms", f"{answer['wait_sec'] * 1000:.1f}".encode()),
                        client_header,
                    ]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            if verdict == "send":
                await send(message)

        return gated_send


class _Ungateable(Exception):
    """A request the gate cannot size as one turn: passed through."""


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body we read, then the real channel."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("session_gate middleware: release failed: %r", task.exception())
