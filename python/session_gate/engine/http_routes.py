"""``vllm.endpoint_plugins`` entry point: the gate's probes as HTTP routes on ``vllm serve``.

Opt-in, as vLLM requires for endpoint plugins: ``VLLM_PLUGINS=session_gate`` (the same name also
allows the ``vllm.general_plugins`` entry that installs the engine-side utility methods, so one
name turns on both halves). Routes, all POST, all answering JSON:

``/session_gate/v1/usage``
    ``session_gate_usage``: ``kv_cache_usage``, ``num_blocks``, ``num_free_blocks``,
    ``num_cached_free_blocks``, ``block_size``, ``hash_algo``, ``engine_us``; O(1) in the cache
    size. ``num_cached_free_blocks`` is ``null`` unless the body is
    ``{"count_cached_free": true}`` (or the query has ``count_cached_free=true``): that count
    visits every block of the cache inside the engine loop (~0.5 ms at 10^5 blocks).
``/session_gate/v1/probe``
    ``session_gate_probe``. Body, one of:

    - ``application/octet-stream``: the prompt as packed little-endian uint32 token ids (the
      fastest form: it goes to the engine core untouched); session id in the ``session_id``
      query parameter or the ``x-session-id`` header (optional).
    - JSON ``{"session_id": ..., "token_ids": [...]}``;
    - JSON ``{"session_id": ..., "prompt": "text" | [ids]}``: a completions prompt, tokenized
      with the server's tokenizer exactly as ``/v1/completions`` would (``add_special_tokens``);
    - JSON ``{"session_id": ..., "messages": [...]}``: a chat body, rendered with the server's
      chat template and tokenized as ``/v1/chat/completions`` would (``add_generation_prompt``,
      ``chat_template_kwargs``, ``tools``, ``continue_final_message`` are honoured).

    Add ``"return_token_ids": true`` to get the prompt's ``token_ids`` back as well.
``/session_gate/v1/forget``
    ``{"session_id": ...}`` → ``{"forgotten": bool}``: drop the session's hash chain.

Errors are ``{"error": {"message", "type", "code"}}`` (vLLM's shape): 400 for bad input, 503 when
the engine-side plugin is missing (or the server has no engine), 500 for anything else.

The engine gate's metrics also show on vLLM's own ``/metrics`` (``metrics_mirror``, started in
``init_state``).

A server started with ``--api-key`` (or ``VLLM_API_KEY``) guards every ``/session_gate`` route
with it exactly as vLLM guards ``/v1`` (``auth``): 401 ``{"error": "Unauthorized"}`` without
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import json
import logging
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from session_gate.engine import auth, dp_leases
from session_gate.engine.gate_driver import BAD_GATE_INPUT
from session_gate.probes import pack_token_ids

logger = logging.getLogger("session_gate")

PREFIX = "/session_gate/v1"
_STATE_ATTR = "session_gate_routes"

#: Keys of a probe body that are ours; everything else of a chat/completions body is passed to
#: vLLM's tokenize request models (which ignore what they do not know).
_OWN_KEYS = {"session_id", "token_ids", "prompt", "messages", "return_token_ids"}


class ProbeError(Exception):
    """An error with its HTTP status, turned into vLLM's JSON error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        kind = {400: "BadRequestError", 409: "Conflict", 503: "ServiceUnavailableError"}.get(
            self.status, "InternalServerError"
        )
        return JSONResponse(
            {"error": {"message": self.message, "type": kind, "code": self.status}},
            status_code=self.status,
        )


def _engine_failure(exc: BaseException) -> ProbeError:
    """Maps a failed utility call to an HTTP error: the engine answers with a message only."""
    message = str(exc)
    if "has no attribute 'session_gate_" in message:
        return ProbeError(
            503,
            "the engine-side session_gate plugin is not loaded in vLLM's engine core "
            "(install session-gate where vLLM runs and allow it: VLLM_PLUGINS=session_gate)",
        )
    if any(tag in message for tag in ("invalid probe input", "must be a str", BAD_GATE_INPUT)):
        # "Call to session_gate_probe method failed: invalid probe input: ..." → the tail.
        return ProbeError(400, message.split("failed: ", 1)[-1])
    return ProbeError(500, f"session_gate probe failed in the engine: {message}")


#: The engine gate's lease doors: calls that name a lease, ticket or client of one gate.
LEASE_METHODS = frozenset(
    ("session_gate_admit", "session_gate_release", "session_gate_cancel", "session_gate_renew")
)


