"""The native block hash equals vLLM's ``hash_block_tokens`` for all four algorithms, on the
installed vLLM (0.32.0; 0.33.0 under ``make test-vllm-next``; 0.31.0 under ``make test-compat``)."""

from __future__ import annotations

import random

import pytest
from session_gate import _native

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
EDGE_IDS = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 4095, 4096, 2**32 - 1]


def vllm_hasher(algo: str):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    none_hash = kv_cache_utils.NONE_HASH

    def hash_block(parent, tokens):
        return kv_cache_utils.hash_block_tokens(fn, parent, tokens, None)

    return none_hash, hash_block


@pytest.mark.parametrize("algo", ALGOS)
def test_thousands_of_random_blocks_match(algo):
    none_hash, expected = vllm_hasher(algo)
    rng = random.Random(algo)
    parent = None
    for i in range(2000):
        size = rng.choice([1, 2, 3, 4, 16, 32, 64, rng.randrange(0, 300)])
        pool = EDGE_IDS if i % 4 == 0 else None
        tokens = [rng.choice(pool) if pool else rng.randrange(0, 2**17) for _ in range(size)]
        want = expected(parent, tokens)
        got = _native.hash_block(algo, none_hash, parent, tokens)
        assert got == want, (algo, i, tokens[:8], parent)
        # Alternate between chaining from the previous block and restarting at NONE_HASH.
        parent = want if i % 3 else None


@pytest.mark.parametrize("algo", ALGOS)
def test_edge_token_ids_and_large_blocks_match(algo):
    none_hash, expected = vllm_hasher(algo)
    for tokens in ([t] for t in EDGE_IDS):
        assert _native.hash_block(algo, none_hash, None, tokens) == expected(None, tokens)
    big = [t % (2**31 + 7) for t in range(0, 20000 * 977, 977)]  # crosses pickle's 64 KiB frame
    parent = expected(None, [1, 2, 3])
    assert _native.hash_block(algo, none_hash, parent, big) == expected(parent, big)


@pytest.mark.parametrize("algo", ALGOS)
def test_chained_hashes_match_vllms_request_hasher(algo):
    none_hash, expected = vllm_hasher(algo)
    rng = random.Random(99)
    tokens = [rng.randrange(0, 4096) for _ in range(16 * 40 + 9)]
    want, parent = [], None
    for start in range(0, len(tokens) - 15, 16):
        parent = expected(parent, tokens[start : start + 16])
        want.append(parent)
    assert _native.hash_blocks(algo, none_hash, tokens, 16) == want
    assert _native.hash_chain_tip(algo, none_hash, tokens, 16) == want[-1]
    assert _native.hash_chain_tip(algo, none_hash, tokens[:15], 16) is None


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        _native.hash_block("md5", b"\0" * 32, None, [1])
    with pytest.raises(ValueError, match="(?i)none_hash"):
        _native.hash_block("sha256", b"\0" * 16, None, [1])
    with pytest.raises(ValueError, match="negative"):
        _native.hash_block("sha256", b"\0" * 32, None, [1, -2])
