"""Patch ledger: every vLLM symbol session_gate touches, why, how, and when it can go.

Kept as data so tests can check each entry still resolves against the installed vLLM, and so the
list is read in one place instead of discovered by grepping.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    symbol: str
    how: str
    why: str
    removable_when: str
    #: ``module:attr.attr`` paths (or ``module:Class.attr`` for instance attributes set in
    #: ``__init__``, given as ``module:Class#attr``) that must exist in the installed vLLM.
    checks: tuple[str, ...] = ()


LEDGER: tuple[Patch, ...] = (
    Patch(
        symbol="vllm.v1.engine.core.EngineCore.session_gate_usage / _probe / _forget",
        how="added as new attributes (nothing of vLLM's is replaced); set once per process",
        why="UTILITY calls resolve methods with getattr(EngineCore, name); there is no "
        "registry for third-party utility methods",
        removable_when="vLLM offers a plugin hook that registers engine-core utility methods",
        checks=(
            "vllm.v1.engine.core:EngineCore",
            "vllm.v1.engine.core:EngineCore.reset_prefix_cache",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.block_pool.BlockHashToBlockMap._cache",
        how="read only: dict lookups by key through the CPython API, no method calls",
        why="get_one_block() is a Python call per block; the probe must stay within "
        "microseconds inside the engine loop",
        removable_when="BlockPool exposes a batched, side-effect-free longest-prefix lookup",
        checks=("vllm.v1.core.block_pool:BlockHashToBlockMap#_cache",),
    ),
    Patch(
        symbol="vllm.v1.core.kv_cache_utils.KVCacheBlock._block_hash (slot), by identity",
        how="read only: a session probe keeps a strong reference to each block it found and to "
        "the hash object in its _block_hash slot, and next time re-checks `slot is object` "
        "instead of a dict lookup; any other value means a lookup",
        why="re-walking a resident 32K-token prefix by dict lookups cost 120-270 us per probe "
        "inside the engine loop; by identity it is a pointer compare per block. Exact because "
        "vLLM sets a block's primary hash only while inserting it into the map "
        "(_insert_block_hash) and clears it only while removing it (_remove_cached_block_hashes, "
        "reset_prefix_cache, which also replaces the map: witnesses are dropped on a new map)",
        removable_when="BlockPool exposes an eviction counter or a batched residency check",
        checks=(
            "vllm.v1.core.kv_cache_utils:KVCacheBlock._block_hash",
            "vllm.v1.core.kv_cache_utils:KVCacheBlock.set_block_hash",
            "vllm.v1.core.kv_cache_utils:KVCacheBlock.reset_hash",
            "vllm.v1.core.block_pool:BlockPool._insert_block_hash",
            "vllm.v1.core.block_pool:BlockPool._remove_cached_block_hashes",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.block_pool.BlockPool.cached_block_hashes_by_block, .blocks",
        how="read only, and only for session_gate_usage(count_cached_free=True): counts cached "
        "blocks whose ref_cnt is 0 (a visit of every block, so never on the gate's path)",
        why="get_usage() counts free-but-cached blocks as free; the gate needs both numbers",
        removable_when="BlockPool reports its number of cached free blocks",
        checks=(
            "vllm.v1.core.block_pool:BlockPool#cached_block_hashes_by_block",
            "vllm.v1.core.block_pool:BlockPool#blocks",
            "vllm.v1.core.kv_cache_utils:KVCacheBlock.ref_cnt",
            "vllm.v1.core.kv_cache_utils:KVCacheBlock._block_hash",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.block_pool.BlockPool.free_block_queue.num_free_blocks, "
        ".num_gpu_blocks",
        how="read only: the engine gate's book takes the pool's free_block_queue once when it "
        "is built and reads its num_free_blocks on every admit (get_usage()'s own arithmetic)",
        why="get_usage() is two Python frames per admit inside the engine loop; the queue is "
        "made in BlockPool.__init__ and never replaced (0.31-0.33), so holding it is exact",
        removable_when="BlockPool.get_usage() is cheap enough to call from the engine gate",
        checks=(
            "vllm.v1.core.block_pool:BlockPool#free_block_queue",
            "vllm.v1.core.block_pool:BlockPool#num_gpu_blocks",
            "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue#num_free_blocks",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.kv_cache_utils.NONE_HASH",
        how="read once on the first probe (after EngineCore.__init__ ran init_none_hash)",
        why="the first block's parent hash; random per process for xxhash without PYTHONHASHSEED",
        removable_when="never: it is the hash chain's root, reading it is the exact way",
        checks=("vllm.v1.core.kv_cache_utils:init_none_hash",),
    ),
    Patch(
        symbol="KVCacheCoordinator.find_longest_cache_hit, kv_cache_utils.hash_block_tokens, "
        "get_request_block_hasher over an unscheduled Request",
        how="called as-is (read only) on engines the native path cannot answer exactly; with "
        "lookahead hashes (BlockPool.num_hash_lookahead_tokens, vLLM 0.33+) the request block "
        "hasher runs over a Request that is never scheduled",
        why="hybrid models, EAGLE (and its lookahead hashes) and context parallelism change the "
        "hash or the hit rule; vLLM's own functions are exact by construction",
        removable_when="never needed on plain full-attention engines",
        checks=(
            "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.find_longest_cache_hit",
            "vllm.v1.core.kv_cache_coordinator:UnitaryKVCacheCoordinator",
            "vllm.v1.core.kv_cache_utils:hash_block_tokens",
            "vllm.v1.core.kv_cache_utils:get_request_block_hasher",
            "vllm.v1.request:Request",
        ),
    ),
    Patch(
        symbol="app.state.serving_tokenization.create_tokenize, Tokenize*Request (vllm serve)",
        how="called as-is from the endpoint plugin's /session_gate/v1/probe route (read only)",
        why="a probe given text or chat messages must tokenize exactly as the server would",
        removable_when="never: reusing the server's own tokenizer and chat template is the point",
        checks=(
            "vllm.entrypoints.serve.tokenize.protocol:TokenizeChatRequest",
            "vllm.entrypoints.serve.tokenize.protocol:TokenizeCompletionRequest",
            "vllm.entrypoints.serve.engine.protocol:ErrorResponse",
        ),
    ),
    Patch(
        symbol="engine_client.generate of `vllm serve` (AsyncLLM.generate), read through "
        "app.state.openai_serving_completion / openai_serving_chat .engine_client",
        how="wrapped once per API-server process by the gating middleware: a request that "
        "carries an admission waits for the gate's answer before the original generate runs "
        "(refused: NotAdmitted, the middleware answers instead); every other request passes "
        "straight through; not wrapped (admit first) when the handlers use another client",
        why="the admit's round trip to the engine core overlaps vLLM's parsing and rendering "
        "of the request instead of preceding it, and the request reaches the engine only once "
        "admitted",
        removable_when="vLLM offers a middleware hook between request rendering and the engine",
        checks=("vllm.v1.engine.async_llm:AsyncLLM.generate",),
    ),
    Patch(
        symbol="EngineCore.session_gate_admit / _release / _cancel / _finish / _renew / _stats",
        how="added as new attributes, like the probes; admit may return a "
        "concurrent.futures.Future, which EngineCoreProc._invoke_utility_method answers later",
        why="the engine gate lives in the engine core so every client of the engine shares it",
        removable_when="vLLM offers a plugin hook that registers engine-core utility methods",
        checks=(
            "vllm.v1.engine.core:EngineCoreProc._invoke_utility_method",
            "vllm.v1.engine:EngineCoreRequestType.UTILITY",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.sched.scheduler.Scheduler._free_request",
        how="wrapped once in the engine core process (gate_binding): vLLM's own freeing runs, "
        "then a request whose SamplingParams.extra_args carries session_gate_lease releases "
        "that lease in the engine gate's book; any other request costs one attribute read and "
        "a truthiness test. The wrapper spells out vLLM 0.31-0.33's (request, "
        "delay_free_blocks=False) signature",
        why="a lease bound to the vLLM request it admitted is freed when that request ends or "
        "is aborted (a client gone: vLLM aborts it) with no release call (zero IPC); "
        "_free_request is the one place every finished and aborted request passes "
        "(update_from_output and finish_requests). The release's usage read counts "
        "Scheduler.running and Scheduler.waiting (the idle-engine rule); update_from_output "
        "frees a request before it takes it off running, so running counts 0 when none of its "
        "requests is still RequestStatus.RUNNING",
        removable_when="vLLM offers a request-finished hook for plugins in the engine core",
        checks=(
            "vllm.v1.core.sched.scheduler:Scheduler._free_request",
            "vllm.v1.core.sched.scheduler:Scheduler.finish_requests",
            "vllm.v1.core.sched.scheduler:Scheduler#running",
            "vllm.v1.core.sched.scheduler:Scheduler#waiting",
            "vllm.v1.request:Request#sampling_params",
            "vllm.v1.request:Request#status",
            "vllm.v1.request:RequestStatus.RUNNING",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue.remove / prepend_n "
        "(a finished session's blocks)",
        how="called, not replaced (finished_blocks): Scheduler._free_request's wrapper keeps "
        "the last freed request's Request.block_hashes per Request.session_id; the engine "
        "gate's finish looks each hash past the session's first prompt up with "
        "BlockHashToBlockMap.get_one_block(make_block_hash_with_group_id(hash, 0)), and moves "
        "the blocks whose ref_cnt is 0 (in the free queue) to its front, deepest first: what "
        "BlockPool.free_blocks does for blocks without a hash. Their hashes stay until vLLM "
        "reuses them",
        why="vLLM's free queue is LRU, so a finished session's blocks (freed last) outlive the "
        "prefixes of sessions between turns, which will come back; nobody asks for a finished "
        "session's blocks again",
        removable_when="vLLM's block pool takes an eviction-priority hint per request or session",
        checks=(
            "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.remove",
            "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue.prepend_n",
            "vllm.v1.core.kv_cache_utils:make_block_hash_with_group_id",
            "vllm.v1.core.kv_cache_utils:KVCacheBlock.is_null",
            "vllm.v1.core.block_pool:BlockHashToBlockMap.get_one_block",
            "vllm.v1.core.block_pool:BlockPool#free_block_queue",
            "vllm.v1.core.block_pool:BlockPool#cached_block_hash_to_block",
            "vllm.v1.request:Request#session_id",
            "vllm.v1.request:Request#block_hashes",
            "vllm.v1.request:Request#prompt_token_ids",
        ),
    ),
    Patch(
        symbol="vllm.SamplingParams.extra_args (the gating middleware's requests)",
        how="the middleware's wrapped engine_client.generate adds the key session_gate_lease "
        "(the admitted lease id, an int) to a gated request's extra_args (a new dict), for "
        "requests of one engine request (n 1, no beam search) on an engine without data "
        "parallelism; it travels to the engine core inside the EngineCoreRequest",
        why="binds the lease to the request it admitted (see Scheduler._free_request above)",
        removable_when="vLLM offers a request-finished hook for plugins in the engine core",
        checks=("vllm.sampling_params:SamplingParams.extra_args",),
    ),
    Patch(
        symbol="vllm.v1.core.sched.scheduler.Scheduler._handle_blocked_waiting_request",
        how="wrapped once in the engine core process, only with SESSION_GATE_SCHEDULER="
        "session-id (gate_scheduler): vLLM's own check runs first; when it says the request may "
        "proceed and the request carries a session_id, the engine gate's book decides, and a "
        "held request answers False. vLLM then skips it for this step (schedule()'s "
        "skip_request: into deferred_waiting, prepended back to its queue in order) and asks "
        "again next step. Once the scheduler has its gate, its instance __dict__ gets the "
        "native look (_native.SchedulerLook, a bound method that shadows the class's wrapper) "
        "for the looks that decide nothing: a request held with no answer (one map lookup, "
        "vLLM's check not called: a held request waits as WAITING or PREEMPTED, where the "
        "check does nothing), a request without a session_id, and a scheduled one; vLLM's "
        "check runs first for every other status",
        why="the one place schedule() asks whether a waiting request may start this step, and "
        "the way vLLM itself holds requests that wait for remote KV or a grammar: a held turn "
        "keeps its place in vLLM's own waiting queue, with no client protocol",
        removable_when="vLLM offers a plugin hook that admits or defers waiting requests",
        checks=(
            "vllm.v1.core.sched.scheduler:Scheduler._handle_blocked_waiting_request",
            "vllm.v1.core.sched.scheduler:Scheduler.schedule",
            "vllm.v1.core.sched.scheduler:Scheduler#deferred_waiting",
            "vllm.v1.request:Request#session_id",
            "vllm.v1.request:Request#prompt_token_ids",
            "vllm.v1.request:Request#status",
            "vllm.v1.request:RequestStatus.WAITING",
            "vllm.v1.request:RequestStatus.PREEMPTED",
        ),
    ),
    Patch(
        symbol="vllm.v1.core.sched.scheduler.Scheduler._update_request_as_session",
        how="wrapped once in the engine core process, only in scheduler mode (gate_scheduler): "
        "vLLM's own update runs first; then, if the streaming-input request holds a lease, the "
        "lease's committed working set grows to its new prompt and the chunk's max_tokens",
        why="a streaming-input session takes its next chunk into the same request, with no new "
        "admission; this is where vLLM extends its prompt, so the gate counts what the request "
        "now holds instead of its first chunk's size",
        removable_when="vLLM offers a plugin hook on a streaming request's next chunk",
        checks=(
            "vllm.v1.core.sched.scheduler:Scheduler._update_request_as_session",
            "vllm.v1.request:Request#max_tokens",
        ),
    ),
    Patch(
        symbol="vllm.v1.engine.core.EngineCore.add_request",
        how="wrapped once, only in scheduler mode: on an engine core's first request it builds "
        "the engine gate (if no utility call did) and its scheduler's gate, then forwards; "
        "later requests cost one dict lookup",
        why="scheduler mode needs the gate before the first request is scheduled, and plugins "
        "load inside EngineCore.__init__, before the hash root exists (the probe reads it)",
        removable_when="vLLM offers an engine-core-ready hook for plugins",
        checks=("vllm.v1.engine.core:EngineCore.add_request",),
    ),
    Patch(
        symbol="EngineCoreRequest.session_id / Request.session_id (read only)",
        how="read by the scheduler's gate; set by vLLM from the body field session_id, the "
        "X-Session-ID header or vllm_xargs (OpenAI server) and AsyncLLM.generate(session_id=)",
        why="the session identity vLLM already carries to the engine core keys the gate",
        removable_when="never: it is vLLM's own session identity",
        checks=(
            "vllm.v1.engine:EngineCoreRequest.session_id",
            "vllm.v1.engine.async_llm:AsyncLLM.generate",
        ),
    ),
    Patch(
        symbol="vllm.v1.request.Request.block_hashes (read only)",
        how="with SESSION_GATE_SCHEDULER=infer, read by the scheduler's gate when it first looks "
        "at a request without a session id (the prompt's full blocks: its length is the prompt "
        "block count) and when vLLM frees it (prompt and answer blocks, extended by "
        "Request.update_block_hashes as output tokens are appended); never written",
        why="session inference matches a request to the session whose answer blocks it contains, "
        "from the hashes vLLM already computed (no hashing of ours)",
        removable_when="never: it is vLLM's own per-request hash chain",
        checks=(
            "vllm.v1.request:Request#block_hashes",
            "vllm.v1.request:Request.update_block_hashes",
        ),
    ),
    Patch(
        symbol="vllm.v1.engine.core_client.DPLBAsyncMPClient.get_core_engine_for_request / "
        "add_request_async / call_utility_async (data parallelism with internal balancing)",
        how="wrapped once per process (dp_pin); vLLM's own code runs in every case. A request "
        "with a session_id and no data_parallel_rank (not pooling, not a streaming-input chunk "
        "already in flight) gets its session's pinned rank written into "
        "EngineCoreRequest.data_parallel_rank before vLLM's balancer reads it; a session's first "
        "turn is placed by vLLM's balancer and its engine's index becomes the pin. With several "
        "API-server processes (client_count > 1), add_request_async first asks the first engine "
        "core for a pin this process lacks (_call_utility_async, one round trip); "
        "call_utility_async forgets the pin after a session_gate_finish. The engine gate's lease "
        "doors (dp_leases) call one rank's gate with _call_utility_async: an admit goes to the "
        "session's pin, or to the least-loaded rank read from lb_engines and engine_inflight "
        "(read, never written), and pins it there. Nothing else changes: "
        "other requests cost one attribute read and a type test",
        why="vLLM's balancer sends each request to the least-loaded core, so one session's turns "
        "scatter across the DP ranks' caches; data_parallel_rank is vLLM's own way to pin a "
        "request (the X-data-parallel-rank header sets it), and the balancing client is the one "
        "place every request of every API server passes with its session id",
        removable_when="vLLM's DP balancer offers session affinity",
        checks=(
            "vllm.v1.engine.core_client:DPLBAsyncMPClient.get_core_engine_for_request",
            "vllm.v1.engine.core_client:DPLBAsyncMPClient.add_request_async",
            "vllm.v1.engine.core_client:DPLBAsyncMPClient.call_utility_async",
            "vllm.v1.engine.core_client:DPLBAsyncMPClient#reqs_in_flight",
            "vllm.v1.engine.core_client:DPLBAsyncMPClient#client_count",
            "vllm.v1.engine.core_client:MPClient#core_engines",
            "vllm.v1.engine.core_client:AsyncMPClient._call_utility_async",
            "vllm.v1.engine.core_client:DPAsyncMPClient#lb_engines",
            "vllm.v1.engine.core_client:DPLBAsyncMPClient#engine_inflight",
            "vllm.v1.engine:EngineCoreRequest.data_parallel_rank",
            "vllm.v1.engine:EngineCoreRequest.session_id",
            "vllm.v1.engine:EngineCoreRequest.pooling_params",
            "vllm.v1.engine:EngineCoreRequest.request_id",
            "vllm.entrypoints.generate.base.serving:GenerateBaseServing._get_data_parallel_rank",
        ),
    ),
    Patch(
        symbol="EngineCore.session_gate_dp_pin",
        how="added as new attributes, like the probes; only the first engine core's are called "
        "(the pins' authority between API-server processes), and session_gate_finish drops the "
        "session's pin there",
        why="several API-server processes balance over the same engine cores, and a session's "
        "turns may enter any of them: one table decides its rank",
        removable_when="vLLM's DP balancer offers session affinity",
        checks=("vllm.v1.engine.core:EngineCoreProc._invoke_utility_method",),
    ),
    Patch(
        symbol="vllm.v1.engine.core.EngineCore.post_step",
        how="wrapped once: the original runs, then the engine gate ticks if its timer is due "
        "(one dict lookup and one attribute read per step otherwise)",
        why="a busy engine runs no idle callbacks; the gate's waits, grace windows and lease "
        "TTLs must fire between steps, on the engine thread that owns the block pool",
        removable_when="vLLM offers a per-step or timer hook for plugins",
        checks=("vllm.v1.engine.core:EngineCore.post_step",),
    ),
    Patch(
        symbol="EngineCore._idle_state_callbacks, EngineCoreProc.input_queue (WAKEUP)",
        how="the gate's timer thread appends its tick to the idle callbacks and puts a WAKEUP "
        "request in the input queue, which unblocks the idle busy loop; vLLM then runs the "
        "callback on the engine thread",
        why="an idle engine blocks in input_queue.get(); the gate's timers must still fire",
        removable_when="vLLM offers a timer hook for plugins",
        checks=(
            "vllm.v1.engine.core:EngineCore#_idle_state_callbacks",
            "vllm.v1.engine.core:EngineCoreProc._notify_idle_state_callbacks",
            "vllm.v1.engine:EngineCoreRequestType.WAKEUP",
        ),
    ),
    Patch(
        symbol="the registry vllm serve's /metrics serves (get_prometheus_registry)",
        how="nothing is patched: the metrics mirror (metrics_mirror) registers a collector on "
        "prometheus_client's default REGISTRY, or with PROMETHEUS_MULTIPROC_DIR set writes "
        "mostrecent gauges there: what that function makes /metrics serve",
        why="the engine gate's numbers live in the engine core process; the frontend's stat "
        "loggers (vllm.stat_logger_plugins included) only receive vLLM's own SchedulerStats",
        removable_when="vLLM lets engine-core plugins publish metrics to the frontend",
        checks=(
            "vllm.v1.metrics.prometheus:get_prometheus_registry",
            "vllm.entrypoints.serve.instrumentator.metrics:attach_router",
        ),
    ),
    Patch(
        symbol="Scheduler.connector -> OffloadingConnector.connector_scheduler -> "
        "OffloadingConnectorScheduler.manager (CPUOffloadingManager) ._policy "
        "(LRUCachePolicy) .chunks, ._num_chunks, and .config (SchedulerOffloadConfig)",
        how="read only (host_tier): the prefix probe looks the offload keys of the prompt's "
        "chunks after the GPU hit up in the policy's chunks dict through the CPython API "
        "(PyDict_GetItemWithError: no Python call), until the first miss; the usage probe "
        "reads len(chunks) and _num_chunks. The config's group geometry decides whether the "
        "walk reproduces the connector's lookup; anything else answers 'unavailable'",
        why="CPUOffloadingManager.lookup is side-effect free today (policy.get), but a Python "
        "call per chunk inside the engine loop costs what the GPU probe avoids, and touch(), "
        "prepare_load() and the connector's get_num_new_matched_tokens() move LRU ranks or "
        "statistics; a dict read moves nothing (tested: ranks, heap, evictable set, chunk "
        "states and connector stats equal before and after probes)",
        removable_when="the offloading manager exposes a batched, side-effect-free prefix "
        "lookup and its capacity and use",
        checks=(
            "vllm.v1.core.sched.scheduler:Scheduler#connector",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
            "OffloadingConnector#connector_scheduler",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "OffloadingConnectorScheduler#manager",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "OffloadingConnectorScheduler#config",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "SchedulerOffloadConfig.kv_group_configs",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "SchedulerOffloadConfig.blocks_per_chunk",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "SchedulerOffloadConfig.supports_partial_tail",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "SchedulerOffloadConfig.dcp_world_size",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "GroupOffloadConfig.group_idx",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "GroupOffloadConfig.tokens_per_block",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "GroupOffloadConfig.hashes_per_chunk",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "GroupOffloadConfig.sliding_window_size_in_chunks",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "GroupOffloadConfig.is_eagle_group",
            "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager#_policy",
            "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager#_num_chunks",
            "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.lookup",
            "vllm.v1.kv_offload.cpu.policies.lru:LRUCachePolicy#chunks",
        ),
    ),
    Patch(
        symbol="vllm.v1.kv_offload.base.make_offload_key (the key format, not the function)",
        how="reproduced natively: a chunk's key is its last block's hash followed by the "
        "4-byte big-endian KV-cache group id, the bytes the GPU prefix map's keys have",
        why="the tier walk builds keys in one reused bytes object, as the GPU walk does",
        removable_when="never: it is the tier's own key; the in-process tests check every "
        "answer against the connector's lookup",
        checks=(
            "vllm.v1.kv_offload.base:make_offload_key",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:"
            "OffloadingConnectorScheduler.get_num_new_matched_tokens",
        ),
    ),
)
