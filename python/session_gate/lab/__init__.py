"""The lab: benchmarks, the twin's calibration and fidelity checks, soak runs, demos and test
fixtures. None of it ships in the wheel (``[tool.maturin] exclude`` in ``pyproject.toml``); it
runs from a checkout (``python -m session_gate.lab.bench``, ``python -m session_gate.lab.soak``,
``python -m session_gate.lab.sim.calibrate`` ...; the Makefile names each). The product
(``session_gate`` outside this folder) never imports from here.
"""
