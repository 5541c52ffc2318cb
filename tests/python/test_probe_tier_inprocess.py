"""The tiered prefix probe against vLLM's own host tier, in this process.

vLLM's CPU backend refuses KV offloading (its worker needs a CUDA-alike or XPU device), so the
tier is the scheduler side of a real ``OffloadingConnector`` (its ``CPUOffloadingManager`` and
``LRUCachePolicy``) beside a real ``KVCacheManager``, fed what the connector feeds its manager
(``session_gate.lab.engine.inprocess_tier``). Every probe's ``offloaded_tokens`` is compared
with the connector's own ``get_num_new_matched_tokens`` for the same prompt right after, and the
tier's LRU order, ranks and statistics with what they were before the probes.
"""

from __future__ import annotations

import random

import pytest
from conftest import pool_snapshot, random_prompt
from session_gate.lab.engine.inprocess import engine_state, make_kv_cache_manager
from session_gate.lab.engine.inprocess_tier import TieredDriver, tiered_state

BLOCK = 16


def assert_matches_vllm(driver, state, session, tokens) -> dict:
    """The probe's GPU hit and tier hit equal vLLM's for the same prompt, asked right after."""
    answer = state.probe_answer(session, tokens)
    assert answer["available"] and answer["path"] == "native", answer
    vllm = driver.lookup(tokens)
    assert answer["hit_tokens"] == vllm.gpu_hit, (answer, vllm)
    assert answer["offloaded_tokens"] == vllm.external, (answer, vllm)
    return answer


def evict_from_gpu(driver, state, rng, session, prompt, below: int, size: int = 20) -> None:
    """Runs other sessions' prompts until ``session``'s GPU hit on ``prompt`` is below
    ``below`` tokens."""
    for _ in range(20):
        if state.probe_answer(session, prompt)["hit_tokens"] < below:
            return
        driver.run(random_prompt(rng, size * BLOCK))
    pytest.fail(f"the GPU blocks of {session!r} were never evicted")


@pytest.fixture
def tiered():
    driver = TieredDriver(gpu_blocks=48, block_size=BLOCK, tier_chunks=512)
    return driver, tiered_state(driver)


def test_a_prompt_fully_on_the_gpu(tiered):
    driver, state = tiered
    rng = random.Random(1)
    prompt = random_prompt(rng, 10 * BLOCK + 5)
    driver.run(prompt)
    answer = assert_matches_vllm(driver, state, "a", prompt)
    assert (answer["hit_tokens"], answer["offloaded_tokens"]) == (10 * BLOCK, 0)
    # A prompt of whole blocks: vLLM recomputes its last token, so the GPU hit stops one block
    # short, and the connector offers that block from the tier.
    whole = random_prompt(rng, 6 * BLOCK)
    driver.run(whole)
    answer = assert_matches_vllm(driver, state, "w", whole)
    assert (answer["hit_tokens"], answer["offloaded_tokens"]) == (5 * BLOCK, BLOCK)


def test_a_prompt_partly_evicted_to_the_tier(tiered):
    driver, state = tiered
    rng = random.Random(2)
    prompt = random_prompt(rng, 24 * BLOCK + 3)
    driver.run(prompt)
    # vLLM frees a request's blocks tail first: the first evictions take the prompt's end.
    evict_from_gpu(driver, state, rng, "v", prompt, below=24 * BLOCK, size=6)
    answer = assert_matches_vllm(driver, state, "v", prompt)
    assert 0 < answer["hit_tokens"] < 24 * BLOCK, answer
    assert answer["hit_tokens"] + answer["offloaded_tokens"] == 24 * BLOCK, answer
    # Gone from the GPU altogether: the whole prefix is in the tier.
    evict_from_gpu(driver, state, rng, "v", prompt, below=1)
    answer = assert_matches_vllm(driver, state, "v", prompt)
    assert (answer["hit_tokens"], answer["offloaded_tokens"]) == (0, 24 * BLOCK)
    # The tier's prefix loads: vLLM then reports it cached.
    loaded = driver.run(prompt)
    assert (loaded.gpu_hit, loaded.external) == (0, 24 * BLOCK)
    assert assert_matches_vllm(driver, state, "v", prompt)["hit_tokens"] == 24 * BLOCK


def test_a_prompt_evicted_from_both():
    driver = TieredDriver(gpu_blocks=48, block_size=BLOCK, tier_chunks=40)
    state = tiered_state(driver)
    rng = random.Random(3)
    prompt = random_prompt(rng, 12 * BLOCK + 1)
    driver.run(prompt)
    for _ in range(4):
        driver.run(random_prompt(rng, 20 * BLOCK))
    answer = assert_matches_vllm(driver, state, "gone", prompt)
    assert (answer["hit_tokens"], answer["offloaded_tokens"]) == (0, 0)
    # The tier's LRU evicted the prompt's oldest chunks first (a request's chunks are ranked
    # tail first, so its head is the least recently used): nothing of the prefix is left.
    assert answer["offload_used_blocks"] == 40