class _Routes:
    """Per-app state: how to reach the engine core and the server's tokenizer."""

    def __init__(self, engine_client: Any, state: Any) -> None:
        self.engine_client = engine_client
        self.state = state
        #: The engine gate's lease TTL, once an answer told it (``gate_routes``).
        self.lease_ttl_sec: float | None = None

    @property
    def several_engines(self) -> bool:
        """Whether this server's engine client fans a utility call out to several engine cores
        (DP with internal load balancing): each has its own gate, so the lease doors go to the
        rank a call is about (``dp_leases``) and the stats ask every rank."""
        core = getattr(self.engine_client, "engine_core", None)
        return len(getattr(core, "core_engines", None) or ()) > 1

    async def call(self, method: str, *args: Any) -> Any:
        client = self.engine_client
        if client is None or not hasattr(client, "engine_core"):
            raise ProbeError(503, "this vLLM server has no engine to probe")
        try:
            if method in LEASE_METHODS and self.several_engines:
                return await dp_leases.call(client.engine_core, method, *args)
            return await client.engine_core.call_utility_async(method, *args)
        except ProbeError:
            raise
        except Exception as exc:  # the engine's failure message, as an Exception
            raise _engine_failure(exc) from exc

    async def call_each(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every engine core, one answer per DP rank in rank order (one answer
        without data parallelism). Only for methods that change nothing (stats): a lease
        door's method goes through :meth:`call`, to the one rank it is about."""
        if method in LEASE_METHODS or not self.several_engines:
            return [await self.call(method, *args)]
        try:
            return await dp_leases.each_rank(self.engine_client.engine_core, method, *args)
        except Exception as exc:  # the engine's failure message, as an Exception
            raise _engine_failure(exc) from exc

    async def tokenize(self, body: dict[str, Any], raw_request: Request) -> list[int]:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.tokenize.protocol import (
            TokenizeChatRequest,
            TokenizeCompletionRequest,
        )

        handler = getattr(self.state, "serving_tokenization", None)
        if handler is None:
            raise ProbeError(503, "this vLLM server has no tokenizer (skip_tokenizer_init?)")
        fields = {k: v for k, v in body.items() if k not in _OWN_KEYS}
        model: Any = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        if "messages" in body:
            fields["messages"] = body["messages"]
        else:
            fields["prompt"] = body["prompt"]
        known = {k: v for k, v in fields.items() if k in model.model_fields}
        try:
            request = model.model_validate(known)
            answer = await handler.create_tokenize(request, raw_request)
        except ProbeError:
            raise
        except (ValueError, TypeError, KeyError) as exc:  # pydantic and template errors
            raise ProbeError(400, f"cannot tokenize the probe body: {exc}") from exc
        except Exception as exc:
            raise ProbeError(400, f"cannot tokenize the probe body: {exc!r}") from exc
        if isinstance(answer, ErrorResponse):
            raise ProbeError(
                answer.error.code if answer.error.code in (400, 503) else 400,
                f"cannot tokenize the probe body: {answer.error.message}",
            )
        return list(answer.tokens)


def _routes(request: Request) -> _Routes:
    routes = getattr(request.app.state, _STATE_ATTR, None)
    if routes is None:
        raise ProbeError(503, "the session_gate endpoint plugin was not initialised")
    return routes


def _session_id(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ProbeError(400, f"session_id must be a string or null, got {type(value).__name__}")


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ProbeError(400, "token_ids must be a non-empty list of integers")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= 2**32:
            raise ProbeError(400, f"token_ids[{i}] = {t!r} is not a non-negative integer")
    return value


async def _json_body(request: Request, *, required: bool) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ProbeError(400, "the request body must be a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ProbeError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProbeError(400, "the request body must be a JSON object")
    return body


async def usage(request: Request) -> Response:
    try:
        routes = _routes(request)
        body = await _json_body(request, required=False)
        count = body.get("count_cached_free", False)
        query = request.query_params.get("count_cached_free")
        if query is not None:
            if query.lower() not in ("true", "false", "1", "0"):
                raise ProbeError(400, f"count_cached_free must be true or false, got {query!r}")
            count = query.lower() in ("true", "1")
        if not isinstance(count, bool):
            raise ProbeError(
                400, f"count_cached_free must be a boolean, got {type(count).__name__}"
            )
        return JSONResponse(await routes.call("session_gate_usage", count))
    except ProbeError as err:
        return err.response()


@dataclass
class PromptInput:
    """A route's prompt, read by :func:`read_prompt`."""

    session_id: str | None
    #: Packed little-endian uint32 token ids, as the engine core reads them.
    packed: bytes
    #: The ids as a list, when the body gave or tokenized them (None for octet-stream bodies).
    token_ids: list[int] | None
    #: The rest of the request: the JSON body, or the query parameters of an octet-stream body.
    fields: Any


async def prompt_ids(routes: _Routes, body: dict[str, Any], request: Request) -> list[int]:
    """The token ids of a body with exactly one of ``token_ids``, ``prompt`` (text or ids) or
    ``messages`` (a chat), tokenized as the server's own completions/chat routes would."""
    given = [k for k in ("token_ids", "prompt", "messages") if k in body]
    if len(given) != 1:
        raise ProbeError(400, "the body needs exactly one of token_ids, prompt or messages")
    if given[0] == "token_ids":
        return _token_ids(body["token_ids"])
    if given[0] == "prompt" and isinstance(body["prompt"], list):
        return _token_ids(body["prompt"])
    if given[0] == "prompt" and not isinstance(body["prompt"], str):
        raise ProbeError(400, "prompt must be a string or a list of token ids")
    if given[0] == "messages" and not isinstance(body["messages"], list):
        raise ProbeError(400, "messages must be a list of chat messages")
    token_ids = await routes.tokenize(body, request)
    if not token_ids:
        raise ProbeError(400, "the prompt tokenizes to no tokens")
    return token_ids


async def read_prompt(routes: _Routes, request: Request) -> PromptInput:
    """The prompt of a probe or admit request: an ``application/octet-stream`` body of packed
    uint32 ids (session id in the ``session_id`` query parameter or ``x-session-id``), or a
    JSON body for :func:`prompt_ids` with a ``session_id``."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/octet-stream":
        packed = await request.body()
        if not packed or len(packed) % 4:
            raise ProbeError(
                400,
                f"an octet-stream body must be packed uint32 token ids "
                f"(a non-zero multiple of 4 bytes), got {len(packed)} bytes",
            )
        session_id = request.query_params.get("session_id") or request.headers.get("x-session-id")
        return PromptInput(session_id, packed, None, request.query_params)
    body = await _json_body(request, required=True)
    session_id = _session_id(body.get("session_id"))
    token_ids = await prompt_ids(routes, body, request)
    try:
        packed = pack_token_ids(token_ids)
    except OverflowError as exc:
        raise ProbeError(400, f"token ids must fit in uint32: {exc}") from exc
    return PromptInput(session_id, packed, token_ids, body)


async def probe(request: Request) -> Response:
    try:
        routes = _routes(request)
        prompt = await read_prompt(routes, request)
        answer = await routes.call("session_gate_probe", prompt.session_id, prompt.packed)
        if prompt.token_ids is not None and prompt.fields.get("return_token_ids", False):
            answer["token_ids"] = prompt.token_ids
        return JSONResponse(answer)
    except ProbeError as err:
        return err.response()


async def forget(request: Request) -> Response:
    try:
        routes = _routes(request)
        body = await _json_body(request, required=True)
        session_id = body.get("session_id")
        if not isinstance(session_id, str):
            raise ProbeError(400, "session_id must be a string")
        return JSONResponse(
            {"forgotten": bool(await routes.call("session_gate_forget", session_id))}
        )
    except ProbeError as err:
        return err.response()


class SessionGateEndpoints:
    """The ``session_gate`` endpoint plugin (see the module docstring)."""

    name = "session_gate"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route(f"{PREFIX}/usage", usage, methods=["POST"], include_in_schema=True)
        router.add_api_route(f"{PREFIX}/probe", probe, methods=["POST"])
        router.add_api_route(f"{PREFIX}/forget", forget, methods=["POST"])
        from session_gate.engine import gate_routes  # the engine gate's routes

        gate_routes.attach(router)
        app.include_router(router)
        app.add_middleware(
            auth.ApiKeyMiddleware, prefixes=("/session_gate/", gate_routes.FINISH_SESSION_PATH)
        )

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        auth.set_keys(state, auth.server_api_keys(args))
        routes = _Routes(engine_client, state)
        setattr(state, _STATE_ATTR, routes)
        if engine_client is not None and hasattr(engine_client, "engine_core"):
            try:  # the engine gate's metrics on vLLM's /metrics
                from session_gate.engine import metrics_mirror

                metrics_mirror.start(routes)
            except Exception as exc:  # the routes serve without it
                logger.warning("session_gate: engine gate metrics not on /metrics: %r", exc)


def plugin() -> SessionGateEndpoints:
    """Entry point factory (zero arguments), as ``vllm.endpoint_plugins`` requires."""
    return SessionGateEndpoints()
