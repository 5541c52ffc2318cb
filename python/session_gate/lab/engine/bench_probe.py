"""``make bench-probe``: what a probe costs inside vLLM's engine loop, against vLLM's own Python.

Two cache sizes, each on vLLM's real data structures, each measured against its baseline in the
same run:

* **131,072 blocks of 16 tokens** (an H200's cache for a 7B model): a real ``KVCacheManager``
  built in this process (no GPU needed at any size) and filled to 90% with many sessions'
  prefixes through the scheduler's own calls (``get_computed_blocks``, ``allocate_slots``,
  ``free``; see ``session_gate.lab.engine.inprocess``). Probes run the exact code of the
  ``session_gate_*`` utility methods (``EngineState.usage_answer`` / ``probe_answer``).
* **1,104 blocks of 32 tokens in a running CPU engine** (engine core in this process, tiny
  model with dummy weights): probes go through the installed ``EngineCore.session_gate_*``
  methods.

Per size and call: the engine-loop time per call (each answer's own ``engine_us`` timer: what every
running sequence waits), median and p99; on the CPU engine also the whole utility call as vLLM's
loop makes it (``*_dispatch_us``: method lookup, ``inspect.signature``, the call; see
``_dispatch``). The probes: usage (O(1)), usage with the exact
free-but-cached count (opt-in, linear), a full probe of a 32,768-token prompt, and an incremental
probe (the same session's prompt grown by a 512-token turn, every block resident), timed straight
after the session's previous probe (warm caches) and, as ``incremental_probe_cold_us``, after
64 MB were written in between (cold caches, as after model steps in a serving engine). The baseline
(``vllm_python_ms``) is vLLM's own Python path for the same prompt on the same cache: its request
block hasher, then ``get_cached_block`` per block until the first miss (as
``find_longest_cache_hit`` does). Prints a table, then one JSON line last.

Memory: the in-process cache takes about 0.5 GB; the CPU engine about 1.5 GB (tiny model, a 72 MB
KV cache). If the engine does not start (another process holds the memory, or the machine is
smaller), the error says why; ``SESSION_GATE_BENCH_ENGINE=0`` skips it and keeps the in-process
measurements.
"""

from __future__ import annotations

import array
import gc
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

PROMPT_TOKENS = 32_768
TURN_TOKENS = 512
GPU_BLOCKS = 131_072
GPU_BLOCK_SIZE = 16
FILL = 0.90
#: Samples per timed call (p99 needs a few hundred); vLLM's Python path is slower, fewer.
SAMPLES = 300
BASELINE_SAMPLES = 15
#: Bytes written between a session's two probes in the cold variant: more than this VM's L2
#: (4 MB a core) and a fair share of its L3, as a model step's weights and activations do.
COLD_BYTES = 64 << 20


def _stats(samples_us: list[float]) -> tuple[float, float]:
    """(median, p99) of samples in microseconds (the gate benchmark's quantiles)."""
    from session_gate.lab.bench_gate import quantiles

    return quantiles([us * 1000.0 for us in samples_us])