def test_chunks_of_several_blocks_and_one_off_probes():
    """Chunks of 4 blocks: the GPU hit need not end on a chunk boundary (the connector then
    re-offers the chunk it ends in); a probe without a session hashes from block 0."""
    driver = TieredDriver(gpu_blocks=64, block_size=BLOCK, tier_chunks=128, blocks_per_chunk=4)
    state = tiered_state(driver)
    rng = random.Random(4)
    prompts = [
        random_prompt(rng, rng.randrange(5, 40) * BLOCK + rng.randrange(BLOCK)) for _ in range(6)
    ]
    for step in range(60):
        p = prompts[step % len(prompts)]
        session = None if step % 3 == 0 else f"s{step % len(prompts)}"
        assert_matches_vllm(driver, state, session, p)
        driver.run(p)
        if step % 4 == 0:
            prompts[step % len(prompts)] = p + random_prompt(rng, rng.randrange(1, 3 * BLOCK))
        if len(prompts[step % len(prompts)]) > 50 * BLOCK:
            prompts[step % len(prompts)] = random_prompt(rng, 7 * BLOCK)


def test_random_traffic_matches_vllm_on_every_probe(tiered):
    driver, state = tiered
    rng = random.Random(5)
    prompts = {f"s{i}": random_prompt(rng, rng.randrange(2, 20) * BLOCK + 3) for i in range(8)}
    offloaded = 0
    for _ in range(200):
        session = rng.choice(sorted(prompts))
        tokens = prompts[session]
        if rng.random() < 0.6:
            tokens = tokens + random_prompt(rng, rng.randrange(1, 2 * BLOCK))
        if len(tokens) > 40 * BLOCK:
            tokens = random_prompt(rng, 3 * BLOCK)
        prompts[session] = tokens
        offloaded += assert_matches_vllm(driver, state, session, tokens)["offloaded_tokens"]
        driver.run(tokens)
    assert offloaded > 0, "the walk should have found prefixes in the tier"


def test_probes_leave_the_tier_lru_and_the_gpu_pool_unchanged(tiered):
    driver, state = tiered
    rng = random.Random(6)
    prompts = [random_prompt(rng, n * BLOCK + 7) for n in (9, 14, 21)]
    for p in prompts:
        driver.run(p)
    evict_from_gpu(driver, state, rng, "x", prompts[0], below=1)
    tier_before = driver.lru_snapshot()
    pool_before = pool_snapshot(driver.kv_cache_manager)
    assert len(tier_before["order"]) > 20
    found = 0
    for i in range(300):
        p = prompts[i % 3]
        answer = state.probe_answer(f"s{i % 4}" if i % 5 else None, p[: len(p) - i % 9])
        found += answer["offloaded_tokens"]
        state.usage_answer(i % 2 == 0)
    assert found > 0
    assert driver.lru_snapshot() == tier_before
    assert pool_snapshot(driver.kv_cache_manager) == pool_before
    # ...while vLLM's own use of the same chunks does move them: the comparison can fail.
    driver.run(prompts[0])
    assert driver.lru_order() != tier_before["order"]


def test_a_chunk_whose_store_is_in_flight_counts(tiered):
    """vLLM's lookup defers a request whose chunks are still being stored (``None``) and loads
    them once stored: the probe already counts them, as the tokens that will load."""
    driver, state = tiered
    rng = random.Random(7)
    prompt = random_prompt(rng, 8 * BLOCK + 2)
    request = driver.gpu.request(prompt)
    driver.connector.on_new_request(request)
    context = driver.scheduler_side._req_status[request.request_id].req_context
    keys = driver.chunk_keys(request)
    out = driver.manager.prepare_store(keys, context)
    assert out is not None and len(out.keys_to_store) == 8
    answer = state.probe_answer("p", prompt)
    assert (answer["hit_tokens"], answer["offloaded_tokens"]) == (0, 8 * BLOCK)
    assert driver.lookup(prompt).external is None  # vLLM: ask again next step
    driver.manager.complete_store(out.keys_to_store, context)
    assert driver.lookup(prompt).external == 8 * BLOCK
    del driver.scheduler_side._req_status[request.request_id]


def test_usage_reports_the_tier_in_gpu_blocks():
    driver = TieredDriver(gpu_blocks=48, block_size=BLOCK, tier_chunks=30, blocks_per_chunk=2)
    state = tiered_state(driver)
    assert state.usage_answer()["offload_num_blocks"] == 60
    assert state.usage_answer()["offload_used_blocks"] == 0
    driver.run(random_prompt(random.Random(8), 9 * BLOCK + 4))
    # Nine full blocks are four full chunks of two.
    assert state.usage_answer()["offload_used_blocks"] == 8
    assert state.tier_usage() == (60, 8)


def test_without_a_readable_tier_the_probes_say_unavailable():
    kvm = make_kv_cache_manager(32, BLOCK)
    state = engine_state(kvm, vocab_size=4096)
    answer = state.probe_answer("s", random_prompt(random.Random(9), 3 * BLOCK))
    assert answer["offloaded_tokens"] == "unavailable"
    usage = state.usage_answer()
    assert usage["offload_num_blocks"] == usage["offload_used_blocks"] == "unavailable"
    assert state.tier_usage() is None
    assert "no KV connector" in state.tier_unavailable


