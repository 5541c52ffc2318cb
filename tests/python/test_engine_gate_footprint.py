"""The engine gate's native book over a real vLLM ``BlockPool`` in this process (no engine):
the usage it decides on follows the pool, and the cold-cache benchmark
(``python -m session_gate.lab.engine.bench_gate_footprint``) runs end to end.

The book reads the pool's free-block queue, taken once when it is built (one attribute read
less per call in the engine loop): these tests take and return blocks through vLLM's own
``BlockPool`` calls and check that every admit sees the pool's usage of that moment.
"""

from __future__ import annotations

import itertools

import pytest
from session_gate import _native
from session_gate.engine.gate_driver import native_book
from session_gate.lab.engine import bench_gate_footprint
from session_gate.lab.engine.inprocess import engine_state, make_kv_cache_manager

_ids = itertools.count()


def no_walk(session_id, token_ids):
    raise AssertionError("an open gate never walks the prefix")


@pytest.fixture
def pool_and_book():
    kvm = make_kv_cache_manager(101, 16)  # 100 usable blocks
    state = engine_state(kvm, vocab_size=4096, max_model_len=1600)
    book = native_book(_native, _native.GateConfig(), 30.0, state, no_walk, lambda at: None)
    return kvm.block_pool, book


def admit_usage(book, pool) -> float:
    n = next(_ids)
    answer = book.admit(f"s-{n}", [5] * 32, 1, False, f"t-{n}", "client")
    assert answer["status"] == "admitted" and answer["reason"] == "open", answer
    assert book.release(answer["lease"], "client")
    return answer["usage"]


def test_every_admit_decides_on_the_pools_usage_of_that_moment(pool_and_book):
    pool, book = pool_and_book
    assert admit_usage(book, pool) == pytest.approx(0.0)
    taken = pool.get_new_blocks(30)
    assert pool.get_usage() == pytest.approx(0.30)
    assert admit_usage(book, pool) == pytest.approx(0.30)
    more = pool.get_new_blocks(20)
    assert admit_usage(book, pool) == pytest.approx(0.50)
    pool.free_blocks(taken + more)
    assert admit_usage(book, pool) == pytest.approx(0.0)


def test_the_cold_cache_benchmark_runs_and_reports_each_mode():
    out = bench_gate_footprint.run(3, ["none", "python"], 64, 16)
    assert out["pairs"] == 3
    for mode in ("none", "python"):
        row = out[mode]
        assert row["pair_us_p50"] > 0 and row["usage_us_p50"] > 0 and row["noop_us_p50"] > 0
        assert row["pair_over_none"] > 0
    assert out["none"]["pair_over_none"] == 1.0
