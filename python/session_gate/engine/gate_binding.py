"""A lease bound to the vLLM request it admitted: the engine core releases it when that request
ends, with no release call (zero IPC).

The gating middleware (``gate_middleware``) holds a gated request at ``engine_client.generate``
until its admit is answered; there it puts the lease id into the request's
``SamplingParams.extra_args`` under :data:`LEASE_KEY` (:func:`bind`), which travels to the engine
core inside the ``EngineCoreRequest``. In the engine core, ``Scheduler._free_request`` is the one
place every request passes when it ends: finished (``update_from_output``) or aborted
(``finish_requests``: a client that went away, an API server's abort). It is wrapped once
(:func:`install`): after vLLM's own freeing, a request carrying a bound lease releases it in the
engine gate's book (``EngineGateDriver.release_bound``). A request without one costs one
attribute read and a truthiness test (``extra_args`` is None for almost every request). A request
that carries vLLM's own ``session_id`` also leaves its block hashes to ``finished_blocks``, which
evicts a finished session's blocks first.

Exactly once. The middleware skips its own release for a request whose generate yielded an
output (the engine core had it, so its end passes ``_free_request``); for anything else (a 4xx
before generate, a refusal, a client gone before the engine answered) it releases as before. A
lease released twice is released once: the book's second release of a lease finds nothing and
changes nothing (``bound_releases_unknown`` counts those on the engine side).

Never raises into the scheduler: a failed release is logged and counted as a tick error.
"""

from __future__ import annotations

import logging
from typing import Any

from session_gate.engine import finished_blocks

logger = logging.getLogger("session_gate")

#: The key of ``SamplingParams.extra_args`` that carries a bound lease id.
LEASE_KEY = "session_gate_lease"
#: Whether this process's ``Scheduler._free_request`` is wrapped (set by :func:`install`).
installed = False
#: Where the engine core's scheduler keeps its engine gate driver (set when the driver is built).
SCHEDULER_DRIVER_ATTR = "_session_gate_driver"
#: Where it keeps its scheduler-mode gate (``gate_scheduler.SCHEDULER_GATE_ATTR``).
SCHEDULER_GATE_ATTR = "_session_gate_scheduler_gate"


def bind(sampling_params: Any, lease: int) -> bool:
    """Puts ``lease`` into ``sampling_params.extra_args`` (a new dict: the caller's is not
    mutated); False (nothing bound) when the request fans out into several engine requests
    (``n`` > 1), whose first end would free the lease while its siblings still run."""
    if getattr(sampling_params, "n", 1) != 1 or not hasattr(sampling_params, "extra_args"):
        return False
    extra = sampling_params.extra_args
    sampling_params.extra_args = {**extra, LEASE_KEY: lease} if extra else {LEASE_KEY: lease}
    return True


def attach(scheduler: Any, driver: Any) -> None:
    """Lets ``scheduler``'s request freeing reach ``driver`` (engine core, once per driver)."""
    if scheduler is not None:
        scheduler.__dict__[SCHEDULER_DRIVER_ATTR] = driver


def _wrap_free_request(original: Any) -> Any:
    # vLLM 0.31-0.33's signature, spelled out: forwarding *args/**kwargs cost 2x the frame.
    def _free_request(self: Any, request: Any, delay_free_blocks: bool = False) -> Any:
        result = original(self, request, delay_free_blocks)
        params = request.sampling_params
        if params is not None and params.extra_args:
            _release_bound(self, params.extra_args)
        gate = self.__dict__.get(SCHEDULER_GATE_ATTR)
        if gate is not None:  # scheduler mode (gate_scheduler): its lease or its held admit
            _free_scheduled(gate, request)
        session_id = getattr(request, "session_id", None)  # vLLM 0.31+
        if session_id:  # its blocks are its session's newest (finished_blocks)
            _record_session_blocks(self, session_id, request)
        return result

    _free_request.__wrapped__ = original  # type: ignore[attr-defined]
    return _free_request


def _release_bound(scheduler: Any, extra_args: dict[str, Any]) -> None:
    lease = extra_args.get(LEASE_KEY)
    if lease is None:
        return
    driver = scheduler.__dict__.get(SCHEDULER_DRIVER_ATTR)
    if driver is None:  # no engine gate here (another engine's lease): nothing to release
        return
    try:
        driver.release_bound(lease)
    except Exception:  # noqa: BLE001 - never take the scheduler down
        driver.counters["tick_errors"] += 1
        logger.exception("session_gate: releasing lease %r bound to a request failed", lease)


def _record_session_blocks(scheduler: Any, session_id: Any, request: Any) -> None:
    finished = finished_blocks.of_scheduler(scheduler)
    if finished is None or not isinstance(session_id, str):
        return
    try:
        finished.record(session_id, request)
    except Exception:  # noqa: BLE001 - never take the scheduler down
        logger.exception("session_gate: recording the blocks of session %r failed", session_id)


def _free_scheduled(gate: Any, request: Any) -> None:
    try:
        gate.free(request)
    except Exception:  # noqa: BLE001 - never take the scheduler down
        gate.counters["errors"] += 1
        logger.exception("session_gate: freeing the scheduler's hold of %r failed", request)


def install() -> bool:
    """Wraps ``Scheduler._free_request`` (idempotent); False, with a warning, if this vLLM has
    none. Then the driver does not say ``binds_requests`` in its renewals, the middleware binds
    nothing and releases as before."""
    global installed
    from vllm.v1.core.sched.scheduler import Scheduler

    if installed:
        return True
    original = getattr(Scheduler, "_free_request", None)
    if original is None:
        logger.warning(
            "session_gate: Scheduler._free_request not found: leases are released by their "
            "clients' calls only"
        )
        return False
    Scheduler._free_request = _wrap_free_request(original)
    installed = True
    return True
