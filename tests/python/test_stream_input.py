"""vLLM's own sessions on the CPU engine: ``AsyncLLM.generate`` fed an async generator of
``StreamingInput`` (vLLM 0.32's streaming input) runs a multi-turn session as one resumable
request, which is what the bench's ``stream`` mode (``session_gate.lab.bench.stream``) drives.

What these tests pin down, on a real engine (64 blocks of 32 tokens, 63 usable):

* each chunk's prompt is the *new* tokens only; vLLM appends them to the request's context, and
  the previous chunk's output joins the context except its last sampled token (it has no KV
  yet: ``Scheduler._update_request_as_session``). Checked through the prefix cache: after the
  session ends, a plain request with exactly that context hits every full block of it;
* each chunk's ``sampling_params`` carries its ``max_tokens``; a chunk ends with an output whose
  ``finish_reason`` is set while ``finished`` stays false, and the request stays open until the
  generator ends;
* ``RequestOutput.num_cached_tokens`` is the first chunk's prefix-cache hit on every later
  output too (vLLM takes prefill stats once per request), and ``prompt_token_ids`` grows by the
  new chunks only (the output processor does not add the kept output tokens, and extends the
  first chunk's token list in place: the caller's list, and every output's, is that list);
* a paused session keeps its KV blocks: a plain request that does not fit beside them waits
  (nothing preempts a session in ``WAITING_FOR_STREAMING_REQ``) until the session ends;
* the bench's ``run_stream`` records each chunk with its kept context as cached, reports a stall
  when paused sessions fill the cache (and leaves the engine serving), and completes the same
  workload with one session at a time (``stream-cap1``).
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from session_gate.lab.bench.stream import run_stream
from session_gate.lab.engine.launch import agenerate, make_async_llm
from session_gate.workloads import EngineShape, SessionSpec, Turn, Workload
from vllm import SamplingParams
from vllm.engine.protocol import StreamingInput
from vllm.sampling_params import RequestOutputKind

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 32


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    llm = make_async_llm(num_blocks=64, block_size=BLOCK, max_num_seqs=4)
    try:
        yield llm
    finally:
        llm.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i) % 4000 for i in range(n)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )


class Session:
    """One streaming-input request whose next chunk is sent only when the previous one has
    finished (or, for a chunk given as ``None``, the generator waits for :meth:`close`)."""

    def __init__(self, chunks: list[tuple[list[int], int]]):
        self.chunks = chunks
        self.done = [asyncio.Event() for _ in chunks]
        self.closed = asyncio.Event()
        self.outputs: list[list] = [[] for _ in chunks]
        #: ``len(prompt_token_ids)`` as each chunk ended (vLLM extends that list in place).
        self.prompt_lens: list[int] = []

    async def inputs(self):
        for i, (tokens, max_tokens) in enumerate(self.chunks):
            # A copy: vLLM's output processor extends the first chunk's list in place.
            yield StreamingInput({"prompt_token_ids": list(tokens)}, params(max_tokens))
            await self.done[i].wait()
        await self.closed.wait()

    def close(self) -> None:
        self.closed.set()

    async def run(self, llm, request_id: str) -> None:
        chunk = 0
        async for out in llm.generate(self.inputs(), params(1), request_id=request_id):
            self.outputs[chunk].append(out)
            if out.outputs[0].finish_reason is not None:
                self.prompt_lens.append(len(out.prompt_token_ids))
                self.done[chunk].set()
                chunk += 1

    def tokens(self, chunk: int) -> list[int]:
        return [t for out in self.outputs[chunk] for t in out.outputs[0].token_ids]


async def test_a_three_chunk_session_appends_new_tokens_and_keeps_its_kv(engine):
    await engine.reset_prefix_cache()
    system = prompt(1, 2 * BLOCK)
    await agenerate(engine, system, 1, "warm-system")  # 2 full blocks for the first chunk to hit
    first, second, third = system + prompt(2, 36), prompt(3, 50), prompt(4, 40)
    session = Session([(first, 5), (second, 7), (third, 3)])
    session.close()  # the generator ends right after the third chunk
    await asyncio.wait_for(session.run(engine, "stream-3"), 300)

    assert [len(session.tokens(c)) for c in range(3)] == [5, 7, 3]
    for chunk in session.outputs:
        *running, last = chunk
        assert last.outputs[0].finish_reason == "length"
        assert all(o.outputs[0].finish_reason is None for o in running)
        assert not any(o.finished for o in chunk)  # STREAM_FINISHED itself is not yielded
    outs = [o for chunk in session.outputs for o in chunk]
    assert {o.request_id for o in outs} == {"stream-3"}
    # The first chunk's hit, reported again on every later output.
    assert {o.num_cached_tokens for o in outs} == {2 * BLOCK}
    # New chunks only: the kept output tokens are not in the output's prompt.
    assert session.prompt_lens == [100, 150, 190]

    out1, out2, out3 = (session.tokens(c) for c in range(3))
    context = first + out1[:-1] + second + out2[:-1] + third + out3[:-1]
    assert len(context) == 202  # the session's computed tokens when it ended: 6 full blocks
    _, cached = await agenerate(engine, context + prompt(5, 30), 1, "probe-drop")
    assert cached == 6 * BLOCK
    # Had the last sampled token been kept, the cache would diverge at position 104.
    keep = first + out1 + second + out2 + third + out3
    _, cached = await agenerate(engine, keep + prompt(5, 30), 1, "probe-keep")
    assert cached == 3 * BLOCK


async def test_a_paused_session_pins_its_blocks_until_it_ends(engine):
    await engine.reset_prefix_cache()
    session = Session([(prompt(6, 1200), 4)])  # 38 blocks, then paused waiting for input
    task = asyncio.ensure_future(session.run(engine, "stream-pinned"))
    await asyncio.wait_for(session.done[0].wait(), 300)
    # 29 more blocks do not fit beside the paused session's 38 (63 usable).
    plain = asyncio.ensure_future(agenerate(engine, prompt(7, 900), 2, "plain-blocked"))
    await asyncio.sleep(10.0)
    assert not plain.done(), "the plain request ran beside a paused session's blocks"
    session.close()  # the session ends: vLLM aborts it and frees its blocks
    await asyncio.wait_for(task, 60)
    output, _ = await asyncio.wait_for(plain, 120)
    assert len(output) == 2


def small_workload(name: str, sessions: int, task: int, appends: tuple[int, ...]) -> Workload:
    """Sessions on the fixture's engine shape: a 64-token shared system prompt, ``task`` tokens,
    then a turn per entry of ``appends`` (8 output tokens each, 0.1 s tools)."""
    turns = tuple(Turn(a, 8, 0.1) for a in (0, *appends))
    specs = tuple(SessionSpec(f"w{i}", 2 * BLOCK, task, turns) for i in range(sessions))
    return Workload(name, specs, EngineShape(num_blocks=64, block_size=BLOCK, max_num_seqs=4))


async def test_the_stream_mode_records_every_chunk_with_its_kept_context(engine):
    workload = small_workload("fits", 2, 100, (50, 40))
    result = await asyncio.wait_for(run_stream(engine, workload, stall_sec=60), 300)
    assert "stalled" not in result.gate_stats and result.gate_stats["preemptions"] == 0
    records = sorted(result.records, key=lambda r: (r.session_id, r.turn))
    assert [(r.session_id, r.turn) for r in records] == [
        (f"w{i}", t) for i in range(2) for t in range(3)
    ]
    for first, second, third in (records[:3], records[3:]):
        assert first.prompt_tokens == 164
        # Each later chunk resumes from the kept context: the previous prompt and its output
        # less the last sampled token; the prompt adds the tool result.
        assert second.cached_tokens == 164 + 8 - 1 and second.prompt_tokens == 171 + 50
        assert third.cached_tokens == 221 + 8 - 1 and third.prompt_tokens == 228 + 40
        assert second.ideal_cached_tokens == 160 and third.ideal_cached_tokens == 224
    summary = result.summary()
    assert summary["turns"] == 6 and summary["hit_rate"] > summary["ideal_hit_rate"] - 0.2


async def test_the_stream_mode_reports_a_stall_when_paused_sessions_fill_the_cache(engine):
    # Three sessions growing to 1,688 tokens (53 blocks) each on 63 usable blocks.
    workload = small_workload("outgrows", 3, 600, (300, 300, 300))
    result = await asyncio.wait_for(run_stream(engine, workload, stall_sec=5), 300)
    stalled = result.gate_stats["stalled"]
    assert stalled["turns_done"] == len(result.records) < stalled["turns_total"] == 12
    assert stalled["chunks_outstanding"] >= 1 and stalled["running"] == 0
    # The aborted sessions gave their blocks back: the engine serves a plain request again.
    output, _ = await asyncio.wait_for(agenerate(engine, prompt(8, 1500), 2, "after-stall"), 120)
    assert len(output) == 2


async def test_a_capped_stream_run_completes_where_the_uncapped_one_stalls(engine):
    workload = small_workload("outgrows", 3, 600, (300, 300, 300))
    result = await asyncio.wait_for(run_stream(engine, workload, max_sessions=1), 300)
    assert result.mode == "stream-cap1" and "stalled" not in result.gate_stats
    assert len(result.records) == 12
