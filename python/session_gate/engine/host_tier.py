"""The host KV tier as the probes read it: vLLM's offloading connector, scheduler side.

``--kv-offloading-size GB`` (native backend) or ``--kv-transfer-config`` with
``OffloadingConnector`` gives the engine core's scheduler a connector whose
``OffloadingConnectorScheduler`` owns a ``CPUOffloadingManager``; that manager's cache policy
keeps the chunks the tier holds in a dict (``LRUCachePolicy.chunks``: offload key → chunk).
The probe reads that dict and two counts, never a method: ``manager.lookup`` is side-effect free
today (``policy.get`` → ``dict.get``), but ``touch``, ``prepare_load`` and the connector's own
``get_num_new_matched_tokens`` move LRU ranks or statistics, and a dict read cannot.

Anything else is answered "unavailable" with the reason: no connector, another connector
(LMCache runs its tier in another process; ``SimpleCPUOffloadConnector`` keeps a second block
pool), another cache policy (ARC splits its chunks over two ordered dicts), or a geometry the
native walk does not reproduce (several KV-cache groups, sliding windows, EAGLE groups, partial
tails, context parallelism).
"""

from __future__ import annotations

from typing import Any

#: What a probe answers for a host-tier figure it cannot read.
UNAVAILABLE = "unavailable"


class HostTier:
    """One engine's readable host tier: the policy's chunk dict and the chunk geometry."""

    def __init__(self, manager: Any, chunks: dict, blocks_per_chunk: int) -> None:
        self.manager = manager
        #: ``LRUCachePolicy.chunks``: read only, by key, through the CPython API.
        self.chunks = chunks
        self.blocks_per_chunk = int(blocks_per_chunk)

    def usage(self) -> tuple[int, int]:
        """``(capacity, held)`` in GPU blocks: the manager's chunk count and the chunks its
        policy holds (stores in flight included: their chunks are allocated), each times the
        chunk size. O(1)."""
        per_chunk = self.blocks_per_chunk
        return int(self.manager._num_chunks) * per_chunk, len(self.chunks) * per_chunk


def resolve(scheduler: Any, block_size: int) -> tuple[HostTier | None, str | None]:
    """The host tier of ``scheduler`` (vLLM's V1 ``Scheduler``) whose GPU blocks hold
    ``block_size`` tokens, or ``None`` and why it cannot be read."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return None, "no KV connector: the engine has no host KV tier"
    return of_connector(connector, block_size)


def of_connector(connector: Any, block_size: int) -> tuple[HostTier | None, str | None]:
    """The host tier behind a scheduler-side KV connector (see :func:`resolve`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    name = type(connector).__name__
    if not isinstance(connector, OffloadingConnector):
        return None, f"KV connector {name} keeps its tier where this process cannot read it"
    scheduler_side = getattr(connector, "connector_scheduler", None)
    if scheduler_side is None:
        return None, f"{name} has no scheduler side in this process"
    manager = scheduler_side.manager
    if not isinstance(manager, CPUOffloadingManager):
        return None, f"offloading manager {type(manager).__name__} is not vLLM's CPU manager"
    policy = manager._policy
    chunks = getattr(policy, "chunks", None)
    if type(chunks) is not dict:
        return None, f"cache policy {type(policy).__name__} keeps no single dict of chunks"
    config = scheduler_side.config
    problem = _geometry_problem(config, block_size)
    if problem:
        return None, problem
    return HostTier(manager, chunks, config.blocks_per_chunk), None


def _geometry_problem(config: Any, block_size: int) -> str | None:
    """Why the native walk would not reproduce this connector's lookup, if it would not."""
    groups = config.kv_group_configs
    if len(groups) != 1:
        return f"the connector offloads {len(groups)} KV-cache groups (one is supported)"
    (group,) = groups
    if group.group_idx != 0:
        return f"the offloaded KV-cache group is {group.group_idx}, not 0"
    if group.sliding_window_size_in_chunks is not None:
        return "the offloaded group uses a sliding window"
    if group.is_eagle_group:
        return "the offloaded group holds EAGLE/MTP draft layers"
    if config.supports_partial_tail:
        return "the connector loads partial tails (recurrent groups)"
    if getattr(config, "dcp_world_size", 1) != 1:
        return "decode context parallelism is on"
    if group.tokens_per_block != block_size:
        return f"offloaded blocks hold {group.tokens_per_block} tokens, GPU blocks {block_size}"
    if group.hashes_per_chunk != config.blocks_per_chunk:
        return "the connector hashes at another granularity than the GPU blocks"
    return None
