"""Clients of the engine gate: the ``SessionGate`` surface, with the gate living in the engine.

``EngineGate(async_llm)`` reaches the gate through vLLM's utility calls; ``HttpGate(base_url)``
(``http_gate``) through the routes on ``vllm serve``. Both are this module's ``RemoteGate`` over a
different transport, so switching from the in-process gate is one line::

    gate = EngineGate(async_llm)            # was: SessionGate(probe=EngineProbe(async_llm))
    async with gate.admit(session_id, prompt_ids, max_tokens=512) as lease:
        ...                                 # lease.reason, .wait_sec, .usage, .hit_ratio, ...
    await gate.finish_session(session_id)
    await gate.stats(); await gate.prometheus()   # async here: the numbers live in the engine

Every client (process, or gate object) has a ``client_id``. While it has anything open it sends a
heartbeat (``session_gate_renew``) every third of the engine's ``lease_ttl_sec``; if it dies, the
engine frees its leases and pending admits once the TTL has passed (see
``session_gate.engine.gate_driver``). Cancelling a waiting ``acquire`` withdraws the attempt in
the engine (and releases the lease if the admission raced the cancel).

This module must not import vLLM: ``EngineGate`` only calls methods on the ``AsyncLLM`` it is given.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from .errors import AdmissionPreempted, SessionGateError
from .gate import _Admission
from .probes import pack_token_ids

__all__ = ["AdmissionExpired", "EngineGate", "RemoteGate", "RemoteLease"]

logger = logging.getLogger("session_gate")

#: Heartbeat period before the engine told us its TTL (the engine's default TTL is 30 s).
_FIRST_RENEW_SEC = 5.0


class AdmissionExpired(SessionGateError):
    """The engine ended an admit without admitting it: ``status`` is ``cancelled`` (someone
    cancelled its ticket) or ``expired`` (its client was silent for the lease TTL)."""

    def __init__(self, session_id: str, status: str) -> None:
        super().__init__(f"admission attempt for session {session_id!r} ended: {status}")
        self.session_id = session_id
        self.status = status

    def __reduce__(self):
        return (type(self), (self.session_id, self.status))


class Transport(Protocol):
    """How a ``RemoteGate`` reaches the engine gate (one method per engine utility method)."""

    async def admit(
        self,
        session_id: str,
        prompt_ids: Sequence[int] | bytes,
        max_tokens: int,
        retain_session: bool,
        ticket: str,
        client_id: str,
    ) -> dict[str, Any]: ...

    async def release(self, lease: int, client_id: str) -> bool: ...

    async def cancel(self, ticket: str, client_id: str) -> bool: ...

    async def finish(self, session_id: str, client_id: str) -> bool: ...

    async def renew(self, client_id: str) -> dict[str, Any]: ...

    async def stats(self, fmt: str) -> Any: ...


def new_client_id(kind: str) -> str:
    """A client id that says where it came from: ``kind-host-pid-random``."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class RemoteLease:
    """One admission by the engine gate; the same fields as ``session_gate.Lease``.

    ``release()`` sends the release and returns at once (False if released already);
    ``await lease.arelease()`` waits for the engine to have it. ``async with gate.admit(...)``
    releases on exit.
    """

    __slots__ = ("_gate", "_answer", "_released", "session_id", "_task")

    def __init__(self, gate: RemoteGate, session_id: str, answer: dict[str, Any]) -> None:
        self._gate = gate
        self._answer = answer
        self._released = False
        self._task: asyncio.Task[bool] | None = None
        #: The session this lease admitted.
        self.session_id = session_id

    reason = property(lambda self: self._answer["reason"], doc="Why it was admitted.")
    wait_sec = property(lambda self: self._answer["wait_sec"], doc="Seconds until admission.")
    usage = property(lambda self: self._answer.get("usage"), doc="vLLM's KV usage then.")
    pressure = property(lambda self: self._answer.get("pressure"), doc="What met the watermark.")
    hit_ratio = property(lambda self: self._answer.get("hit_ratio"), doc="The prefix probe's.")
    retain_session = property(lambda self: self._answer["retain_session"])
    reserved = property(lambda self: self._answer["reserved"])
    revoked = property(lambda self: self._answer["revoked"])
    working_set_blocks = property(lambda self: self._answer.get("working_set_blocks"))
    num_preempted = property(lambda self: self._answer["num_preempted"])
    lease_id = property(lambda self: self._answer["lease"], doc="The lease's id in the engine.")
    #: Time the engine loop spent on the admit call, if it answered at once (diagnostics).
    engine_us = property(lambda self: self._answer.get("engine_us"))

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Send the release (once); False if it was sent already."""
        if self._released:
            return False
        self._released = True
        self._task = self._gate._spawn(
            self._gate._transport.release(self.lease_id, self._gate.client_id)
        )
        return True

    async def arelease(self) -> bool:
        """Release and wait until the engine has it. Cancelling the caller does not stop it."""
        first = self.release()
        task = self._task
        if task is not None:
            await asyncio.shield(task)
        return first

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return (
            f"<RemoteLease {self.session_id!r} reason={self.reason} lease={self.lease_id} {state}>"
        )

    def __del__(self) -> None:
        # A lease dropped unreleased: release it (the engine's TTL would otherwise only catch it
        # once this client dies). Never raise from a finaliser.
        try:
            if not self._released:
                self._gate._release_dropped(self.lease_id)
        except BaseException:  # noqa: BLE001
            pass


class RemoteGate:
    """The ``SessionGate`` surface over a transport to the engine gate (use ``EngineGate`` or
    ``HttpGate``). Belongs to the event loop it is first used on."""

    def __init__(self, transport: Transport, client_id: str) -> None:
        self._transport = transport
        self.client_id = client_id
        self._tickets = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._renew_every = _FIRST_RENEW_SEC
        self.leases_dropped_unreleased = 0

    def admit(
        self,
        session_id: str,
        prompt_ids: Sequence[int] | bytes,
        max_tokens: int,
        *,
        retain_session: bool = True,
    ) -> _Admission:
        """``async with gate.admit(session_id, prompt_ids, max_tokens) as lease:`` — waits
        until the engine gate admits this turn; releases the lease when the block exits."""
        return _Admission(self, (session_id, prompt_ids, max_tokens, retain_session))

    async def acquire(
        self,
        session_id: str,
        prompt_ids: Sequence[int] | bytes,
        max_tokens: int,
        *,
        retain_session: bool = True,
    ) -> RemoteLease:
        """Like :meth:`admit`, returning the lease for the caller to release.

        Raises ``AdmissionPreempted`` when a newer admit of the session (from any client)
        took over, ``AdmissionExpired`` when the engine ended the attempt, and the
        transport's error for bad input. Cancel safety: cancelling the task withdraws the
        attempt in the engine (a lease won in the race is released there)."""
        self._bind()
        ticket = f"{self.client_id}:{next(self._tickets)}"
        try:
            answer = await self._transport.admit(
                session_id, prompt_ids, max_tokens, retain_session, ticket, self.client_id
            )
        except BaseException:
            # Cancelled, or the transport failed mid-wait: withdraw the attempt (a no-op if the
            # engine never saw it), and release the lease if it was won in the race.
            self._spawn(self._transport.cancel(ticket, self.client_id))
            raise
        status = answer.get("status")
        if status == "admitted":
            return RemoteLease(self, session_id, answer)
        if status == "preempted":
            raise AdmissionPreempted(session_id, int(answer.get("num_preempted", 0)))
        raise AdmissionExpired(session_id, str(status))

    async def finish_session(self, session_id: str) -> bool:
        """End the session's ownership window now (waking waiters); whether it had one."""
        self._bind()
        return bool(await self._transport.finish(session_id, self.client_id))

    async def stats(self) -> dict[str, Any]:
        """The engine gate's counters (the ``SessionGate.stats()`` keys, plus
        ``engine_gate``: clients, leases held, TTL expiries)."""
        return await self._transport.stats("json")

    async def prometheus(self) -> str:
        """The engine gate's Prometheus text exposition."""
        return await self._transport.stats("prometheus")

    async def aclose(self) -> None:
        """Stop the heartbeat and wait for releases in flight."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def __aenter__(self) -> RemoteGate:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals ----------------------------------------------------------------------------

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._heartbeat = None
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = loop.create_task(self._beat())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro, loop=self._loop)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("session_gate: engine gate call failed: %r", task.exception())

    def _release_dropped(self, lease: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # nobody can send it now: the engine's lease TTL frees it
        self.leases_dropped_unreleased += 1
        loop.call_soon_threadsafe(self._spawn, self._transport.release(lease, self.client_id))

    async def _beat(self) -> None:
        """Renews this client every third of the engine's lease TTL."""
        while True:
            try:
                answer = await self._transport.renew(self.client_id)
                self._renew_every = max(0.05, float(answer["lease_ttl_sec"]) / 3)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep beating; the engine may come back
                logger.debug("session_gate: heartbeat failed: %r", exc)
            await asyncio.sleep(self._renew_every)


