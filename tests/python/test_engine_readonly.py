"""Probes are read-only: the block pool is bit-for-bit the same before and after a burst of probes.

Runs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the test can look at
the block pool directly, and uses the ``xxhash`` algorithm, whose NONE_HASH is random per process,
to check that the native path follows the engine's own seed.
"""

from __future__ import annotations

import os
import random

import pytest
from conftest import pool_snapshot, random_prompt, run_prompt
from session_gate.lab.engine.launch import make_llm

BLOCK = 32


@pytest.fixture(scope="module")
def llm():
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        engine = make_llm(num_blocks=48, block_size=BLOCK, hash_algo="xxhash")
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    yield engine
    engine.llm_engine.engine_core.shutdown()


def engine_core(llm):
    return llm.llm_engine.engine_core.engine_core


def snapshot(core) -> dict:
    """The block pool's state (see ``pool_snapshot``) and the scheduler's queues."""
    return {
        **pool_snapshot(core.scheduler.kv_cache_manager),
        "waiting": len(core.scheduler.waiting),
        "running": len(core.scheduler.running),
    }


def test_a_burst_of_probes_changes_nothing_in_the_block_pool(llm):
    rng = random.Random(3)
    core = engine_core(llm)
    prompts = [random_prompt(rng, n) for n in (5 * BLOCK + 3, 9 * BLOCK, 14 * BLOCK + 31)]
    for p in prompts[:2]:
        run_prompt(llm, p, max_tokens=3)
    before = snapshot(core)
    assert before["map"], "the cache should hold prefixes before probing"
    for i in range(300):
        p = prompts[i % 3]
        core.session_gate_probe(f"s{i % 7}", p[: len(p) - (i % 5)])
        core.session_gate_usage(i % 2 == 0)
    core.session_gate_forget("s1")
    assert snapshot(core) == before


def test_native_probe_follows_the_engines_random_none_hash(llm):
    core = engine_core(llm)
    prompt = random_prompt(random.Random(5), 7 * BLOCK + 2)
    run_prompt(llm, prompt)
    answer = core.session_gate_probe("xx", prompt)
    assert answer["path"] == "native"
    assert answer["hit_tokens"] == run_prompt(llm, prompt) == 7 * BLOCK


def test_usage_counts_exactly_the_free_blocks_that_still_hold_a_prefix(llm):
    core = engine_core(llm)
    rng = random.Random(8)
    for n in (4 * BLOCK + 1, 11 * BLOCK + 7, 6 * BLOCK):
        run_prompt(llm, random_prompt(rng, n), max_tokens=2)
        pool = core.scheduler.kv_cache_manager.block_pool
        by_block = pool.cached_block_hashes_by_block
        expected = sum(
            1
            for b in pool.blocks
            if b.ref_cnt == 0 and (b.block_hash is not None or b.block_id in by_block)
        )
        usage = core.session_gate_usage(True)
        assert expected > 0
        assert core.session_gate_usage()["num_cached_free_blocks"] is None
        assert usage["num_cached_free_blocks"] == expected
        assert usage["kv_cache_usage"] == pool.get_usage()
        assert usage["num_free_blocks"] == pool.get_num_free_blocks()
