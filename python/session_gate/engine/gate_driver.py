"""The engine gate's driver: the Rust ``GateCore`` held inside vLLM's engine core process.

One driver per engine core. It is the asyncio driver's twin (``session_gate/gate.py``) with the
I/O taken out: the core's ``ProbeUsage`` / ``ProbePrefix`` actions are answered in-process from
the block pool (no IPC), ``Wait`` parks the attempt, and an admit answers later through the
``concurrent.futures.Future`` vLLM accepts from a utility method. Every decision is the core's.

Threads. Everything that touches the core or the block pool runs on the engine core's own thread
(the busy loop): utility calls, the post-step hook and the idle callback. The only other thread is
the timer, which touches nothing but a float and vLLM's input queue: when a deadline comes (a
waiter's ``Wait.until``, a client's lease TTL) it raises ``due`` and wakes the busy loop, which
then runs :meth:`EngineGateDriver.tick` on its own thread:

- engine busy: the loop steps continuously and ``post_step`` (wrapped once, see ``ledger``) ticks
  when ``due`` is set — one attribute read per step otherwise;
- engine idle: the loop blocks in ``input_queue.get()``. The timer appends the tick to
  ``EngineCore._idle_state_callbacks`` (vLLM calls those on every idle pass of
  ``_process_input_queue``) and puts a ``WAKEUP`` request in the input queue, which unblocks
  the loop; its next idle pass runs the tick.

Dead clients (no leaked reservations). Every admit names a ``client_id``; a client is alive while
it calls the engine gate at least every ``lease_ttl_sec`` (any call counts; clients send
``session_gate_renew`` every third of the TTL). A client silent for longer is declared dead at
the next tick: its pending attempts are cancelled (answered ``expired``), its leases released as
dropped and those sessions' ownership windows ended. So a dead client's reservations hold the
cache at most ``lease_ttl_sec`` (+ one timer tick) after its last call. A ``cancel(ticket)``
that races with the admission releases the lease the client will never see.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.engine import EngineCoreRequestType

logger = logging.getLogger("session_gate")

_now = time.monotonic

#: Default seconds a silent client's leases and attempts survive (env SESSION_GATE_LEASE_TTL_SEC).
DEFAULT_LEASE_TTL_SEC = 30.0
#: How every bad-input failure of the engine gate's methods starts (the HTTP routes answer 400).
BAD_GATE_INPUT = "invalid engine gate input"
#: A client id or ticket longer than this is refused (they are dictionary keys in the engine).
MAX_ID_LEN = 256


def lease_ttl_from_env() -> float:
    """``SESSION_GATE_LEASE_TTL_SEC`` (seconds, finite, > 0), or the default."""
    raw = os.environ.get("SESSION_GATE_LEASE_TTL_SEC")
    if raw is None or not raw.strip():
        return DEFAULT_LEASE_TTL_SEC
    try:
        ttl = float(raw)
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(
            f"SESSION_GATE_LEASE_TTL_SEC must be a positive number of seconds, got {raw!r}"
        )
    return ttl


def _check_id(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{name} must be a non-empty str, got {type(value).__name__} {value!r}"[:300]
        )
    if len(value) > MAX_ID_LEN:
        raise ValueError(f"{name} is {len(value)} characters long, more than {MAX_ID_LEN}")
    return value


# slots: these are made and read on every call, on the engine thread.
@dataclass(eq=False, slots=True)
class _Attempt:
    """One admit call the engine has not answered yet."""

    ticket: str
    client: str
    session_id: str
    token_ids: Any
    attempt: int
    started: float
    future: Future | None = None
    until: float = math.inf


@dataclass(eq=False, slots=True)
class _Held:
    """One lease the engine issued and the client has not released."""

    client: str
    session_id: str
    ticket: str


@dataclass(slots=True)
class _Client:
    last_seen: float
    attempts: set[str] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)


class _Timer(threading.Thread):
    """Sleeps until the earliest deadline, then asks the engine thread to tick."""

    def __init__(self, fire: Any) -> None:
        super().__init__(name="session_gate-timer", daemon=True)
        self._fire = fire
        self._cond = threading.Condition()
        self._at = math.inf

    def arm(self, at: float) -> None:
        with self._cond:
            if at < self._at:
                self._at = at
                self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while True:
                    delay = self._at - _now()
                    if delay <= 0:
                        break
                    self._cond.wait(None if math.isinf(delay) else delay)
                self._at = math.inf
            try:
                self._fire()
            except Exception:  # noqa: BLE001 - the timer must outlive a failed wake-up
                logger.exception("session_gate: engine gate timer could not wake the engine")


class EngineGateDriver:
    """The gate core, the attempts waiting in it, the leases it issued and who holds them.

    ``engine`` is vLLM's ``EngineCore``; ``probes`` is the engine half's ``EngineState`` (usage
    and prefix probes, read in-process on the engine thread)."""

    def __init__(
        self, engine: Any, probes: Any, native: Any, config: Any, lease_ttl_sec: float
    ) -> None:
        self._engine = engine
        self._probes = probes
        self._core = native.GateCore(config)
        self._admit_cls = native.Admit
        self._wait_cls = native.Wait
        self._usage_cls = native.ProbeUsage
        self._prefix_cls = native.ProbePrefix
        self.config = config
        self.lease_ttl_sec = lease_ttl_sec
        self._epoch = self._core.epoch
        self._attempts: dict[str, _Attempt] = {}  # ticket → attempt
        self._waiting: dict[str, _Attempt] = {}  # parked in Wait
        self._held: dict[int, _Held] = {}  # lease id → holder
        self._ticket_lease: dict[str, int] = {}  # admitted tickets, until released
        self._clients: dict[str, _Client] = {}
        self._usage_memo: tuple[int, tuple] | None = None
        self._pass = 0
        self.counters = {
            "clients_expired": 0,
            "leases_expired": 0,
            "attempts_expired": 0,
            "ticks": 0,
            "tick_errors": 0,
        }
        #: Engine-loop time of the calls answered at once: name → [count, total µs].
        self._loop_us: dict[str, list[float]] = {"admit": [0, 0.0], "release": [0, 0.0]}
        #: Set by the timer thread; the engine thread ticks when it sees it.
        self.due = False
        #: The earliest deadline the timer holds, as this thread last armed it. A call arms the
        #: timer only for a deadline earlier than that (no lock, no scan of the clients); a
        #: tick, which runs whenever the timer fired, re-arms it for the exact earliest one.
        self._armed = math.inf
        self._timer = _Timer(self._wake_engine)
        self._timer.start()

    # -- utility calls (engine thread) ------------------------------------------------------

    def admit(
        self,
        session_id: Any,
        token_ids: Any,
        max_tokens: Any,
        retain_session: Any,
        ticket: Any,
        client_id: Any,
    ) -> dict[str, Any] | Future:
        # The common case is checked inline (this runs in the engine loop); _check_id names
        # what is wrong otherwise.
        if not (type(session_id) is str and 0 < len(session_id) <= MAX_ID_LEN):
            session_id = _check_id("session_id", session_id)
        if not (type(ticket) is str and 0 < len(ticket) <= MAX_ID_LEN):
            ticket = _check_id("ticket", ticket)
        if not (type(client_id) is str and 0 < len(client_id) <= MAX_ID_LEN):
            client_id = _check_id("client_id", client_id)
        if type(max_tokens) is not int or max_tokens < 0:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
                raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
        if type(retain_session) is not bool:
            raise TypeError(f"retain_session must be a bool, got {type(retain_session).__name__}")
        attempts = self._attempts
        if ticket in attempts or ticket in self._ticket_lease:
            raise ValueError(f"ticket {ticket!r} is already in use; every admit needs a new one")
        prompt_tokens = self._probes.prompt_length(token_ids)
        self._pass += 1  # _begin_pass, inline
        now = _now()
        client = self._clients.get(client_id)
        if client is None:
            client = self._seen(client_id, now)
        else:
            client.last_seen = now
        attempt = self._core.begin(session_id, prompt_tokens, max_tokens, retain_session, now)
        a = _Attempt(ticket, client_id, session_id, token_ids, attempt, now)
        attempts[ticket] = a
        client.attempts.add(ticket)
        answer = self._drive(a, now)
        if self._core.epoch != self._epoch:
            self._settle(now)
        if answer is not None:
            return answer
        a.future = Future()
        return a.future

    def release(self, lease: Any, client_id: Any = None) -> bool:
        if type(lease) is not int and (isinstance(lease, bool) or not isinstance(lease, int)):
            raise TypeError(f"lease must be an int lease id, got {type(lease).__name__}")
        self._pass += 1  # _begin_pass, inline
        now = _now()
        if client_id is not None:
            client = self._clients.get(client_id) if type(client_id) is str else None
            if client is None:
                self._seen(_check_id("client_id", client_id), now)
            else:
                client.last_seen = now
        released = self._release(lease, now, dropped=False)
        if self._core.epoch != self._epoch:
            self._settle(now)
        return released

    def cancel(self, ticket: Any, client_id: Any = None) -> bool:
        ticket = _check_id("ticket", ticket)
        now = self._begin_pass()
        if client_id is not None:
            self._seen(_check_id("client_id", client_id), now)
        done = self._cancel(ticket, now, "cancelled")
        self._settle(now)
        return done

    def finish(self, session_id: Any, client_id: Any = None) -> bool:
        session_id = _check_id("session_id", session_id)
        now = self._begin_pass()
        if client_id is not None:
            self._seen(_check_id("client_id", client_id), now)
        ended = self._core.finish_session(session_id, now)
        self._probes.forget(session_id)
        self._settle(now)
        return bool(ended)

    def renew(self, client_id: Any) -> dict[str, Any]:
        client_id = _check_id("client_id", client_id)
        now = self._begin_pass()
        client = self._seen(client_id, now)
        self._settle(now)
        return {
            "lease_ttl_sec": self.lease_ttl_sec,
            "leases": len(client.leases),
            "pending": len(client.attempts),
        }

    def loop_time(self, call: str, us: float) -> None:
        """Records how long one ``call`` held the engine loop (admits answered at once)."""
        entry = self._loop_us[call]
        entry[0] += 1
        entry[1] += us

    def stats(self) -> dict[str, Any]:
        now = self._begin_pass()
        self._settle(now)
        s = self._core.stats()
        s["engine_gate"] = {
            **self.counters,
            "clients": len(self._clients),
            "lease_ttl_sec": self.lease_ttl_sec,
            "leases_held": len(self._held),
            "attempts_pending": len(self._attempts),
            **{f"{call}_loop_calls": count for call, (count, _) in self._loop_us.items()},
            **{f"{call}_loop_us_total": total for call, (_, total) in self._loop_us.items()},
        }
        return s

    def prometheus(self) -> str:
        now = self._begin_pass()
        self._settle(now)
        lines = [self._core.prometheus().rstrip("\n")]
        extra = {
            "clients": ("gauge", len(self._clients), "Clients alive (seen within the lease TTL)"),
            "clients_expired_total": (
                "counter",
                self.counters["clients_expired"],
                "Clients declared dead after the lease TTL",
            ),
            "leases_expired_total": (
                "counter",
                self.counters["leases_expired"],
                "Leases released because their client went silent",
            ),
        }
        for name, (kind, value, text) in extra.items():
            metric = f"session_gate_engine_{name}"
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]
        return "\n".join(lines) + "\n"

    # -- timers (engine thread) -------------------------------------------------------------

    def tick(self) -> None:
        """Runs due deadlines: waiters whose ``Wait.until`` passed, dead clients, grace ends.
        Never raises: it runs inside vLLM's busy loop."""
        self.due = False
        self._armed = math.inf  # the timer fired: it holds nothing now
        try:
            now = self._begin_pass()
            self.counters["ticks"] += 1
            self._expire_clients(now)
            self._core.expire(now)
            for a in [a for a in self._waiting.values() if a.until <= now]:
                self._drive(a, now)
            self._settle(now)
            self._schedule()
        except Exception:  # noqa: BLE001 - never take the engine down
            self.counters["tick_errors"] += 1
            logger.exception("session_gate: engine gate tick failed")

    def _wake_engine(self) -> None:
        # Timer thread: only flags, a list append and a queue put (all thread-safe).
        self.due = True
        engine = self._engine
        callbacks = getattr(engine, "_idle_state_callbacks", None)
        if callbacks is not None and _tick_callback not in callbacks:
            callbacks.append(_tick_callback)
        queue = getattr(engine, "input_queue", None)
        if queue is not None:
            queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _arm(self, at: float) -> None:
        if at < self._armed:
            self._armed = at
            self._timer.arm(at)

    def _schedule(self) -> None:
        """Arms the timer for the earliest deadline (a scan: only at ticks)."""
        at = math.inf
        for a in self._waiting.values():
            at = min(at, a.until)
        if self._clients:
            # The first client to go silent for a whole TTL is checked exactly then.
            oldest = min(c.last_seen for c in self._clients.values())
            at = min(at, oldest + self.lease_ttl_sec)
        if not math.isinf(at):
            self._arm(at)

    # -- driving the core -------------------------------------------------------------------

    def _begin_pass(self) -> float:
        # The block pool cannot change during one engine-thread call: usage is read once.
        self._pass += 1
        return _now()

    def _usage(self) -> tuple:
        memo = self._usage_memo
        if memo is not None and memo[0] == self._pass:
            return memo[1]
        u = self._probes.usage()
        values = (
            float(u["kv_cache_usage"]),
            int(u["num_blocks"]),
            int(u["num_free_blocks"]),
            # None: the O(1) usage probe does not count free-but-cached blocks.
            None if u["num_cached_free_blocks"] is None else int(u["num_cached_free_blocks"]),
            int(u["block_size"]),
        )
        self._usage_memo = (self._pass, values)
        return values

    def _drive(self, a: _Attempt, now: float) -> dict[str, Any] | None:
        """Polls ``a`` until it waits or ends; returns the answer if it ended."""
        core = self._core
        while True:
            action = core.poll(a.attempt, now)
            kind = type(action)
            if kind is self._usage_cls:
                core.on_usage(a.attempt, *self._usage(), now)
            elif kind is self._prefix_cls:
                self._probe_prefix(a, now)
            elif kind is self._wait_cls:
                a.until = action.until
                self._waiting[a.ticket] = a
                self._arm(a.until)
                return None
            elif kind is self._admit_cls:
                return self._finish(a, self._admitted(a, action))
            else:  # Preempted: the core already counted it and forgot the attempt.
                answer = {"status": "preempted", "num_preempted": core.num_preempted(a.session_id)}
                return self._finish(a, answer)

    def _probe_prefix(self, a: _Attempt, now: float) -> None:
        started = time.perf_counter()
        try:
            p = self._probes.probe(a.session_id, a.token_ids)
        except Exception as exc:  # noqa: BLE001 - a failed probe means "unavailable"
            self._core.record_probe("prefix", time.perf_counter() - started, False)
            self._core.on_prefix_unavailable(a.attempt, f"prefix probe raised {exc!r}", now)
            return
        self._core.record_probe("prefix", time.perf_counter() - started, True)
        if p.get("available", True) is False:
            reason = str(p.get("reason") or "prefix probe unavailable")
            self._core.on_prefix_unavailable(a.attempt, reason, now)
        else:
            self._core.on_prefix(
                a.attempt,
                float(p["hit_ratio"]),
                int(p["hit_blocks"]),
                int(p["hit_tokens"]),
                int(p["prompt_tokens"]),
                now,
            )

    def _admitted(self, a: _Attempt, admit: Any) -> dict[str, Any]:
        lease = admit.lease
        self._held[lease] = _Held(a.client, a.session_id, a.ticket)
        self._ticket_lease[a.ticket] = lease
        client = self._clients.get(a.client)
        if client is not None:
            client.leases.add(lease)
        return {
            "status": "admitted",
            "lease": lease,
            "ticket": a.ticket,
            "session_id": a.session_id,
            "reason": admit.reason,
            "wait_sec": admit.wait_sec,
            "usage": admit.usage,
            "pressure": admit.pressure,
            "hit_ratio": admit.hit_ratio,
            "retain_session": admit.retain_session,
            "reserved": admit.reserved,
            "revoked": admit.revoked,
            "working_set_blocks": admit.working_set_blocks,
            "num_preempted": admit.num_preempted,
        }

    def _finish(self, a: _Attempt, answer: dict[str, Any]) -> dict[str, Any]:
        """The attempt is over: forget it and answer its deferred call, if it has one."""
        self._attempts.pop(a.ticket, None)
        self._waiting.pop(a.ticket, None)
        client = self._clients.get(a.client)
        if client is not None:
            client.attempts.discard(a.ticket)
        if a.future is not None and not a.future.done():
            a.future.set_result(answer)
        return answer

    def _settle(self, now: float) -> None:
        """Wakes every waiter while the epoch moves (the core answers a spurious wake-up with
        the same ``Wait``, without a probe; a new deadline arms the timer in ``_drive``)."""
        while self._core.epoch != self._epoch:
            self._epoch = self._core.epoch
            for a in list(self._waiting.values()):
                if a.ticket in self._waiting:
                    del self._waiting[a.ticket]
                    self._drive(a, now)

    # -- releases, cancels, dead clients ----------------------------------------------------

    def _seen(self, client_id: str, now: float) -> _Client:
        client = self._clients.get(client_id)
        if client is None:
            client = self._clients[client_id] = _Client(now)
            # Its silence is checked one TTL from now (a known client's deadline only moves
            # later while it calls, so the armed one is early enough).
            self._arm(now + self.lease_ttl_sec)
        else:
            client.last_seen = now
        return client

    def _release(self, lease: int, now: float, *, dropped: bool) -> bool:
        held = self._held.pop(lease, None)
        if held is not None:
            self._ticket_lease.pop(held.ticket, None)
            client = self._clients.get(held.client)
            if client is not None:
                client.leases.discard(lease)
        if dropped:
            return bool(self._core.release_dropped(lease, now))
        return bool(self._core.release(lease, now))

    def _cancel(self, ticket: str, now: float, status: str) -> bool:
        a = self._attempts.get(ticket)
        if a is not None:
            self._core.cancel(a.attempt, now)
            self._finish(a, {"status": status})
            return True
        lease = self._ticket_lease.get(ticket)
        if lease is not None:
            # Admitted while the client gave up: it never saw the lease, so release it here.
            return self._release(lease, now, dropped=True)
        return False

    def _expire_clients(self, now: float) -> None:
        dead = [cid for cid, c in self._clients.items() if now - c.last_seen >= self.lease_ttl_sec]
        for cid in dead:
            client = self._clients.pop(cid)
            self.counters["clients_expired"] += 1
            num_attempts = len(client.attempts)
            for ticket in list(client.attempts):
                if self._cancel(ticket, now, "expired"):
                    self.counters["attempts_expired"] += 1
            sessions = set()
            num_leases = len(client.leases)
            for lease in list(client.leases):
                held = self._held.get(lease)
                if held is not None:
                    sessions.add(held.session_id)
                if self._release(lease, now, dropped=True):
                    self.counters["leases_expired"] += 1
            live = {h.session_id for h in self._held.values()}
            live |= {a.session_id for a in self._attempts.values()}
            for session_id in sessions - live:
                # Its idle grace window would hold the cache for a client that is gone.
                self._core.finish_session(session_id, now)
            # A client that closed cleanly holds nothing: only a dead holder is worth a warning.
            logger.log(
                logging.WARNING if num_leases or num_attempts else logging.DEBUG,
                "session_gate: client %s silent for %.1f s (lease TTL %.1f s): released %d "
                "leases, cancelled %d pending admits",
                cid,
                now - client.last_seen,
                self.lease_ttl_sec,
                num_leases,
                num_attempts,
            )


def _tick_callback(engine: Any) -> None:
    """vLLM idle-state callback: runs the engine gate's due timers on the engine thread."""
    driver = engine.__dict__.get(DRIVER_ATTR)
    if driver is not None and driver.due:
        driver.tick()


DRIVER_ATTR = "_session_gate_driver"
