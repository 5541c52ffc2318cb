"""The engine gate's utility methods on vLLM's ``EngineCore``: ``session_gate_admit``,
``…_release``, ``…_cancel``, ``…_finish``, ``…_renew`` and ``…_stats``.

They run as ``EngineCoreRequestType.UTILITY`` calls on the engine core's thread, like the probes
(``methods``), and drive one ``EngineGateDriver`` per engine core (``gate_driver``): every client,
proxy and API-server process of the replica shares that one gate. ``session_gate_admit`` answers
at once when the core admits (or preempts) straight away, and otherwise returns a
``concurrent.futures.Future`` that vLLM answers when the gate resolves it later.

Answers of ``session_gate_admit`` (a dict, ``status`` first):

- ``admitted``: ``lease``, ``reason``, ``wait_sec``, ``usage``, ``pressure``, ``hit_ratio``,
  ``retain_session``, ``reserved``, ``revoked``, ``working_set_blocks``, ``num_preempted``;
- ``preempted``: a newer admit of the same session took over (``num_preempted``);
- ``cancelled``: ``session_gate_cancel(ticket)`` withdrew it;
- ``expired``: its client stopped calling for ``lease_ttl_sec`` (see ``gate_driver``).

Knobs: ``GateConfig.from_env()`` (``SESSION_GATE_*`` in the engine's environment) and
``SESSION_GATE_LEASE_TTL_SEC`` (through the native knob table, ``knob_from_env``), read once,
when the first call arrives. Bad arguments raise a
``ValueError`` starting with ``BAD_GATE_INPUT`` and naming the argument; vLLM turns that into
the call's failure message and the engine keeps serving.

Engine-loop cost: ``admit`` and ``release`` are the native ``EngineGateBook`` methods
themselves, bound so that vLLM's per-call ``inspect.signature`` is cheap (:class:`_Utility`);
``engine_us`` in an admit's answer and the ``*_loop_*`` stats are their own timings.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm.v1.engine.core import EngineCore

from session_gate.engine import dp_pin, finished_blocks, gate_binding, gate_scheduler, methods
from session_gate.engine.gate_driver import (
    BAD_GATE_INPUT,
    DRIVER_ATTR,
    EngineGateDriver,
)
from session_gate.engine.utility import Utility as _Utility

logger = logging.getLogger("session_gate")


class _Probes:
    """What the driver reads from this engine, in-process: the probes' own code (``methods``)
    and the block pool the native book reads usage from."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.block_pool = state.block_pool
        self.block_size = state.block_size
        self.vocab_size = state.vocab_size
        self.max_model_len = state.max_model_len
        #: The host KV tier, when the engine has one the probes can read (else ``None`` and
        #: ``tier_unavailable`` says why).
        self.tier = state.tier
        self.tier_unavailable = state.tier_unavailable
        #: vLLM's scheduler: the book counts its running and waiting requests, leaving out
        #: listed ones that are no longer in ``running_status``.
        self.scheduler = state.scheduler
        self.running_status = state.running_status

    @property
    def held_in_queue(self) -> tuple[Any, ...]:
        """What scheduler mode holds in the waiting queue, kept on the probes' state so the
        usage probe's counts leave it out too."""
        return self._state.held_in_queue

    @held_in_queue.setter
    def held_in_queue(self, held: tuple[Any, ...]) -> None:
        self._state.held_in_queue = held

    def tier_usage(self) -> tuple[int, int] | None:
        return self._state.tier_usage()

    def probe(self, session_id: str, token_ids: Any) -> dict[str, Any]:
        return self._state.probe(session_id, token_ids)

    def forget(self, session_id: str) -> bool:
        return self._state.forget(session_id)


def _checked(call: Any, *args: Any) -> Any:
    """Runs a driver call; bad arguments become one ValueError the HTTP routes answer 400
    (the native calls raise theirs that way already)."""
    try:
        return call(*args)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith(BAD_GATE_INPUT):
            raise
        raise ValueError(f"{BAD_GATE_INPUT}: {exc}") from None


def _driver(core: EngineCore) -> EngineGateDriver:
    driver = core.__dict__.get(DRIVER_ATTR)
    if driver is None:
        native, error = methods._load_native()
        if native is None:
            raise RuntimeError(f"the engine gate is unavailable: {error}")
        config = gate_scheduler.gate_config(native, native.GateConfig.from_env())
        driver = EngineGateDriver(
            core,
            _Probes(methods._state(core)),
            native,
            config,
            native.knob_from_env("lease_ttl_sec"),
        )
        core.__dict__[DRIVER_ATTR] = driver
        if gate_binding.installed:
            gate_binding.attach(getattr(core, "scheduler", None), driver)
            driver.binds_requests = True
        if gate_scheduler.installed:  # SESSION_GATE_SCHEDULER=session-id
            gate_scheduler.attach(getattr(core, "scheduler", None), driver)
        logger.info(
            "session_gate: engine gate up (%r, lease TTL %.1f s)", config, driver.lease_ttl_sec
        )
    return driver


