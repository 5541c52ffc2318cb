"""The engine half (the vLLM plugin): everything of the product that imports vLLM lives here.

``plugin.register`` is the ``vllm.general_plugins`` entry point; ``methods`` adds the
``session_gate_*`` utility methods to vLLM's ``EngineCore``; ``gate_methods`` the engine gate's;
``http_routes`` and ``gate_routes`` are the ``vllm.endpoint_plugins`` routes; ``ledger`` lists
every vLLM symbol the plugin touches. Tiny engines for tests and benchmarks live in the lab
(``session_gate.lab.engine``).
"""
