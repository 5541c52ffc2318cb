"""``HttpProbe``: the gate's probes over HTTP, against ``vllm serve`` with the endpoint plugin.

``vllm serve`` must run with ``VLLM_PLUGINS=session_gate`` (that allows both the engine-side
utility methods and the HTTP routes; see ``session_gate.engine.http_routes``). The answers have
the same keys as ``EngineProbe``'s. Prompts travel as packed little-endian uint32 token ids
(``application/octet-stream``), which the server hands to the engine core untouched.

Uses ``httpx`` (installed with vLLM and the ``openai`` client), imported when a probe is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import SessionGateError
from .probes import pack_token_ids

__all__ = ["HttpProbe", "HttpProbeError"]

PREFIX = "/session_gate/v1"


class HttpProbeError(SessionGateError):
    """The server answered a probe with an error (``status`` and its ``message``)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        #: The route that failed.
        self.url = url
        #: HTTP status (400 bad input, 503 plugin missing on the engine side, …).
        self.status = status
        #: The server's error message.
        self.message = message


class HttpProbe:
    """Probes a ``vllm serve`` instance at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    ``timeout`` bounds each HTTP call (the gate also applies its own ``probe_timeout_sec``);
    ``headers`` are sent with every call (e.g. ``{"Authorization": "Bearer …"}`` when the server
    runs with ``--api-key``). Pass ``client`` to share an ``httpx.AsyncClient``; otherwise one is
    created on first use and closed by :meth:`aclose` (or ``async with``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
        client: Any = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._client = client
        self._owns_client = client is None
        self._usage_url = f"{self.base_url}{PREFIX}/usage"
        self._probe_url = f"{self.base_url}{PREFIX}/probe"
        self._forget_url = f"{self.base_url}{PREFIX}/forget"

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=self._timeout,
                headers=self._headers,
                limits=httpx.Limits(max_keepalive_connections=32),
            )
        return self._client

    async def _post(self, url: str, **kwargs: Any) -> Any:
        response = await self._http().post(url, **kwargs)
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - not our JSON error: show the raw text
                message = response.text[:500]
            raise HttpProbeError(url, response.status_code, message)
        return response.json()

    async def usage(self) -> dict[str, Any]:
        """``session_gate_usage``: vLLM's KV usage and the block counts behind it."""
        return await self._post(self._usage_url)

    async def prefix(
        self, session_id: str | None, prompt_ids: Sequence[int] | bytes
    ) -> dict[str, Any]:
        """``session_gate_probe``: how much of this prompt's prefix vLLM would find cached."""
        params = {"session_id": session_id} if session_id is not None else None
        return await self._post(
            self._probe_url,
            content=pack_token_ids(prompt_ids),
            params=params,
            headers={"content-type": "application/octet-stream"},
        )

    async def prefix_of(self, session_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """``session_gate_probe`` for a completions ``prompt`` or chat ``messages`` body,
        tokenized by the server (add ``"return_token_ids": True`` to get the ids back)."""
        return await self._post(self._probe_url, json={**body, "session_id": session_id})

    async def forget(self, session_id: str) -> bool:
        """``session_gate_forget``: drop the session's remembered hash chain in the engine."""
        return bool(
            (await self._post(self._forget_url, json={"session_id": session_id}))["forgotten"]
        )

    async def aclose(self) -> None:
        """Close the HTTP client if this probe created it."""
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> HttpProbe:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"HttpProbe({self.base_url!r})"
