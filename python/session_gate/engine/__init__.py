"""The engine half: everything that imports vLLM lives in this folder.

``plugin.register`` is the ``vllm.general_plugins`` entry point; ``methods`` adds the
``session_gate_*`` utility methods to vLLM's ``EngineCore``; ``ledger`` lists every vLLM symbol the
plugin touches; ``launch`` builds the tiny CPU engines used by tests, the demo and benchmarks.
"""
