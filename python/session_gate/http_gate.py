"""``HttpGate``: the engine gate of a ``vllm serve`` instance, over its HTTP routes.

The same surface as ``SessionGate`` and ``EngineGate`` (``remote_gate.RemoteGate``); the gate
itself lives in the server's engine core, shared by every client of that server. ``vllm serve``
must run with ``VLLM_PLUGINS=session_gate`` (see ``session_gate.engine.gate_routes``). Admits are
long-polls: cancelling a waiting ``acquire`` closes its connection and cancels the attempt.
"""

from __future__ import annotations

from typing import Any

from .http_probe import PREFIX, HttpProbe, HttpProbeError
from .probes import pack_token_ids
from .remote_gate import RemoteGate, new_client_id

__all__ = ["HttpGate"]


class _HttpTransport:
    """The engine gate's routes, through an ``HttpProbe``'s client (shared settings)."""

    def __init__(self, http: HttpProbe) -> None:
        self.http = http
        base = f"{http.base_url}{PREFIX}"
        self._admit = f"{base}/admit"
        self._release = f"{base}/release"
        self._cancel = f"{base}/cancel"
        self._finish = f"{base}/finish"
        self._renew = f"{base}/renew"
        self._stats = f"{base}/stats"

    async def admit(self, session_id, prompt_ids, max_tokens, retain_session, ticket, client_id):
        params = {
            "session_id": session_id,
            "max_tokens": str(max_tokens),
            "retain_session": "true" if retain_session else "false",
            "ticket": ticket,
            "client_id": client_id,
        }
        # No timeout: the answer comes when the gate admits (the route renews us meanwhile).
        response = await self.http._http().post(
            self._admit,
            content=pack_token_ids(prompt_ids),
            params=params,
            headers={"content-type": "application/octet-stream"},
            timeout=None,
        )
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "status" not in answer:
            try:
                message = answer["error"]["message"]  # type: ignore[index]
            except Exception:  # noqa: BLE001
                message = response.text[:500]
            raise HttpProbeError(self._admit, response.status_code, message)
        return answer

    async def release(self, lease: int, client_id: str) -> bool:
        body = {"lease": lease, "client_id": client_id}
        return bool((await self.http._post(self._release, json=body))["released"])

    async def cancel(self, ticket: str, client_id: str) -> bool:
        body = {"ticket": ticket, "client_id": client_id}
        return bool((await self.http._post(self._cancel, json=body))["cancelled"])

    async def finish(self, session_id: str, client_id: str) -> bool:
        body = {"session_id": session_id, "client_id": client_id}
        return bool((await self.http._post(self._finish, json=body))["finished"])

    async def renew(self, client_id: str) -> dict[str, Any]:
        return await self.http._post(self._renew, json={"client_id": client_id})

    async def stats(self, fmt: str) -> Any:
        if fmt == "json":
            return await self.http._post(self._stats)
        response = await self.http._http().post(self._stats, params={"format": fmt})
        if response.status_code != 200:
            raise HttpProbeError(self._stats, response.status_code, response.text[:500])
        return response.text


class HttpGate(RemoteGate):
    """The engine gate of the ``vllm serve`` at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    ``timeout`` bounds every call but the admit long-poll; ``headers`` go with every call (e.g.
    an ``Authorization`` header for ``--api-key``); ``client`` shares an ``httpx.AsyncClient``.
    Errors from the server raise ``HttpProbeError`` (``status``, ``message``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
        client: Any = None,
        client_id: str | None = None,
    ) -> None:
        self._probe = HttpProbe(base_url, timeout=timeout, headers=headers, client=client)
        super().__init__(_HttpTransport(self._probe), client_id or new_client_id("http-gate"))
        self.base_url = self._probe.base_url

    async def aclose(self) -> None:
        """Stop the heartbeat, wait for releases in flight, close the HTTP client."""
        await super().aclose()
        await self._probe.aclose()

    def __repr__(self) -> str:
        return f"HttpGate({self.base_url!r}, client_id={self.client_id!r})"
