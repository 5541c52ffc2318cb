"""Tiny CPU engines for tests, the demo and the benchmarks.

A 2-layer Llama with dummy weights needs no download: we write its ``config.json`` and let vLLM
fill the weights (``load_format="dummy"``). Prompts are token ids (``skip_tokenizer_init``).
Scripts that start an engine need the ``if __name__ == "__main__":`` guard (multiprocessing spawn).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

TINY_VOCAB = 4096

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": TINY_VOCAB,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@contextlib.contextmanager
def env_while(key: str, value: str) -> Iterator[None]:
    """``key=value`` in this process's environment inside the block, the old value (or none)
    restored after: for settings vLLM reads when an engine starts, which must not leak into
    the engines started after it in the same process."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def write_tiny_model(directory: str | None = None) -> str:
    """Write the tiny model's ``config.json`` into ``directory`` (a fresh temp dir by default)."""
    directory = directory or tempfile.mkdtemp(prefix="session-gate-tiny-")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(TINY_LLAMA_CONFIG, f)
    return directory


def tiny_engine_args(
    *,
    num_blocks: int = 256,
    block_size: int = 32,
    max_model_len: int | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    hash_algo: str = "sha256",
    model_dir: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``: a small CPU engine whose KV cache
    has exactly ``num_blocks`` blocks of ``block_size`` tokens (a multiple of 32 on CPU)."""
    if max_model_len is None:
        # vLLM reserves one block (the null block), so one request can use num_blocks - 1.
        max_model_len = min((num_blocks - 1) * block_size, 8192)
    args: dict[str, Any] = dict(
        model=model_dir or write_tiny_model(),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=block_size,
        num_gpu_blocks_override=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
        enable_prefix_caching=True,
        prefix_caching_hash_algo=hash_algo,
        gpu_memory_utilization=0.1,
        seed=0,
    )
    args.update(extra)
    return args


def make_llm(**kwargs: Any) -> Any:
    """A synchronous ``vllm.LLM`` over the tiny model (see :func:`tiny_engine_args`)."""
    from vllm import LLM

    return LLM(**tiny_engine_args(**kwargs))


def make_async_llm(**kwargs: Any) -> Any:
    """An ``AsyncLLM`` over the tiny model; call ``.shutdown()`` when done."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**tiny_engine_args(**kwargs)))


def generate(llm: Any, token_ids: list[int], max_tokens: int = 1) -> tuple[list[int], int]:
    """Run one greedy request on ``llm``; return (output token ids, ``num_cached_tokens``)."""
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": list(token_ids)}],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        use_tqdm=False,
    )
    return list(out[0].outputs[0].token_ids), int(out[0].num_cached_tokens)


async def agenerate(
    async_llm: Any,
    token_ids: list[int],
    max_tokens: int,
    request_id: str,
    session_id: str | None = None,
) -> tuple[list[int], int]:
    """One greedy request through an ``AsyncLLM`` (with vLLM's own ``session_id`` when given);
    returns (output ids, ``num_cached_tokens``)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    kwargs = {"session_id": session_id} if session_id is not None else {}
    final = None
    async for output in async_llm.generate(
        {"prompt_token_ids": token_ids}, params, request_id=request_id, **kwargs
    ):
        final = output  # with the default output kind, the last output is the finished one
    assert final is not None, "vLLM returned no output"
    return list(final.outputs[0].token_ids), int(final.num_cached_tokens or 0)