def session_gate_admit(
    self: EngineCore,
    session_id: Any,
    token_ids: Any,
    max_tokens: Any,
    retain_session: Any = True,
    ticket: Any = None,
    client_id: Any = None,
) -> Any:
    """Admit one turn: a dict now, or a ``Future`` of it (see the module docstring).
    ``ticket`` (unique per attempt) lets ``session_gate_cancel`` withdraw it; ``client_id``
    names the caller whose silence for ``lease_ttl_sec`` frees what it holds.

    What vLLM calls is the native ``EngineGateBook.admit`` itself (see :class:`_Utility`),
    with these same arguments: it checks them, reads the clock and times itself."""
    return _driver(self).admit(session_id, token_ids, max_tokens, retain_session, ticket, client_id)


def session_gate_release(self: EngineCore, lease: Any, client_id: Any = None) -> bool:
    """Release a lease (its session keeps an idle grace window if it asked for one). What
    vLLM calls is the native ``EngineGateBook.release`` itself (see :class:`_Utility`)."""
    return _driver(self).release(lease, client_id)


def session_gate_cancel(self: EngineCore, ticket: Any, client_id: Any = None) -> bool:
    """Withdraw a pending admit (answered ``cancelled``), or release the lease it obtained
    if the admission raced the cancel. False if the ticket is unknown."""
    return _checked(_driver(self).cancel, ticket, client_id)


def session_gate_finish(self: EngineCore, session_id: Any, client_id: Any = None) -> bool:
    """End the session's ownership window now and drop its hash chain (and its DP pin, on
    the engine core that keeps the pins: ``dp_pin``)."""
    dp_pin.forget_in_core(self, session_id)
    return _checked(_driver(self).finish, session_id, client_id)


def session_gate_renew(self: EngineCore, client_id: Any) -> dict[str, Any]:
    """A client's heartbeat: keeps its leases and pending admits alive for ``lease_ttl_sec``."""
    return _checked(_driver(self).renew, client_id)


def session_gate_stats(self: EngineCore, fmt: Any = "json", build: Any = True) -> Any:
    """The gate's counters as a dict (``fmt="json"``) or Prometheus text (``"prometheus"``);
    ``"inferred"``: the scheduler mode's recent inferences (``infer``), a list of
    ``[request_id, session, kind]``, oldest first (empty in other modes). ``build=False``
    answers None while this engine has no gate yet instead of building one (a reader that must
    not start a gate: ``metrics_mirror``), except the Prometheus text of ``finished_blocks``,
    which needs no gate. The JSON has ``dp_pins`` on the engine core that
    keeps the DP pins' authority table, once it has one (``dp_pin``)."""
    if fmt not in ("json", "prometheus", "inferred"):
        raise ValueError(
            f'{BAD_GATE_INPUT}: fmt must be "json", "prometheus" or "inferred", got {fmt!r}'
        )
    driver = _driver(self) if build else self.__dict__.get(DRIVER_ATTR)
    if driver is None:
        # No gate, but sessions may still end here through the probes (a proxy's gates):
        # their blocks' counters are the engine's own.
        if fmt == "prometheus":
            return finished_blocks.prometheus_text(getattr(self, "scheduler", None))
        return None
    if fmt == "inferred":
        gate = driver.scheduler_gate
        return [list(row) for row in gate.recent_inferred] if gate is not None else []
    if fmt == "prometheus":
        return driver.prometheus()
    answer = driver.stats()
    pins = dp_pin.core_stats(self)
    if pins is not None:  # the first engine core of a DP engine with several API servers
        answer["dp_pins"] = pins
    return answer


UTILITY_METHODS = {
    "session_gate_admit": session_gate_admit,
    "session_gate_release": session_gate_release,
    "session_gate_cancel": session_gate_cancel,
    "session_gate_finish": session_gate_finish,
    "session_gate_renew": session_gate_renew,
    "session_gate_stats": session_gate_stats,
}


def _native_method(name: str, core: EngineCore) -> Any:
    """The driver's native method ``name`` (building the driver on the first call)."""
    return getattr(_driver(core), name)


def _wrap_post_step(original: Any) -> Any:
    def post_step(self: EngineCore, model_executed: bool) -> None:
        original(self, model_executed)
        # A busy engine never runs idle callbacks: the gate's timers tick here, between steps,
        # when the timer fired or its deadline passed (then it does not fire: no GIL hand-off).
        driver = self.__dict__.get(DRIVER_ATTR)
        if driver is not None and (driver.due or driver.take_due()):
            driver.due = True
            driver.tick_when_settled()

    post_step.__wrapped__ = original  # type: ignore[attr-defined]
    return post_step


def install() -> None:
    """Add the engine gate's methods and its post-step tick to ``EngineCore`` (idempotent)."""
    if getattr(EngineCore, "_session_gate_gate_installed", False):
        return
    for name, fn in UTILITY_METHODS.items():
        native = {"session_gate_admit": "admit", "session_gate_release": "release"}.get(name)
        # For admit and release vLLM calls the driver's native method itself.
        bind = None if native is None else functools.partial(_native_method, native)
        setattr(EngineCore, name, _Utility(fn, bind))
    EngineCore.post_step = _wrap_post_step(EngineCore.post_step)
    try:
        gate_binding.install()
    except Exception as exc:  # the gate works without it: clients release as before
        logger.warning("session_gate: leases are not bound to requests: %r", exc)
    EngineCore._session_gate_gate_installed = True
