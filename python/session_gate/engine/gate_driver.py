"""The engine gate's driver: the Rust ``GateCore`` held inside vLLM's engine core process.

One driver per engine core. The core and its bookkeeping (attempts by ticket, leases by holder,
clients by last call) are one native object, ``_native.EngineGateBook`` (``src/gate/book.rs``):
each utility call is one native call, which answers the core's ``ProbeUsage`` from the block
pool and ``ProbePrefix`` through the engine's prefix probe (in-process, no IPC), parks a
``Wait``, and answers a deferred admit by resolving the ``concurrent.futures.Future`` vLLM
accepts from a utility method. Every decision is the core's.

Threads. Everything that touches the core or the block pool runs on the engine core's own thread
(the busy loop): utility calls, the post-step hook and the idle callback. The only other thread is
the timer (``_native.WakeTimer``, a native thread: arming it from the engine thread wakes no
Python thread and costs the loop no GIL hand-off), which touches nothing but its deadline and
vLLM's input queue: when a deadline comes (a
waiter's ``Wait.until``, a client's lease TTL) it raises ``due`` and wakes the busy loop, which
then runs :meth:`EngineGateDriver.tick` on its own thread:

- engine busy: the loop steps continuously and ``post_step`` (wrapped once, see ``ledger``) ticks
  when ``due`` is set or the timer's deadline passed (``take_due``, which takes it: the timer
  thread then never fires, nor takes the GIL) — an attribute read and one native call per step
  otherwise — once the requests queued during the step (renewals among them) have been handled
  (``tick_when_settled``);
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

import atexit
import logging
import time
from concurrent.futures import Future
from typing import Any

from vllm.v1.engine import EngineCoreRequestType

from session_gate.engine import finished_blocks

logger = logging.getLogger("session_gate")

_now = time.monotonic

#: Longest a due tick waits for vLLM's input queue to empty (a steady stream of requests must
#: not put off expiries and waiter deadlines for long).
MAX_TICK_DEFER_SEC = 0.5

#: How every bad-input failure of the engine gate's methods starts (the HTTP routes answer 400).
BAD_GATE_INPUT = "invalid engine gate input"


def native_book(
    native: Any, config: Any, lease_ttl_sec: float, state: Any, walk: Any, arm: Any
) -> Any:
    """The native ``EngineGateBook`` over ``state``'s block pool (``state`` has the engine
    half's ``block_pool``, ``block_size``, ``vocab_size`` and ``max_model_len``): ``walk`` is
    the prefix probe ``walk(session_id, token_ids)`` it calls under pressure, ``arm(at)`` the
    timer it asks to wake the engine at monotonic time ``at``. The one place its arguments are
    spelled out (the engine, the footprint bench and its test build it)."""
    return native.EngineGateBook(
        config,
        lease_ttl_sec,
        state.block_pool,
        state.block_size,
        state.vocab_size,
        state.max_model_len,
        walk,
        arm,
        Future,
        # The host tier's capacity and use join every usage read, when the engine has one.
        tier_usage=state.tier_usage if getattr(state, "tier", None) is not None else None,
        # The request counts of every usage read (the core's idle-engine rule).
        scheduler=getattr(state, "scheduler", None),
        running_status=getattr(state, "running_status", None),
    )


def metric_lines(metric: str, kind: str, text: str, value: Any) -> list[str]:
    """One unlabelled metric in Prometheus' text format: its HELP, TYPE and sample lines."""
    return [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]


