"""vLLM's own load signals, read in-process the way a production controller scrapes ``/metrics``.

prime-rl's adaptive concurrency polls each engine's Prometheus endpoint for
``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
the ``vllm:num_preemptions`` counter. An ``AsyncLLM`` in this process registers those very
metrics (its ``PrometheusStatLogger``, on by default: ``disable_log_stats=False``) in the
process's Prometheus registry, so the benchmark reads them with vLLM's own
``get_metrics_snapshot`` instead of serving HTTP: same names, same values, same update points
(one record per engine-core output batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions"


@dataclass(frozen=True)
class EngineLoad:
    """One scrape: usage is the max over engines, counts and the counter are sums."""

    kv_usage: float
    running: int
    waiting: int
    preemptions_total: int


class MetricsUnavailable(RuntimeError):
    """vLLM's stat logger is not registered (e.g. ``disable_log_stats=True``)."""


def scrape() -> EngineLoad:
    """Read the four signals from vLLM's in-process Prometheus metrics."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    usage: list[float] = []
    running = waiting = preemptions = 0
    seen: set[str] = set()
    for m in get_metrics_snapshot():
        if m.name == KV_USAGE:
            usage.append(float(m.value))
        elif m.name == RUNNING:
            running += int(m.value)
        elif m.name == WAITING:
            waiting += int(m.value)
        elif m.name == PREEMPTIONS:
            preemptions += int(m.value)
        else:
            continue
        seen.add(m.name)
    missing = {KV_USAGE, RUNNING, WAITING, PREEMPTIONS} - seen
    if missing:
        raise MetricsUnavailable(
            f"vLLM metrics {sorted(missing)} are not registered in this process: start the "
            "AsyncLLM with log_stats on (disable_log_stats=False, the default)"
        )
    return EngineLoad(min(max(usage), 1.0), running, waiting, preemptions)


def kv_capacity(llm: Any) -> tuple[int, int]:
    """``(num_gpu_blocks * block_size, max_model_len)`` of a running ``AsyncLLM``: what
    prime-rl reads from ``vllm:cache_config_info`` and ThunderAgent from the cache config."""
    cache = llm.vllm_config.cache_config
    return int(cache.num_gpu_blocks) * int(cache.block_size), int(llm.model_config.max_model_len)
