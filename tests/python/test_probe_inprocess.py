"""Probes against a real vLLM ``KVCacheManager`` in this process, driven by the scheduler's calls.

No engine: block 16 (which the CPU backend cannot run) and exact control over evictions. Each
probe's answer is compared with the ``num_cached_tokens`` vLLM reports when the same prompt is
scheduled right after, and the incremental probe's witnesses are shown to notice every eviction,
reuse and reset.
"""

from __future__ import annotations

import random

import pytest
from conftest import pool_snapshot, random_prompt
from session_gate.lab.engine.inprocess import SchedulerDriver, engine_state, make_kv_cache_manager

BLOCK = 16


@pytest.fixture
def cache():
    kvm = make_kv_cache_manager(64, BLOCK)
    return SchedulerDriver(kvm), engine_state(kvm, vocab_size=4096)


def assert_matches_vllm(driver, state, session, tokens) -> dict:
    """The probe's hit_tokens equals vLLM's num_cached_tokens for the same prompt right after."""
    answer = state.probe_answer(session, tokens)
    assert answer["available"] and answer["path"] == "native", answer
    actual = driver.run(tokens)
    assert answer["hit_tokens"] == actual, f"probe said {answer['hit_tokens']}, vLLM {actual}"
    return answer


def test_cold_warm_extended_diverged_prompts_match_vllm(cache):
    driver, state = cache
    rng = random.Random(3)
    base = random_prompt(rng, 10 * BLOCK + 5)
    assert assert_matches_vllm(driver, state, "a", base)["hit_tokens"] == 0
    assert assert_matches_vllm(driver, state, "a", base)["hit_tokens"] == 10 * BLOCK
    extended = base + random_prompt(rng, 3 * BLOCK + 7)
    assert assert_matches_vllm(driver, state, "a", extended)["hit_tokens"] == 10 * BLOCK
    diverged = extended[: 4 * BLOCK + 3] + [9] + extended[4 * BLOCK + 4 :]
    assert assert_matches_vllm(driver, state, "a", diverged)["hit_tokens"] == 4 * BLOCK


def test_a_resident_prefix_is_rechecked_without_lookups(cache):
    driver, state = cache
    prompt = random_prompt(random.Random(4), 20 * BLOCK)
    driver.run(prompt)
    first = state.probe_answer("s", prompt)
    assert (first["hit_tokens"], first["blocks_rechecked"]) == (19 * BLOCK, 0)
    again = state.probe_answer("s", prompt + [7] * BLOCK)
    assert again["hit_tokens"] == 20 * BLOCK
    # The 19 blocks the first probe found are re-checked by identity; block 19 was not looked
    # up then (the last token is recomputed), so it is looked up now.
    assert (again["blocks_rechecked"], again["blocks_hashed"]) == (19, 1)


def fill_until_evicted(driver, state, rng, session: str, prompt: list[int], hit: int) -> None:
    """Runs other sessions' 30-block prompts (at most 10) until ``session``'s probe of
    ``prompt`` reports fewer than ``hit`` tokens: its blocks were handed out again."""
    for _ in range(10):
        driver.run(random_prompt(rng, 30 * BLOCK))
        if state.probe_answer(session, prompt)["hit_tokens"] < hit:
            return
    pytest.fail(f"the blocks of session {session!r} were never evicted")


def test_an_incremental_probe_after_an_eviction_reports_the_eviction(cache):
    driver, state = cache
    rng = random.Random(5)
    victim = random_prompt(rng, 24 * BLOCK + 1)
    driver.run(victim)
    assert state.probe_answer("victim", victim)["hit_tokens"] == 24 * BLOCK
    assert state.probe_answer("victim", victim)["blocks_rechecked"] == 24
    # Other sessions take the cache: the free queue hands out the victim's blocks (tail first:
    # vLLM frees a request's blocks in reverse), evicting their hashes and caching new ones.
    fill_until_evicted(driver, state, rng, "victim", victim, 24 * BLOCK)
    # The witnesses of the evicted (and reused) blocks no longer hold; the answer is vLLM's.
    answer = assert_matches_vllm(driver, state, "victim", victim)
    assert answer["hit_tokens"] < 24 * BLOCK
    assert answer["blocks_rechecked"] <= answer["hit_blocks"]


