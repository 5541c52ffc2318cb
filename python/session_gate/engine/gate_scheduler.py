"""Scheduler mode of the engine gate: vLLM's own scheduler asks the gate before it starts a
waiting request that carries a session id, so every client is gated with nothing to change but
the id it already sends.

The setting. ``SESSION_GATE_SCHEDULER`` in the environment of ``vllm serve`` (or of the process
that builds an ``AsyncLLM``): ``off`` (the default), ``session-id``, or ``infer``
(``session-id``, and requests that carry no id are gated under the session *inferred* from
their blocks, below). Any other value is refused with an error that names the variable: the
plugin then logs it and serves without this mode (the other doors stay up).

Where the id comes from. vLLM 0.32+ carries a session identity to the engine core: the OpenAI
server reads the body field ``session_id`` (chat, completions, responses), else the
``X-Session-ID`` header, else ``vllm_xargs.session_id``; ``AsyncLLM.generate(...,
session_id=...)`` takes it; ``EngineCoreRequest`` and the scheduler's ``Request`` hold it as
``session_id``. Empty ids are dropped by vLLM's server (they count as no id here too).

What is held. When the scheduler looks at a waiting request, vLLM's
``Scheduler._handle_blocked_waiting_request`` says whether it may proceed this step (it is how
vLLM skips a request that waits for remote KV or a grammar). It is wrapped once: when vLLM says
yes and the request carries a session id, the engine gate's book (the same ``EngineGateBook``,
core, knobs and reasons as the lease doors: ``gate_driver``) decides, with the request's prompt
token ids and ``max_tokens``. Admitted now: the request is scheduled in this very step and holds
the lease. Otherwise the request is *held*: vLLM skips it for this step, which leaves it where it
was in the waiting queue (not refused, not re-queued at the back; vLLM counts it among its
skipped waiting requests), and every later step looks again until the gate admits it; it is
then scheduled in the first step after. Those looks are the native look's
(``_native.SchedulerLook``, ``src/python/sched_look.rs``): once the scheduler has its gate, a
bound method in the scheduler's instance ``__dict__`` shadows the class's wrapper and answers
the looks that decide nothing without a Python frame: a held request with no answer yet (one
map lookup), a request without an id, a scheduled one. Every other look comes here
(:meth:`SchedulerGate.ready`). Requests without
an id, pooling requests, and prompts given as embeddings are never gated. While a request of a
session is held, later requests of the same session wait behind it without an admit of their own
(a second admit would take over the first's attempt: the core keeps one pending attempt per
session). A request vLLM preempts and re-queues keeps its lease and is not gated again.

Release. The lease is released when vLLM frees the request (``Scheduler._free_request``, wrapped
by ``gate_binding``: finished, stopped, or aborted): by the native look's ``free`` for a
scheduled request (no Python frame of the gate's), by :meth:`SchedulerGate.on_free` for the
rest. A held request that is aborted (its HTTP
client went away, ``AsyncLLM.abort``) cancels its attempt: it leaves no reservation; a lease that
raced the abort is released by the cancel. The leases belong to one client of the book,
``SCHEDULER_CLIENT``, which this module renews on the driver's ticks while it holds anything, so
the lease TTL never drops a running request's lease.

vLLM's own sessions (streaming input: ``AsyncLLM.generate`` fed ``StreamingInput`` chunks, one
resumable request whose blocks stay allocated while it waits for its next chunk) are decided on
their first chunk, under their session id (or inferred session). The lease then stays committed
for the whole stream, waiting included, and is released when vLLM frees the request at the
stream's end; later chunks are never held (their request is already decided: holding them
would free nothing, the blocks are the request's). Each later chunk grows the committed working
set to the request's new prompt (every chunk so far and the kept answers) and that chunk's
``max_tokens`` (``Scheduler._update_request_as_session``, wrapped: ``on_chunk``); it never
shrinks while the stream lives.

``max_wait`` bounds every hold. In this mode ``SESSION_GATE_MAX_WAIT_SEC`` defaults to
``DEFAULT_MAX_WAIT_SEC`` (7,200 s, ``_native.SCHEDULER_MAX_WAIT_SEC``: the gate's own order
legitimately holds turns for over an hour on large models' rollouts) when it is unset or
``off``: a request held that long is
admitted anyway with reason ``max_wait`` and scheduled, so a turn never starves. (The lease doors
share the book, so the bound applies to their admits too.)

Inference (``infer``). For clients that send no id at all (``LLM.generate``, an in-process
``AsyncLLM`` as verl calls it), a request is matched to the session whose previous request it
extends, by ``SessionInference`` (``src/gate/infer.rs``) over the block hashes vLLM already
computed for it (``request.block_hashes``; no hashing of ours). When a request is freed, the
hashes of its blocks past its prompt (the model's answer) become its session's *own* blocks; a
new request continues the idle session whose own block it contains at the deepest position,
else it is a new session, keyed ``infer:<n>`` in the book. Blocks many sessions share (a system
prompt, a GRPO group's task prompt) are prompt blocks, never own blocks, so they never merge
sessions; identical histories (greedy decoding from one prompt) continue one of them and count
as ``ambiguous``. What defeats it: a client that re-renders earlier turns differently (a chat
template that drops earlier reasoning, text re-tokenized differently from the tokens the model
produced), answers shorter than a block (``no_own_block``), prefix caching off (no hashes). It
shows in the counters under ``scheduler.inferred`` (``continued`` / ``ambiguous`` / ``new`` /
``no_own_block`` / ``forgotten`` / ``idle``) and as ``session_gate_scheduler_inferred_total``.
A request that carries an id is gated by its id in this mode too.

Bad ids. vLLM passes the header's bytes through (latin-1 decoded): any non-empty id is a
``str``. An id the book refuses (longer than 256 characters) is not gated: the request is
scheduled as if it had no id and counted under ``bad_session_ids``; the engine core never fails
on an id.

Data parallelism: every engine core has its own scheduler and so its own gate, which sees only
the requests routed to it.

Counters: ``session_gate_stats`` (``/session_gate/v1/stats``) has them under ``scheduler``, and
its Prometheus text (``?format=prometheus``) as ``session_gate_scheduler_*``.

Cost. Off: nothing is wrapped. On: a request without an id costs the native look's two
attribute reads per look; a held request one map lookup per step; a gated request one admit
(the native book's, with the prefix walk) when first seen. While a request is held vLLM keeps
stepping (it has an unfinished request), as it does for requests that wait for remote KV.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any

from session_gate import _native
from session_gate.engine import gate_binding
from session_gate.engine.gate_driver import metric_lines

logger = logging.getLogger("session_gate")

_now = time.monotonic

#: The setting and its values.
OFF = "off"
SESSION_ID = "session-id"
INFER = "infer"
#: ``max_wait_sec`` of the book in this mode when ``SESSION_GATE_MAX_WAIT_SEC`` sets none.
DEFAULT_MAX_WAIT_SEC: float = _native.SCHEDULER_MAX_WAIT_SEC
#: Inferences kept for ``session_gate_stats("inferred")``.
RECENT_INFERRED = 16384
#: The book's client that holds the scheduler's leases and attempts.
SCHEDULER_CLIENT = "session_gate-scheduler"
#: Where the scheduler keeps its gate (set by :func:`attach`).
SCHEDULER_GATE_ATTR = gate_binding.SCHEDULER_GATE_ATTR

#: Whether this process's ``Scheduler`` and ``EngineCore`` are wrapped, and in which mode.
installed = False
mode = OFF
#: vLLM's own ``Scheduler._handle_blocked_waiting_request`` (set by :func:`install`).
_vllm_check: Any = None
#: The scheduler's method the look replaces (in the class) and shadows (per scheduler).
LOOK_ATTR = "_handle_blocked_waiting_request"


def mode_from_env() -> str:
    """``SESSION_GATE_SCHEDULER`` through the knob table: ``off`` (unset too), ``session-id`` or
    ``infer``; any other value raises ``ValueError`` naming the variable and the value."""
    try:
        return str(_native.knob_from_env("scheduler"))
    except ValueError as e:
        # Name the variable the user set, not only the table's knob name.
        env = next(k["env"] for k in _native.knobs() if k["name"] == "scheduler")
        raise ValueError(f"{env}: {e}") from None


def gate_config(native: Any, config: Any) -> Any:
    """The book's config in this process: ``config`` itself, except that in scheduler mode a
    config without ``max_wait_sec`` gets :data:`DEFAULT_MAX_WAIT_SEC` (every hold is bounded)."""
    if not installed or config.max_wait_sec is not None:
        return config
    return native.GateConfig(**{**config.to_dict(), "max_wait_sec": DEFAULT_MAX_WAIT_SEC})


class _Held:
    """A request the gate has not admitted yet: its admit's ticket, session and start, and the
    admit's answer once the book gives it (``answer``: the scheduler's look at a held request
    is then one attribute read, not ``Future.done()``, which takes a lock, on every step).

    It is also what the book answers the admit through. An admit of the native look's gets one
    from the book in place of a ``Future`` (``done()`` and ``set_result(answer)`` are all the
    book calls, on the engine thread: no lock, no callback list); an admit of the Python
    gate's waits on the ``Future`` ``admit_trusted`` returned (:meth:`wait_for`)."""

    __slots__ = ("session_id", "ticket", "since", "answer", "request", "look")

    def __init__(self) -> None:
        self.session_id = ""
        self.ticket = ""
        self.since = 0.0
        self.answer: dict[str, Any] | None = None
        #: The request and the native look that answers its looks while it waits
        #: (``_native.SchedulerLook``), told when the answer comes.
        self.request: Any = None
        self.look: Any = None

    def start(
        self, session_id: str, ticket: str, since: float, request: Any = None, look: Any = None
    ) -> None:
        """The hold begins: ``look`` answers the request's looks until the answer comes."""
        self.session_id = session_id
        self.ticket = ticket
        self.since = since
        self.request = request
        self.look = look
        if look is not None and self.answer is None:
            look.hold(request)

    def wait_for(self, future: Future) -> None:
        """The answer comes through ``future`` (after :meth:`start`: a done one answers now)."""
        future.add_done_callback(self._from_future)

    # -- what the book calls --------------------------------------------------------------

    def done(self) -> bool:
        return self.answer is not None

    def set_result(self, answer: dict[str, Any]) -> None:
        self.answer = answer
        self.let_go()

    def _from_future(self, future: Future) -> None:
        if future.cancelled():
            self.set_result({"status": "cancelled"})
            return
        exc = future.exception()
        self.set_result({"status": "error", "error": repr(exc)} if exc else future.result())

    def let_go(self) -> None:
        """The hold is over (answered, or its request freed): the native look lets go."""
        if self.look is not None:
            self.look.unhold(self.request)


