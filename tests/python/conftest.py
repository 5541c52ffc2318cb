"""Shared helpers for the Python tests: prompt builders, and for the HTTP tests the proxy binary,
server start timeout, plain GETs, Prometheus sample sums and vLLM's settled token count."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from session_gate.lab.engine import serve
from session_gate.lab.engine.launch import generate
from session_gate.lab.engine.tiny_tokenizer import word_ids  # noqa: F401 (the tests import it from here)
from session_gate.lab.soak.cluster import get_text, metric  # noqa: F401 (the tests import them from here)

ROOT = Path(__file__).resolve().parents[2]

#: Seconds a ``vllm serve`` may take to become healthy (CPU start is ~40 s; CI machines vary).
SERVE_TIMEOUT = float(os.environ.get("SESSION_GATE_SERVE_TIMEOUT", "900"))


def run_prompt(llm, token_ids: list[int], max_tokens: int = 1) -> int:
    """Generate from ``token_ids`` and return the ``num_cached_tokens`` vLLM reports."""
    return generate(llm, token_ids, max_tokens)[1]


def random_prompt(rng: random.Random, n: int, vocab: int = 4096) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def pool_snapshot(kv_cache_manager) -> dict:
    """Everything of a ``KVCacheManager`` a probe could disturb: free-queue order, ref counts,
    hashes, the prefix map and the prefix-cache statistics."""
    import dataclasses

    pool = kv_cache_manager.block_pool
    order = []
    node = pool.free_block_queue.fake_free_list_head.next_free_block
    while node is not None and node is not pool.free_block_queue.fake_free_list_tail:
        order.append(node.block_id)
        node = node.next_free_block
    cache = pool.cached_block_hash_to_block._cache
    stats = kv_cache_manager.prefix_cache_stats
    return {
        "free_order": order,
        "num_free": pool.get_num_free_blocks(),
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "hashes": [b.block_hash for b in pool.blocks],
        "map": {k: (v.block_id if hasattr(v, "block_id") else sorted(v)) for k, v in cache.items()},
        "by_block": {k: sorted(v) for k, v in pool.cached_block_hashes_by_block.items()},
        "stats": dataclasses.asdict(stats) if stats is not None else None,
    }


def pytest_configure(config) -> None:
    """``make test-vllm-next`` names the vLLM it overlays: fail at once if another one is what
    imports, so those tests can never pass against the wrong version."""
    expected = os.environ.get("SESSION_GATE_EXPECT_VLLM")
    if expected:
        import vllm

        if vllm.__version__ != expected:
            raise pytest.UsageError(
                f"SESSION_GATE_EXPECT_VLLM={expected} but vllm {vllm.__version__} imports "
                f"(from {vllm.__file__}): is the overlay on PYTHONPATH installed?"
            )


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """Sets environment variables for the block: engines and servers started inside inherit
    them (e.g. the engine gate's ``SESSION_GATE_*`` knobs)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def served_vllm(
    prefix: str,
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    num_blocks: int = 128,
    block_size: int = 32,
    max_model_len: int = 4064,
) -> Iterator[str]:
    """A ``vllm serve`` over the tiny model (both session_gate plugins) for a test module's
    fixture: yields its base URL, and always stops it and removes its work directory. ``env``
    is set while it starts (the engine gate reads its ``SESSION_GATE_*`` knobs then)."""
    from session_gate.lab.engine.serve import start_vllm, stop

    workdir = Path(tempfile.mkdtemp(prefix=f"session-gate-{prefix}-"))
    try:
        with environ(env or {}):
            proc, url = start_vllm(
                workdir,
                num_blocks=num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                extra_args=extra_args,
                timeout=SERVE_TIMEOUT,
            )
        try:
            yield url
        finally:
            stop(proc)
    finally:
        keep_log(workdir / "vllm.log", prefix)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def served_multi_api(
    prefix: str,
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    max_num_seqs: int = 16,
    num_blocks: int = 128,
    block_size: int = 32,
    max_model_len: int = 4064,
) -> Iterator[str]:
    """``vllm serve --api-server-count 2`` over the tiny model with a tokenizer, through the
    CLI's own serve command (``session_gate.lab.engine.vllm_serve``: ``start_vllm`` ignores the
    flag), both session_gate plugins and ``env``: yields its base URL, and always stops it and
    removes its work directory."""
    import sys

    from session_gate.lab.engine.serve import _start, free_port, stop
    from session_gate.lab.engine.tiny_tokenizer import write_tiny_model_with_tokenizer

    workdir = Path(tempfile.mkdtemp(prefix=f"session-gate-{prefix}-"))
    model = write_tiny_model_with_tokenizer(str(workdir / "model"))
    port = free_port()
    args = [
        sys.executable, "-m", "session_gate.lab.engine.vllm_serve", "--model", model,
        "--served-model-name", "tiny",
        "--load-format", "dummy", "--enforce-eager", "--dtype", "bfloat16",
        "--block-size", str(block_size), "--num-gpu-blocks-override", str(num_blocks),
        "--max-model-len", str(max_model_len), "--enable-prefix-caching",
        "--gpu-memory-utilization", "0.1", "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_model_len), "--seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--api-server-count", "2",
        *extra_args,
    ]  # fmt: skip
    full_env = dict(os.environ, **(env or {}), VLLM_PLUGINS="session_gate", HF_HUB_OFFLINE="1")
    base = f"http://127.0.0.1:{port}"
    try:
        proc = _start(args, workdir / "vllm.log", f"{base}/health", SERVE_TIMEOUT, env=full_env)
        try:
            yield base
        finally:
            stop(proc)
    finally:
        keep_log(workdir / "vllm.log", prefix)
        shutil.rmtree(workdir, ignore_errors=True)


