"""session-gate: session-level admission control for agentic rollouts on vLLM.

The engine half (``session_gate.engine``) runs inside vLLM's engine core and answers residency
probes; the gate decides when a session's next turn may reach vLLM.
"""

from __future__ import annotations

__all__: list[str] = []