class _UtilityTransport:
    """The engine gate through vLLM's utility calls (``AsyncLLM.engine_core``)."""

    __slots__ = ("_call",)

    def __init__(self, async_llm: Any) -> None:
        self._call = async_llm.engine_core.call_utility_async

    async def admit(self, session_id, prompt_ids, max_tokens, retain_session, ticket, client_id):
        return await self._call(
            "session_gate_admit",
            session_id,
            pack_token_ids(prompt_ids),
            max_tokens,
            retain_session,
            ticket,
            client_id,
        )

    async def release(self, lease: int, client_id: str) -> bool:
        return bool(await self._call("session_gate_release", lease, client_id))

    async def cancel(self, ticket: str, client_id: str) -> bool:
        return bool(await self._call("session_gate_cancel", ticket, client_id))

    async def finish(self, session_id: str, client_id: str) -> bool:
        return bool(await self._call("session_gate_finish", session_id, client_id))

    async def renew(self, client_id: str) -> dict[str, Any]:
        return await self._call("session_gate_renew", client_id)

    async def stats(self, fmt: str) -> Any:
        return await self._call("session_gate_stats", fmt)


class EngineGate(RemoteGate):
    """The engine gate of an in-process ``AsyncLLM`` (its engine core runs the gate: every
    ``AsyncLLM``, ``vllm serve`` process and proxy of that engine shares it).

    Needs the engine plugin (installed with this package; with ``VLLM_PLUGINS`` set, it must
    allow ``session_gate``) and vLLM's multiprocess engine core (the default)."""

    def __init__(self, async_llm: Any, *, client_id: str | None = None) -> None:
        super().__init__(_UtilityTransport(async_llm), client_id or new_client_id("engine-gate"))

    def __repr__(self) -> str:
        return f"EngineGate(client_id={self.client_id!r})"
