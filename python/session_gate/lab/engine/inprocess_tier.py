"""A real vLLM host KV tier in this process: the scheduler side of ``OffloadingConnector``
beside an in-process ``KVCacheManager``, fed what the connector feeds its manager.

vLLM's CPU backend refuses KV offloading (its worker side needs a CUDA-alike or XPU device:
see docs/lab-notes/host-tier-probe.md), but the scheduler side is plain Python: the connector
built with ``KVConnectorRole.SCHEDULER`` owns the very ``OffloadingConnectorScheduler``,
``CPUOffloadingManager`` and ``LRUCachePolicy`` an engine would. A request here goes the way the
V1 scheduler and the connector take it:

1. ``connector.on_new_request``; the GPU hit (``KVCacheManager.get_computed_blocks``); the
   connector's own lookup ``get_num_new_matched_tokens(request, gpu_hit)`` (the reference the
   probe must equal);
2. a hit in the tier is loaded: ``manager.prepare_load`` then ``complete_load`` over its
   chunks (what ``update_state_after_alloc`` and the worker's finished load do);
3. the prompt is prefilled on the GPU (``SchedulerDriver.prefill``) and its newly computed
   full chunks are stored: ``manager.prepare_store`` then ``complete_store`` (the connector's
   store jobs, offload-prompt-only, chunk level: from the first chunk after the hit);
4. it finishes: GPU blocks freed, ``manager.on_request_finished`` (the LRU's recency update).

Used by the tiered probe's tests and ``make bench-probe``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from session_gate.engine.host_tier import HostTier, of_connector
from session_gate.engine.methods import EngineState, _load_native
from session_gate.lab.engine.inprocess import SchedulerDriver, make_kv_cache_manager
from session_gate.lab.engine.launch import write_tiny_model


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def make_offloading_connector(
    kv_cache_manager: Any, tier_chunks: int, blocks_per_chunk: int = 1
) -> OffloadingConnector:
    """The scheduler side of vLLM's ``OffloadingConnector`` for ``kv_cache_manager``'s cache,
    with a CPU tier of exactly ``tier_chunks`` chunks of ``blocks_per_chunk`` blocks."""
    # The tiny model's config.json only: ModelConfig reads it, nothing is downloaded.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kv_config = kv_cache_manager.kv_cache_config
    (group,) = kv_config.kv_cache_groups
    block_size = group.kv_cache_spec.block_size
    page_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    chunk_bytes = _round_up(page_bytes * blocks_per_chunk, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    model = ModelConfig(
        model=write_tiny_model(),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=kv_cache_manager.max_model_len,
    )
    vllm_config = VllmConfig(
        model_config=model,
        # Named, not detected: vLLM 0.33's GPU wheel (``make test-vllm-next``) finds no device.
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": tier_chunks * chunk_bytes,
                "blocks_per_chunk": blocks_per_chunk,
            },
        ),
    )
    connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
    num_chunks = connector.connector_scheduler.manager._num_chunks
    if num_chunks != tier_chunks:
        raise RuntimeError(f"asked for a tier of {tier_chunks} chunks, vLLM made {num_chunks}")
    return connector


@dataclass
class Prefilled:
    """What one request found: its GPU hit and what the connector's lookup offered."""

    gpu_hit: int
    external: int


