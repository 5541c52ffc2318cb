"""The replica twin: the real gate core against a modelled vLLM replica, in virtual time.

``python -m session_gate.sim`` runs workloads (the bench's, traces, and the GPU-scale ones) on
a profile (``cpu-tiny``, ``h200-qwen2.5-7b``, ...) in every mode and prints the bench's table;
``python -m session_gate.sim tune`` sweeps the gate's knobs on a trace. Results are always
labelled as simulated (``engine: "twin:<profile>"``). The model itself is Rust (``src/sim``);
:func:`session_gate.sim.twin.run_twin` runs one mode of one workload through it.
"""
