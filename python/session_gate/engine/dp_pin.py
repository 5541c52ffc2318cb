"""Data parallelism: every turn of a session reaches one engine core (one DP rank).

With ``vllm serve --data-parallel-size N`` and vLLM's internal load balancing, each engine core
has its own KV cache, scheduler and so its own engine gate. vLLM's balancer
(``DPLBAsyncMPClient.get_core_engine_for_request``) sends each request to the least-loaded core,
so one session's turns scatter across N caches and most of its prefix is never reused. vLLM has
the means to pin a request: ``EngineCoreRequest.data_parallel_rank`` (which the OpenAI server sets
from the ``X-data-parallel-rank`` header and ``AsyncLLM.generate`` takes as an argument); a
request that names a rank goes to that core.

What this module does, in the client that balances (every API-server process of ``vllm serve``,
or an in-process ``AsyncLLM`` with DP):

- a request that carries a session id (``EngineCoreRequest.session_id``: vLLM's server reads it
  from the body's ``session_id``, the ``X-Session-ID`` header or ``vllm_xargs``) and names no rank
  is pinned: its session's first turn goes where vLLM's own balancer sends it, and every later
  turn gets that rank in ``data_parallel_rank``;
- a request that already names a rank (``X-data-parallel-rank``), a pooling request, a request
  without a session id, and the later chunks of a streaming-input request (vLLM keeps those on
  their core itself) are left to vLLM as they are;
- the engine gate's finish (``POST /finish_session``, ``/session_gate/v1/finish``,
  ``session_gate_finish``) forgets the session's pin: its next turn is placed afresh;
- pins are kept in an LRU of :data:`MAX_PINS` sessions: a session forgotten that way is placed
  afresh (as after a finish).

Several API-server processes (``--api-server-count``, which vLLM defaults to the DP size) each
have their own balancer, and a session's turns may enter any of them. So the first engine core
(index 0 of the client's engines) also keeps the pins, as the authority between them
(``session_gate_dp_pin``, a utility method: the first pin recorded for a session wins). A
process that has no pin for a session asks it before it sends the turn (one utility round trip
to that core, on a session's first turn in that process only), and records its own placements
there (without waiting). With one API-server process nothing is asked: its pins are exact. A
finish reaches every engine core and the process that served it; another API-server process
keeps its copy of the pin until its LRU drops it (a session id used again after its finish
may then go back to its old rank there).

Nothing of this runs without data parallelism: only ``DPLBAsyncMPClient`` (vLLM's client for
DP with internal balancing) is wrapped. Counters: ``dp_pins`` in the first engine core's
``session_gate_stats`` (``/session_gate/v1/stats``: the authority's table) and
:func:`client_stats` in each API-server process.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from typing import Any

logger = logging.getLogger("session_gate")

#: Sessions whose pin a client (and the authority) keeps; older pins are forgotten first.
MAX_PINS = 1 << 16
#: Where the engine core keeps the authority's pins, and a client its own.
CORE_PINS_ATTR = "_session_gate_dp_pins"
CLIENT_PINS_ATTR = "_session_gate_dp_pins"

installed = False


class SessionPins:
    """Session id -> rank, least recently used first; at most ``capacity`` sessions."""

    def __init__(self, capacity: int = MAX_PINS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._ranks: OrderedDict[str, int] = OrderedDict()
        self.counters: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._ranks)

    def get(self, session_id: str) -> int | None:
        """The session's rank (and it becomes the most recently used), or None."""
        rank = self._ranks.get(session_id)
        if rank is not None:
            self._ranks.move_to_end(session_id)
        return rank

    def put(self, session_id: str, rank: int) -> int:
        """Pins the session to ``rank`` unless it already has a rank; returns its rank."""
        known = self.get(session_id)
        if known is not None:
            return known
        self._ranks[session_id] = rank
        if len(self._ranks) > self.capacity:
            self._ranks.popitem(last=False)
            self.counters["evicted"] += 1
        return rank

    def set(self, session_id: str, rank: int) -> None:
        """Pins the session to ``rank``, replacing its rank if it had one."""
        self._ranks.pop(session_id, None)
        self.put(session_id, rank)

    def sessions_by_rank(self) -> Counter[int]:
        """How many sessions are pinned to each rank."""
        return Counter(self._ranks.values())

    def forget(self, session_id: str) -> bool:
        """Drops the session's pin; False if it had none."""
        if self._ranks.pop(session_id, None) is None:
            return False
        self.counters["forgotten"] += 1
        return True


# -- the authority, in the first engine core --------------------------------------------------


