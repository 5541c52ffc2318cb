"""vLLM's ``--api-key`` on the session_gate routes (``/session_gate/v1/*``: the probes of
``http_routes`` and the engine gate's ``gate_routes``, and its ``/finish_session``).

vLLM guards only its own prefixes (``/v1``, ...) with its ``AuthenticationMiddleware``; the
plugin's routes live under ``/session_gate`` and would be open. This middleware applies the same
rule to them, the same way (vLLM 0.32, ``vllm/entrypoints/serve/middleware/authenticate.py``):
the keys are ``--api-key`` or else ``VLLM_API_KEY``; ``OPTIONS`` passes; any other request needs
``Authorization: Bearer <one of the keys>`` (scheme case-insensitive, compared as SHA-256
digests in constant time), else 401 ``{"error": "Unauthorized"}``. Without keys, nothing is
checked.
"""

from __future__ import annotations

import hashlib
import secrets
from argparse import Namespace
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

_STATE_ATTR = "session_gate_api_keys"


def server_api_keys(args: Namespace) -> list[str]:
    """The keys vLLM's own middleware enforces for this server (``--api-key`` wins over
    ``VLLM_API_KEY``, as in vLLM's ``init_entrypoints_middleware``)."""
    from vllm import envs

    given = getattr(args, "api_key", None)
    if isinstance(given, str):
        given = [given]
    return [k for k in (given or [envs.VLLM_API_KEY]) if k]


def set_keys(state: Any, keys: list[str]) -> None:
    """Stores the digests the middleware compares with (called once at start-up)."""
    setattr(state, _STATE_ATTR, [hashlib.sha256(k.encode("utf-8")).digest() for k in keys])


def verify(headers: Headers, digests: list[bytes]) -> bool:
    """vLLM's ``verify_token``: a bearer token whose digest equals one of ``digests``."""
    value = headers.get("Authorization")
    if not value:
        return False
    scheme, _, param = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(param.encode("utf-8")).digest()
    match = False
    for d in digests:
        match |= secrets.compare_digest(digest, d)
    return match


class ApiKeyMiddleware:
    """Pure ASGI middleware guarding the paths that start with one of ``prefixes`` with the
    server's API keys."""

    def __init__(self, app: Any, prefixes: tuple[str, ...]) -> None:
        self.app = app
        self.prefixes = prefixes

    def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(self.prefixes):
            # Read per request: the keys are set in the plugin's init_state, after the app's
            # middleware stack was built.
            app = scope.get("app")
            digests = getattr(getattr(app, "state", None), _STATE_ATTR, None) if app else None
            if digests and not verify(Headers(scope=scope), digests):
                return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(
                    scope, receive, send
                )
        return self.app(scope, receive, send)
