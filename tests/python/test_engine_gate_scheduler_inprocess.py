"""Scheduler mode with an in-process ``AsyncLLM`` (verl's and OpenRLHF's way: no HTTP, no lease
protocol): ``AsyncLLM.generate(..., session_id=...)`` is gated in vLLM's scheduler, a held
request aborted with ``AsyncLLM.abort`` leaves nothing, and shutting the engine down while a
request is held exits cleanly.

One small CPU engine (128 blocks of 32 tokens, 127 usable; line 0.85 x 127 = 107.95 blocks).
Pressure comes from a blocker lease taken with the gate's own ``session_gate_admit`` (16 + 75
blocks), which leaves no room for a 300 + 600 token turn (29 blocks).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
import pytest_asyncio
from conftest import environ, eventually
from session_gate.lab.engine.launch import make_async_llm
from session_gate.probes import pack_token_ids
from vllm import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENV = {
    "SESSION_GATE_SCHEDULER": "session-id",
    "SESSION_GATE_MAX_WAIT_SEC": "60",
    "SESSION_GATE_WAIT_POLL_SEC": "0.5",
    "SESSION_GATE_IDLE_GRACE_SEC": "0",
    "SESSION_GATE_LEASE_TTL_SEC": "60",
}
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    with environ(ENV):  # the engine core process inherits them
        llm = make_async_llm(num_blocks=128, block_size=32)
    try:
        yield llm
    finally:
        if not getattr(llm, "_test_shut_down", False):
            llm.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i) % 4000 for i in range(n)]


async def call(engine, name: str, *args):
    return await engine.engine_core.call_utility_async(name, *args)


async def sched(engine) -> dict:
    return (await call(engine, "session_gate_stats", "json"))["scheduler"]


async def run(engine, seed: int, n: int, max_tokens: int, request_id: str, **kwargs) -> int:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    tokens = 0
    async for out in engine.generate(
        {"prompt_token_ids": prompt(seed, n)}, params, request_id=request_id, **kwargs
    ):
        tokens = len(out.outputs[0].token_ids)
    return tokens


async def blocker(engine) -> int:
    answer = await call(
        engine,
        "session_gate_admit",
        f"blocker-{next(_ids)}",
        pack_token_ids(prompt(900, 500)),
        2400,
        False,
        f"blocker-ticket-{next(_ids)}",
        "blocker",
    )
    assert answer["status"] == "admitted", answer
    return answer["lease"]


async def test_generate_with_a_session_id_is_gated_and_without_one_is_not(engine):
    before = await sched(engine)
    assert await run(engine, 1, 64, 4, f"r-{next(_ids)}", session_id="inproc-1") == 4
    mid = await sched(engine)
    assert mid["gated"] == before["gated"] + 1 and mid["admitted"] == before["admitted"] + 1
    assert await run(engine, 2, 64, 4, f"r-{next(_ids)}") == 4
    after = await sched(engine)
    assert after["gated"] == mid["gated"], after
    assert after["leases"] == 0, after


async def test_a_held_generate_runs_when_the_gate_admits_it(engine):
    before = await sched(engine)
    lease = await blocker(engine)
    turn = asyncio.ensure_future(run(engine, 3, 300, 600, f"r-{next(_ids)}", session_id="held"))

    async def held() -> bool:
        return (await sched(engine))["holding"] == 1

    await eventually(held, what="the turn held")
    await asyncio.sleep(1.0)
    assert not turn.done()
    assert await call(engine, "session_gate_release", lease, "blocker") is True
    assert await asyncio.wait_for(turn, 120) == 600
    after = await sched(engine)
    assert after["held"] == before["held"] + 1 and after["max_wait"] == before["max_wait"]
    assert after["leases"] == 0 and after["holding"] == 0, after


async def test_a_held_request_aborted_with_asyncllm_abort_leaves_nothing(engine):
    before = await sched(engine)
    lease = await blocker(engine)
    rid = f"r-{next(_ids)}"
    turn = asyncio.ensure_future(run(engine, 4, 300, 600, rid, session_id="aborted"))

    async def held() -> bool:
        return (await sched(engine))["holding"] == 1

    await eventually(held, what="the turn held")
    await engine.abort(rid)

    async def gone() -> bool:
        return (await sched(engine))["holding"] == 0

    await eventually(gone, what="the hold ended")
    turn.cancel()
    s = await call(engine, "session_gate_stats", "json")
    assert s["scheduler"]["aborted_while_held"] == before["aborted_while_held"] + 1, s
    assert s["engine_gate"]["leases_held"] == 1, s  # the blocker's only
    assert s["engine_gate"]["attempts_pending"] == 0, s
    assert s["scheduler"]["admitted"] == before["admitted"], s
    assert await call(engine, "session_gate_release", lease, "blocker") is True
    assert engine.output_processor.get_num_unfinished_requests() == 0


async def test_a_streaming_input_session_holds_its_first_chunks_lease_until_it_ends(engine):
    """vLLM's own sessions (streaming input: one resumable request, KV kept between chunks):
    the gate decides on the first chunk; the lease stays committed while the session waits for
    its next chunk (its blocks stay allocated) and is released when the stream ends. Later
    chunks are not held (holding them would free nothing: their blocks are the request's), but
    each grows the lease's committed working set to what the request now holds."""
    from vllm.engine.protocol import StreamingInput
    from vllm.sampling_params import RequestOutputKind

    before = await sched(engine)
    chunks = [prompt(6, 100), prompt(7, 200)]
    # Chunk i > 0 is sent once the test read the stats after chunk i - 1 (``proceed[i]``).
    proceed = [asyncio.Event() for _ in chunks]
    finished = [asyncio.Event() for _ in chunks]
    close = asyncio.Event()

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
        )

    async def inputs():
        for i, tokens in enumerate(chunks):
            if i:
                await proceed[i].wait()
            yield StreamingInput({"prompt_token_ids": list(tokens)}, params(4))
            await finished[i].wait()
        await close.wait()

    async def consume() -> None:
        chunk = 0
        async for out in engine.generate(
            inputs(), params(1), request_id=f"stream-{next(_ids)}", session_id="streamed"
        ):
            if out.outputs[0].finish_reason is not None and chunk < len(finished):
                finished[chunk].set()
                chunk += 1

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(finished[0].wait(), 120)
    stats = await call(engine, "session_gate_stats", "json")
    paused = stats["scheduler"]
    assert paused["gated"] == before["gated"] + 1 and paused["leases"] == 1, paused
    # 100 prompt + 4 output tokens, in 32-token blocks.
    assert stats["committed_blocks"] == 4, stats
    proceed[1].set()
    await asyncio.wait_for(finished[1].wait(), 120)
    stats = await call(engine, "session_gate_stats", "json")
    resumed = stats["scheduler"]
    assert resumed["gated"] == paused["gated"] and resumed["leases"] == 1, resumed
    assert resumed["held"] == before["held"], resumed
    # The second chunk's request: 100 + 3 kept answer tokens (vLLM drops the last sampled
    # one) + 200 prompt tokens, and 4 to generate: 307 tokens, 10 blocks.
    assert resumed["stream_chunks_grown"] == before["stream_chunks_grown"] + 1, resumed
    assert stats["committed_blocks"] == 10, stats
    close.set()
    await asyncio.wait_for(task, 120)

    async def released() -> bool:
        return (await sched(engine))["leases"] == 0

    await eventually(released, what="the stream's lease released")


async def test_shutdown_with_a_held_request_exits_cleanly(engine):
    await blocker(engine)  # never released: the engine goes down holding it
    turn = asyncio.ensure_future(run(engine, 5, 300, 600, f"r-{next(_ids)}", session_id="down"))

    async def held() -> bool:
        return (await sched(engine))["holding"] == 1

    await eventually(held, what="the turn held")
    done = threading.Event()

    def shut_down() -> None:
        engine.shutdown()
        done.set()

    threading.Thread(target=shut_down, daemon=True).start()
    engine._test_shut_down = True
    deadline = time.monotonic() + 60
    while not done.is_set():
        assert time.monotonic() < deadline, "shutdown with a held request did not return"
        await asyncio.sleep(0.1)
    turn.cancel()
