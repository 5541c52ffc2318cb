"""The twin's host KV tier against vLLM's real ``CPUOffloadingManager`` (LRU policy), operation
by operation.

vLLM's manager is the one its native offloading backend (``--kv-offloading-size``) runs in the
scheduler; it is built in-process with its default policy (``lru``, ``store_threshold`` 0). The
twin's ``SimHostTier`` gets the same operations with integer keys. A long random sequence of
requests over shared prefix chains offers blocks to store (``prepare_store``, evicting when
full), completes stores, looks up and loads leading runs of ready blocks (``prepare_load`` /
``complete_load``) and finishes requests (``on_request_finished``, which re-ranks what the
request touched); after EVERY operation the answers (stored keys, chunk ids, evicted keys, a
refusal), every key's lookup, the LRU eviction order and the chunk map must be identical. No
engine, no GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from session_gate import _native

BLOCK = 16


def require_vllm_032() -> None:
    """The twin models vLLM 0.32's LRU. 0.33 ranks a request's inserts together, tails before
    heads (``_RequestRank`` in ``cpu/policies/lru.py``), so its eviction order differs."""
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.32."):
        pytest.skip(f"the twin's host tier models vLLM 0.32's LRU, not {vllm.__version__}'s")


def vllm_key(key: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(key.to_bytes(8, "big"), 0)


@dataclass
class Req:
    rid: int
    chain: list[int]
    context: Any  # vllm.v1.kv_offload.base.ReqContext
    next_stored: int = 0
    loads: list[list[int]] = field(default_factory=list)
    finished: bool = False


class Pair:
    """vLLM's manager and the twin's tier, with the same operations applied to both."""

    def __init__(self, num_chunks: int) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.ReqContext = ReqContext
        self.names = {
            LookupResult.MISS: "miss",
            LookupResult.HIT: "hit",
            LookupResult.HIT_PENDING: "hit_pending",
        }
        self.vllm = CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru")
        self.twin = _native.SimHostTier(num_chunks)
        self.keys: set[int] = set()
        self.by_vllm: dict[bytes, int] = {}
        self.stores: list[list[int]] = []
        self.refusals = 0
        self.evictions = 0

    def new_request(self, rid: int, chain: list[int]) -> Req:
        ctx = self.ReqContext(req_id=str(rid))
        for i, k in enumerate(chain):
            vk = vllm_key(k)
            self.by_vllm[vk] = k
            ctx.set_offload_key_position(vk, (i + 1) * BLOCK)
        self.vllm.on_new_request(ctx)
        self.keys.update(chain)
        return Req(rid, chain, ctx)

    def lookup(self, key: int) -> str:
        want = self.names[self.vllm.lookup(vllm_key(key), None)]
        assert self.twin.lookup(key) == want, key
        return want

    def store(self, req: Req, upto: int) -> None:
        pairs = [(i, req.chain[i]) for i in range(req.next_stored, upto)]
        out = self.vllm.prepare_store([vllm_key(k) for _, k in pairs], req.context)
        got = self.twin.prepare_store(req.rid, pairs)
        if out is None:
            assert got is None
            self.refusals += 1
            return
        stored = [self.by_vllm[k] for k in out.keys_to_store]
        evicted = [self.by_vllm[k] for k in out.evicted_keys]
        chunk_ids = [int(c) for c in out.store_spec.block_ids]
        assert got == (stored, chunk_ids, evicted)
        self.evictions += len(evicted)
        req.next_stored = upto
        if stored:
            self.stores.append(stored)

    def complete_store(self, idx: int) -> None:
        keys = self.stores.pop(idx)
        self.vllm.complete_store([vllm_key(k) for k in keys], None)
        self.twin.complete_store(keys)

    def load(self, req: Req) -> None:
        """Loads the leading run of ready blocks, as the connector does when none is pending."""
        n = 0
        for k in req.chain:
            found = self.lookup(k)
            if found == "miss":
                break
            if found == "hit_pending":
                return
            n += 1
        if n == 0:
            return
        pairs = [(i, req.chain[i]) for i in range(n)]
        self.vllm.prepare_load([vllm_key(k) for _, k in pairs], req.context)
        self.twin.prepare_load(req.rid, pairs)
        req.loads.append([k for _, k in pairs])
        req.next_stored = max(req.next_stored, n)

    def complete_load(self, req: Req) -> None:
        keys = req.loads.pop(0)
        self.vllm.complete_load([vllm_key(k) for k in keys], req.context)
        self.twin.complete_load(keys)

    def finish(self, req: Req) -> None:
        self.vllm.on_request_finished(req.context)
        self.twin.request_finished(req.rid)
        req.finished = True

    def check(self) -> None:
        for k in sorted(self.keys):
            self.lookup(k)
        policy = self.vllm._policy
        order = sorted(policy._evictable, key=policy._ranks.__getitem__)
        assert self.twin.eviction_order() == [self.by_vllm[k] for k in order]
        chunks = sorted((self.by_vllm[k], c.chunk_id) for k, c in policy.chunks.items())
        assert self.twin.chunk_map() == chunks
        assert self.twin.used() == len(policy.chunks)


def chains(rng: random.Random, count: int) -> list[list[int]]:
    """Prefix chains sharing heads: a few roots, each chain extending a random earlier one."""
    out: list[list[int]] = []
    next_key = 1
    for _ in range(count):
        base: list[int] = []
        if out and rng.random() < 0.7:
            parent = rng.choice(out)
            base = parent[: rng.randint(1, len(parent))]
        extra = rng.randint(1, 12)
        chain = base + list(range(next_key, next_key + extra))
        next_key += extra
        out.append(chain)
    return out


@pytest.mark.parametrize("seed,num_chunks", [(0, 24), (1, 40), (2, 64), (3, 9)])
def test_host_tier_matches_vllms_cpu_offloading_manager(seed: int, num_chunks: int) -> None:
    require_vllm_032()
    rng = random.Random(seed)
    pair = Pair(num_chunks)
    pool = chains(rng, 60)
    live: list[Req] = []
    next_rid = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.15 or not live:
            req = pair.new_request(next_rid, rng.choice(pool))
            next_rid += 1
            live.append(req)
            if rng.random() < 0.5:
                pair.load(req)
        elif op < 0.45:
            req = rng.choice(live)
            if req.next_stored < len(req.chain) and not req.finished:
                upto = rng.randint(req.next_stored + 1, len(req.chain))
                pair.store(req, upto)
        elif op < 0.65 and pair.stores:
            pair.complete_store(rng.randrange(len(pair.stores)))
        elif op < 0.75:
            req = rng.choice(live)
            if req.loads:
                pair.complete_load(req)
        elif op < 0.9:
            req = rng.choice(live)
            if not req.finished:
                pair.finish(req)
        else:
            # Drop requests that are done (finished, no load in flight).
            live = [r for r in live if not r.finished or r.loads]
        pair.check()
    # The sequence exercised what it is for.
    assert pair.evictions > 0
    assert pair.refusals > 0 or num_chunks > 30


def test_lookups_leave_the_lru_order_alone() -> None:
    require_vllm_032()
    pair = Pair(8)
    a = pair.new_request(0, [1, 2, 3, 4])
    pair.store(a, 4)
    pair.complete_store(0)
    pair.finish(a)
    before = pair.twin.eviction_order()
    for k in (1, 2, 3, 4, 5):
        pair.lookup(k)
    pair.check()
    assert pair.twin.eviction_order() == before == [4, 3, 2, 1]