class SchedulerGate:
    """The gate of one engine core's scheduler, over that core's ``EngineGateDriver``.

    ``_decided`` maps a request id to its lease (an int) or ``None`` (scheduled ungated);
    ``_held`` maps a request id to its pending admit; ``_held_sessions`` a session to the
    request id whose admit is pending. With ``infer``, ``_inferred`` maps a request without an
    id to its inferred session's number and its prompt's full blocks."""

    def __init__(self, driver: Any, infer: bool = False) -> None:
        self._driver = driver
        self._book = driver._book
        self.mode = INFER if infer else SESSION_ID
        self._inference = _native.SessionInference() if infer else None
        self._inferred: dict[str, tuple[int, int]] = {}
        #: The last inferences, ``(request_id, "infer:<n>", kind)``: what
        #: ``session_gate_stats("inferred")`` answers (to audit the rule on a known workload).
        self.recent_inferred: deque[tuple[str, str, str]] = deque(maxlen=RECENT_INFERRED)
        self._decided: dict[str, int | None] = {}
        #: Leases granted here less those released here (read on every tick: no scan); the
        #: native look counts its own grants and releases (:meth:`_lease_count` adds them up).
        self._leases = 0
        self._held: dict[str, _Held] = {}
        self._held_sessions: dict[str, str] = {}
        #: Held requests with no admit yet (behind another request of their session).
        self._queued: set[str] = set()
        #: Tickets are numbered, not named after request ids (which clients may choose, and
        #: which may be longer than the book accepts).
        self._tickets = itertools.count()
        self.counters: Counter[str] = Counter()
        self.admitted_by_reason: Counter[str] = Counter()
        #: The scheduler's native look (``_native.SchedulerLook``, set by :func:`attach`).
        self.look: Any = None
        #: What vLLM's free calls (``gate_binding``): :meth:`on_free`, or the native look's
        #: ``free`` once it is installed (it releases a scheduled request's lease itself and
        #: hands every other free to :meth:`on_free`).
        self.free: Any = self.on_free
        # The requests held here sit in vLLM's waiting queue but are no work the engine could
        # do: the usage reads (the book's and the usage probe's) take them off the waiting
        # count, so an engine whose only waiting requests are held counts as idle.
        held_in_queue = (self._held, self._queued)
        self._book.hold_in_queue(list(held_in_queue))
        state = getattr(driver, "_probes", None)
        if state is not None:
            state.held_in_queue = held_in_queue

    # -- the scheduler's question (engine thread) -------------------------------------------

    def ready(self, request: Any) -> bool:
        """Whether ``request`` (which carries a session id) may be scheduled now."""
        rid = request.request_id
        if rid in self._decided:
            return True
        held = self._held.get(rid)
        if held is not None:
            if held.answer is None:
                return False
            return self._answered(rid, held, held.answer)
        return self._first_look(request, rid)

    def _first_look(self, request: Any, rid: str) -> bool:
        session_id = request.session_id
        params = request.sampling_params
        tokens = request.prompt_token_ids
        if not (isinstance(session_id, str) and session_id) and self._inference is not None:
            session_id = self._infer(request, rid)
        if not isinstance(session_id, str) or params is None or not tokens:
            self._decided[rid] = None
            self.counters["ungated"] += 1
            return True
        owner = self._held_sessions.get(session_id)
        if owner is not None and owner != rid:
            # Behind a pending admit of its own session: a second admit would take over that
            # attempt (one pending attempt per session), so it waits without one.
            if rid not in self._queued:
                self._queued.add(rid)
                self.counters["held"] += 1
                self.counters["held_behind_session"] += 1
            return False
        self._queued.discard(rid)
        max_tokens = params.max_tokens if params.max_tokens is not None else 0
        ticket = self._ticket()
        try:
            answer = self._book.admit_trusted(
                session_id, tokens, max_tokens, ticket, SCHEDULER_CLIENT
            )
        except (TypeError, ValueError) as exc:
            # An id (or prompt) the book refuses: scheduled as if it carried no id.
            self._decided[rid] = None
            self.counters["bad_session_ids"] += 1
            logger.debug("session_gate: request %s not gated: %s", rid, exc)
            return True
        except Exception:  # noqa: BLE001 - never take the scheduler down
            self._decided[rid] = None
            self.counters["errors"] += 1
            logger.exception("session_gate: the scheduler's admit of %s failed", rid)
            return True
        self.counters["gated"] += 1
        if isinstance(answer, Future):
            if answer.done():
                return self._answered(rid, None, answer.result())
            return self._hold(request, rid, session_id, ticket, answer)
        return self._answered(rid, None, answer)

    def _hold(
        self, request: Any, rid: str, session_id: str, ticket: str, future: Future | _Held
    ) -> bool:
        """Holds ``request``: its admit (``ticket``) waits for the book's answer, through
        ``future`` (the Python gate's admits) or the ``_Held`` the book made for it (the native
        look's first looks, which call this too)."""
        held = future if isinstance(future, _Held) else _Held()
        held.start(session_id, ticket, _now(), request, self.look)
        if held is not future:
            held.wait_for(future)
        self._held[rid] = held
        self._held_sessions[session_id] = rid
        self.counters["held"] += 1
        return False

    def _ticket(self) -> str:
        """A new ticket: the native look numbers them when there is one (it admits too)."""
        if self.look is not None:
            return self.look.ticket()
        return f"sched:{next(self._tickets)}"

    def _lease_count(self) -> int:
        """Leases held: granted here or by the native look, less those released here."""
        return self._leases + (0 if self.look is None else self.look.leases)

    def _infer(self, request: Any, rid: str) -> str | None:
        """The inferred session of a request without an id (once per request: a later look
        reuses it); ``None`` for requests that are never gated."""
        known = self._inferred.get(rid)
        if known is None:
            if request.sampling_params is None or not request.prompt_token_ids:
                return None
            hashes = request.block_hashes
            number, kind = self._inference.arrive(hashes)  # counted by the inference
            known = self._inferred[rid] = (number, len(hashes))
            self.recent_inferred.append((rid, f"infer:{number}", kind))
        return f"infer:{known[0]}"

    def _answered(self, rid: str, held: _Held | None, answer: dict[str, Any]) -> bool:
        if held is not None:
            held.let_go()
            del self._held[rid]
            if self._held_sessions.get(held.session_id) == rid:
                del self._held_sessions[held.session_id]
            self.counters["hold_ms_total"] += int((_now() - held.since) * 1000)
        status = answer.get("status")
        if status == "admitted":
            reason = str(answer.get("reason"))
            self._decided[rid] = int(answer["lease"])
            self._leases += 1
            self.counters["admitted"] += 1
            self.admitted_by_reason[reason] += 1
            if reason == "max_wait":
                self.counters["max_wait"] += 1
        else:  # preempted by another door's admit of the session, cancelled, expired
            self._decided[rid] = None
            self.counters[f"ungated_{status}"] += 1
        return True

    # -- vLLM frees the request (engine thread, from gate_binding) -------------------------

    def on_free(self, request: Any) -> None:
        """Releases the request's lease, or withdraws its pending admit (an aborted hold)."""
        rid = request.request_id
        inferred = self._inferred.pop(rid, None)
        if inferred is not None:
            # Its answer's blocks become its session's own blocks: the next turn continues it.
            self._inference.finish(inferred[0], request.block_hashes, inferred[1])
        if rid in self._decided:
            lease = self._decided.pop(rid)
            if lease is not None:
                self._leases -= 1
                self._driver.release_bound(lease)
            return
        if rid in self._queued:
            self._queued.discard(rid)
            self.counters["aborted_while_held"] += 1
            return
        held = self._held.pop(rid, None)
        if held is None:
            return
        held.let_go()
        if self._held_sessions.get(held.session_id) == rid:
            del self._held_sessions[held.session_id]
        self.counters["aborted_while_held"] += 1
        # Withdraws the attempt; if the admission raced this abort (answered, not yet read by
        # the scheduler) the book releases the lease it granted.
        self._book.cancel(held.ticket, SCHEDULER_CLIENT, _now())

    # -- a streaming-input request takes its next chunk (engine thread) ---------------------

    def on_chunk(self, request: Any) -> None:
        """Grows the lease of a streaming-input request that took its next chunk to what the
        request now holds: its whole prompt and the chunk's ``max_tokens``."""
        lease = self._decided.get(request.request_id)
        if lease is None:
            return
        max_tokens = request.max_tokens
        if max_tokens is None and request.sampling_params is not None:
            max_tokens = request.sampling_params.max_tokens
        ws_tokens = len(request.prompt_token_ids or ()) + (max_tokens or 0)
        if self._book.grow_lease(lease, ws_tokens):
            self.counters["stream_chunks_grown"] += 1

    # -- the driver's tick (engine thread) --------------------------------------------------

    def keep_alive(self, now: float) -> None:
        """Renews the scheduler's client while it holds leases or attempts: the requests are
        alive as long as vLLM has them, whatever the lease TTL."""
        if self._held or self._lease_count():
            self._book.renew(SCHEDULER_CLIENT, now)

    # -- counters ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            key: self.counters[key]
            for key in (
                "gated",
                "held",
                "held_behind_session",
                "admitted",
                "max_wait",
                "aborted_while_held",
                "ungated",
                "bad_session_ids",
                "ungated_preempted",
                "ungated_cancelled",
                "ungated_expired",
                "ungated_error",
                "errors",
                "hold_ms_total",
                "stream_chunks_grown",
            )
        }
        admitted_by_reason = Counter(self.admitted_by_reason)
        if self.look is not None:  # what the native look decided on its own
            native = self.look.counts()
            for key in ("gated", "admitted", "max_wait", *(k for k in native if "ungated_" in k)):
                out[key] += native[key]
            admitted_by_reason.update(native["admitted_by_reason"])
        out["mode"] = self.mode
        if self._inference is not None:
            out["inferred"] = self._inference.stats()
        out["holding"] = len(self._held) + len(self._queued)
        # Held requests whose looks the native look answers (None: no native look here).
        out["native_holding"] = None if self.look is None else self.look.holding
        out["leases"] = self._lease_count()
        out["admitted_by_reason"] = dict(admitted_by_reason)
        return out

    def prometheus(self) -> str:
        s = self.stats()
        by_reason = sorted(s["admitted_by_reason"].items()) or [("none", 0)]
        rows = [
            ("gated_total", "counter", "Requests the scheduler asked the gate about", s["gated"]),
            ("held_total", "counter", "Requests held in vLLM's waiting queue", s["held"]),
            ("max_wait_total", "counter", "Holds ended by max_wait", s["max_wait"]),
            (
                "aborted_while_held_total",
                "counter",
                "Held requests aborted before their admission",
                s["aborted_while_held"],
            ),
            (
                "bad_session_ids_total",
                "counter",
                "Requests not gated because the book refused their id",
                s["bad_session_ids"],
            ),
            ("holding", "gauge", "Requests held now", s["holding"]),
            ("leases", "gauge", "Leases of the requests the scheduler admitted", s["leases"]),
        ]
        metric = "session_gate_scheduler_admitted_total"
        lines = [
            f"# HELP {metric} Requests the gate admitted in the scheduler, by reason",
            f"# TYPE {metric} counter",
            *(f'{metric}{{reason="{reason}"}} {n}' for reason, n in by_reason),
        ]
        if "inferred" in s:
            metric = "session_gate_scheduler_inferred_total"
            lines += [
                f"# HELP {metric} Requests without a session id, by what inference decided",
                f"# TYPE {metric} counter",
                *(
                    f'{metric}{{kind="{kind}"}} {s["inferred"][kind]}'
                    for kind in ("continued", "ambiguous", "new")
                ),
            ]
        for name, kind, text, value in rows:
            lines += metric_lines(f"session_gate_scheduler_{name}", kind, text, value)
        return "\n".join(lines) + "\n"


