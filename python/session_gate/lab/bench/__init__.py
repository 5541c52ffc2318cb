"""The thrash benchmark: agentic sessions with growing prompts against one CPU vLLM engine,
run with no gate, static session caps, the seed's gate and the default gate.

``python -m session_gate.lab.bench`` runs it (``make bench``, ``make demo``); see ``--help``.
"""
