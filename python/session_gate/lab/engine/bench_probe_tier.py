"""``make bench-probe`` (last part): the tiered prefix probe's cost beside the GPU-only probe's.

One in-process GPU cache (a real ``KVCacheManager``, 4,096 blocks of 16 tokens) and one real
host tier (the scheduler side of vLLM's ``OffloadingConnector``, 16,384 chunks of one block; see
``session_gate.lab.engine.inprocess_tier``). Two probe states over them, each with its own chain
cache: ``gpu`` (the probe without a tier, as on an engine without offloading) and ``tiered``
(the same probe reading the tier too). The same 32,768-token prompt (packed uint32 ids), the
same session, timed in interleaved pairs so both see the same machine:

* ``gpu_resident``: the prompt is on the GPU (the tier holds it too). The tiered probe adds one
  chunk lookup after the GPU hit. Target: tiered <= 2 x gpu.
* ``in_tier``: the prompt was evicted from the GPU and the tier holds all of it. The GPU-only
  probe stops at block 0; the tiered probe walks every chunk. Its cost is set beside the GPU-only
  probe of the same prompt while it was resident (``gpu_resident``'s ``gpu``): the same number
  of blocks walked, dict lookups against witness re-checks.
  And beside the GPU-only probe of the resident prompt without witnesses (``gpu_lookups_us``:
  a dict lookup per block, the tier walk's own kind of work).
* ``in_tier_one_off``: the same without a session (no chain: every block hashed), beside the
  GPU-only one-off probe of the prompt while resident.

Engine-loop time per call (each answer's ``engine_us``), median of ``SAMPLES`` pairs. The last line
is JSON.
"""

from __future__ import annotations

import array
import json
import random
import statistics
from typing import Any

from vllm.v1.core import kv_cache_utils

from session_gate.lab.engine.inprocess import engine_state
from session_gate.lab.engine.inprocess_tier import TieredDriver, tiered_state

PROMPT_TOKENS = 32_768
BLOCK = 16
GPU_BLOCKS = 4_096
TIER_CHUNKS = 16_384
SAMPLES = 300


def _pairs(a: Any, b: Any, samples: int) -> tuple[float, float]:
    """Median ``engine_us`` of ``a()`` and ``b()``, called in alternation."""
    ta, tb = [], []
    for i in range(samples):
        first, second = (a, b) if i % 2 else (b, a)
        r1, r2 = first()["engine_us"], second()["engine_us"]
        if first is a:
            ta.append(r1)
            tb.append(r2)
        else:
            ta.append(r2)
            tb.append(r1)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    rng = random.Random(29)
    prompt = [rng.randrange(3, 4096) for _ in range(PROMPT_TOKENS)]
    driver = TieredDriver(GPU_BLOCKS, BLOCK, TIER_CHUNKS)
    gpu = engine_state(driver.kv_cache_manager, vocab_size=4096)
    tiered = tiered_state(driver)
    driver.run(prompt)
    # The GPU probe without witnesses (no block class given): every block a dict lookup, as
    # the tier walk's chunks are (a chunk has no back-pointer to its key to re-check).
    lookups = engine_state(driver.kv_cache_manager, vocab_size=4096)
    lookups.native = lookups._native_module.ProbeEngine(
        lookups.hash_algo,
        kv_cache_utils.NONE_HASH,
        lookups.block_size,
        lookups.vocab_size,
        lookups.max_model_len,
        lookups._native_module.knob_from_env("chain_cache_bytes"),
    )

    # Packed uint32 ids, as the HTTP route and ``make bench-probe`` pass them: a list of 32K
    # Python ints would cost more to read than the walk itself.
    packed = array.array("I", prompt).tobytes()

    def probe(state: Any, session: str | None) -> Any:
        return lambda: state.probe_answer(session, packed)

    resident_g, resident_t = probe(gpu, "s"), probe(tiered, "s")
    first = resident_t()
    assert first["hit_tokens"] == PROMPT_TOKENS - BLOCK, first
    gpu_us, tiered_us = _pairs(resident_g, resident_t, SAMPLES)
    lookups_us, _ = _pairs(probe(lookups, "s"), resident_t, SAMPLES)
    one_off_g, one_off_t = probe(gpu, None), probe(tiered, None)
    gpu_one_resident_us, _ = _pairs(one_off_g, one_off_t, SAMPLES // 3)
    rows: dict[str, Any] = {
        "gpu_resident": {
            "gpu_us": gpu_us,
            "tiered_us": tiered_us,
            "ratio": tiered_us / gpu_us,
            "offloaded_tokens": first["offloaded_tokens"],
            "gpu_lookups_us": lookups_us,
        }
    }
    # Other sessions take the GPU cache; their prompts go to the tier as well.
    for _ in range(3):
        driver.run([rng.randrange(3, 4096) for _ in range(PROMPT_TOKENS)])
    evicted = tiered.probe_answer("s", prompt)
    assert evicted["hit_tokens"] == 0, evicted
    assert evicted["offloaded_tokens"] == PROMPT_TOKENS, evicted
    assert driver.lookup(prompt).external == PROMPT_TOKENS
    gpu_miss_us, tier_us = _pairs(resident_g, resident_t, SAMPLES)
    rows["in_tier"] = {
        "gpu_us_now": gpu_miss_us,
        "tiered_us": tier_us,
        "ratio_to_gpu_resident": tier_us / gpu_us,
        "ratio_to_gpu_lookups": tier_us / lookups_us,
        "tier_blocks_hashed": evicted["tier_blocks_hashed"],
    }
    gpu_one_us, tier_one_us = _pairs(one_off_g, one_off_t, SAMPLES // 3)
    rows["in_tier_one_off"] = {
        "gpu_us_now": gpu_one_us,
        "gpu_us_resident": gpu_one_resident_us,
        "tiered_us": tier_one_us,
        "ratio_to_gpu_resident": tier_one_us / gpu_one_resident_us,
    }
    print("SIMULATED tier (vLLM's own connector and manager, in-process; no KV moves)")
    print(f"{'case':<18}{'gpu-only us':>14}{'tiered us':>12}{'ratio':>8}")
    print(f"{'gpu_resident':<18}{gpu_us:>14.1f}{tiered_us:>12.1f}{tiered_us / gpu_us:>8.2f}")
    print(
        f"{'in_tier':<18}{gpu_us:>14.1f}{tier_us:>12.1f}{tier_us / gpu_us:>8.2f}"
        "   (gpu-only column: the same prompt while resident)"
    )
    print(
        f"{'in_tier':<18}{lookups_us:>14.1f}{tier_us:>12.1f}{tier_us / lookups_us:>8.2f}"
        "   (gpu-only column: resident, every block looked up, no witnesses)"
    )
    print(
        f"{'in_tier_one_off':<18}{gpu_one_resident_us:>14.1f}{tier_one_us:>12.1f}"
        f"{tier_one_us / gpu_one_resident_us:>8.2f}   (no session: every block hashed)"
    )
    print(json.dumps({"probe_tier": rows}))


if __name__ == "__main__":
    main()
