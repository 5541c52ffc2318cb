"""With ``SESSION_GATE_SCHEDULER`` unset (off, the default) the plugin changes nothing in vLLM's
scheduler: a real CPU ``vllm serve`` with the plugin serves requests that carry session ids
without asking the engine gate, and its stats (and vLLM's ``/metrics``) have no scheduler
section. (One engine of its own: the setting is read when the engine core loads the plugin.)"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from conftest import get_text, served_vllm, word_ids
from session_gate.engine.metrics_mirror import INTERVAL_SEC

NUM_BLOCKS = 128
MAX_MODEL_LEN = 4064


@pytest.fixture(scope="module")
def url():
    assert "SESSION_GATE_SCHEDULER" not in os.environ, "the test needs the setting unset"
    with served_vllm(
        "engine-gate-scheduler-off",
        extra_args=["--max-num-seqs", "4", "--max-num-batched-tokens", str(MAX_MODEL_LEN)],
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    ) as base:
        yield base


def test_requests_with_session_ids_are_not_gated_when_the_setting_is_off(url):
    for headers, extra in (({"X-Session-ID": "off-1"}, {}), ({}, {"session_id": "off-2"})):
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": word_ids(10, 40), "max_tokens": 4, **extra},
            headers=headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text
    # The metrics mirror asked the engine a few times meanwhile, and built no gate by asking:
    # nothing of the gate's on vLLM's /metrics yet. Only the engine's counters of finished
    # sessions' blocks, which need no gate (the requests carried session ids).
    time.sleep(2.5 * INTERVAL_SEC)
    shown = {
        line.split(" ")[0]
        for line in get_text(f"{url}/metrics").splitlines()
        if line.startswith("session_gate_")
    }
    assert shown <= {
        "session_gate_engine_finished_sessions_evicted_first_total",
        "session_gate_engine_finished_blocks_evicted_first_total",
    }, shown
    s = httpx.get(f"{url}/session_gate/v1/stats", timeout=60).json()
    assert "scheduler" not in s, s
    # The book saw no admit at all: nothing but the lease doors would call it.
    assert s["engine_gate"]["admit_loop_calls"] == 0, s
    assert s["engine_gate"]["leases_held"] == 0, s
    text = httpx.get(f"{url}/session_gate/v1/stats?format=prometheus", timeout=60).text
    assert "session_gate_scheduler_" not in text
    # The stats call built the gate (a lease door would have): its metrics now show on vLLM's
    # /metrics, and still no scheduler's.
    deadline = time.monotonic() + 10 * INTERVAL_SEC + 20
    while "\nsession_gate_leases_active " not in (text := get_text(f"{url}/metrics")):
        assert time.monotonic() < deadline, "the engine gate's metrics never showed on /metrics"
        time.sleep(0.2)
    assert "session_gate_scheduler_" not in text
