"""``make bench-probe``: what a probe costs inside vLLM's engine loop, against vLLM's own Python.

Two settings, both on vLLM's real data structures, each measured against its baseline in the
same run:

* **block 16** (the issue's setting): vLLM's ``BlockPool`` built in this process with
  ``hash_block_size=16`` and filled with the 32,768-token prompt's blocks through vLLM's own
  ``BlockHashToBlockMap.insert``. The CPU backend only runs block sizes that are multiples of 32,
  so this is the closest a CPU machine gets to a block-16 engine.
* **block 32 in a running engine**: a CPU engine (engine core in this process) that prefilled the
  prompt; probes go through the installed ``EngineCore.session_gate_*`` methods and their own
  ``engine_us`` timer.

The baseline (``vllm_python_ms``) is vLLM's hashing and lookup for the same prompt:
``hash_block_tokens`` per block (as ``request_block_hasher`` does) then ``get_cached_block`` per
block until the first miss (as ``FullAttentionManager.find_longest_cache_hit`` does).
Prints a table, then one JSON line last.
"""

from __future__ import annotations

import array
import json
import os
import platform
import random
import statistics
import time
from typing import Any

PROMPT_TOKENS = 32_768
TURN_TOKENS = 512
REPEATS = 30


def _median_us(fn, repeats: int = REPEATS) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return statistics.median(samples)


def _vllm_python_probe(hash_fn, get_cached_block, tokens: list[int], block: int):
    """vLLM's own path for one prompt: its request block hasher over a real ``Request``, then
    ``get_cached_block`` per block until the first miss. Returns a function timing one run."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(block, hash_fn)
    request = Request("bench", tokens, SamplingParams(max_tokens=1), None)

    def run() -> int:
        hit = 0
        for h in hasher(request)[: (len(tokens) - 1) // block]:
            if not get_cached_block(h, [0]):
                break
            hit += 1
        return hit * block

    return run


def bench_block_pool(block: int, prompt: list[int], grown: list[int]) -> dict[str, Any]:
    """Native probe vs vLLM's Python on a real ``BlockPool`` holding ``grown``'s blocks."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    from session_gate import _native

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    none_hash = kv_cache_utils.NONE_HASH
    n_blocks = len(grown) // block
    pool = BlockPool(num_gpu_blocks=n_blocks + 2, enable_caching=True, hash_block_size=block)
    for i, h in enumerate(_native.hash_blocks("sha256", none_hash, grown, block)):
        key = kv_cache_utils.make_block_hash_with_group_id(h, 0)
        pool.cached_block_hash_to_block.insert(key, pool.blocks[i + 1])
    cache = pool.cached_block_hash_to_block._cache
    budget = 256 * 1024 * 1024
    engine = _native.ProbeEngine("sha256", none_hash, block, 1 << 32, 1 << 20, budget)
    packed, packed_grown = (array.array("I", t).tobytes() for t in (prompt, grown))

    expect = (len(prompt) - 1) // block * block
    vllm_probe = _vllm_python_probe(hash_fn, pool.get_cached_block, prompt, block)
    assert engine.probe(cache, None, packed)[1] == expect
    assert vllm_probe() == expect

    full_us = _median_us(lambda: engine.probe(cache, None, packed))
    full_list_us = _median_us(lambda: engine.probe(cache, None, prompt))
    python_us = _median_us(vllm_probe, 10)

    counter = iter(range(10**9))

    def incremental() -> float:
        sid = f"inc-{next(counter)}"
        engine.probe(cache, sid, packed)
        t0 = time.perf_counter_ns()
        engine.probe(cache, sid, packed_grown)
        return (time.perf_counter_ns() - t0) / 1000.0

    incremental_us = statistics.median(incremental() for _ in range(REPEATS))
    lookups_only_us = _median_us(lambda: engine.probe(cache, "warm", packed_grown))

    chain = _native.ProbeEngine("sha256", none_hash, block, 1 << 32, 1 << 20, budget)
    for s in range(10_000):
        chain.probe(cache, f"s{s}", packed)
    return {
        "block_size": block,
        "full_probe_ms": full_us / 1000.0,
        "full_probe_list_input_ms": full_list_us / 1000.0,
        "vllm_python_ms": python_us / 1000.0,
        "speedup": python_us / full_us,
        "incremental_probe_us": incremental_us,
        "rewalk_cached_chain_us": lookups_only_us,
        "chain_cache_bytes_10k": chain.chain_cache_bytes,
        "chain_cache_sessions_10k": chain.chain_cache_sessions,
        "chain_cache_budget_bytes": budget,
    }


def bench_engine(prompt: list[int], grown: list[int]) -> dict[str, Any]:
    """The same probes through the installed utility methods of a running CPU engine (block 32)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    from session_gate.engine.launch import generate, make_llm

    block = 32
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    llm = make_llm(
        num_blocks=len(grown) // block + 64,
        block_size=block,
        max_model_len=len(grown) + 64,
        max_num_batched_tokens=8192,
    )
    try:
        core = llm.llm_engine.engine_core.engine_core
        generate(llm, grown)
        packed, packed_grown = (array.array("I", t).tobytes() for t in (prompt, grown))
        answer = core.session_gate_probe(None, packed)
        assert answer["hit_tokens"] == (len(prompt) - 1) // block * block, answer

        def engine_us(method: str, *args) -> float:
            return statistics.median(
                getattr(core, method)(*args)["engine_us"] for _ in range(REPEATS)
            )

        counter = iter(range(10**9))

        def incremental() -> float:
            sid = f"inc-{next(counter)}"
            core.session_gate_probe(sid, packed)
            return core.session_gate_probe(sid, packed_grown)["engine_us"]

        pool = core.scheduler.kv_cache_manager.block_pool
        hash_fn = get_hash_fn_by_name("sha256")
        vllm_probe = _vllm_python_probe(hash_fn, pool.get_cached_block, prompt, block)
        assert vllm_probe() == answer["hit_tokens"]
        python_us = _median_us(vllm_probe, 10)
        full_us = engine_us("session_gate_probe", None, packed)
        return {
            "block_size": block,
            "full_probe_ms": full_us / 1000.0,
            "vllm_python_ms": python_us / 1000.0,
            "speedup": python_us / full_us,
            "incremental_probe_us": statistics.median(incremental() for _ in range(REPEATS)),
            "usage_probe_us": engine_us("session_gate_usage"),
            "num_cached_blocks": len(pool.cached_block_hash_to_block),
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 4096) for _ in range(PROMPT_TOKENS)]
    grown = prompt + [rng.randrange(3, 4096) for _ in range(TURN_TOKENS)]
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"prompt {PROMPT_TOKENS} tokens + a {TURN_TOKENS}-token turn; sha256; "
        f"median of {REPEATS}"
    )
    pool16 = bench_block_pool(16, prompt, grown)
    engine32 = bench_engine(prompt, grown)
    for name, row in (("BlockPool, block 16", pool16), ("engine, block 32", engine32)):
        print(f"\n{name}:")
        for key, value in row.items():
            print(
                f"  {key:<28} {value:,.3f}"
                if isinstance(value, float)
                else f"  {key:<28} {value:,}"
            )
    result = {
        "full_probe_ms": pool16["full_probe_ms"],
        "vllm_python_ms": pool16["vllm_python_ms"],
        "speedup": pool16["speedup"],
        "incremental_probe_us": pool16["incremental_probe_us"],
        "usage_probe_us": engine32["usage_probe_us"],
        "chain_cache_bytes_10k": pool16["chain_cache_bytes_10k"],
        "engine_block32": engine32,
        "block_pool_block16": pool16,
    }
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
