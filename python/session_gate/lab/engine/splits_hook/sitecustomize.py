"""Lab only: a process started with this folder on ``PYTHONPATH`` times the engine gate's
admit and release calls (``session_gate.lab.engine.gate_splits``; see its docstring). Python
runs ``sitecustomize`` at start-up, so vLLM's engine processes pick it up with no flag of ours."""

from session_gate.lab.engine import gate_splits

gate_splits.hook_plugin()
