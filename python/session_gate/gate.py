"""``SessionGate``: the asyncio driver of the Rust gate core.

Rust (``session_gate._native.GateCore``) owns every piece of state and every decision; this
module only carries out what the core asks for, exactly like the tokio driver in
``src/gate/driver.rs``: ``begin`` → ``poll`` → do the action (probe usage, probe a prefix, wait) →
report → ``poll`` … until the core answers ``Admit`` or ``Preempted``.

Waking: after every core call, if ``core.epoch`` moved, every sleeping waiter is woken and polls
again (the core answers a spurious wake-up with the same ``Wait`` without probing). A waiter also
wakes by itself at ``Wait.until``.

Threads: the gate belongs to the event loop it is first used on. Releases that happen anywhere
else — another thread, or a garbage-collected lease whose finaliser may run in the middle of a
core call — are handed to that loop with ``call_soon_threadsafe``, so the core is only ever
entered from the loop and waiters are only woken there.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._native import Admit, GateConfig, GateCore, ProbePrefix, ProbeUsage, Wait
from .errors import AdmissionPreempted
from .probes import Probe

if TYPE_CHECKING:
    from ._native import _GateStatsDict

__all__ = ["Lease", "SessionGate"]

logger = logging.getLogger("session_gate")

# The core's clock. time.monotonic is what asyncio's default loop.time() reads, and unlike
# loop.time() it can be read from a finaliser on any thread. Waits are slept as relative delays,
# so the loop's own clock (uvloop's included) never has to agree with it.
_now = time.monotonic
_perf = time.perf_counter


def _optional_int(value: Any) -> int | None:
    """``None`` stays ``None`` (a count the engine was not asked for), anything else is an int."""
    return None if value is None else int(value)


#: What an engine answers for a host-tier figure it cannot read (no connector, a tier in
#: another process).
TIER_UNAVAILABLE = "unavailable"


def _tier_int(value: Any) -> int | None:
    """A host-tier figure: ``"unavailable"``, ``None`` or absent (an engine that predates the
    tier) is ``None``; any other string is an unusable answer."""
    if value is None or value == TIER_UNAVAILABLE:
        return None
    if isinstance(value, str):
        raise ValueError(f"host-tier figure must be an int or {TIER_UNAVAILABLE!r}, got {value!r}")
    return int(value)


if sys.version_info >= (3, 11):
    _timeout = asyncio.timeout
else:  # pragma: no cover - Python 3.10
    _timeout = None


class Lease:
    """One admission. Release it when the engine's answer is complete: that is what lets the
    next waiter through (``async with gate.admit(...)`` does it on exit, exception or not).

    ``release()`` is idempotent. A lease garbage-collected unreleased is released by the gate
    and counted in ``stats()["leases_dropped_unreleased"]``.
    """

    __slots__ = ("_gate", "_admit", "_released", "session_id", "probe_error")

    def __init__(
        self, gate: SessionGate, session_id: str, admit: Admit, probe_error: str | None
    ) -> None:
        self._gate = gate
        self._admit = admit
        self._released = False
        #: The session this lease admitted.
        self.session_id = session_id
        #: Why the last probe of this attempt was unavailable, if one was (diagnostics).
        self.probe_error = probe_error

    @property
    def reason(self) -> str:
        """Why it was admitted: ``open``, ``reserved_session``, ``prefix_probe_unavailable``,
        ``resident_prefix``, ``max_wait`` or ``offloaded_prefix`` (the prefix is back from the
        host KV tier at its reload cost)."""
        return self._admit.reason

    @property
    def wait_sec(self) -> float:
        """Seconds from the start of the attempt to its admission."""
        return self._admit.wait_sec

    @property
    def usage(self) -> float | None:
        """vLLM's ``kv_cache_usage`` at the decision, if the usage probe answered."""
        return self._admit.usage

    @property
    def pressure(self) -> float | None:
        """What was compared with the watermark (usage, or committed share in committed mode)."""
        return self._admit.pressure

    @property
    def hit_ratio(self) -> float | None:
        """The prefix probe's hit ratio, if it was asked and answered."""
        return self._admit.hit_ratio

    @property
    def retain_session(self) -> bool:
        """Whether an ownership window (idle grace after release) was asked for."""
        return self._admit.retain_session

    @property
    def reserved(self) -> bool:
        """Whether this lease holds the session's reservation while in flight."""
        return self._admit.reserved

    @property
    def revoked(self) -> bool:
        """Whether the session's reservation was revoked (age order) during this attempt."""
        return self._admit.revoked

    @property
    def working_set_blocks(self) -> int | None:
        """Prompt + max_tokens in KV blocks, once the engine's block size is known."""
        return self._admit.working_set_blocks

    @property
    def num_preempted(self) -> int:
        """How many older attempts of this session were preempted so far."""
        return self._admit.num_preempted

    @property
    def lease_id(self) -> int:
        """The lease's id in the core."""
        return self._admit.lease

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Release the lease; returns False (a no-op) when it was released already."""
        if self._released:
            return False
        self._released = True
        return self._gate._release(self._admit.lease)

    async def arelease(self) -> bool:
        """:meth:`release`, awaitable: the same call as ``RemoteLease.arelease`` (the engine
        gate's leases), so code and ``async with`` serve both kinds of lease."""
        return self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return (
            f"<Lease {self.session_id!r} reason={self.reason} wait_sec={self.wait_sec:.3f} "
            f"hit_ratio={self.hit_ratio} {state}>"
        )

    def __del__(self) -> None:
        # Never raise from a finaliser; it may run on any thread, during a core call, or at
        # interpreter shutdown (when the gate's module globals may already be gone).
        try:
            if not self._released:
                self._released = True
                self._gate._release_dropped(self._admit.lease)
        except BaseException:  # noqa: BLE001 - nothing may escape a finaliser
            pass


class _Admission:
    """``async with gate.admit(...) as lease``: acquire on enter, release on exit (for
    ``SessionGate`` and the engine gate's clients alike)."""

    __slots__ = ("_gate", "_args", "_lease")

    def __init__(self, gate: Any, args: tuple[Any, ...]) -> None:
        self._gate = gate
        self._args = args
        self._lease: Any = None

    async def __aenter__(self) -> Any:
        session_id, prompt_ids, max_tokens, retain_session = self._args
        self._lease = await self._gate.acquire(
            session_id, prompt_ids, max_tokens, retain_session=retain_session
        )
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.arelease()


class SessionGate:
    """Session-level admission gate for one vLLM engine (docs/architecture.md describes it).

    ``probe`` is any object with async ``usage()`` and ``prefix(session_id, prompt_ids)``
    (optionally ``forget(session_id)``), e.g. ``EngineProbe(async_llm)``; ``config`` defaults to
    ``GateConfig()`` (use ``GateConfig.from_env()`` for ``SESSION_GATE_*``).
    """

    def __init__(self, probe: Probe, config: GateConfig | None = None) -> None:
        if config is None:
            config = GateConfig()
        self._core = GateCore(config)
        self._config = config
        self._probe = probe
        # Bound once: the hot path does no attribute lookups on the probe.
        self._usage_call = probe.usage
        self._prefix_call = probe.prefix
        self._forget_call = getattr(probe, "forget", None)
        self._probe_timeout = config.probe_timeout_sec
        self._loop: asyncio.AbstractEventLoop | None = None
        self._epoch = self._core.epoch
        self._waiters: set[asyncio.Future[None]] = set()

    # -- public API ---------------------------------------------------------------------------

    @property
    def config(self) -> GateConfig:
        return self._config

    @property
    def probe(self) -> Probe:
        return self._probe

    def admit(
        self,
        session_id: str,
        prompt_ids: Sequence[int] | bytes,
        max_tokens: int | None = None,
        *,
        retain_session: bool = True,
    ) -> _Admission:
        """``async with gate.admit(session_id, prompt_ids, max_tokens=512) as lease:`` waits
        until this turn may go to the engine and releases the lease when the block exits.

        ``prompt_ids`` is the turn's whole prompt: a sequence of token ids, or ``bytes`` of
        packed little-endian uint32 (``probes.pack_token_ids``), which ``EngineProbe`` forwards
        as is. Its length plus ``max_tokens`` is the turn's working set; without ``max_tokens``
        (a plain ``admit(session_id, prompt_ids)``) the working set counts the config's
        ``default_max_tokens`` instead, so pass the turn's real one when you know it.
        ``retain_session`` keeps the session's reservation for ``idle_grace_sec`` after
        release, so the next turn (after a tool call) re-enters as ``reserved_session``; after
        half of that window (or 8 of the session's mean turn times, if longer) it may yield
        its room to a waiting session that fits only without it.

        Raises ``AdmissionPreempted`` when a newer attempt for the same session arrives while
        this one waits. Cancelling the waiting task removes the attempt from the queue.
        """
        return _Admission(self, (session_id, prompt_ids, max_tokens, retain_session))

    async def acquire(
        self,
        session_id: str,
        prompt_ids: Sequence[int] | bytes,
        max_tokens: int | None = None,
        *,
        retain_session: bool = True,
    ) -> Lease:
        """Like :meth:`admit`, returning the lease; the caller releases it (e.g. when a stream
        it proxies ends). A lease that is garbage-collected unreleased is released and counted.

        Cancel safety: cancelling the task while it waits or probes forgets the attempt in the
        core (queue slot included) and re-raises ``CancelledError``.
        """
        self._bind_loop()
        core = self._core
        # Packed prompts are 4 bytes a token.
        prompt_tokens = len(prompt_ids) >> 2 if type(prompt_ids) is bytes else len(prompt_ids)
        attempt = core.begin(session_id, prompt_tokens, max_tokens, retain_session, _now())
        if core.epoch != self._epoch:
            self._wake()
        probe_error: str | None = None
        try:
            while True:
                now = _now()
                action = core.poll(attempt, now)
                if core.epoch != self._epoch:
                    self._wake()
                if isinstance(action, ProbeUsage):
                    error = await self._probe_usage(attempt)
                    if error is not None:
                        probe_error = error
                elif isinstance(action, Admit):
                    return Lease(self, session_id, action, probe_error)
                elif isinstance(action, Wait):
                    await self._sleep(action.until - now)
                elif isinstance(action, ProbePrefix):
                    error = await self._probe_prefix(attempt, session_id, prompt_ids)
                    if error is not None:
                        probe_error = error
                else:  # Preempted: the core already counted it and forgot the attempt.
                    raise AdmissionPreempted(session_id, core.num_preempted(session_id))
        except AdmissionPreempted:
            raise
        except BaseException:
            # Cancelled (or anything unexpected): leave no trace in the queue. The attempt may
            # already be gone, in which case cancel() is a no-op.
            core.cancel(attempt, _now())
            if core.epoch != self._epoch:
                self._wake()
            raise

    async def finish_session(self, session_id: str) -> bool:
        """End the session's ownership window at once (waking waiters), then ask the probe to
        ``forget`` the session when it can. Errors and timeouts of ``forget`` are counted in
        ``stats()["probes"]["forget"]["failures"]``, never raised. Returns whether a window was
        open."""
        self._bind_loop()
        core = self._core
        ended = core.finish_session(session_id, _now())
        if core.epoch != self._epoch:
            self._wake()
        if self._forget_call is not None:
            started = _perf()
            _, error = await self._ask(self._forget_call, (session_id,))
            core.record_probe("forget", _perf() - started, error is None)
            if error is not None:
                logger.debug("session_gate: forget(%r) failed: %s", session_id, error)
        return ended

    def stats(self) -> _GateStatsDict:
        """Counters and gauges: ``admissions`` by reason, ``pending``, ``waiting``,
        ``reservations_held``, ``preemptions``, ``wait_sec`` and ``probes`` histograms, …"""
        return self._core.stats()

    def prometheus(self) -> str:
        """Prometheus text exposition of :meth:`stats` (metric names ``session_gate_*``)."""
        return self._core.prometheus()

    def num_preempted(self, session_id: str) -> int:
        """Attempts of this session preempted by newer ones (while the gate tracks it)."""
        return self._core.num_preempted(session_id)

    def has_reservation(self, session_id: str) -> bool:
        """Whether the session holds a reservation, in flight or in its idle grace window."""
        return self._core.has_reservation(session_id)

    # -- probes -------------------------------------------------------------------------------

    async def _ask(self, call: Any, args: tuple[Any, ...]) -> tuple[Any, str | None]:
        """Calls a probe method under ``probe_timeout_sec``; returns (answer, error)."""
        timeout = self._probe_timeout
        deadline = None
        try:
            if _timeout is None:
                return await asyncio.wait_for(call(*args), timeout), None
            deadline = _timeout(timeout)
            async with deadline:
                return await call(*args), None
        except Exception as exc:  # noqa: BLE001 - any probe failure means "unavailable"
            # A probe may raise TimeoutError of its own (an HTTP client's, say): only our
            # deadline expiring means the probe did not answer in time.
            ours = (
                deadline.expired()
                if deadline is not None
                else isinstance(exc, asyncio.TimeoutError)
            )
            if ours:
                return None, f"probe did not answer within {timeout} s"
            return None, f"probe raised {type(exc).__name__}: {exc}"

    async def _probe_usage(self, attempt: int) -> str | None:
        core = self._core
        started = _perf()
        answer, error = await self._ask(self._usage_call, ())
        failed = error is not None
        if not failed:
            try:
                if answer.get("available", True) is False:
                    error = str(answer.get("reason") or "usage probe answered unavailable")
                else:
                    # Plain floats and ints go to the core: no dict crosses into Rust.
                    core.on_usage(
                        attempt,
                        float(answer["kv_cache_usage"]),
                        int(answer["num_blocks"]),
                        int(answer["num_free_blocks"]),
                        _optional_int(answer.get("num_cached_free_blocks")),
                        int(answer["block_size"]),
                        _now(),
                        _tier_int(answer.get("offload_num_blocks")),
                        _tier_int(answer.get("offload_used_blocks")),
                        # The engine's queues (absent from an older plugin: never idle).
                        _optional_int(answer.get("num_running_reqs")),
                        _optional_int(answer.get("num_waiting_reqs")),
                    )
            except KeyError as exc:
                error, failed = f"usage answer has no {exc.args[0]!r}", True
            except (AttributeError, TypeError, ValueError, OverflowError) as exc:
                error, failed = f"usage answer unusable: {type(exc).__name__}: {exc}", True
        core.record_probe("usage", _perf() - started, not failed)
        if error is not None:
            core.on_usage_unavailable(attempt, error, _now())
        return error

    async def _probe_prefix(
        self, attempt: int, session_id: str, prompt_ids: Sequence[int] | bytes
    ) -> str | None:
        core = self._core
        started = _perf()
        answer, error = await self._ask(self._prefix_call, (session_id, prompt_ids))
        failed = error is not None
        if not failed:
            try:
                if answer.get("available", True) is False:
                    error = str(answer.get("reason") or "prefix probe answered unavailable")
                else:
                    core.on_prefix(
                        attempt,
                        float(answer["hit_ratio"]),
                        int(answer["hit_blocks"]),
                        int(answer["hit_tokens"]),
                        int(answer["prompt_tokens"]),
                        _now(),
                        _tier_int(answer.get("offloaded_tokens")),
                    )
            except KeyError as exc:
                error, failed = f"prefix answer has no {exc.args[0]!r}", True
            except (AttributeError, TypeError, ValueError, OverflowError) as exc:
                error, failed = f"prefix answer unusable: {type(exc).__name__}: {exc}", True
        # An engine that answers "available: False" (prefix caching off, say) did answer: only
        # errors, timeouts and malformed answers count as probe failures.
        core.record_probe("prefix", _perf() - started, not failed)
        if error is not None:
            core.on_prefix_unavailable(attempt, error, _now())
        return error

    # -- waiting and waking -------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError(
                    "this SessionGate is bound to another running event loop; create one gate "
                    "per loop"
                )
            self._loop = loop
        return loop

    async def _sleep(self, delay: float) -> None:
        """Sleeps until woken by :meth:`_wake` or for ``delay`` seconds."""
        loop = self._loop
        assert loop is not None
        fut = loop.create_future()
        self._waiters.add(fut)
        timer = loop.call_later(max(delay, 0.0), _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiters.discard(fut)

    def _wake(self) -> None:
        """The epoch moved: wake every waiter so each polls the core again."""
        self._epoch = self._core.epoch
        if self._waiters:
            waiters, self._waiters = self._waiters, set()
            for fut in waiters:
                _resolve(fut)

    # -- releasing ----------------------------------------------------------------------------

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _release(self, lease_id: int) -> bool:
        if self._on_loop():
            return self._release_now(lease_id, False)
        # Another thread: the loop does it. The lease is known and unreleased, so it will be.
        self._defer_release(lease_id, False)
        return True

    def _release_dropped(self, lease_id: int) -> None:
        # Always deferred, even on the loop's thread: a finaliser can run inside a core call
        # (the garbage collector runs during allocations), when the core is busy.
        self._defer_release(lease_id, True)

    def _defer_release(self, lease_id: int, dropped: bool) -> None:
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._release_now, lease_id, dropped)
                return
        except RuntimeError:  # the loop is closed: nobody else can be using the core now
            pass
        # No waiter can be woken on a closed loop; only the core's books matter now.
        if dropped:
            self._core.release_dropped(lease_id, _now())
        else:
            self._core.release(lease_id, _now())

    def _release_now(self, lease_id: int, dropped: bool) -> bool:
        core = self._core
        if dropped:
            released = core.release_dropped(lease_id, _now())
        else:
            released = core.release(lease_id, _now())
        if core.epoch != self._epoch:
            self._wake()
        return released


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