class TieredDriver:
    """A ``SchedulerDriver`` whose requests also go through a real offloading connector."""

    def __init__(
        self, gpu_blocks: int, block_size: int, tier_chunks: int, blocks_per_chunk: int = 1
    ) -> None:
        self.gpu = SchedulerDriver(make_kv_cache_manager(gpu_blocks, block_size))
        self.kv_cache_manager = self.gpu.kv_cache_manager
        self.connector = make_offloading_connector(
            self.kv_cache_manager, tier_chunks, blocks_per_chunk
        )
        self.scheduler_side = self.connector.connector_scheduler
        self.manager = self.scheduler_side.manager
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk

    def tier(self) -> HostTier:
        tier, why = of_connector(self.connector, self.block_size)
        if tier is None:
            raise RuntimeError(why)
        return tier

    def lookup(self, token_ids: list[int]) -> Prefilled:
        """vLLM's own answer for this prompt now, with nothing scheduled: the GPU hit and the
        connector's ``get_num_new_matched_tokens`` (its lookup only reads the policy; the
        request is dropped from the connector afterwards, never finished, so no recency
        moves)."""
        request = self.gpu.request(token_ids)
        self.connector.on_new_request(request)
        try:
            _, gpu_hit, *_ = self.kv_cache_manager.get_computed_blocks(request)
            external, _ = self.connector.get_num_new_matched_tokens(request, gpu_hit)
        finally:
            del self.scheduler_side._req_status[request.request_id]
        return Prefilled(gpu_hit, external)

    def run(self, token_ids: list[int]) -> Prefilled:
        """One request through the GPU cache and the tier (see the module docstring)."""
        request = self.gpu.request(token_ids)
        self.connector.on_new_request(request)
        status = self.scheduler_side._req_status[request.request_id]
        context = status.req_context
        _, gpu_hit, *_ = self.kv_cache_manager.get_computed_blocks(request)
        external, _ = self.connector.get_num_new_matched_tokens(request, gpu_hit)
        if external is None:
            raise RuntimeError("the connector deferred its lookup (a store still in flight)")
        keys = self.chunk_keys(request)
        per_chunk = self.block_size * self.blocks_per_chunk
        first, hit_end = gpu_hit // per_chunk, (gpu_hit + external) // per_chunk
        if external:
            loaded = keys[first:hit_end]
            self.manager.prepare_load(loaded, context)
            self.manager.complete_load(loaded, context)
        self.gpu.prefill(request)
        stored = keys[hit_end : request.num_prompt_tokens // per_chunk]
        if stored:
            out = self.manager.prepare_store(stored, context)
            if out is not None:
                self.manager.complete_store(out.keys_to_store, context)
        self.gpu.free(request)
        self.manager.on_request_finished(context)
        del self.scheduler_side._req_status[request.request_id]
        return Prefilled(gpu_hit, external)

    def chunk_keys(self, request: Any) -> list[bytes]:
        """The offload key of each full chunk of ``request`` (its last block's hash + group 0),
        with the positions the connector records for the LRU's prefix order."""
        status = self.scheduler_side._req_status[request.request_id]
        status.update_offload_keys()
        return list(status.group_states[0].offload_keys)

    def lru_order(self) -> list[bytes]:
        """The LRU policy's eviction order of evictable chunks, oldest first, as its ranks
        give it (what ``evict`` would take), plus every other field a probe could move."""
        policy = self.manager._policy
        return sorted(policy._evictable, key=policy._ranks.__getitem__)

    def lru_snapshot(self) -> dict:
        """Everything of the tier a probe could disturb: ranks, heap, evictable set, chunk
        states, the manager's counts, and the connector's statistics."""
        policy = self.manager._policy
        manager = self.manager
        return {
            "order": self.lru_order(),
            "ranks": dict(policy._ranks),
            "next_rank": policy._next_rank,
            "heap": list(policy._heap),
            "chunks": {k: (c.ref_cnt, c.chunk_id) for k, c in policy.chunks.items()},
            "free_list": list(manager._free_list),
            "allocated": manager._num_allocated_chunks,
            "evictable": manager._num_evictable_cache_chunks,
            "stats": repr(self.scheduler_side._connector_stats.__dict__),
        }


def tiered_state(driver: TieredDriver, *, vocab_size: int = 4096) -> EngineState:
    """The probes' state over the driver's GPU cache and host tier (what ``EngineState.of_core``
    builds in an engine whose scheduler has the connector)."""
    native, error = _load_native()
    pool = driver.kv_cache_manager.block_pool
    return EngineState(
        driver.kv_cache_manager,
        hash_algo="sha256",
        vocab_size=vocab_size,
        max_model_len=pool.num_gpu_blocks * pool.hash_block_size,
        lora_enabled=False,
        native=native,
        native_error=error,
        tier=driver.tier(),
        tier_unavailable=None,
    )


__all__ = ["TieredDriver", "make_offloading_connector", "tiered_state"]
