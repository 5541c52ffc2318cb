"""Scheduler mode ``infer`` with offline ``vllm.LLM.generate`` (no session id anywhere, the way
verl and OpenRLHF call vLLM today): each request is gated under the session inferred from the
block hashes vLLM computed for it, and the inference is audited against the truth the test
knows, through ``session_gate_stats("inferred")``.

One small CPU engine (256 blocks of 32 tokens). Sessions answer 40 tokens per turn (more than a
block, so each answer leaves an own block) and add 20 tokens of tool result before the next.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import environ
from session_gate.lab.engine.launch import make_llm
from vllm import SamplingParams

ENV = {
    "SESSION_GATE_SCHEDULER": "infer",
    "SESSION_GATE_MAX_WAIT_SEC": "60",
    "SESSION_GATE_IDLE_GRACE_SEC": "0",
}
ANSWER, TOOL, TURNS = 40, 20, 3
_seed = itertools.count(1)


@pytest.fixture(scope="module")
def llm():
    with environ(ENV):  # the engine core process inherits them
        engine = make_llm(num_blocks=256, block_size=32)
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()


def utility(llm, *args):
    return llm.llm_engine.engine_core.call_utility("session_gate_stats", *args)


def words(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i * 7) % 4000 for i in range(n)]


def play(llm, prompts: dict[str, list[int]], sampled: bool) -> dict[str, list[str]]:
    """Runs ``TURNS`` turns of every session (one ``generate`` per turn, all sessions in it);
    returns each session's engine-side request ids, turn by turn."""
    ids: dict[str, list[str]] = {s: [] for s in prompts}
    history = {s: list(p) for s, p in prompts.items()}
    for turn in range(TURNS):
        names = list(history)
        params = [
            SamplingParams(
                max_tokens=ANSWER,
                ignore_eos=True,
                temperature=1.0 if sampled else 0.0,
                seed=next(_seed) if sampled else None,
            )
            for _ in names
        ]
        before = len(utility(llm, "inferred"))
        outs = llm.generate(
            [{"prompt_token_ids": history[s]} for s in names], params, use_tqdm=False
        )
        rows = utility(llm, "inferred")[before:]
        # The engine's id is the LLM's id plus a random suffix.
        by_external = {rid.rsplit("-", 1)[0]: (rid, key) for rid, key, _ in rows}
        for name, out in zip(names, outs, strict=True):
            ids[name].append(by_external[out.request_id][1])
            history[name] += list(out.outputs[0].token_ids) + words(1000 + turn, TOOL)
    return ids


def test_every_turn_lands_in_its_own_session_and_a_task_group_is_never_merged(llm):
    before = utility(llm, "json")["scheduler"]
    task = words(7, 200)  # one GRPO group's task prompt, shared by four sessions
    prompts = {f"solo-{i}": words(100 + i, 120) for i in range(4)}
    prompts |= {f"group-{i}": list(task) for i in range(4)}
    keys = play(llm, prompts, sampled=True)
    for name, turns in keys.items():
        assert len(set(turns)) == 1, f"{name}'s turns went to several sessions: {turns}"
    firsts = [turns[0] for turns in keys.values()]
    assert len(set(firsts)) == len(prompts), f"sessions merged: {keys}"
    after = utility(llm, "json")["scheduler"]
    inferred, was = after["inferred"], before.get("inferred", {})
    assert inferred["new"] - was.get("new", 0) == len(prompts)
    assert inferred["continued"] - was.get("continued", 0) == len(prompts) * (TURNS - 1)
    assert after["gated"] - before["gated"] == len(prompts) * TURNS
    assert after["leases"] == 0 and after["holding"] == 0, after
    assert after["mode"] == "infer"


def test_identical_greedy_histories_are_ambiguous_but_stay_separate_sessions(llm):
    before = utility(llm, "json")["scheduler"]["inferred"]
    task = words(8, 150)
    prompts = {f"greedy-{i}": list(task) for i in range(3)}
    keys = play(llm, prompts, sampled=False)
    for turn in range(TURNS):
        in_turn = [turns[turn] for turns in keys.values()]
        assert len(set(in_turn)) == 3, f"turn {turn} merged sessions: {keys}"
    after = utility(llm, "json")["scheduler"]["inferred"]
    # Three identical idle sessions: the first two continuations choose among several.
    assert after["ambiguous"] - before["ambiguous"] >= 2 * (TURNS - 1)
    assert after["new"] - before["new"] == 3


def test_prometheus_text_carries_the_inference_counts_the_dashboard_plots(llm):
    text = utility(llm, "prometheus")
    for kind in ("continued", "ambiguous", "new"):
        assert f'session_gate_scheduler_inferred_total{{kind="{kind}"}}' in text
    dashboard = (
        Path(__file__).resolve().parents[2] / "dashboards" / "session-gate.json"
    ).read_text()
    assert "session_gate_scheduler_inferred_total" in dashboard