def _core_pins(core: Any) -> SessionPins:
    pins = core.__dict__.get(CORE_PINS_ATTR)
    if pins is None:
        pins = core.__dict__[CORE_PINS_ATTR] = SessionPins()
    return pins


def session_gate_dp_pin(self: Any, session_id: Any, rank: Any = None) -> int | None:
    """The session's rank as the authority knows it; with ``rank``, pins the session there if
    it has no rank yet (the first pin wins). None: no rank known, none given."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank must be a non-negative int or None, got {rank!r}")
    pins = _core_pins(self)
    if rank is None:
        known = pins.get(session_id)
        pins.counters["asked_known" if known is not None else "asked_unknown"] += 1
        return known
    pinned = pins.put(session_id, rank)
    pins.counters["recorded" if pinned == rank else "recorded_lost"] += 1
    return pinned


def core_stats(core: Any) -> dict[str, int] | None:
    """The authority's table in this engine core: ``pins`` held, and its counters
    (``recorded``, ``recorded_lost``, ``asked_known``, ``asked_unknown``, ``forgotten``,
    ``evicted``); None if this core keeps none (in ``session_gate_stats`` as ``dp_pins``)."""
    pins = core.__dict__.get(CORE_PINS_ATTR)
    return None if pins is None else {"pins": len(pins), **pins.counters}


def forget_in_core(core: Any, session_id: Any) -> None:
    """The engine gate's finish, in an engine core: drop the authority's pin (if any)."""
    pins = core.__dict__.get(CORE_PINS_ATTR)
    if pins is not None and isinstance(session_id, str):
        pins.forget(session_id)


# -- the balancing client, in each API-server process ----------------------------------------


class _ClientPins:
    """One balancing client's pins, and whether it shares its engines with other clients."""

    def __init__(self, client: Any) -> None:
        self.pins = SessionPins()
        self.shared = int(getattr(client, "client_count", 1)) > 1
        self.tasks: set[asyncio.Task[Any]] = set()
        self.warned = False


def _client_pins(client: Any) -> _ClientPins:
    state = client.__dict__.get(CLIENT_PINS_ATTR)
    if state is None:
        state = client.__dict__[CLIENT_PINS_ATTR] = _ClientPins(client)
    return state


def _pinnable(client: Any, request: Any) -> str | None:
    """The session id of a request this module pins, else None."""
    session_id = getattr(request, "session_id", None)
    if not isinstance(session_id, str) or not session_id:
        return None
    if request.data_parallel_rank is not None or request.pooling_params is not None:
        return None  # the caller named a rank, or vLLM routes pooling requests itself
    if request.request_id in client.reqs_in_flight:
        return None  # a streaming-input request's next chunk: vLLM keeps it on its core
    return session_id


def _wrap_get_core_engine(original: Any) -> Any:
    def get_core_engine_for_request(self: Any, request: Any) -> Any:
        session_id = _pinnable(self, request)
        if session_id is None:
            return original(self, request)
        state = _client_pins(self)
        rank = state.pins.get(session_id)
        if rank is not None and rank < len(self.core_engines):
            request.data_parallel_rank = rank
            state.pins.counters["pinned"] += 1
            return original(self, request)
        engine = original(self, request)  # vLLM's own balancer places the first turn
        rank = self.core_engines.index(engine)
        state.pins.set(session_id, rank)
        state.pins.counters["placed"] += 1
        if state.shared:
            _record(self, state, session_id, rank)
        return engine

    get_core_engine_for_request.__wrapped__ = original  # type: ignore[attr-defined]
    return get_core_engine_for_request


def _wrap_add_request(original: Any) -> Any:
    async def add_request_async(self: Any, request: Any) -> None:
        session_id = _pinnable(self, request)
        if session_id is not None:
            state = _client_pins(self)
            if state.shared and state.pins.get(session_id) is None:
                rank = await _ask(self, state, session_id)
                if rank is not None:
                    state.pins.set(session_id, rank)
                    state.pins.counters["learned"] += 1
        return await original(self, request)

    add_request_async.__wrapped__ = original  # type: ignore[attr-defined]
    return add_request_async


def _wrap_call_utility(original: Any) -> Any:
    async def call_utility_async(self: Any, method: str, *args: Any) -> Any:
        answer = await original(self, method, *args)
        if method == "session_gate_finish" and args and isinstance(args[0], str):
            state = self.__dict__.get(CLIENT_PINS_ATTR)
            if state is not None:
                state.pins.forget(args[0])
        return answer

    call_utility_async.__wrapped__ = original  # type: ignore[attr-defined]
    return call_utility_async