class EngineGateDriver:
    """The host of the native ``EngineGateBook`` (the gate core, the attempts waiting in it, the
    leases it issued and who holds them; ``src/gate/book.rs``): one native call per utility
    call. This class keeps only what must be Python: the timer thread, the tick flag and the
    warning for a dead client.

    ``engine`` is vLLM's ``EngineCore``; ``probes`` is what the engine half reads in-process
    (its ``block_pool``, ``block_size``, ``vocab_size``, ``max_model_len``, the prefix probe
    ``probe(session_id, token_ids)`` and ``forget(session_id)``)."""

    def __init__(
        self, engine: Any, probes: Any, native: Any, config: Any, lease_ttl_sec: float
    ) -> None:
        self._engine = engine
        self._probes = probes
        self.config = config
        self.lease_ttl_sec = lease_ttl_sec
        #: The book counts the engine's releases of leases bound to requests (under
        #: ``engine_gate`` in the stats): ``leases_released_by_request``, and
        #: ``bound_releases_unknown`` for those that found the lease already gone.
        self.counters = {"ticks": 0, "tick_errors": 0}
        #: Whether the engine releases leases bound to requests (``gate_binding``); clients learn
        #: it from their renewals' answers.
        self.binds_requests = False
        #: ``gate_scheduler.SchedulerGate`` in scheduler mode: its counters join the stats, and
        #: it renews its client before each tick.
        self.scheduler_gate: Any = None
        #: Set by the timer thread; the engine thread ticks when it sees it.
        self.due = False
        #: When a due tick was first put off for queued requests (``tick_when_settled``).
        self._due_since: float | None = None
        #: The timer (``_native.WakeTimer``: a native thread, so arming it from the engine
        #: thread wakes no Python thread); stopped at exit, before the interpreter goes.
        self._timer = native.WakeTimer(self._wake_engine)
        atexit.register(self._timer.stop)
        #: Whether the timer's deadline passed (then taken: the timer will not fire for it);
        #: asked after every step, so a busy engine ticks without the timer thread.
        self.take_due = self._timer.take_due
        self._book = native_book(
            native, config, lease_ttl_sec, probes, probes.probe, self._timer.arm
        )
        #: What vLLM calls for ``session_gate_admit`` / ``…_release`` (``gate_methods`` binds
        #: them to the engine core): the native methods themselves, which take the utility
        #: call's arguments, read the clock, check and time themselves.
        self.admit = self._book.admit
        self.release = self._book.release
        #: The engine's own release of a lease bound to a vLLM request that just ended
        #: (``gate_binding``, scheduler mode; engine thread): the same native release as a
        #: client's, counted; releasing a lease twice changes nothing the second time (False),
        #: so a client that released it first makes this a no-op.
        self.release_bound = self._book.release_bound

    # -- utility calls (engine thread) ------------------------------------------------------

    def cancel(self, ticket: Any, client_id: Any = None) -> bool:
        return self._book.cancel(ticket, client_id, _now())

    def finish(self, session_id: Any, client_id: Any = None) -> bool:
        ended = self._book.finish(session_id, client_id, _now())
        # Also evicts the session's own blocks first (``finished_blocks``).
        self._probes.forget(session_id)
        return ended

    def _finished_counters(self) -> dict[str, int]:
        return finished_blocks.counters_of(getattr(self._engine, "scheduler", None))

    def renew(self, client_id: Any) -> dict[str, Any]:
        leases, pending = self._book.renew(client_id, _now())
        return {
            "lease_ttl_sec": self.lease_ttl_sec,
            "leases": leases,
            "pending": pending,
            "binds_requests": self.binds_requests,
        }

    def stats(self) -> dict[str, Any]:
        s = self._book.stats()
        s["engine_gate"].update(self.counters)
        s["engine_gate"].update(self._finished_counters())
        if self.scheduler_gate is not None:
            s["scheduler"] = self.scheduler_gate.stats()
        s["host_tier"] = self._host_tier()
        return s

    def _host_tier(self) -> dict[str, Any]:
        """The host KV tier's capacity and use in GPU blocks, or why it cannot be read."""
        usage = getattr(self._probes, "tier_usage", lambda: None)()
        if usage is None:
            reason = getattr(self._probes, "tier_unavailable", None) or "no host KV tier"
            return {"num_blocks": None, "used_blocks": None, "unavailable": reason}
        return {"num_blocks": usage[0], "used_blocks": usage[1], "unavailable": None}

    def prometheus(self) -> str:
        engine = self._book.stats()["engine_gate"]
        lines = [self._book.prometheus().rstrip("\n")]
        extra = {
            "clients": ("gauge", engine["clients"], "Clients alive (seen within the lease TTL)"),
            "clients_expired_total": (
                "counter",
                engine["clients_expired"],
                "Clients declared dead after the lease TTL",
            ),
            "leases_expired_total": (
                "counter",
                engine["leases_expired"],
                "Leases released because their client went silent",
            ),
        }
        for name, (kind, value, text) in extra.items():
            lines += metric_lines(f"session_gate_engine_{name}", kind, text, value)
        lines += finished_blocks.prometheus_lines(getattr(self._engine, "scheduler", None))
        tier = self._host_tier()
        if tier["unavailable"] is None:
            # Only an engine with a readable host tier has these (no series means no tier).
            lines += metric_lines(
                "session_gate_offload_blocks",
                "gauge",
                "Host KV tier capacity, in GPU blocks",
                tier["num_blocks"],
            )
            lines += metric_lines(
                "session_gate_offload_used_blocks",
                "gauge",
                "GPU blocks' worth of KV the host KV tier holds",
                tier["used_blocks"],
            )
        if self.scheduler_gate is not None:
            lines.append(self.scheduler_gate.prometheus().rstrip("\n"))
        return "\n".join(lines) + "\n"

    # -- timers (engine thread) -------------------------------------------------------------

    def tick_when_settled(self) -> None:
        """After a step: ticks if the timer is due and the engine has no client request queued,
        else leaves ``due`` set for the next step (at most ``MAX_TICK_DEFER_SEC``).

        Why: a renewal can sit in vLLM's input queue while the engine thread was held up by a
        step (a long one, or a starved CPU: this machine has stalled processes for seconds);
        ticking first would declare its client silent and drop its leases mid-stream. vLLM
        drains the whole queue before its next step, so one step later the renewal counts."""
        if not self.due:
            return
        queue = getattr(self._engine, "input_queue", None)
        now = _now()
        if queue is not None and not queue.empty():
            if self._due_since is None:
                self._due_since = now
            if now - self._due_since < MAX_TICK_DEFER_SEC:
                return
        self.tick()

    def tick(self) -> None:
        """Runs due deadlines: waiters whose ``Wait.until`` passed, dead clients, grace ends.
        Never raises: it runs inside vLLM's busy loop."""
        self.due = False
        self._due_since = None
        try:
            self.counters["ticks"] += 1
            now = _now()
            if self.scheduler_gate is not None:
                self.scheduler_gate.keep_alive(now)
            for cid, silent, leases, attempts in self._book.tick(now):
                # A client that closed cleanly holds nothing: only a dead holder is worth a
                # warning.
                logger.log(
                    logging.WARNING if leases or attempts else logging.DEBUG,
                    "session_gate: client %s silent for %.1f s (lease TTL %.1f s): released %d "
                    "leases, cancelled %d pending admits",
                    cid,
                    silent,
                    self.lease_ttl_sec,
                    leases,
                    attempts,
                )
        except Exception:  # noqa: BLE001 - never take the engine down
            self.counters["tick_errors"] += 1
            logger.exception("session_gate: engine gate tick failed")

    def _wake_engine(self) -> None:
        # Timer thread: only flags, a list append and a queue put (all thread-safe).
        try:
            self.due = True
            engine = self._engine
            callbacks = getattr(engine, "_idle_state_callbacks", None)
            if callbacks is not None and _tick_callback not in callbacks:
                callbacks.append(_tick_callback)
            queue = getattr(engine, "input_queue", None)
            if queue is not None:
                queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        except Exception:  # noqa: BLE001 - the timer must outlive a failed wake-up
            logger.exception("session_gate: engine gate timer could not wake the engine")


def _tick_callback(engine: Any) -> None:
    """vLLM idle-state callback: runs the engine gate's due timers on the engine thread."""
    driver = engine.__dict__.get(DRIVER_ATTR)
    # Idle: the loop just took our WAKEUP off the queue, so every request queued before the
    # deadline has been handled (first in, first out): no reason to wait.
    if driver is not None and driver.due:
        driver.tick()


DRIVER_ATTR = "_session_gate_driver"