def test_a_witness_rechecks_the_hash_slot_alone_even_after_a_class_change(cache):
    """A re-check reads only the block's hash slot: its type was checked when the witness was
    taken, and CPython lets ``__class__`` change only to a type of the same layout, so the slot
    read is still the one vLLM writes. Blocks moved to such a class are still re-checked, and
    their eviction is still reported."""
    driver, state = cache
    rng = random.Random(12)
    prompt = random_prompt(rng, 8 * BLOCK + 1)
    driver.run(prompt)
    assert state.probe_answer("s", prompt)["hit_tokens"] == 8 * BLOCK
    pool = driver.kv_cache_manager.block_pool
    block_type = type(pool.blocks[1])

    class SameLayout(block_type):
        __slots__ = ()

    class OtherLayout(block_type):
        __slots__ = ("extra",)

    with pytest.raises(TypeError, match="layout"):
        pool.blocks[1].__class__ = OtherLayout
    for block in pool.blocks:
        block.__class__ = SameLayout
    again = state.probe_answer("s", prompt)
    assert (again["hit_tokens"], again["blocks_rechecked"]) == (8 * BLOCK, 8)
    fill_until_evicted(driver, state, rng, "s", prompt, 8 * BLOCK)
    assert assert_matches_vllm(driver, state, "s", prompt)["hit_tokens"] < 8 * BLOCK


def test_a_grown_prompt_is_validated_where_it_differs_from_the_remembered_one(cache):
    """Ids the session's chain already holds were checked when stored; every other id is still
    checked, and a refused prompt leaves the remembered chain as it was."""
    driver, state = cache
    prompt = random_prompt(random.Random(10), 12 * BLOCK + 1)
    driver.run(prompt)
    assert state.probe_answer("s", prompt)["hit_tokens"] == 12 * BLOCK
    grown = prompt + [4096] + random_prompt(random.Random(11), BLOCK)
    with pytest.raises(ValueError, match=f"token id 4096 at index {len(prompt)} is outside"):
        state.probe_answer("s", grown)
    # An out-of-vocabulary id inside the remembered prefix differs from the stored one there.
    inside = prompt[:40] + [5000] + prompt[41:]
    with pytest.raises(ValueError, match="token id 5000 at index 40 is outside"):
        state.probe_answer("s", inside)
    again = state.probe_answer("s", prompt)
    assert (again["hit_tokens"], again["blocks_rechecked"], again["blocks_hashed"]) == (
        12 * BLOCK,
        12,
        0,
    )
    # A session first seen with a refused prompt is not remembered.
    sessions = state.native.chain_cache_sessions
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.probe_answer("new", [4096] * (3 * BLOCK))
    assert state.native.chain_cache_sessions == sessions


def test_random_traffic_never_fools_a_witness(cache):
    """Many sessions growing and diverging on a small cache, every probe checked against vLLM."""
    driver, state = cache
    rng = random.Random(6)
    prompts = {f"s{i}": random_prompt(rng, rng.randrange(1, 12) * BLOCK) for i in range(6)}
    rechecked = 0
    for step in range(150):
        session = rng.choice(sorted(prompts))
        tokens = prompts[session]
        move = rng.random()
        if move < 0.6:
            tokens = tokens + random_prompt(rng, rng.randrange(1, 3 * BLOCK))
        elif move < 0.7 and len(tokens) > BLOCK:
            tokens = tokens[: rng.randrange(1, len(tokens))]
        elif move < 0.8:
            i = rng.randrange(len(tokens))
            tokens = tokens[:i] + [(tokens[i] + 1) % 4096] + tokens[i + 1 :]
        if len(tokens) > 40 * BLOCK:
            tokens = random_prompt(rng, 3 * BLOCK)
        prompts[session] = tokens
        answer = assert_matches_vllm(driver, state, session, tokens)
        rechecked += answer["blocks_rechecked"]
        assert answer["blocks_rechecked"] <= answer["hit_blocks"], step
    assert rechecked > 0, "the walk should have re-checked witnesses"


def test_reset_prefix_cache_invalidates_every_witness(cache):
    driver, state = cache
    prompt = random_prompt(random.Random(7), 10 * BLOCK + 1)
    driver.run(prompt)
    assert state.probe_answer("s", prompt)["hit_tokens"] == 10 * BLOCK
    assert driver.kv_cache_manager.reset_prefix_cache()
    answer = state.probe_answer("s", prompt)
    assert (answer["hit_tokens"], answer["blocks_rechecked"]) == (0, 0)
    assert driver.run(prompt) == 0


def test_probes_leave_the_block_pool_unchanged_with_a_request_running(cache):
    driver, state = cache
    rng = random.Random(8)
    prompts = [random_prompt(rng, n) for n in (7 * BLOCK + 3, 12 * BLOCK, 5 * BLOCK + 9)]
    driver.run(prompts[0])
    running = driver.request(prompts[1])
    driver.prefill(running)  # holds its blocks (ref_cnt 1) while we probe
    before = pool_snapshot(driver.kv_cache_manager)
    for i in range(200):
        p = prompts[i % 3]
        state.probe_answer(f"s{i % 5}", p[: len(p) - i % 4])
        state.usage_answer(i % 2 == 0)
    state.forget("s1")
    assert pool_snapshot(driver.kv_cache_manager) == before
    driver.free(running)