def test_an_unreadable_policy_or_geometry_is_named():
    from session_gate.engine.host_tier import of_connector, resolve

    class NoConnector:
        connector = None

    assert resolve(NoConnector(), BLOCK) == (
        None,
        "no KV connector: the engine has no host KV tier",
    )
    assert "keeps its tier where this process cannot read it" in of_connector(object(), BLOCK)[1]
    driver = TieredDriver(gpu_blocks=32, block_size=BLOCK, tier_chunks=8)
    assert of_connector(driver.connector, 2 * BLOCK)[1] == (
        f"offloaded blocks hold {BLOCK} tokens, GPU blocks {2 * BLOCK}"
    )
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

    driver.manager._policy = ARCCachePolicy(cache_capacity=8)
    assert (
        "ARCCachePolicy keeps no single dict of chunks" in of_connector(driver.connector, BLOCK)[1]
    )


def test_a_remembered_chain_of_another_prompt_is_not_trusted_past_the_shared_prefix(tiered):
    """A session's chain keeps an older prompt's tail after a GPU miss inside the shared prefix;
    the tier walk uses the chain's hashes only while its stored tokens are this prompt's."""
    driver, state = tiered
    rng = random.Random(10)
    older = random_prompt(rng, 20 * BLOCK + 1)
    driver.run(older)
    evict_from_gpu(driver, state, rng, "s", older, below=1)
    assert assert_matches_vllm(driver, state, "s", older)["offloaded_tokens"] == 20 * BLOCK
    # The same session now sends a prompt that shares 5 blocks with the older one; its tail was
    # never run, so only those 5 blocks are in the tier (the older prompt's 20 still are).
    newer = older[: 5 * BLOCK] + random_prompt(rng, 12 * BLOCK + 1)
    answer = assert_matches_vllm(driver, state, "s", newer)
    assert (answer["hit_tokens"], answer["offloaded_tokens"]) == (0, 5 * BLOCK)


def test_the_engine_gate_reports_the_tier_and_reads_it_on_admits(tiered):
    """The engine gate over a tiered engine: its stats and Prometheus text carry the tier's
    capacity and use (the dashboard's host-tier panel), and admits (usage with the tier's
    figures, the tiered prefix probe under pressure) run through."""
    import re
    from pathlib import Path

    from session_gate.engine.gate_driver import EngineGateDriver
    from session_gate.engine.gate_methods import _Probes
    from session_gate.engine.methods import _load_native

    driver, state = tiered
    rng = random.Random(11)
    driver.run(random_prompt(rng, 9 * BLOCK + 1))
    native, _ = _load_native()
    # A watermark of 0 puts every admit under pressure: each one asks the prefix probe.
    config = native.GateConfig(high_watermark=0.01)
    # While the tier (512 blocks) holds every committed working set the gate steps aside:
    # admitted open, no prefix probe.
    aside = EngineGateDriver(object(), _Probes(state), native, config, 30.0)
    for n in range(2):
        answer = aside.admit(f"a{n}", random_prompt(rng, 5 * BLOCK), 16, False, f"a{n}", "c")
        assert (answer["status"], answer["reason"]) == ("admitted", "open"), answer
    assert aside.stats()["probes"]["prefix"]["count"] == 0
    # A first session whose working set (600 blocks) the tier cannot hold: the next cold one
    # is decided by the tree under pressure, the tiered prefix probe answers, and it waits.
    gate = EngineGateDriver(object(), _Probes(state), native, config, 30.0)
    first = gate.admit("s0", random_prompt(rng, 5 * BLOCK), 600 * BLOCK, False, "t0", "c")
    assert first["status"] == "admitted", first
    gate.admit("s1", random_prompt(rng, 5 * BLOCK), 16, False, "t1", "c")
    probes = gate.stats()["probes"]
    assert probes["prefix"]["count"] == 1 and probes["prefix"]["failures"] == 0, probes
    assert probes["usage"]["failures"] == 0, probes
    tier = gate.stats()["host_tier"]
    assert tier == {"num_blocks": 512, "used_blocks": 9, "unavailable": None}
    text = gate.prometheus()
    assert "session_gate_offload_blocks 512\n" in text
    assert "session_gate_offload_used_blocks 9\n" in text
    assert 'session_gate_admissions_total{reason="offloaded_prefix"} 0' in text
    dashboard = (
        Path(__file__).resolve().parents[2] / "dashboards" / "session-gate.json"
    ).read_text()
    for name in ("session_gate_offload_blocks", "session_gate_offload_used_blocks"):
        assert re.search(rf"\b{name}\b", dashboard), name
    assert 'reason=\\"offloaded_prefix\\"' in dashboard
    # Without a tier: no series, and the stats say why.
    plain = EngineGateDriver(
        object(),
        _Probes(engine_state(make_kv_cache_manager(32, BLOCK), vocab_size=4096)),
        native,
        config,
        30.0,
    )
    assert "session_gate_offload_blocks" not in plain.prometheus()
    assert "no KV connector" in plain.stats()["host_tier"]["unavailable"]
