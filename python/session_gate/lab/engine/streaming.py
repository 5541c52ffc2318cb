"""vLLM's streaming input, as the ``stream`` baseline (``session_gate.lab.bench.stream``) feeds it:
the sampling parameters of a chunk and the chunk itself. Here because every ``import vllm`` of lab
code lives in this folder."""

from __future__ import annotations

from typing import Any


def chunk_params(max_tokens: int) -> Any:
    """A chunk's ``SamplingParams``: exactly ``max_tokens`` greedy tokens, streamed as deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # DELTA: each output carries its new tokens; FINAL_ONLY is refused for streaming input.
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )


def chunk(token_ids: list[int], max_tokens: int) -> Any:
    """One ``StreamingInput``: the chunk's new prompt tokens and its own ``max_tokens``."""
    from vllm.engine.protocol import StreamingInput

    return StreamingInput({"prompt_token_ids": token_ids}, chunk_params(max_tokens))
