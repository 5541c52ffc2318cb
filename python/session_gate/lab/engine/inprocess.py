"""A real vLLM ``KVCacheManager`` in this process, driven through the scheduler's own calls.

No engine, no model, no GPU: the block pool, the prefix map, the free queue and the hit rule are
vLLM's, at any size (131,072 blocks of 16 tokens, as on an H200, fits in a few hundred MB of
Python objects). Requests are prefilled the way the V1 scheduler does it —
``get_computed_blocks``, then ``allocate_slots`` (which allocates, touches hits, evicts from the
free queue's front and caches full blocks), then ``free`` (which returns blocks to the queue in
eviction order) — so the probes can be checked against ``num_computed_tokens`` exactly as the
scheduler would report it, and timed on a cache of GPU size.

Used by ``make bench-probe`` and by the tests that need no running engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from session_gate.engine.methods import EngineState, _load_native


def make_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    *,
    hash_algo: str = "sha256",
    max_model_len: int | None = None,
    use_eagle: bool = False,
    num_hash_lookahead_tokens: int = 0,
) -> KVCacheManager:
    """A full-attention ``KVCacheManager`` of ``num_blocks`` blocks (the null block included, as
    ``num_gpu_blocks_override`` counts them), with prefix caching on and ``NONE_HASH`` seeded for
    ``hash_algo`` the way ``EngineCore.__init__`` seeds it. ``num_hash_lookahead_tokens`` (EAGLE
    block drop, vLLM 0.33+) is only passed when non-zero, so older vLLMs build the same way."""
    lookahead = {"num_hash_lookahead_tokens": num_hash_lookahead_tokens}
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(hash_algo))
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len or (num_blocks - 1) * block_size,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        use_eagle=use_eagle,
        log_stats=True,
        **(lookahead if num_hash_lookahead_tokens else {}),
    )


@dataclass
class SchedulerDriver:
    """Prefills and frees requests on a ``KVCacheManager`` with the scheduler's calls."""

    kv_cache_manager: KVCacheManager
    hash_algo: str = "sha256"
    _ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        pool = self.kv_cache_manager.block_pool
        lookahead = getattr(pool, "num_hash_lookahead_tokens", 0)
        self._hasher = kv_cache_utils.get_request_block_hasher(
            pool.hash_block_size,
            get_hash_fn_by_name(self.hash_algo),
            **({"num_hash_lookahead_tokens": lookahead} if lookahead else {}),
        )

    def request(self, token_ids: list[int]) -> Request:
        """A request for ``token_ids``, its block hashes computed by vLLM's request hasher."""
        return Request(
            f"req-{next(self._ids)}",
            list(token_ids),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self._hasher,
        )

    def prefill(self, request: Request) -> int:
        """Schedules ``request``'s whole prompt as one chunk; returns the tokens vLLM found
        cached (``num_cached_tokens``). The request keeps its blocks until :meth:`free`."""
        kvm = self.kv_cache_manager
        blocks, num_cached, _ = kvm.get_computed_blocks(request)
        new = kvm.allocate_slots(request, request.num_tokens - num_cached, num_cached, blocks)
        if new is None:
            raise RuntimeError(
                f"the cache cannot hold a {request.num_tokens}-token request "
                f"({kvm.block_pool.get_num_free_blocks()} blocks free)"
            )
        request.num_computed_tokens = request.num_tokens
        request.num_cached_tokens = num_cached
        return num_cached

    def free(self, request: Request) -> None:
        """The request finished: its blocks go back to the free queue, hashes kept."""
        self.kv_cache_manager.free(request)

    def run(self, token_ids: list[int]) -> int:
        """Prefill and finish one request; returns its ``num_cached_tokens``."""
        request = self.request(token_ids)
        cached = self.prefill(request)
        self.free(request)
        return cached


def engine_state(
    kv_cache_manager: KVCacheManager,
    *,
    hash_algo: str = "sha256",
    vocab_size: int = 1 << 20,
    max_model_len: int | None = None,
    native: Any = None,
) -> EngineState:
    """The probes' state over ``kv_cache_manager``: the code the ``session_gate_*`` utility
    methods run inside the engine core (``usage_answer``, ``probe_answer``)."""
    error = None
    if native is None:
        native, error = _load_native()
    pool = kv_cache_manager.block_pool
    return EngineState(
        kv_cache_manager,
        hash_algo=hash_algo,
        vocab_size=vocab_size,
        max_model_len=max_model_len or pool.num_gpu_blocks * pool.hash_block_size,
        lora_enabled=False,
        native=native,
        native_error=error,
    )
