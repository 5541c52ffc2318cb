"""A finished session's own blocks are evicted first (``session_gate.engine.finished_blocks``).

The rule on vLLM's own free queue and blocks (the hash map stood in for by a dict), then on a
real CPU engine: an idle session's prefix, freed before a finished session's, survives an
allocation that vLLM's LRU order would have taken it for.

The engine: 64 blocks of 32 tokens (63 usable), plain (no scheduler mode), in-process
``AsyncLLM`` with its engine core in its own process.
"""

from __future__ import annotations

import itertools

import pytest
import pytest_asyncio
from conftest import word_ids
from session_gate.engine import finished_blocks
from session_gate.engine.finished_blocks import FinishedBlocks
from session_gate.lab.engine.launch import agenerate, make_async_llm
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

BLOCK = 32  # the CPU backend takes multiples of 32


class _Map:
    """vLLM's ``BlockHashToBlockMap`` reduced to the one call the rule makes."""

    def __init__(self) -> None:
        self.blocks: dict[object, KVCacheBlock] = {}

    def get_one_block(self, key: object) -> KVCacheBlock | None:
        return self.blocks.get(key)


class _Pool:
    def __init__(self, n: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(n)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = _Map()


class _Request:
    def __init__(self, hashes: list[bytes], prompt_tokens: int) -> None:
        self.block_hashes = hashes
        self.prompt_token_ids = list(range(prompt_tokens))


def _hashes(session: str, n: int) -> list[bytes]:
    return [f"{session}-{i}".encode() for i in range(n)]


def _free_ids(pool: _Pool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _pool_with(sessions: dict[str, int]) -> _Pool:
    """A pool whose blocks 0.. hold each session's hashes in order (all free, in id order)."""
    pool = _Pool(sum(sessions.values()) + 2)
    ids = itertools.count()
    for session, n in sessions.items():
        for h in _hashes(session, n):
            pool.cached_block_hash_to_block.blocks[h] = pool.blocks[next(ids)]
    return pool


def _rule(pool: _Pool) -> FinishedBlocks:
    return FinishedBlocks(pool, BLOCK, lambda h: h)


def test_blocks_past_the_first_prompt_go_to_the_front_deepest_first():
    pool = _pool_with({"a": 6, "b": 4})  # a: blocks 0-5, b: 6-9, then 10 and 11 unused
    rule = _rule(pool)
    rule.record("a", _Request(_hashes("a", 3), prompt_tokens=2 * BLOCK + 5))  # first: 2 blocks
    rule.record("a", _Request(_hashes("a", 6), prompt_tokens=5 * BLOCK))  # its last request
    assert rule.evict_first("a") == 4
    assert _free_ids(pool) == [5, 4, 3, 2, 0, 1, 6, 7, 8, 9, 10, 11]
    assert rule.counters["finished_blocks_evicted_first"] == 4
    assert rule.evict_first("a") == 0, "a session is moved once, then forgotten"
    assert rule.evict_first("b") == 0, "b was never recorded"


def test_blocks_in_use_and_hashes_no_longer_cached_stay_where_they_are():
    pool = _pool_with({"a": 4})
    rule = _rule(pool)
    rule.record("a", _Request(_hashes("a", 1), prompt_tokens=0))
    rule.record("a", _Request(_hashes("a", 4), prompt_tokens=3 * BLOCK))
    # Block 2 is held by a running request (out of the free queue, ref count 1); hash a-3 was
    # evicted and its block reused.
    pool.free_block_queue.remove(pool.blocks[2])
    pool.blocks[2].ref_cnt = 1
    del pool.cached_block_hash_to_block.blocks[b"a-3"]
    assert rule.evict_first("a") == 2
    assert _free_ids(pool) == [1, 0, 3, 4, 5]


def test_at_most_max_sessions_are_remembered(monkeypatch):
    monkeypatch.setattr(finished_blocks, "MAX_SESSIONS", 2)
    pool = _pool_with({"a": 2, "b": 2, "c": 2})
    rule = _rule(pool)
    for s in "abc":
        rule.record(s, _Request(_hashes(s, 2), prompt_tokens=0))
    assert rule.sessions == 2 and rule.counters["finished_sessions_forgotten"] == 1
    assert rule.evict_first("a") == 0, "the least recently freed session was dropped"
    assert rule.evict_first("c") == 2


def test_a_request_without_full_blocks_records_nothing():
    rule = _rule(_pool_with({}))
    rule.record("a", _Request([], prompt_tokens=3))
    assert rule.sessions == 0


# -- the real engine ----------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    llm = make_async_llm(num_blocks=64, block_size=BLOCK)
    try:
        yield llm
    finally:
        llm.shutdown()


async def utility(llm, name: str, *args):
    return await llm.engine_core.call_utility_async(name, *args)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_idle_sessions_prefix_outlives_a_finished_sessions_blocks(engine):
    await engine.reset_prefix_cache()
    # The idle session: 20 blocks, freed first (vLLM's LRU would evict them first).
    idle = word_ids(1, 20 * BLOCK)
    await agenerate(engine, idle, 1, "idle-1", session_id="idle")
    # The finished session: a 4-block first prompt, then a 20-block second turn.
    done = word_ids(2, 4 * BLOCK)
    out, _ = await agenerate(engine, done, BLOCK, "done-1", session_id="done")
    done = done + out + word_ids(3, 20 * BLOCK - len(done) - len(out))
    _, cached = await agenerate(engine, done, 1, "done-2", session_id="done")
    assert cached >= 4 * BLOCK, "the second turn continues the first"
    # Its end: the 16 blocks past its first prompt go to the front of the free queue.
    await utility(engine, "session_gate_forget", "done")
    stats = (await utility(engine, "session_gate_stats", "json"))["engine_gate"]
    assert stats["finished_sessions_evicted_first"] == 1
    assert stats["finished_blocks_evicted_first"] == 16
    # 33 new blocks: the 23 never used and 10 more. In LRU order those 10 would be the idle
    # session's (its tail first), here they are the finished session's.
    await agenerate(engine, word_ids(4, 33 * BLOCK - 8), 1, "filler")
    _, cached = await agenerate(engine, idle + word_ids(5, BLOCK), 1, "idle-2", session_id="idle")
    assert cached == 20 * BLOCK
    # The finished session's first prompt stayed (other sessions may share it); the blocks
    # past it went to the filler.
    _, cached = await agenerate(engine, done, 1, "done-3")
    assert cached == 4 * BLOCK