async def _ask(client: Any, state: _ClientPins, session_id: str) -> int | None:
    """The authority's rank for the session (None: unknown, or the authority failed)."""
    try:
        rank = await client._call_utility_async(
            "session_gate_dp_pin", session_id, None, engine=client.core_engines[0]
        )
    except Exception as exc:  # noqa: BLE001 - vLLM's balancer places the turn instead
        _warn_once(state, exc)
        return None
    return rank if isinstance(rank, int) and 0 <= rank < len(client.core_engines) else None


def _record(client: Any, state: _ClientPins, session_id: str, rank: int) -> None:
    """Tells the authority where this process placed the session (without waiting); if another
    process pinned it first, the authority's rank replaces this one for the next turns."""

    async def record() -> None:
        try:
            pinned = await client._call_utility_async(
                "session_gate_dp_pin", session_id, rank, engine=client.core_engines[0]
            )
        except Exception as exc:  # noqa: BLE001 - the local pin stands
            _warn_once(state, exc)
            return
        if isinstance(pinned, int) and pinned != rank and state.pins.get(session_id) == rank:
            state.pins.set(session_id, pinned)
            state.pins.counters["overruled"] += 1

    task = asyncio.get_running_loop().create_task(record())
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)


async def rank_for_lease(client: Any, session_id: str) -> int:
    """The rank a lease door's admit for ``session_id`` goes to (``dp_leases``), pinned there so
    that the turn's request follows it: the session's pin in this process; else, with several
    API-server processes, the authority's; else the least-loaded rank by vLLM's own load view
    (:func:`least_loaded`), recorded with the authority (awaited: the lease lands on the rank
    it answers, which is another process's when that one pinned the session first)."""
    state = _client_pins(client)
    n = len(client.core_engines)
    rank = state.pins.get(session_id)
    if rank is None and state.shared:
        rank = await _ask(client, state, session_id)
        if rank is not None:
            state.pins.counters["learned"] += 1
    if rank is None or rank >= n:
        rank = least_loaded(client, state)
        state.pins.counters["lease_placed"] += 1
        if state.shared:
            try:
                pinned = await client._call_utility_async(
                    "session_gate_dp_pin", session_id, rank, engine=client.core_engines[0]
                )
            except Exception as exc:  # noqa: BLE001 - the local choice stands
                _warn_once(state, exc)
                pinned = rank
            if isinstance(pinned, int) and 0 <= pinned < n:
                rank = pinned
    state.pins.set(session_id, rank)
    return rank


def least_loaded(client: Any, state: _ClientPins | None = None) -> int:
    """The rank vLLM's balancer would think least loaded: the coordinator's waiting + running
    (``lb_engines``) or this process's requests in flight there, whichever is more, as vLLM's
    own ``get_core_engine_for_request`` reads them; ties go to the rank with the fewest
    sessions pinned in this process (a burst of new sessions on idle ranks spreads), then the
    lowest rank. Read only: vLLM's counters are not touched."""
    engines = client.core_engines
    counts = getattr(client, "lb_engines", None) or []
    inflight = getattr(client, "engine_inflight", None) or {}
    client_count = int(getattr(client, "client_count", 1))
    pinned = state.pins.sessions_by_rank() if state is not None else Counter()

    def load(rank: int) -> tuple[float, int, int]:
        waiting_running = sum(counts[rank][:2]) if rank < len(counts) else 0
        own = client_count * inflight.get(engines[rank], 0)
        return (max(own, waiting_running), pinned[rank], rank)

    return min(range(len(engines)), key=load)


def _warn_once(state: _ClientPins, exc: BaseException) -> None:
    if not state.warned:
        state.warned = True
        logger.warning(
            "session_gate: the DP pin authority (first engine core) did not answer, "
            "pins are this process's own: %r",
            exc,
        )


def client_stats(client: Any) -> dict[str, int]:
    """A balancing client's pins and counters (``placed``, ``pinned``, ``learned``,
    ``overruled``, ``forgotten``, ``evicted``); empty before its first pinned request."""
    state = client.__dict__.get(CLIENT_PINS_ATTR)
    if state is None:
        return {}
    return {"pins": len(state.pins), **state.pins.counters}


def install() -> None:
    """Wraps vLLM's DP balancing client and adds the authority's utility methods to
    ``EngineCore`` (idempotent; in every process: each class is used only where it lives)."""
    global installed
    if installed:
        return
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    from session_gate.engine.utility import Utility

    client = DPLBAsyncMPClient
    client.get_core_engine_for_request = _wrap_get_core_engine(client.get_core_engine_for_request)
    client.add_request_async = _wrap_add_request(client.add_request_async)
    client.call_utility_async = _wrap_call_utility(client.call_utility_async)
    EngineCore.session_gate_dp_pin = Utility(session_gate_dp_pin)
    installed = True
