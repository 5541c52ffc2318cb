"""The engine gate's Prometheus metrics on vLLM's own ``/metrics`` (started by the endpoint
plugin in every API-server process of ``vllm serve``; no middleware, nothing to configure).

The numbers live in the engine core process (``gate_driver``, ``gate_scheduler``); ``/metrics``
is served by the API-server process(es) from prometheus_client's registry, and a collector there
is synchronous: it cannot await the engine client's utility call on the event loop it runs on.
So each API-server process runs a small task that every :data:`INTERVAL_SEC` fetches
``session_gate_stats("prometheus")`` (the very text of ``/session_gate/v1/stats?format=
prometheus``, so names, labels and help are the same) and mirrors it, the way vLLM serves its
engine's numbers: as of the last update it received, never a round trip per scrape. A scrape
therefore lags the engine by at most ``INTERVAL_SEC`` (plus one utility call).

How it is mirrored follows how vLLM builds ``/metrics`` (``vllm.v1.metrics.prometheus``):

- one API server (``PROMETHEUS_MULTIPROC_DIR`` unset): vLLM serves prometheus_client's default
  ``REGISTRY``; a collector registered there yields the last fetched families as they are
  (counters stay counters, the histograms stay histograms);
- ``--api-server-count`` > 1: vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` and serves only what the
  processes wrote there (``MultiProcessCollector``), which sums counters and histograms over the
  processes. Every process mirrors the same engine, so a sum would count each value once per
  API server: every sample (a histogram's ``_bucket``/``_sum``/``_count`` too) is written as a
  gauge of the sample's name with ``multiprocess_mode="mostrecent"`` (as vLLM does for its
  engine-side gauges), which reports the latest write of any process. The names and labels are
  the same; only the ``TYPE`` line says ``gauge`` (PromQL's ``rate`` and ``histogram_quantile``
  work on them alike).

Asking never builds a gate: the call passes ``build=False``, and an engine whose gate has not
been used yet (no admit, no request with a session id in scheduler mode) answers None: nothing is
mirrored until it is, except the counters of finished sessions' blocks (``finished_blocks``),
which need no gate and show once a request with a session id has ended. An engine without the
engine-side plugin stops the task (one warning).
With data parallelism every engine core (DP rank) has its own gate: each one is asked, and each
sample carries a ``rank`` label (:func:`ranked_text`), as on ``/session_gate/v1/stats?format=
prometheus``; without it the labels are the engine's own.

Cost: one utility call per API-server process every ``INTERVAL_SEC`` (the engine renders its
counters as text between two steps, as for ``/session_gate/v1/stats``), and a parse of that text
in the API server.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("session_gate")

#: Seconds between two fetches of the engine gate's metrics.
INTERVAL_SEC = 2.0


def multiprocess() -> bool:
    """Whether vLLM's ``/metrics`` serves the multiprocess directory (its own test, in
    ``vllm.v1.metrics.prometheus.get_prometheus_registry``)."""
    return os.getenv("PROMETHEUS_MULTIPROC_DIR") is not None


class _Snapshot:
    """Collector of the default registry (one API server): the last fetched families."""

    def __init__(self) -> None:
        self.families: list[Any] = []

    def collect(self) -> list[Any]:
        return self.families

    def describe(self) -> list[Any]:
        # Nothing known at registration: the names arrive with the first fetch.
        return []


class _Gauges:
    """The last fetched samples as ``mostrecent`` gauges (several API servers): one gauge per
    sample name, its label names fixed by the first sample seen."""

    def __init__(self) -> None:
        self._gauges: dict[str, tuple[Gauge, tuple[str, ...]]] = {}

    def update(self, families: list[Any]) -> None:
        for family in families:
            for sample in family.samples:
                entry = self._gauges.get(sample.name)
                if entry is None:
                    names = tuple(sorted(sample.labels))
                    gauge = Gauge(
                        sample.name,
                        family.documentation,
                        labelnames=names,
                        multiprocess_mode="mostrecent",
                    )
                    entry = self._gauges[sample.name] = (gauge, names)
                gauge, names = entry
                if set(sample.labels) != set(names):
                    continue  # a label set the engine never writes for this name
                child = gauge.labels(*(sample.labels[n] for n in names)) if names else gauge
                child.set(sample.value)


#: This process's mirror target (one per process: the registry is per process).
_target: _Snapshot | _Gauges | None = None


def _mirror() -> _Snapshot | _Gauges:
    global _target
    if _target is None:
        if multiprocess():
            _target = _Gauges()
        else:
            _target = _Snapshot()
            REGISTRY.register(_target)
    return _target


class _Families:
    """A collector of fixed families, to render them with prometheus_client's own writer."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def ranked_text(texts: list[str | None]) -> str | None:
    """One Prometheus text of several engine cores' texts (``texts[r]``: DP rank ``r``'s, None
    while it has no gate): every sample gains a ``rank`` label, each family is listed once with
    the samples of every rank (the format wants a family's samples together). None when no rank
    answered."""
    merged: dict[str, Any] = {}
    for rank, text in enumerate(texts):
        for family in text_string_to_metric_families(text or ""):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "rank": str(rank)}, sample.value)
    if not merged:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


async def fetch(routes: Any, build: bool = True) -> str | None:
    """The engine gate's Prometheus text: the engine core's own, or with data parallelism every
    rank's, labelled (:func:`ranked_text`). ``build=False``: None while no gate exists yet."""
    texts = await routes.call_each("session_gate_stats", "prometheus", build)
    return texts[0] if len(texts) == 1 else ranked_text(texts)


def update(text: str) -> None:
    """Mirrors one fetched Prometheus text."""
    families = list(text_string_to_metric_families(text))
    target = _mirror()
    if isinstance(target, _Snapshot):
        target.families = families
    else:
        target.update(families)


async def run(routes: Any, interval_sec: float = INTERVAL_SEC) -> None:
    """Fetches and mirrors the engine gate's metrics until cancelled (``routes`` is the
    endpoint plugin's per-app state, ``http_routes._Routes``)."""
    from session_gate.engine.http_routes import ProbeError

    while True:
        try:
            text = await fetch(routes, build=False)
            if text:
                update(text)
        except asyncio.CancelledError:
            raise
        except ProbeError as err:
            if err.status == 503:  # no engine-side plugin (or no engine): nothing will come
                logger.warning("session_gate: engine gate metrics not on /metrics: %s", err)
                return
            logger.debug("session_gate: engine gate metrics not fetched: %s", err.message)
        except Exception:  # noqa: BLE001 - e.g. the engine shutting down: try again later
            logger.debug("session_gate: engine gate metrics not mirrored", exc_info=True)
        await asyncio.sleep(interval_sec)


#: The running task (a reference, so it is not collected), one per process.
_task: asyncio.Task[None] | None = None


def start(routes: Any) -> None:
    """Starts the mirror on the running event loop (the API server's), once per process."""
    global _task
    if _task is not None and not _task.done():
        return
    _task = asyncio.get_running_loop().create_task(run(routes), name="session_gate-metrics")