def gate_stats(url: str) -> dict:
    """``/session_gate/v1/stats`` of the server at ``url``."""
    import httpx

    r = httpx.get(f"{url}/session_gate/v1/stats", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


async def eventually(
    condition, timeout: float = 30.0, what: str = "condition", poll: float = 0.1
) -> None:
    """Until ``condition()`` (a plain or an async callable) is true, asking every ``poll``
    seconds; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return
        assert time.monotonic() < deadline, f"{what} never became true"
        await asyncio.sleep(poll)


def scheduler_settled(url: str) -> dict:
    """The gate's stats once no scheduler lease nor hold is left (turns end asynchronously)."""
    deadline = time.monotonic() + 30
    while True:
        s = gate_stats(url)
        if s["scheduler"]["leases"] == 0 and s["scheduler"]["holding"] == 0:
            return s
        assert time.monotonic() < deadline, f"scheduler leases or holds never ended: {s}"
        time.sleep(0.1)


#: How many times a test streams and leaves mid-stream before it fails: a sample where vLLM's
#: API server sent nothing until the whole generation ended cannot show a cut, and is retried.
MID_STREAM_SAMPLES = 10


async def generated_when_idle(http, vllm_url: str) -> float:
    """vLLM's ``generation_tokens_total`` once it runs no request (a cut stream is over), read
    with the ``httpx.AsyncClient`` ``http``; a stream's tokens are the change across it."""
    deadline = time.monotonic() + 60.0
    while True:
        r = await http.get(f"{vllm_url}/metrics")
        assert r.status_code == 200, r.text
        if metric(r.text, "vllm:num_requests_running") == 0:
            return metric(r.text, "vllm:generation_tokens_total")
        assert time.monotonic() < deadline, "vLLM kept running a request for 60 s"
        await asyncio.sleep(0.05)


def keep_log(log: Path, prefix: str) -> None:
    """With ``SESSION_GATE_TEST_LOGS=DIR``, a server's log outlives its work directory (for a
    failure seen only on another machine)."""
    keep = os.environ.get("SESSION_GATE_TEST_LOGS")
    if keep and log.exists():
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(log, Path(keep) / f"{prefix}-{os.getpid()}-{time.time_ns()}.log")


def proxy_binary() -> Path:
    """Build ``session-gate`` (debug: the tests' build) and return its path."""
    return serve.proxy_binary(release=False)
