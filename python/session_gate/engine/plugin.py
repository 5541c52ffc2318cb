"""``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process that loads general plugins (API server, engine core,
workers), possibly more than once. Registration is idempotent and never raises: a plugin that
fails logs a warning, disables itself, and lets vLLM serve.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("session_gate")

_registered = False


def register() -> None:
    """Add the session_gate utility methods (probes, then the engine gate) to vLLM's
    ``EngineCore``, the session pins of data parallelism to its DP balancing client
    (``dp_pin``), and with ``SESSION_GATE_SCHEDULER=session-id`` the gate in its scheduler
    (``gate_scheduler``), once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from session_gate.engine.methods import install

        install()
    except Exception as exc:  # never take vLLM down with us
        logger.warning("session_gate: plugin disabled, vLLM serves without probes: %r", exc)
    try:
        from session_gate.engine.dp_pin import install as install_dp_pin

        install_dp_pin()
    except Exception as exc:  # DP serves unpinned, as vLLM alone does
        logger.warning("session_gate: sessions are not pinned to DP ranks: %r", exc)
    try:
        from session_gate.engine.gate_methods import install as install_gate

        install_gate()
    except Exception as exc:  # the probes stay up without the engine gate
        logger.warning("session_gate: engine gate disabled, vLLM serves without it: %r", exc)
        return
    try:
        from session_gate.engine.gate_scheduler import install as install_scheduler

        install_scheduler()
    except Exception as exc:  # a bad SESSION_GATE_SCHEDULER: the other doors stay up
        logger.error("session_gate: scheduler mode disabled, requests are not gated: %s", exc)
