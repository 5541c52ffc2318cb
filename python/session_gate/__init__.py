"""session-gate: session-level admission control for agentic rollouts on vLLM.

The engine half (``session_gate.engine``) runs inside vLLM's engine core and answers residency
probes; the gate decides when a session's next turn may reach vLLM::

    from session_gate import SessionGate, GateConfig, EngineProbe, AdmissionPreempted

    gate = SessionGate(probe=EngineProbe(async_llm), config=GateConfig(high_watermark=0.85))
    async with gate.admit(session_id, prompt_ids, max_tokens=512) as lease:
        ...                      # lease.reason, .wait_sec, .usage, .hit_ratio, .retain_session
    await gate.finish_session(session_id)

Names are imported lazily: vLLM loads this package in its engine core (through the plugin),
where the gate's driver is never used and the native module may even be missing — the plugin
must still load and report why its probes are unavailable.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._native import GateConfig
    from .errors import AdmissionPreempted, SessionGateError
    from .gate import Lease, SessionGate
    from .http_gate import HttpGate
    from .http_probe import HttpProbe
    from .probes import EngineProbe, Probe
    from .remote_gate import AdmissionExpired, EngineGate, RemoteLease

__all__ = [
    "AdmissionExpired",
    "AdmissionPreempted",
    "EngineGate",
    "EngineProbe",
    "GateConfig",
    "HttpGate",
    "HttpProbe",
    "Lease",
    "Probe",
    "RemoteLease",
    "SessionGate",
    "SessionGateError",
]

_HOME = {
    "AdmissionExpired": "remote_gate",
    "AdmissionPreempted": "errors",
    "EngineGate": "remote_gate",
    "HttpGate": "http_gate",
    "EngineProbe": "probes",
    "GateConfig": "_native",
    "HttpProbe": "http_probe",
    "Lease": "gate",
    "Probe": "probes",
    "RemoteLease": "remote_gate",
    "SessionGate": "gate",
    "SessionGateError": "errors",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'session_gate' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
