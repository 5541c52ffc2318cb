"""The twin's scheduler against vLLM 0.32's real V1 ``Scheduler``, step by step.

vLLM's ``Scheduler`` is built in-process from the tiny engine's real ``VllmConfig`` (no model,
no engine, no GPU); a stand-in model runner returns one chosen token per request that finished
its prompt. The twin's ``SimReplica`` gets the same requests at the same steps. Agentic sessions
continue their history turn after turn on a small cache, so prefix hits, chunked prefill, the
token budget, ``max_num_seqs`` and preemption by recompute all happen. After every step the
scheduled tokens per request, the preempted requests, the finished requests and their
``num_cached_tokens`` (as vLLM reports them in the first output) must be identical.
"""

from __future__ import annotations

import random

import pytest
from session_gate import _native

BLOCK = 32


class VllmSide:
    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int, max_len: int) -> None:
        import torch
        from session_gate.lab.engine.launch import tiny_engine_args
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        args = tiny_engine_args(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_model_len=max_len,
            max_num_seqs=max_num_seqs,
        )
        args["max_num_batched_tokens"] = budget
        config = EngineArgs(**args).create_engine_config()
        config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=4, head_size=64, dtype=torch.bfloat16
        )
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        self.scheduler = Scheduler(
            config, kv_config, StructuredOutputManager(config), block_size=BLOCK
        )
        kv_cache_utils.init_none_hash(sha256)
        self.hasher = kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
        self.cached: dict[int, int] = {}

    def add(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(
            Request(str(rid), list(prompt), params, None, block_hasher=self.hasher)
        )

    def step(self, outputs: dict[int, list[int]]) -> tuple[dict, set, dict]:
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.scheduler
        out = sched.schedule()
        scheduled = {int(r): n for r, n in out.num_scheduled_tokens.items()}
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            req = sched.requests[r]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([outputs[int(r)][req.num_output_tokens]])
            else:
                sampled.append([])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        finished = {}
        for engine_outputs in sched.update_from_output(out, mro).values():
            for o in engine_outputs.outputs:
                rid = int(o.request_id)
                if o.prefill_stats is not None and rid not in self.cached:
                    self.cached[rid] = o.prefill_stats.num_cached_tokens
                if o.finish_reason is not None:
                    finished[rid] = self.cached.pop(rid)
        preempted = {int(r) for r in (out.preempted_req_ids or ())}
        return scheduled, preempted, finished


class Chain:
    """The twin's block hashes: one integer per distinct (parent, block tokens)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def hashes(self, tokens: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(len(tokens) // BLOCK):
            key = (parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            parent = self.ids.setdefault(key, len(self.ids) + 1)
            out.append(parent)
        return out


def run(seed: int, *, sessions: int, turns: int, num_blocks: int, max_seqs: int, budget: int):
    rng = random.Random(seed)
    max_len = (num_blocks - 1) * BLOCK
    vllm = VllmSide(num_blocks, max_seqs, budget, max_len)
    twin = _native.SimReplica(num_blocks, BLOCK, max_seqs, budget)
    chain = Chain()
    system = [rng.randrange(3, 4096) for _ in range(2 * BLOCK + 7)]
    history = {s: system + [rng.randrange(3, 4096) for _ in range(40)] for s in range(sessions)}
    turn = dict.fromkeys(range(sessions), 0)
    arrivals: dict[int, list[int]] = {}
    for s in range(sessions):
        arrivals.setdefault(rng.randrange(0, 8), []).append(s)
    outputs: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    stats = {"preempted": 0, "hit_tokens": 0, "chunked": 0, "finished": 0}
    step, next_rid, live = 0, 1, 0
    prev: set[int] = set()
    while arrivals or live:
        for s in arrivals.pop(step, []):
            max_tokens = rng.randrange(2, 40)
            prompt = history[s]
            if len(prompt) + max_tokens > max_len:
                continue  # the session is done: its context no longer fits
            rid, next_rid = next_rid, next_rid + 1
            outputs[rid] = [rng.randrange(3, 4096) for _ in range(max_tokens)]
            owner[rid] = s
            vllm.add(rid, prompt, max_tokens)
            twin.add_request(rid, len(prompt), max_tokens, chain.hashes(prompt + outputs[rid]))
            live += 1
        want_sched, want_pre, want_fin = vllm.step(outputs)
        got = twin.step()
        if got is None:
            assert not want_sched and not want_fin, f"step {step}: twin idle, vLLM ran"
        else:
            got_sched, got_fin, got_pre, _ = got
            assert dict(got_sched) == want_sched, f"step {step}: scheduled tokens differ"
            assert set(got_pre) == want_pre, f"step {step}: preemptions differ"
            assert dict(got_fin) == want_fin, f"step {step}: finished/num_cached_tokens differ"
            stats["preempted"] += len(want_pre)
            # A prefill that continues from the previous step was chunked.
            stats["chunked"] += sum(1 for r, n in want_sched.items() if n > 1 and r in prev)
            prev = {r for r, n in want_sched.items() if n > 1}
        for rid, cached in want_fin.items():
            live -= 1
            stats["finished"] += 1
            stats["hit_tokens"] += cached
            s = owner.pop(rid)
            turn[s] += 1
            if turn[s] < turns:
                append = [rng.randrange(3, 4096) for _ in range(rng.randrange(1, 200))]
                history[s] = history[s] + outputs[rid] + append
                arrivals.setdefault(step + 1 + rng.randrange(0, 10), []).append(s)
        step += 1
        assert step < 50_000
    return stats


@pytest.mark.parametrize("seed", [0, 1])
def test_twin_scheduler_matches_vllm_step_by_step(seed):
    stats = run(seed, sessions=12, turns=8, num_blocks=96, max_seqs=6, budget=256)
    assert stats["finished"] > 60
    assert stats["preempted"] > 0, stats  # the cache was tight enough to preempt
    assert stats["hit_tokens"] > 0, stats  # continuing sessions hit their history
    assert stats["chunked"] > 0, stats  # long prompts were chunked


def test_roomy_cache_many_sessions():
    stats = run(5, sessions=24, turns=5, num_blocks=400, max_seqs=16, budget=1024)
    assert stats["finished"] > 100
    assert stats["hit_tokens"] > 0