def attach(scheduler: Any, driver: Any) -> SchedulerGate | None:
    """Gives ``scheduler`` a gate over ``driver`` (once per engine core; called where the
    driver is built, ``gate_methods._driver``)."""
    if scheduler is None:
        return None
    gate = scheduler.__dict__.get(SCHEDULER_GATE_ATTR)
    if gate is None:
        gate = SchedulerGate(driver, infer=mode == INFER)
        scheduler.__dict__[SCHEDULER_GATE_ATTR] = gate
        driver.scheduler_gate = gate
        _install_look(scheduler, gate)
    return gate


def _install_look(scheduler: Any, gate: SchedulerGate) -> None:
    """Gives ``scheduler`` the native look (``_native.SchedulerLook``) as an instance attribute
    that shadows the class's wrapper: the looks that decide nothing (a held request's, once per
    step; a request without an id) then cost no Python frame. Without it (a vLLM whose
    ``RequestStatus`` lacks the two plain statuses) the class's wrapper answers, as before."""
    if _vllm_check is None:
        return
    from vllm.v1.request import RequestStatus

    try:
        plain = [RequestStatus.WAITING, RequestStatus.PREEMPTED]
    except AttributeError:
        logger.warning("session_gate: RequestStatus has no WAITING/PREEMPTED: Python looks")
        return
    book = gate._book if isinstance(gate._book, _native.EngineGateBook) else None
    look = _native.SchedulerLook(
        _vllm_check.__get__(scheduler), plain, gate, SCHEDULER_CLIENT, book, sink=_Held
    )
    gate.look = look
    gate.free = look.free
    scheduler.__dict__[LOOK_ATTR] = look.look


