"""The ``session_gate_*`` utility methods added to vLLM's ``EngineCore``.

They run inside the engine core's busy loop as ``EngineCoreRequestType.UTILITY`` calls, between
model steps: a probe never enters the scheduler's queues, never allocates, frees or touches a KV
block, and never changes vLLM's prefix-cache statistics. Every exception becomes the utility
call's failure message (vLLM catches ``Exception`` around utility methods), and the native module
turns Rust panics into ``RuntimeError`` so nothing escapes that net.

Engine-loop cost: vLLM looks a utility method up and runs ``inspect.signature`` on it on every
call. The installed methods are ``utility.Utility`` descriptors, so what vLLM calls is the engine
state's own ``usage_answer`` / ``probe_answer`` / ``forget``, with a signature computed once.
``engine_us`` in an answer is that method's own time; ``make bench-probe`` also times the whole
call as vLLM's loop makes it (``*_dispatch_us``).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

from session_gate.engine import finished_blocks, host_tier
from session_gate.engine.host_tier import UNAVAILABLE, HostTier
from session_gate.engine.utility import Utility

logger = logging.getLogger("session_gate")

_STATE_ATTR = "_session_gate_state"


def _load_native() -> tuple[Any, str | None]:
    try:
        from session_gate import _native

        return _native, None
    except Exception as exc:  # ImportError, or a broken/ABI-mismatched library
        return None, f"session_gate native module failed to load: {exc!r}"


class EngineState:
    """What the probes need from one engine core, resolved once on the first call.

    Built from the engine's ``KVCacheManager`` and a few settings, so the benchmark can also
    build one around a ``KVCacheManager`` of GPU size in-process (``of_core`` is the engine's way).
    """

    def __init__(
        self,
        kv_cache_manager: Any,
        *,
        hash_algo: str,
        vocab_size: int,
        max_model_len: int,
        lora_enabled: bool,
        native: Any,
        native_error: str | None = None,
        tier: HostTier | None = None,
        tier_unavailable: str | None = "no KV connector: the engine has no host KV tier",
        scheduler: Any = None,
    ) -> None:
        kvm = kv_cache_manager
        #: vLLM's scheduler, for the usage probe's request counts (``None``: not reported).
        self.scheduler = scheduler
        #: The status of a request still running: the engine gate's book reads the counts
        #: inside vLLM's free of a finished request too, and leaves finished ones out.
        self.running_status = getattr(RequestStatus, "RUNNING", None)
        #: Containers of the requests the engine gate's scheduler mode holds in the waiting
        #: queue (set when it attaches): not work the engine could do, so not counted waiting.
        self.held_in_queue: tuple[Any, ...] = ()
        self.kv_cache_manager = kvm
        self.block_pool = kvm.block_pool
        self.block_size = int(self.block_pool.hash_block_size)
        self.hash_algo = str(hash_algo)
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        #: Tokens after each block that its hash also covers (vLLM 0.33+, EAGLE), else 0.
        self.lookahead = int(getattr(self.block_pool, "num_hash_lookahead_tokens", 0) or 0)
        self.unavailable = native_error or self._why_unavailable(kvm, lora_enabled)
        self.path = "unavailable" if self.unavailable else self._choose_path(kvm)
        self.native = None
        if self.path == "native":
            # SESSION_GATE_CHAIN_CACHE_BYTES, or its default, from the native knob table.
            budget = native.knob_from_env("chain_cache_bytes")
            self.native = native.ProbeEngine(
                self.hash_algo,
                kv_cache_utils.NONE_HASH,
                self.block_size,
                self.vocab_size,
                self.max_model_len,
                budget,
                # With the block class, session probes remember the blocks they found and
                # re-check them by identity next time (see src/python/residency.rs).
                block_type=kv_cache_utils.KVCacheBlock,
            )
        self._python_hash_fn = get_hash_fn_by_name(self.hash_algo)
        self._lookahead_hasher = (
            kv_cache_utils.get_request_block_hasher(
                self.block_size, self._python_hash_fn, num_hash_lookahead_tokens=self.lookahead
            )
            if self.path == "python" and self.lookahead
            else None
        )
        self._native_module = native
        if tier is not None and self.path != "native":
            # The tier walk continues the native hash chain; vLLM's Python path has none.
            tier, tier_unavailable = None, f"the prefix probe answers on its {self.path} path"
        #: The host KV tier (vLLM's offloading connector), when it can be read in-process.
        self.tier = tier
        self.tier_unavailable = None if tier is not None else tier_unavailable

    @classmethod
    def of_core(cls, core: EngineCore, native: Any, native_error: str | None) -> EngineState:
        config = core.vllm_config
        kvm = core.scheduler.kv_cache_manager
        tier, tier_unavailable = host_tier.resolve(
            core.scheduler, int(kvm.block_pool.hash_block_size)
        )
        return cls(
            kvm,
            hash_algo=str(config.cache_config.prefix_caching_hash_algo),
            vocab_size=int(config.model_config.get_vocab_size()),
            max_model_len=int(config.model_config.max_model_len),
            lora_enabled=config.lora_config is not None,
            native=native,
            native_error=native_error,
            tier=tier,
            tier_unavailable=tier_unavailable,
            scheduler=core.scheduler,
        )

    def _why_unavailable(self, kvm: Any, lora_enabled: bool) -> str | None:
        if not kvm.enable_caching:
            return "prefix caching is disabled in this engine"
        if self.lookahead and not _hasher_takes_lookahead():
            # Each block's hash also covers the next tokens, and this vLLM's request block
            # hasher cannot be asked for such hashes: answer nothing rather than a wrong ratio.
            return (
                f"block hashes cover num_hash_lookahead_tokens={self.lookahead} lookahead tokens "
                "(EAGLE), but kv_cache_utils.get_request_block_hasher takes no "
                "num_hash_lookahead_tokens"
            )
        if lora_enabled:
            # A LoRA request's blocks hash with its adapter name; a probe of bare token ids
            # cannot know which adapter the session's next turn will use.
            return "LoRA is enabled: block hashes depend on the request's adapter"
        return None

    def _choose_path(self, kvm: Any) -> str:
        coordinator = kvm.coordinator
        exact_natively = (
            not self.lookahead
            and isinstance(coordinator, UnitaryKVCacheCoordinator)
            and kvm.num_kv_cache_groups == 1
            and coordinator.block_size == kvm.block_pool.hash_block_size
            and not coordinator.eagle_group_ids
            and getattr(coordinator, "dcp_world_size", 1) == 1
            and getattr(coordinator, "pcp_world_size", 1) == 1
        )
        # Anything else (hybrid models, EAGLE and its lookahead hashes, context parallelism) is
        # answered by vLLM's own Python functions, which are exact by construction.
        return "native" if exact_natively else "python"

    # -- usage ------------------------------------------------------------------------------

    def usage(self, count_cached_free: bool = False) -> dict[str, Any]:
        """O(1) unless ``count_cached_free``: the exact number of free-but-cached blocks means
        visiting every block (about 0.5 ms at 10^5 blocks), so it is ``None`` unless asked for."""
        return self._add_usage({}, count_cached_free)

    def _add_usage(self, answer: dict[str, Any], count_cached_free: bool = False) -> dict[str, Any]:
        # Written into the caller's dict: a probe's answer carries these too, and merging a
        # second dict into it was a measurable part of a 15 us probe.
        pool = self.block_pool
        answer["kv_cache_usage"] = float(pool.get_usage())
        # The null block is never usable; vLLM's usage excludes it too.
        answer["num_blocks"] = int(pool.num_gpu_blocks) - 1
        answer["num_free_blocks"] = int(pool.get_num_free_blocks())
        answer["num_cached_free_blocks"] = self._count_cached_free() if count_cached_free else None
        answer["block_size"] = self.block_size
        answer["hash_algo"] = self.hash_algo
        tier = self.tier
        if tier is not None:
            answer["offload_num_blocks"], answer["offload_used_blocks"] = tier.usage()
        else:
            answer["offload_num_blocks"] = answer["offload_used_blocks"] = UNAVAILABLE
        counts = self.queue_counts()
        answer["num_running_reqs"], answer["num_waiting_reqs"] = counts or (None, None)
        return answer

    def queue_counts(self) -> tuple[int, int] | None:
        """``(running, waiting)`` requests in the engine's scheduler, the waiting ones less
        those the scheduler mode holds, or ``None`` without a scheduler or when this vLLM's
        cannot be read. The utility call is served between engine steps, when vLLM's lists are
        up to date; the engine gate's book reads the same natively, and also inside vLLM's
        free of a finished request, so it leaves out finished requests still listed as
        running (``Queues::counts`` in ``src/python/engine_book.rs``)."""
        scheduler = self.scheduler
        if scheduler is None:
            return None
        try:
            held = sum(len(h) for h in self.held_in_queue)
            return len(scheduler.running), max(len(scheduler.waiting) - held, 0)
        except (AttributeError, TypeError):
            return None

    def tier_usage(self) -> tuple[int, int] | None:
        """The host tier's ``(capacity, held)`` in GPU blocks, or ``None`` without a readable
        tier (the engine gate's usage reads it on every admit)."""
        return self.tier.usage() if self.tier is not None else None

    def _count_cached_free(self) -> int:
        pool = self.block_pool
        if self._native_module is not None:
            return int(
                self._native_module.count_cached_free_blocks(
                    pool.blocks, pool.cached_block_hashes_by_block
                )
            )
        by_block = pool.cached_block_hashes_by_block
        return sum(
            1
            for b in pool.blocks
            if b.ref_cnt == 0 and (b.block_hash is not None or b.block_id in by_block)
        )

    # -- prefix -----------------------------------------------------------------------------

    def probe(self, session_id: Any, token_ids: Any) -> dict[str, Any]:
        """The prefix probe's answer, as the engine gate reads it in-process (no usage fields,
        no timing: the gate reads usage once per decision); the one place its keys are
        written. One native call and one dict: this runs in the engine loop on every probe."""
        if session_id is not None and not isinstance(session_id, str):
            raise TypeError(f"session_id must be a str or None, got {type(session_id).__name__}")
        offloaded: int | str = UNAVAILABLE
        tier_hashed = 0
        if self.path == "native":
            tier = self.tier
            if tier is None:
                hit_blocks, hit_tokens, prompt_tokens, hashed, reused, rechecked = (
                    self.native.probe(
                        self.block_pool.cached_block_hash_to_block._cache, session_id, token_ids
                    )
                )
            else:
                (
                    hit_blocks,
                    hit_tokens,
                    prompt_tokens,
                    hashed,
                    reused,
                    rechecked,
                    offloaded,
                    tier_hashed,
                ) = self.native.probe_tiered(
                    self.block_pool.cached_block_hash_to_block._cache,
                    tier.chunks,
                    tier.blocks_per_chunk,
                    session_id,
                    token_ids,
                )
        else:
            tokens = self._validated_list(token_ids)
            prompt_tokens = len(tokens)
            if self.path == "unavailable":
                return {
                    "available": False,
                    "reason": self.unavailable,
                    "prompt_tokens": prompt_tokens,
                    "path": self.path,
                }
            hit_tokens = self._python_hit_tokens(tokens)
            hit_blocks = hit_tokens // self.block_size
            hashed, reused, rechecked = prompt_tokens // self.block_size, 0, 0
        return {
            "blocks_hashed": hashed,
            "blocks_reused": reused,
            "blocks_rechecked": rechecked,
            "available": True,
            "path": self.path,
            "hit_blocks": hit_blocks,
            "hit_tokens": hit_tokens,
            "prompt_tokens": prompt_tokens,
            "hit_ratio": hit_tokens / prompt_tokens,
            "offloaded_tokens": offloaded,
            "tier_blocks_hashed": tier_hashed,
        }

    def _validated_list(self, token_ids: Any) -> list[int]:
        # Same checks as the native path, so both paths refuse the same prompts.
        if self._native_module is not None:
            return list(
                self._native_module.validate_prompt(token_ids, self.vocab_size, self.max_model_len)
            )
        if isinstance(token_ids, (bytes, bytearray)):
            token_ids = list(memoryview(bytes(token_ids)).cast("I"))
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("invalid probe input: token_ids is empty")
        if len(tokens) > self.max_model_len:
            raise ValueError(
                f"invalid probe input: prompt has {len(tokens)} tokens, longer than "
                f"max_model_len {self.max_model_len}"
            )
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"invalid probe input: token id {t!r} at index {i} is not an "
                    f"int in [0, {self.vocab_size})"
                )
        return tokens

    def _python_hit_tokens(self, tokens: list[int]) -> int:
        """vLLM's own hashing and longest-hit search (read-only), for non-native engines."""
        if self._lookahead_hasher is not None:
            # Lookahead hashes (EAGLE): vLLM's own request block hasher over a request that is
            # never scheduled, so every extra key is what the scheduler's request would carry.
            probe = Request("session-gate-probe", tokens, SamplingParams(max_tokens=1), None)
            hashes = self._lookahead_hasher(probe)
        else:
            size = self.block_size
            hashes = []
            parent = None
            for start in range(0, len(tokens) - size + 1, size):
                parent = kv_cache_utils.hash_block_tokens(
                    self._python_hash_fn, parent, tokens[start : start + size]
                )
                hashes.append(parent)
        # Same cap as KVCacheManager.get_computed_blocks: the last token is always recomputed.
        _, hit_tokens, *_ = self.kv_cache_manager.coordinator.find_longest_cache_hit(
            hashes, len(tokens) - 1
        )
        return int(hit_tokens)

    def forget(self, session_id: Any) -> bool:
        """The session is over: its hash chain is dropped and its own blocks will be evicted
        first (``finished_blocks``). Whether a chain was remembered."""
        if not isinstance(session_id, str):
            raise TypeError(f"session_id must be a str, got {type(session_id).__name__}")
        finished_blocks.evict_first(self.scheduler, session_id)
        return bool(self.native.forget(session_id)) if self.native is not None else False

    # -- the utility methods' answers, timed ------------------------------------------------

    def usage_answer(self, count_cached_free: Any = False) -> dict[str, Any]:
        started = time.perf_counter_ns()
        if not isinstance(count_cached_free, bool):
            raise TypeError(
                f"count_cached_free must be a bool, got {type(count_cached_free).__name__}"
            )
        return _timed(self.usage(count_cached_free), started)

    def probe_answer(self, session_id: Any, token_ids: Any) -> dict[str, Any]:
        # The usage fields are written into the probe's own dict (merging a second dict was a
        # measurable part of a 15 us probe).
        started = time.perf_counter_ns()
        return _timed(self._add_usage(self.probe(session_id, token_ids)), started)


def _hasher_takes_lookahead() -> bool:
    """Whether this vLLM's request block hasher computes lookahead hashes (0.33+)."""
    parameters = inspect.signature(kv_cache_utils.get_request_block_hasher).parameters
    return "num_hash_lookahead_tokens" in parameters


def _state(core: EngineCore) -> EngineState:
    state = core.__dict__.get(_STATE_ATTR)
    if state is None:
        native, error = _load_native()
        state = EngineState.of_core(core, native, error)
        core.__dict__[_STATE_ATTR] = state
    return state


def _timed(answer: dict[str, Any], started_ns: int) -> dict[str, Any]:
    # Time spent inside the engine loop (excludes IPC): what every running sequence waited.
    answer["engine_us"] = (time.perf_counter_ns() - started_ns) / 1000.0
    return answer


def session_gate_usage(self: EngineCore, count_cached_free: bool = False) -> dict[str, Any]:
    """KV usage exactly as ``BlockPool.get_usage()`` computes it, plus the counts behind it, in
    O(1). ``count_cached_free=True`` also counts the free blocks that still hold a prefix
    (``num_cached_free_blocks``, else ``None``): exact, but a visit of every block."""
    return _state(self).usage_answer(count_cached_free)


def session_gate_probe(self: EngineCore, session_id: Any, token_ids: Any) -> dict[str, Any]:
    """Tokens of ``token_ids`` vLLM would report cached if scheduled now, with the O(1) usage
    fields."""
    return _state(self).probe_answer(session_id, token_ids)


def session_gate_forget(self: EngineCore, session_id: Any) -> bool:
    """Drop a finished session's remembered hash chain."""
    return _state(self).forget(session_id)


UTILITY_METHODS = {
    "session_gate_usage": session_gate_usage,
    "session_gate_probe": session_gate_probe,
    "session_gate_forget": session_gate_forget,
}

#: What vLLM calls for each method (see ``utility.Utility``): the engine state's own method,
#: so neither vLLM's per-call ``inspect.signature`` nor a frame of ours runs around it.
_BOUND = {
    "session_gate_usage": lambda core: _state(core).usage_answer,
    "session_gate_probe": lambda core: _state(core).probe_answer,
    "session_gate_forget": lambda core: _state(core).forget,
}


def install() -> None:
    """Add the utility methods to ``EngineCore`` (idempotent). Logs a warning when the native
    module cannot load: the usage probe still answers, the prefix probe answers "unavailable"
    with the reason, and vLLM serves as usual."""
    if getattr(EngineCore, "_session_gate_installed", False):
        return
    native, error = _load_native()
    if native is None:
        logger.warning("session_gate: %s; probes will report it and vLLM serves unchanged", error)
    for name, fn in UTILITY_METHODS.items():
        setattr(EngineCore, name, Utility(fn, _BOUND[name]))
    EngineCore._session_gate_installed = True
