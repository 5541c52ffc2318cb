"""The engine-side probes through real UTILITY calls to a CPU vLLM engine core process.

One engine for the module: 64 blocks of 32 tokens, so a few long prompts force evictions.
"""

from __future__ import annotations

import array
import random

import pytest
from conftest import random_prompt, run_prompt
from session_gate.lab.engine.launch import TINY_VOCAB, make_llm

BLOCK = 32
NUM_BLOCKS = 64
MAX_LEN = (NUM_BLOCKS - 1) * BLOCK


@pytest.fixture(scope="module")
def llm():
    engine = make_llm(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def call(llm, method: str, *args):
    return llm.llm_engine.engine_core.call_utility(method, *args)


def probe(llm, session: str | None, tokens) -> dict:
    answer = call(llm, "session_gate_probe", session, tokens)
    assert answer["available"], answer
    return answer


def assert_probe_matches_vllm(llm, session: str, tokens: list[int]) -> int:
    """The probe's hit_tokens equals what vLLM reports when the prompt runs right after."""
    predicted = probe(llm, session, tokens)["hit_tokens"]
    actual = run_prompt(llm, tokens)
    assert predicted == actual, f"probe said {predicted}, vLLM cached {actual}"
    return actual


def test_usage_reports_vllm_usage_and_block_counts(llm):
    usage = call(llm, "session_gate_usage")
    assert usage["num_blocks"] == NUM_BLOCKS - 1
    assert usage["block_size"] == BLOCK
    assert usage["hash_algo"] == "sha256"
    assert 0 <= usage["num_free_blocks"] <= usage["num_blocks"]
    expected = 1.0 - usage["num_free_blocks"] / usage["num_blocks"]
    assert usage["kv_cache_usage"] == pytest.approx(expected)
    assert usage["num_cached_free_blocks"] is None  # O(1) unless asked for
    counted = call(llm, "session_gate_usage", True)
    assert 0 <= counted["num_cached_free_blocks"] <= counted["num_free_blocks"]
    with pytest.raises(Exception, match="count_cached_free must be a bool"):
        call(llm, "session_gate_usage", "yes")


def test_usage_counts_the_schedulers_running_and_waiting_requests(llm):
    """The counts the gate's idle-engine rule reads: a request added is waiting or running
    (the engine core's own loop may step between the add and the probe) until it finishes;
    an engine with neither is idle."""
    from vllm import SamplingParams

    def counts():
        usage = call(llm, "session_gate_usage")
        return usage["num_running_reqs"], usage["num_waiting_reqs"]

    engine = llm.llm_engine
    assert counts() == (0, 0)
    prompt = {"prompt_token_ids": random_prompt(random.Random(31), 2 * BLOCK + 3)}
    # Long enough that it cannot finish before the probe answers.
    engine.add_request("counted", prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    running, waiting = counts()
    assert running + waiting == 1 and min(running, waiting) == 0, (running, waiting)
    while engine.has_unfinished_requests():
        engine.step()
    assert counts() == (0, 0)


def test_an_engine_without_a_host_tier_says_so_through_the_utility_calls(llm):
    """No KV connector on this engine (vLLM's CPU backend cannot offload): the tier's figures
    cross the utility call as "unavailable", beside a GPU answer that is still given."""
    usage = call(llm, "session_gate_usage")
    assert usage["offload_num_blocks"] == usage["offload_used_blocks"] == "unavailable"
    answer = probe(llm, "no-tier", random_prompt(random.Random(29), 3 * BLOCK + 1))
    assert answer["offloaded_tokens"] == "unavailable" and answer["hit_tokens"] >= 0


def test_cold_warm_extended_diverged_prompts_match_num_cached_tokens(llm):
    rng = random.Random(7)
    base = random_prompt(rng, 10 * BLOCK + 5)
    assert assert_probe_matches_vllm(llm, "s-a", base) == 0  # cold
    assert assert_probe_matches_vllm(llm, "s-a", base) == 10 * BLOCK  # warm
    extended = base + random_prompt(rng, 3 * BLOCK + 7)
    assert assert_probe_matches_vllm(llm, "s-a", extended) == 10 * BLOCK  # extended
    diverged = extended[: 4 * BLOCK + 3] + [9] + extended[4 * BLOCK + 4 :]
    assert assert_probe_matches_vllm(llm, "s-a", diverged) == 4 * BLOCK  # diverged in block 4


def test_exact_block_multiple_is_capped_like_vllm(llm):
    # vLLM always recomputes the last token: a fully cached 8-block prompt reports 7 blocks.
    tokens = random_prompt(random.Random(11), 8 * BLOCK)
    run_prompt(llm, tokens)
    assert assert_probe_matches_vllm(llm, "s-cap", tokens) == 7 * BLOCK


def test_evicted_prefix_is_reported_cold(llm):
    rng = random.Random(21)
    victim = random_prompt(rng, 12 * BLOCK)
    run_prompt(llm, victim)
    assert probe(llm, "victim", victim)["hit_tokens"] == 11 * BLOCK
    # Fill the cache with other prompts until the victim's blocks are reused.
    for _ in range(4):
        run_prompt(llm, random_prompt(rng, MAX_LEN - 40))
    assert assert_probe_matches_vllm(llm, "victim", victim) < 11 * BLOCK


def test_packed_and_list_prompts_answer_the_same(llm):
    tokens = random_prompt(random.Random(31), 6 * BLOCK + 1)
    run_prompt(llm, tokens)
    packed = array.array("I", tokens).tobytes()
    as_list = probe(llm, None, tokens)
    as_bytes = probe(llm, None, packed)
    assert as_list["hit_tokens"] == as_bytes["hit_tokens"] == 6 * BLOCK


def test_incremental_probe_hashes_only_new_blocks(llm):
    rng = random.Random(41)
    first = random_prompt(rng, 20 * BLOCK)
    a = probe(llm, "inc", first)
    # Cold prompt: the walk stops at the first miss, so only one block is hashed.
    assert a["blocks_hashed"] == 1
    run_prompt(llm, first)
    b = probe(llm, "inc", first)
    assert b["hit_tokens"] == 19 * BLOCK
    grown = first + random_prompt(rng, 2 * BLOCK)
    run_prompt(llm, grown)
    c = probe(llm, "inc", grown)
    assert c["hit_tokens"] == 21 * BLOCK
    assert c["blocks_reused"] >= 19 and c["blocks_hashed"] <= 2
    assert call(llm, "session_gate_forget", "inc") is True
    d = probe(llm, "inc", grown)
    assert d["blocks_reused"] == 0 and d["hit_tokens"] == 21 * BLOCK


@pytest.mark.parametrize(
    "session, tokens, message",
    [
        ("s", [], "empty"),
        ("s", [5, -1, 7], "negative"),
        ("s", [5, "x", 7], "index 1"),
        ("s", [5, 1.5], "index 1"),
        ("s", [5, TINY_VOCAB], "outside the vocabulary"),
        ("s", list(range(3, 3 + MAX_LEN + 1)), "max_model_len"),
        ("s", b"\x01\x02\x03", "multiple of 4"),
        ("s", "not a list", "token_ids must be"),
        (42, [5, 6, 7], "session_id must be a str"),
    ],
)
def test_bad_input_is_refused_clearly_and_engine_keeps_serving(llm, session, tokens, message):
    with pytest.raises(Exception, match=message):
        call(llm, "session_gate_probe", session, tokens)
    # The engine core is alive and still generates correctly.
    tokens_ok = random_prompt(random.Random(51), 3 * BLOCK)
    assert run_prompt(llm, tokens_ok) in (0, 2 * BLOCK)
    assert call(llm, "session_gate_usage")["num_blocks"] == NUM_BLOCKS - 1