def _timed_us(fn: Callable[[], Any], samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def _vllm_python_probe(hash_fn, get_cached_block, tokens: list[int], block: int):
    """vLLM's own path for one prompt: its request block hasher over a real ``Request``, then
    ``get_cached_block`` per block until the first miss. Returns a function running it once."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(block, hash_fn)
    request = Request("bench", tokens, SamplingParams(max_tokens=1), None)

    def run() -> int:
        hit = 0
        for h in hasher(request)[: (len(tokens) - 1) // block]:
            if not get_cached_block(h, [0]):
                break
            hit += 1
        return hit * block

    return run


def _measure(
    usage: Callable[[bool], dict[str, Any]],
    probe: Callable[[str | None, bytes], dict[str, Any]],
    forget: Callable[[str], Any],
    vllm_probe: Callable[[], int],
    prompt: list[int],
    grown: list[int],
    block: int,
) -> dict[str, Any]:
    """Every timed call on one cache, through the utility methods' code (``engine_us``)."""
    packed, packed_grown = (array.array("I", t).tobytes() for t in (prompt, grown))
    expect = (len(prompt) - 1) // block * block
    full = probe(None, packed)
    assert full["hit_tokens"] == expect, full
    assert vllm_probe() == expect

    def engine_us(call: Callable[[], dict[str, Any]], samples: int = SAMPLES) -> list[float]:
        return [call()["engine_us"] for _ in range(samples)]

    counter = iter(range(10**9))

    def incremental() -> dict[str, Any]:
        sid = f"inc-{next(counter)}"
        probe(sid, packed)
        answer = probe(sid, packed_grown)
        forget(sid)
        assert answer["hit_tokens"] == (len(grown) - 1) // block * block, answer
        return answer

    flush = bytearray(COLD_BYTES)

    def incremental_cold() -> dict[str, Any]:
        # In the engine a session's next probe comes after model steps, not straight after its
        # last probe: the chain's stored tokens and the witnessed block objects are then cold.
        sid = f"cold-{next(counter)}"
        probe(sid, packed)
        flush[::64] = bytes(COLD_BYTES // 64)
        answer = probe(sid, packed_grown)
        forget(sid)
        return answer

    last = incremental()
    row: dict[str, Any] = {"block_size": block, "num_blocks": usage(False)["num_blocks"]}
    gc.collect()
    for name, call in (
        ("usage_probe_us", lambda: usage(False)),
        ("usage_counted_us", lambda: usage(True)),
        ("full_probe_us", lambda: probe(None, packed)),
        ("incremental_probe_us", incremental),
        ("incremental_probe_cold_us", incremental_cold),
    ):
        samples = SAMPLES // 3 if call is incremental_cold else SAMPLES
        row[name], row[name.replace("_us", "_p99_us")] = _stats(engine_us(call, samples))
    python_us, _ = _stats(_timed_us(vllm_probe, BASELINE_SAMPLES))
    row.update(
        full_probe_ms=row["full_probe_us"] / 1000.0,
        vllm_python_ms=python_us / 1000.0,
        speedup=python_us / row["full_probe_us"],
        incremental_blocks_rechecked=last["blocks_rechecked"],
        incremental_blocks_hashed=last["blocks_hashed"],
        num_cached_free_blocks=usage(True)["num_cached_free_blocks"],
        kv_cache_usage=usage(False)["kv_cache_usage"],
    )
    return row


def bench_gpu_sized(prompt: list[int], grown: list[int]) -> dict[str, Any]:
    """131,072 blocks of 16 tokens in-process, 90% full of many sessions' prefixes."""
    from vllm.utils.hashing import get_hash_fn_by_name

    from session_gate.lab.engine.inprocess import (
        SchedulerDriver,
        engine_state,
        make_kv_cache_manager,
    )

    block = GPU_BLOCK_SIZE
    kvm = make_kv_cache_manager(GPU_BLOCKS, block, max_model_len=len(grown) + block)
    driver = SchedulerDriver(kvm)
    pool = kvm.block_pool
    rng = random.Random(1)
    # The measured session's prefix (the grown prompt, so the turn's blocks are resident too)
    # first, then other sessions' prefixes (4K-32K tokens, sharing a system prompt) until the
    # cache is 90% full. All finished: their blocks are free but cached, as between turns.
    driver.run(grown)
    system = [rng.randrange(3, 4096) for _ in range(2048)]
    sessions = 1
    target = int(FILL * (GPU_BLOCKS - 1))
    while (room := target - len(pool.cached_block_hash_to_block)) >= 64:
        new_tokens = min(rng.randrange(2048, 30720), room * block)
        driver.run(system + [rng.randrange(3, 4096) for _ in range(new_tokens)])
        sessions += 1
    assert pool.get_num_free_blocks() == GPU_BLOCKS - 1, "every request was freed"
    state = engine_state(kvm, vocab_size=4096, max_model_len=len(grown) + block)
    assert state.path == "native", state.path
    vllm_probe = _vllm_python_probe(
        get_hash_fn_by_name("sha256"), pool.get_cached_block, prompt, block
    )
    row = _measure(
        state.usage_answer, state.probe_answer, state.forget, vllm_probe, prompt, grown, block
    )
    row.update(sessions=sessions, num_cached_blocks=len(pool.cached_block_hash_to_block))
    row.update(_breakdown(state, prompt, grown))
    row.update(_full_probe_verdict(row))
    return row


def _breakdown(state: Any, prompt: list[int], grown: list[int]) -> dict[str, Any]:
    """Where a probe's time goes, native calls only (no answer dict), in the same run: the
    incremental probe with witnesses and with a dict lookup per block (how it worked before),
    and the full probe split into its two parts, each timed alone: vLLM's hashing done natively
    (the chain's tip only, no lookup) and the dict lookups of the same hashes (a session's
    remembered chain re-probed without witnesses: every block looked up, none hashed)."""
    from vllm.v1.core import kv_cache_utils

    from session_gate import _native

    cache = state.block_pool.cached_block_hash_to_block._cache
    packed, packed_grown = (array.array("I", t).tobytes() for t in (prompt, grown))
    args = ("sha256", kv_cache_utils.NONE_HASH, state.block_size, 1 << 32, 1 << 20, 1 << 28)
    out: dict[str, Any] = {}
    for name, engine in (
        ("witnesses", _native.ProbeEngine(*args, block_type=kv_cache_utils.KVCacheBlock)),
        ("lookups", _native.ProbeEngine(*args)),
    ):
        counter = iter(range(10**9))

        def incremental(engine: Any = engine, counter: Any = counter) -> float:
            sid = f"b-{next(counter)}"
            engine.probe(cache, sid, packed)
            t0 = time.perf_counter_ns()
            engine.probe(cache, sid, packed_grown)
            elapsed = (time.perf_counter_ns() - t0) / 1000.0
            engine.forget(sid)
            return elapsed

        out[f"native_incremental_{name}_us"] = statistics.median(
            incremental() for _ in range(SAMPLES // 3)
        )
    full = _native.ProbeEngine(*args)
    # The utility method's answer, its own native call, and the native re-check alone (the same
    # prompt re-probed), rotating on one engine, each straight after a fresh session's full
    # probe: all three see the same caches and the same moments of the VM, so their difference
    # is the turn's work (hashing, lookups, growing the chain), not the loop they ran in.
    timed: dict[str, list[float]] = {"answer": [], "native": [], "recheck": []}
    for i in range(SAMPLES // 2):
        sid = f"pair-{i}"
        state.probe(sid, packed)
        kind = ("answer", "native", "recheck")[i % 3]
        if kind == "answer":
            timed[kind].append(state.probe_answer(sid, packed_grown)["engine_us"])
        else:
            again = packed_grown if kind == "native" else packed
            t0 = time.perf_counter_ns()
            state.native.probe(cache, sid, again)
            timed[kind].append((time.perf_counter_ns() - t0) / 1000.0)
        state.forget(sid)
    out["incremental_answer_us"] = statistics.median(timed["answer"])
    out["incremental_native_us"] = statistics.median(timed["native"])
    out.update(_incremental_split(state, _native, cache, packed, packed_grown))
    out["native_full_us"] = statistics.median(
        _timed_us(lambda: full.probe(cache, None, packed), SAMPLES // 3)
    )
    # The two parts of a full probe, each alone. Hashing: each block's hash is the next one's
    # parent, so this is a chain of SHA-256 compressions no probe can shorten.
    out["native_hash_only_us"] = statistics.median(
        _timed_us(
            lambda: _native.hash_chain_tip(
                "sha256", kv_cache_utils.NONE_HASH, packed, state.block_size
            ),
            SAMPLES // 3,
        )
    )
    lookups = _native.ProbeEngine(*args)
    hit_blocks = lookups.probe(cache, "lookups", packed)[0]
    out["native_lookups_only_us"] = statistics.median(
        _timed_us(lambda: lookups.probe(cache, "lookups", packed), SAMPLES // 3)
    )
    out["native_lookups_only_blocks"] = hit_blocks
    # The turn's blocks are looked up one by one (no witness yet). The re-check (with the
    # call) is timed in the incremental probe's own setting, rotating with it above; what the
    # turn adds on top of it is hashing, lookups and growing the chain, and the rest after the
    # first two is the growth.
    turn_blocks = (len(packed_grown) - len(packed)) // 4 // state.block_size
    out["split_turn_lookups_us"] = out["native_lookups_only_us"] / hit_blocks * turn_blocks
    out["split_recheck_us"] = statistics.median(timed["recheck"])
    out["split_turn_us"] = out["incremental_native_us"] - out["split_recheck_us"]
    out["split_rest_us"] = out["split_turn_us"] - (
        out["split_turn_hash_us"] + out["split_turn_lookups_us"]
    )
    return out


def _incremental_split(
    state: Any, native_module: Any, cache: Any, packed: bytes, grown: bytes
) -> dict[str, Any]:
    """Parts of the native incremental probe timed alone, each in a loop of the same call
    (medians, same run): the fixed cost of a call (a session's one-block prompt re-probed), the
    re-check of the resident chain with hot caches (``split_recheck_hot_us``: the same 32K prompt
    re-probed back to back; ``_breakdown`` times the re-check where the incremental probe runs,
    straight after a full probe, as ``split_recheck_us``) and the turn's hashing (its 32 blocks,
    no lookup)."""
    from vllm.v1.core import kv_cache_utils

    native = state.native
    samples = SAMPLES // 3
    one_block = packed[: (state.block_size + 1) * 4]
    native.probe(cache, "split-call", one_block)
    call_us = statistics.median(
        _timed_us(lambda: native.probe(cache, "split-call", one_block), samples)
    )
    native.forget("split-call")
    native.probe(cache, "split-recheck", packed)
    recheck_us = statistics.median(
        _timed_us(lambda: native.probe(cache, "split-recheck", packed), samples)
    )
    native.forget("split-recheck")
    turn = grown[len(packed) :]
    hash_us = statistics.median(
        _timed_us(
            lambda: native_module.hash_chain_tip(
                "sha256", kv_cache_utils.NONE_HASH, turn, state.block_size
            ),
            samples,
        )
    )
    return {
        "split_call_us": call_us,
        "split_recheck_hot_us": recheck_us,
        "split_turn_hash_us": hash_us,
    }


def _full_probe_verdict(row: dict[str, Any]) -> dict[str, Any]:
    """Whether the full-probe targets (0.3 ms, 30x vLLM's path) can be met on this CPU, from
    this run's own measurements: hashing alone is the floor of any probe of a cold prompt."""
    hash_us, lookups_us = row["native_hash_only_us"], row["native_lookups_only_us"]
    vllm_us = row["vllm_python_ms"] * 1000.0
    return {
        "full_probe_floor_ms": hash_us / 1000.0,
        "full_probe_hash_share": hash_us / row["native_full_us"],
        "full_probe_lookup_share": lookups_us / row["native_full_us"],
        # The speedup if the dict lookups cost nothing: above it, 30x is out of reach here.
        "speedup_ceiling": vllm_us / hash_us,
        "full_probe_target_reachable": hash_us <= 300.0 and vllm_us / hash_us >= 30.0,
    }


def bench_engine(prompt: list[int], grown: list[int]) -> dict[str, Any]:
    """The same probes through the installed utility methods of a running CPU engine (block 32)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    from session_gate.lab.engine.launch import generate, make_llm

    block = 32
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    try:
        llm = make_llm(
            num_blocks=len(grown) // block + 64,
            block_size=block,
            max_model_len=len(grown) + 64,
            max_num_batched_tokens=8192,
        )
    except Exception as exc:
        raise SystemExit(
            f"bench-probe: the CPU engine did not start ({type(exc).__name__}: {exc}).\n"
            "It needs about 1.5 GB of free memory besides this process (tiny model, 1,104 "
            "blocks x 32 tokens). Free memory (stop other vLLM engines), or run with "
            "SESSION_GATE_BENCH_ENGINE=0 to keep only the in-process measurements."
        ) from exc
    try:
        core = llm.llm_engine.engine_core.engine_core
        generate(llm, grown)
        pool = core.scheduler.kv_cache_manager.block_pool
        vllm_probe = _vllm_python_probe(
            get_hash_fn_by_name("sha256"), pool.get_cached_block, prompt, block
        )
        row = _measure(
            core.session_gate_usage,
            core.session_gate_probe,
            core.session_gate_forget,
            vllm_probe,
            prompt,
            grown,
            block,
        )
        row["num_cached_blocks"] = len(pool.cached_block_hash_to_block)
        row.update(_dispatch(core, prompt, grown))
        return row
    finally:
        llm.llm_engine.engine_core.shutdown()


def _dispatch(core: Any, prompt: list[int], grown: list[int]) -> dict[str, Any]:
    """The engine-loop time per utility call as vLLM's busy loop spends it
    (``EngineCoreProc._handle_client_request``): look the method up on the engine, convert the
    arguments (``_convert_msgspec_args``: ``inspect.signature`` of the method), call it; only
    the queueing of the output is left out. ``engine_us`` (the answer's own timer) starts inside
    the call, so ``*_dispatch_us - engine_us`` is vLLM's part. ``signature_us`` times the
    signature step alone on the installed method (``utility.Utility``: computed once) and
    ``signature_plain_us`` on a plain bound method (how the probes were installed before)."""
    import types

    from vllm.v1.engine.core import EngineCoreProc

    from session_gate.engine import methods

    convert = EngineCoreProc._convert_msgspec_args
    packed, packed_grown = (array.array("I", t).tobytes() for t in (prompt, grown))

    def call(name: str, *args: Any) -> tuple[Any, float]:
        t0 = time.perf_counter_ns()
        method = getattr(core, name)
        answer = method(*convert(method, args))
        return answer, (time.perf_counter_ns() - t0) / 1000.0

    usage_us = [call("session_gate_usage", False)[1] for _ in range(SAMPLES)]
    incremental_us, overhead_us = [], []
    for i in range(SAMPLES):
        sid = f"dispatch-{i}"
        call("session_gate_probe", sid, packed)
        answer, us = call("session_gate_probe", sid, packed_grown)
        incremental_us.append(us)
        overhead_us.append(us - answer["engine_us"])
        call("session_gate_forget", sid)
    installed = core.session_gate_probe
    plain = types.MethodType(methods.UTILITY_METHODS["session_gate_probe"], core)
    args = ("s", packed_grown)
    row: dict[str, Any] = {}
    row["usage_dispatch_us"], row["usage_dispatch_p99_us"] = _stats(usage_us)
    row["incremental_dispatch_us"], row["incremental_dispatch_p99_us"] = _stats(incremental_us)
    row["dispatch_overhead_us"] = statistics.median(overhead_us)
    row["signature_us"] = statistics.median(_timed_us(lambda: convert(installed, args), SAMPLES))
    row["signature_plain_us"] = statistics.median(_timed_us(lambda: convert(plain, args), SAMPLES))
    return row


def _print_row(name: str, row: dict[str, Any]) -> None:
    print(f"\n{name}:")
    for key, value in row.items():
        if isinstance(value, bool):
            text = str(value)
        else:
            text = f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"
        print(f"  {key:<34} {text}")


def main() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 4096) for _ in range(PROMPT_TOKENS)]
    grown = prompt + [rng.randrange(3, 4096) for _ in range(TURN_TOKENS)]
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"prompt {PROMPT_TOKENS} tokens + a {TURN_TOKENS}-token turn; sha256; "
        f"engine-loop time per call (engine_us), median and p99 of {SAMPLES}"
    )
    gpu = bench_gpu_sized(prompt, grown)
    _print_row(f"in-process KVCacheManager, {GPU_BLOCKS:,} blocks x {GPU_BLOCK_SIZE}", gpu)
    gc.collect()
    engine: dict[str, Any] | None = None
    if os.environ.get("SESSION_GATE_BENCH_ENGINE", "1") != "0":
        engine = bench_engine(prompt, grown)
        _print_row(f"CPU engine, {engine['num_blocks'] + 1:,} blocks x 32", engine)
    result: dict[str, Any] = {
        # Block 16 (the setting) is only possible in-process: the CPU backend needs
        # multiples of 32.
        "full_probe_ms": gpu["full_probe_ms"],
        "vllm_python_ms": gpu["vllm_python_ms"],
        "speedup": gpu["speedup"],
        "usage_probe_us_131k": gpu["usage_probe_us"],
        "incremental_probe_us_131k": gpu["incremental_probe_us"],
        # The same after 64 MB were written between the session's two probes (caches as after
        # model steps): what the engine loop pays in service. No target; reported so the warm
        # number is not read as the whole story.
        "incremental_probe_cold_us_131k": gpu["incremental_probe_cold_us"],
        # Why the full probe misses its targets, if it does: hashing alone, measured above.
        "full_probe_floor_ms": gpu["full_probe_floor_ms"],
        "speedup_ceiling": gpu["speedup_ceiling"],
        "full_probe_target_reachable": gpu["full_probe_target_reachable"],
        "gpu_sized_block16": gpu,
        "notes": [
            "engine-loop time per call: *_probe_us* are each answer's own engine_us (the "
            "method's work: argument checks, the native call, the answer dict); "
            "*_dispatch_us (CPU engine only) is the whole utility call as vLLM's busy loop "
            "makes it (method lookup, inspect.signature, the call), engine_us included; only "
            "queueing the output is left out",
            "incremental_probe_us* are warm (straight after the session's previous probe); "
            "incremental_probe_cold_us* follow 64 MB written in between, as after model steps",
            "speedup and speedup_ceiling divide by vLLM's path timed in this run: the VM's speed "
            "drifts between runs, so compare within one run",
            "gpu_sized_block16.split_*_us: the native incremental probe's parts. split_recheck_us "
            "(re-check of the 2,047 resident blocks, with the call) rotates with "
            "incremental_native_us, both straight after a fresh session's full probe; "
            "split_turn_us is their difference (the turn: 32 hashes, 32 lookups, growing the "
            "chain), split_rest_us that minus split_turn_hash_us and split_turn_lookups_us (each "
            "timed alone in a loop): the growth. split_call_us and split_recheck_hot_us are the "
            "same calls repeated back to back (hot caches)",
            "on the 2-core dev VM (3 Dec) the warm incremental probe at 131K ranged 15-31 us "
            "with the VM's speed (vLLM's path 5.4-9.6 ms); paired in one process, the one-line "
            "re-check and one answer dict cut it 7.5%, the re-check 15% (README, 'Probe cost')",
        ],
    }
    if engine is not None:
        result.update(
            usage_probe_us=engine["usage_probe_us"],
            incremental_probe_us=engine["incremental_probe_us"],
            # The whole utility call as vLLM's loop makes it (method lookup, its signature, the
            # call), beside the answer's own engine_us above.
            usage_dispatch_us=engine["usage_dispatch_us"],
            incremental_dispatch_us=engine["incremental_dispatch_us"],
            engine_block32=engine,
        )
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
