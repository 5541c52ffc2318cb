"""Shared helpers for the Python tests: tiny CPU engines (one per module) and prompt builders."""

from __future__ import annotations

import random

import pytest
from session_gate.engine.launch import generate


def run_prompt(llm, token_ids: list[int], max_tokens: int = 1) -> int:
    """Generate from ``token_ids`` and return the ``num_cached_tokens`` vLLM reports."""
    return generate(llm, token_ids, max_tokens)[1]


def random_prompt(rng: random.Random, n: int, vocab: int = 4096) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