def _wrap_handle_blocked(original: Any, infer: bool) -> Any:
    def _handle_blocked_waiting_request(self: Any, request: Any) -> bool:
        if not original(self, request):
            return False
        if not infer and not request.session_id:
            return True
        gate = self.__dict__.get(SCHEDULER_GATE_ATTR)
        if gate is None:  # no gate on this scheduler (the engine core has none): ungated
            return True
        return gate.ready(request)

    _handle_blocked_waiting_request.__wrapped__ = original  # type: ignore[attr-defined]
    return _handle_blocked_waiting_request


def _wrap_update_as_session(original: Any) -> Any:
    def _update_request_as_session(self: Any, session: Any, update: Any) -> None:
        original(self, session, update)
        gate = self.__dict__.get(SCHEDULER_GATE_ATTR)
        if gate is None:
            return
        try:
            gate.on_chunk(session)
        except Exception:  # noqa: BLE001 - never take the scheduler down
            gate.counters["errors"] += 1
            logger.exception("session_gate: growing the lease of %s failed", session.request_id)

    _update_request_as_session.__wrapped__ = original  # type: ignore[attr-defined]
    return _update_request_as_session


def _wrap_add_request(original: Any) -> Any:
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if SCHEDULER_GATE_ATTR not in self.__dict__:
            _start(self)
        return original(self, request, *args, **kwargs)

    add_request.__wrapped__ = original  # type: ignore[attr-defined]
    return add_request


