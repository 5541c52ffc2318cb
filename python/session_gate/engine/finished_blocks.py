"""A finished session's own blocks are evicted first.

vLLM's free queue is LRU: a block freed later is evicted later. When a session ends (its last
turn is over, its client says so), the blocks of its history are the most recently freed in the
cache, so they outlive the prefixes of sessions that are only between turns and will come back.
Nobody will ask for a finished session's blocks again. On the twin, putting them at the front of
the free queue raised the gate's hit rate on every workload (+0.5 to +2 points of the ideal on
the CPU workloads) and lowered makespan on six of seven (``docs/lab-notes/gate-policy.md``).

How. ``Scheduler._free_request`` (wrapped once by ``gate_binding``) calls :func:`record` for
every freed request that carries vLLM's own ``session_id`` (the ``X-Session-ID`` header or body
field of the OpenAI server, ``AsyncLLM.generate(session_id=...)``): the session's last request's
``block_hashes`` (computed by vLLM; nothing is hashed here) and, from its first request, how many
full blocks its first prompt had. When the session is forgotten (``session_gate_forget``, which
every gate sends when it finishes a session: ``SessionGate`` and the proxy through their probes,
the engine gate's ``finish`` through ``/finish_session``, ``/session_gate/v1/finish`` or
``session_gate_finish``), :func:`evict_first` moves the blocks of those hashes that are free and
still cached to the front of vLLM's free queue (``FreeKVCacheBlockQueue.remove`` and
``prepend_n``, what ``BlockPool.free_blocks`` does for blocks that hold no hash), deepest first.
They stay cached until vLLM needs a block, so a session that was not really over loses nothing
it would not have lost anyway.

What stays. The first prompt's blocks: blocks other live sessions share (a system prompt, a GRPO
group's task prompt) sit there, and a free block's ref count cannot say whether an idle session
will want it. Blocks a running request holds (ref count above 0) are not in the free queue.

Where it applies: engines with one KV cache group whose block size is the hash block size (the
prefix probe's native path), prefix caching on. Requests without vLLM's ``session_id`` are not
recorded, so a lease door that sends none (``EngineGate`` with ``AsyncLLM.generate`` and no
``session_id``, the proxy with ``--gate-at engine``, which drops the header so that a gating
middleware does not admit the turn twice) leaves vLLM's order.
``SESSION_GATE_FINISHED_BLOCKS=lru`` turns it off; at most :data:`MAX_SESSIONS` sessions are
remembered (least recently freed dropped first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger("session_gate")

#: Where a scheduler keeps its :class:`FinishedBlocks` (``False``: tried, not available).
FINISHED_ATTR = "_session_gate_finished_blocks"
#: Sessions remembered between their last free and their finish.
MAX_SESSIONS = 16384
#: What it counts (under ``engine_gate`` in the engine gate's stats).
COUNTERS = (
    "finished_sessions_evicted_first",
    "finished_blocks_evicted_first",
    "finished_sessions_forgotten",
)
#: The knob's values.
FIRST = "first"
LRU = "lru"


class FinishedBlocks:
    """Each session's last freed request's block hashes, and its first prompt's full blocks;
    moves a finished session's free blocks to the front of the free queue."""

    def __init__(self, block_pool: Any, block_size: int, block_key: Any) -> None:
        self._pool = block_pool
        self._block_size = block_size
        #: ``make_block_hash_with_group_id`` with the one group's id bound.
        self._key = block_key
        self._last: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def sessions(self) -> int:
        """Sessions remembered now (no ``__len__``: an empty one must still be truthy)."""
        return len(self._last)

    def record(self, session_id: str, request: Any) -> None:
        """``request`` of ``session_id`` was freed: its blocks are the session's newest."""
        hashes = request.block_hashes
        if not hashes:
            return
        known = self._last.pop(session_id, None)
        if known is None:
            prompt = request.prompt_token_ids
            keep = len(prompt) // self._block_size if prompt else 0
        else:
            keep = known[1]
        self._last[session_id] = (hashes, keep)
        if len(self._last) > MAX_SESSIONS:
            self._last.popitem(last=False)
            self.counters["finished_sessions_forgotten"] += 1

    def evict_first(self, session_id: str) -> int:
        """Moves ``session_id``'s free cached blocks past its first prompt to the front of the
        free queue (deepest first) and forgets the session; returns how many moved."""
        known = self._last.pop(session_id, None)
        if known is None:
            return 0
        hashes, keep = known
        pool = self._pool
        lookup = pool.cached_block_hash_to_block.get_one_block
        queue = pool.free_block_queue
        moved = []
        for block_hash in reversed(hashes[keep:]):
            block = lookup(self._key(block_hash))
            if block is None or block.ref_cnt != 0 or block.is_null:
                continue
            queue.remove(block)
            moved.append(block)
        queue.prepend_n(moved)
        if moved:
            self.counters["finished_sessions_evicted_first"] += 1
            self.counters["finished_blocks_evicted_first"] += len(moved)
        return len(moved)