def test_usage_is_o1_unless_the_cached_free_count_is_asked_for(cache):
    driver, state = cache
    driver.run(random_prompt(random.Random(9), 9 * BLOCK))
    pool = driver.kv_cache_manager.block_pool
    plain = state.usage_answer()
    assert plain["num_cached_free_blocks"] is None
    assert plain["kv_cache_usage"] == pool.get_usage()
    counted = state.usage_answer(True)
    expected = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    assert counted["num_cached_free_blocks"] == expected == 9
    with pytest.raises(TypeError, match="count_cached_free"):
        state.usage_answer("yes")


@pytest.mark.parametrize("use_eagle", [False, True])
def test_lookahead_hashes_are_answered_exactly(use_eagle):
    """vLLM 0.33+ with EAGLE hashes each block with the next tokens (the scheduler then turns the
    last-block drop off; both settings are checked): the probe answers through vLLM's own request
    block hasher, and every answer equals vLLM's num_cached_tokens, through growth, divergence
    and evictions."""
    import inspect

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if "num_hash_lookahead_tokens" not in inspect.signature(KVCacheManager).parameters:
        pytest.skip("this vLLM has no lookahead block hashes (added in 0.33)")
    for lookahead in (1, 3):
        kvm = make_kv_cache_manager(
            64, BLOCK, use_eagle=use_eagle, num_hash_lookahead_tokens=lookahead
        )
        driver, state = SchedulerDriver(kvm), engine_state(kvm, vocab_size=4096)
        assert state.path == "python", state.unavailable
        rng = random.Random(10 + lookahead)
        prompt = random_prompt(rng, 8 * BLOCK + 3)
        assert assert_python_matches_vllm(driver, state, prompt) == 0
        assert assert_python_matches_vllm(driver, state, prompt) > 0, "vLLM hits with lookahead"
        # The block boundary token decides the hash: a prompt that ends right after a block,
        # one that changes the first lookahead token, and sessions evicting each other.
        assert_python_matches_vllm(driver, state, prompt[: 4 * BLOCK + 1])
        # Token 3 * BLOCK opens block 3 and is block 2's lookahead: block 2 no longer hits (and
        # with the EAGLE drop on, vLLM also drops the last block that does).
        changed = prompt[: 3 * BLOCK] + [(prompt[3 * BLOCK] + 1) % 4096] + prompt[3 * BLOCK + 1 :]
        assert assert_python_matches_vllm(driver, state, changed) == (2 - use_eagle) * BLOCK
        prompts = [random_prompt(rng, rng.randrange(2, 20) * BLOCK + 5) for _ in range(4)]
        for step in range(40):
            p = prompts[step % 4]
            p += random_prompt(rng, rng.randrange(1, BLOCK * 2))
            if len(p) > 40 * BLOCK:
                p[:] = random_prompt(rng, 3 * BLOCK)
            assert_python_matches_vllm(driver, state, list(p))


def assert_python_matches_vllm(driver, state, tokens) -> int:
    answer = state.probe_answer("s", tokens)
    assert answer["available"] and answer["path"] == "python", answer
    actual = driver.run(tokens)
    assert answer["hit_tokens"] == actual, f"probe said {answer['hit_tokens']}, vLLM {actual}"
    return actual


def test_vllm_reads_each_probe_methods_signature_without_recomputing_it(cache):
    """vLLM runs ``inspect.signature`` on the method of every utility call; the installed probe
    methods (``utility.Utility``) bind, once per engine, the engine state's own answer methods
    with a signature computed once, cached in the engine's ``__dict__``."""
    import inspect

    from session_gate.engine import methods
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    driver, state = cache
    methods.install()

    class Core:  # stands in for an EngineCore whose probe state was already built
        pass

    core = Core()
    core.__dict__[methods._STATE_ATTR] = state
    for name, params, answer_method in (
        ("session_gate_usage", ["count_cached_free"], state.usage_answer),
        ("session_gate_probe", ["session_id", "token_ids"], state.probe_answer),
        ("session_gate_forget", ["session_id"], state.forget),
    ):
        utility = EngineCore.__dict__[name]
        bound = utility.__get__(core)
        assert core.__dict__[name] is bound, name
        assert bound.func == answer_method and bound.args == (), name
        assert inspect.signature(bound) is utility.signature, name
        assert list(utility.signature.parameters) == params
    tokens = random_prompt(random.Random(77), 5 * 16 + 1)
    args = EngineCoreProc._convert_msgspec_args(core.session_gate_probe, ("sig", tokens))
    assert args == ("sig", tokens)
    answer = core.session_gate_probe(*args)
    assert answer["path"] == "native" and answer["engine_us"] > 0
    assert answer["hit_tokens"] == driver.run(tokens)  # vLLM's own count, right after
    assert core.session_gate_probe(*args)["hit_tokens"] == 5 * 16
    assert core.session_gate_forget("sig") is True
    # A plain call through the class, as a function would be called, answers the same.
    assert EngineCore.session_gate_usage(core, False)["num_cached_free_blocks"] is None
