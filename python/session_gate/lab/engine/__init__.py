"""The lab's engine side: tiny CPU engines and servers for tests, demos and benchmarks
(``launch``, ``serve``, ``tiny_tokenizer``, ``vllm_serve``, ``inprocess``), and the measurements
that run against vLLM (``bench_*``, ``gate_splits``, ``step_timing``, ``metrics``). Every
``import vllm`` of lab code lives in this folder."""