def of_scheduler(scheduler: Any) -> FinishedBlocks | None:
    """``scheduler``'s :class:`FinishedBlocks`, built on first use; ``None`` when the knob is
    ``lru``, the engine's KV cache is not one plain group, or prefix caching is off (each said
    once in the log). Never raises."""
    found = scheduler.__dict__.get(FINISHED_ATTR)
    if found is not None:
        return found or None
    scheduler.__dict__[FINISHED_ATTR] = False
    try:
        from session_gate import _native

        setting = _native.knob_from_env("finished_blocks")
        if setting == LRU:
            return None
        kvm = scheduler.kv_cache_manager
        why = _why_not(kvm)
        if why is not None:
            logger.info("session_gate: finished sessions' blocks keep vLLM's order: %s", why)
            return None
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        def key(block_hash: Any) -> Any:
            return make_block_hash_with_group_id(block_hash, 0)

        pool = kvm.block_pool
        made = FinishedBlocks(pool, int(pool.hash_block_size), key)
    except Exception:  # noqa: BLE001 - vLLM serves in its own order rather than not at all
        logger.exception("session_gate: finished sessions' blocks keep vLLM's order")
        return None
    scheduler.__dict__[FINISHED_ATTR] = made
    return made


def evict_first(scheduler: Any, session_id: str) -> int:
    """The finished ``session_id``'s own blocks go first in ``scheduler``'s block pool; how
    many moved (0 when it is off or knows nothing of the session). Never raises: the finish
    itself has happened."""
    finished = None if scheduler is None else of_scheduler(scheduler)
    if finished is None:
        return 0
    try:
        return finished.evict_first(session_id)
    except Exception:  # noqa: BLE001 - never take the engine down
        logger.exception("session_gate: evicting finished session %r first failed", session_id)
        return 0


def counters_of(scheduler: Any) -> dict[str, int]:
    """What ``scheduler``'s :class:`FinishedBlocks` counted (zeros when it has none)."""
    finished = None if scheduler is None else of_scheduler(scheduler)
    return dict(finished.counters) if finished is not None else dict.fromkeys(COUNTERS, 0)


#: Its Prometheus counters, named ``session_gate_engine_<key>_total``: key and help.
METRICS = (
    (
        "finished_sessions_evicted_first",
        "Finished sessions whose free blocks went to the front of vLLM's free queue",
    ),
    (
        "finished_blocks_evicted_first",
        "Blocks of finished sessions moved to the front of vLLM's free queue",
    ),
)


def prometheus_lines(scheduler: Any) -> list[str]:
    """Its counters in Prometheus' text format (zeros when it has none)."""
    counts = counters_of(scheduler)
    lines: list[str] = []
    for key, text in METRICS:
        metric = f"session_gate_engine_{key}_total"
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter", f"{metric} {counts[key]}"]
    return lines


def prometheus_text(scheduler: Any) -> str | None:
    """The same for an engine without an engine gate (the proxy's gates and ``SessionGate``
    end sessions through the probes alone): None until a request with a session id was freed."""
    if scheduler is None or not scheduler.__dict__.get(FINISHED_ATTR):
        return None
    return "\n".join(prometheus_lines(scheduler)) + "\n"


def _why_not(kvm: Any) -> str | None:
    if not kvm.enable_caching:
        return "prefix caching is disabled"
    if kvm.num_kv_cache_groups != 1:
        return f"{kvm.num_kv_cache_groups} KV cache groups"
    if kvm.coordinator.block_size != kvm.block_pool.hash_block_size:
        return "the block size is not the hash block size"
    return None
