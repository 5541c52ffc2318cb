"""``make demo``: a CPU vLLM engine with the plugin, two sessions whose prompts grow every turn,
and each probe's answer printed beside the ``num_cached_tokens`` vLLM reports for that turn.

Run: ``python -m session_gate.lab.demo`` (``make demo`` does the set-up first).
"""

from __future__ import annotations

import random
import time

from session_gate.lab.engine.launch import generate, make_llm

BLOCK = 32
NUM_BLOCKS = 96  # ~3,000 tokens of KV cache: two growing sessions outgrow it by turn 5 or so


def main() -> None:
    started = time.time()
    print(f"starting a CPU vLLM engine (tiny dummy model, {NUM_BLOCKS} blocks x {BLOCK} tokens)...")
    llm = make_llm(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    print(f"engine up in {time.time() - started:.0f} s\n")
    core = llm.llm_engine.engine_core
    rng = random.Random(0)
    system = [rng.randrange(3, 4096) for _ in range(256)]
    prompts = {s: system + [rng.randrange(3, 4096) for _ in range(200)] for s in ("alice", "bob")}
    header = (
        f"{'turn':>4} {'session':>7} {'prompt':>7} {'probe hit':>9} {'vLLM cached':>11} "
        f"{'ratio':>6} {'hashed':>6} {'reused':>6} {'engine µs':>9} {'usage':>6}"
    )
    print(header)
    print("-" * len(header))
    mismatches = 0
    try:
        for turn in range(8):
            for session, prompt in prompts.items():
                answer = core.call_utility("session_gate_probe", session, prompt)
                output, cached = generate(llm, prompt, max_tokens=16)
                mismatches += answer["hit_tokens"] != cached
                print(
                    f"{turn:>4} {session:>7} {len(prompt):>7} {answer['hit_tokens']:>9} "
                    f"{cached:>11} {answer['hit_ratio']:>6.2f} {answer['blocks_hashed']:>6} "
                    f"{answer['blocks_reused']:>6} {answer['engine_us']:>9.1f} "
                    f"{answer['kv_cache_usage']:>6.2f}"
                )
                # Next turn: the model's reply and a tool result join the history.
                prompt.extend(
                    output + [rng.randrange(3, 4096) for _ in range(rng.randrange(100, 300))]
                )
        usage = core.call_utility("session_gate_usage")
        print(f"\nusage probe: {usage}")
        print(f"probe == vLLM's num_cached_tokens on {16 - mismatches}/16 turns")
    finally:
        core.shutdown()


if __name__ == "__main__":
    main()
