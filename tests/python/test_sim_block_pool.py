"""The twin's block pool and KV-cache manager against vLLM 0.32's real ones, operation by
operation.

vLLM's ``KVCacheManager`` (with its ``BlockPool``, ``FreeKVCacheBlockQueue`` and one
full-attention group) is built in-process exactly as the scheduler builds it, over real
``Request`` objects hashed by vLLM's own block hasher; the twin's ``SimKvManager`` gets the same
operations with its integer block hashes. A long random sequence of request arrivals (prefix
lookup, then allocation with the full-prompt admission check), prefill chunks, decodes (an output
token appended, then one slot), frees (finish or preemption) and read-only lookups runs on both,
and after EVERY operation the free-queue order, the cached map, every ref count, the hit blocks
and every allocation's success must be identical. No engine, no GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from session_gate import _native

BLOCK = 16


def vllm_manager(num_blocks: int, max_model_len: int) -> Any:
    from session_gate.lab.engine.inprocess import make_kv_cache_manager

    return make_kv_cache_manager(num_blocks, BLOCK, max_model_len=max_model_len)


def vllm_hasher() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    return kv_cache_utils.get_request_block_hasher(BLOCK, sha256)


@dataclass
class Live:
    rid: int
    request: Any  # vllm.v1.request.Request
    tokens: list[int]
    twin_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    running: bool = False


class Pair:
    """Both managers plus the translation of vLLM's block hashes to the twin's ids."""

    def __init__(self, num_blocks: int, max_model_len: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_block_hash
        from vllm.v1.request import Request, RequestStatus

        self.Request, self.RequestStatus = Request, RequestStatus
        self.SamplingParams = SamplingParams
        self.get_block_hash = get_block_hash
        self.vllm = vllm_manager(num_blocks, max_model_len)
        self.twin = _native.SimKvManager(num_blocks, BLOCK, max_model_len)
        self.hasher = vllm_hasher()
        self.chain: dict[tuple[int, tuple[int, ...]], int] = {}
        self.to_twin: dict[Any, int] = {}
        self.hits = 0

    def twin_hashes(self, tokens: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(len(tokens) // BLOCK):
            key = (parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            parent = self.chain.setdefault(key, len(self.chain) + 1)
            out.append(parent)
        return out

    def sync_hashes(self, live: Live) -> None:
        live.twin_hashes = self.twin_hashes(live.tokens)
        assert len(live.request.block_hashes) == len(live.twin_hashes)
        for v, t in zip(live.request.block_hashes, live.twin_hashes, strict=True):
            assert self.to_twin.setdefault(v, t) == t

    def new_request(self, rid: int, tokens: list[int]) -> Live:
        params = self.SamplingParams(max_tokens=10_000, ignore_eos=True)
        req = self.Request(str(rid), list(tokens), params, None, block_hasher=self.hasher)
        live = Live(rid, req, list(tokens))
        self.sync_hashes(live)
        return live

    # -- operations (each returns what both sides said, already compared) -------------------

    def admit(self, live: Live, chunk: int) -> bool:
        blocks, hit_tokens = self.vllm.get_computed_blocks(live.request)[:2]
        want_hit = [b.block_id for b in blocks.blocks[0]]
        got_hit = self.twin.lookup(live.twin_hashes, len(live.tokens))
        assert got_hit == want_hit, "prefix hit differs"
        assert hit_tokens == len(want_hit) * BLOCK
        self.hits += len(want_hit)
        n = min(len(live.tokens) - hit_tokens, chunk)
        want = self.vllm.allocate_slots(
            live.request,
            n,
            num_new_computed_tokens=hit_tokens,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
        )
        got = self.twin.allocate(live.rid, 0, n, got_hit, len(live.tokens), live.twin_hashes, True)
        assert got == (want is not None), "admission differs"
        if got:
            live.request.status = self.RequestStatus.RUNNING
            live.num_computed = hit_tokens + n
            live.request.num_computed_tokens = live.num_computed
            live.running = True
        else:
            self.twin.free(live.rid)
        return got

    def advance(self, live: Live, chunk: int, rng: random.Random) -> bool:
        if live.num_computed >= len(live.tokens):
            token = rng.randrange(0, 64)  # small vocabulary: outputs collide across requests
            live.request.append_output_token_ids(token)
            live.tokens.append(token)
            self.sync_hashes(live)
        n = min(len(live.tokens) - live.num_computed, chunk)
        want = self.vllm.allocate_slots(live.request, n)
        got = self.twin.allocate(
            live.rid, live.num_computed, n, [], len(live.tokens), live.twin_hashes, False
        )
        assert got == (want is not None), "allocation differs"
        if got:
            live.num_computed += n
            live.request.num_computed_tokens = live.num_computed
        return got

    def free(self, live: Live) -> None:
        self.vllm.free(live.request)
        self.twin.free(live.rid)
        live.running = False

    def check(self, where: str) -> None:
        pool = self.vllm.block_pool
        want_queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert self.twin.free_queue() == want_queue, f"free queue differs after {where}"
        want_map = []
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            h = self.to_twin[self.get_block_hash(key)]
            ids = [blocks.block_id] if not isinstance(blocks, dict) else list(blocks)
            want_map += [(h, b) for b in ids]
        assert self.twin.cached_map() == sorted(want_map), f"cached map differs after {where}"
        want_refs = [b.ref_cnt for b in pool.blocks]
        got_refs = self.twin.ref_counts()
        assert got_refs[1:] == want_refs[1:], f"ref counts differ after {where}"
        free, cached_free, usage = self.twin.usage()
        assert free == pool.get_num_free_blocks()
        assert cached_free == sum(
            1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None and b.block_id
        )
        assert usage == pytest.approx(pool.get_usage())


def run_sequence(seed: int, ops: int, num_blocks: int) -> Pair:
    rng = random.Random(seed)
    max_model_len = (num_blocks - 1) * BLOCK
    pair = Pair(num_blocks, max_model_len)
    histories: list[list[int]] = []  # earlier sequences: prompts grow from them (agentic turns)
    live: list[Live] = []
    next_id = 0
    counts = {"admit": 0, "admit_fail": 0, "advance": 0, "advance_fail": 0, "free": 0}
    for i in range(ops):
        r = rng.random()
        running = [x for x in live if x.running]
        if r < 0.25 or not running:
            if histories and rng.random() < 0.7:
                base = rng.choice(histories)
                base = base[: rng.randrange(0, len(base) + 1)]
            else:
                base = []
            extra = rng.randrange(1, 6 * BLOCK)
            tokens = base + [rng.randrange(0, 64) for _ in range(extra)]
            tokens = tokens[: max_model_len - 8]
            x = pair.new_request(next_id, tokens)
            next_id += 1
            chunk = rng.choice([BLOCK, 3 * BLOCK + 5, 10_000])
            if pair.admit(x, chunk):
                live.append(x)
                counts["admit"] += 1
            else:
                counts["admit_fail"] += 1
            where = f"op {i}: admit {x.rid}"
        elif r < 0.85:
            x = rng.choice(running)
            chunk = rng.choice([1, BLOCK, 2 * BLOCK + 3, 10_000])
            if pair.advance(x, chunk, rng):
                counts["advance"] += 1
            else:
                # The scheduler would preempt: free it (recompute later from scratch).
                pair.free(x)
                live.remove(x)
                counts["advance_fail"] += 1
            where = f"op {i}: advance {x.rid}"
        elif r < 0.97:
            x = rng.choice(running)
            pair.free(x)
            live.remove(x)
            histories.append(list(x.tokens))
            histories = histories[-30:]
            counts["free"] += 1
            where = f"op {i}: free {x.rid}"
        else:
            # A read-only lookup (the prefix probe): nothing may change.
            if histories:
                x = pair.new_request(10**9 + i, rng.choice(histories))
                blocks, _ = pair.vllm.get_computed_blocks(x.request)[:2]
                got = pair.twin.lookup(x.twin_hashes, len(x.tokens))
                assert got == [b.block_id for b in blocks.blocks[0]]
            where = f"op {i}: lookup"
        pair.check(where)
    assert counts["admit_fail"] > 0 and counts["advance_fail"] > 0, counts  # pressure was real
    assert counts["free"] > 50, counts
    return pair


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_twin_block_pool_matches_vllm_after_every_operation(seed):
    pair = run_sequence(seed, ops=3000, num_blocks=64)
    assert pair.hits > 100  # prefix hits were exercised


def test_large_pool_long_sequence():
    pair = run_sequence(7, ops=4000, num_blocks=400)
    assert pair.hits > 200
