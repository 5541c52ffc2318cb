"""The twin's lab: fit its profile to this machine (``calibrate``), compare it with the real CPU
engine (``fidelity``) and time it (``speed``). The twin's CLI itself is ``session_gate.sim``."""