def _start(core: Any) -> None:
    """Builds the engine gate of ``core`` (if no utility call did yet) and its scheduler's gate.
    On the first request: by then ``EngineCore.__init__`` is over (the hash root is set)."""
    core.__dict__[SCHEDULER_GATE_ATTR] = None  # tried once per core, even if it fails
    try:
        from session_gate.engine.gate_methods import _driver

        driver = _driver(core)  # attaches the scheduler's gate
        core.__dict__[SCHEDULER_GATE_ATTR] = driver.scheduler_gate
        logger.info(
            "session_gate: scheduler mode %s (max_wait %.1f s)",
            mode,
            driver.config.max_wait_sec,
        )
    except Exception:  # noqa: BLE001 - vLLM serves ungated rather than not at all
        logger.exception("session_gate: scheduler mode unavailable, requests are not gated")


def install() -> bool:
    """In scheduler mode, wraps ``Scheduler._handle_blocked_waiting_request``,
    ``Scheduler._update_request_as_session`` (where vLLM has it) and ``EngineCore.add_request``
    (idempotent); False when the setting is off. Raises
    ``ValueError`` for a bad setting and ``AttributeError`` for a vLLM without the hook."""
    global installed, mode, _vllm_check
    if installed:
        return True
    wanted = mode_from_env()
    if wanted == OFF:
        return False
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    handle = Scheduler._handle_blocked_waiting_request
    add = EngineCore.add_request
    _vllm_check = handle
    Scheduler._handle_blocked_waiting_request = _wrap_handle_blocked(handle, wanted == INFER)
    EngineCore.add_request = _wrap_add_request(add)
    # Streaming input (vLLM 0.32 on): a vLLM without it has no chunks to count.
    chunk = getattr(Scheduler, "_update_request_as_session", None)
    if chunk is not None:
        Scheduler._update_request_as_session = _wrap_update_as_session(chunk)
    installed = True
    mode = wanted
    return True
