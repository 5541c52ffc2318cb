"""Where the engine loop's time goes in the engine gate's admit and release (measurement only).

Off unless ``SESSION_GATE_LOOP_SPLITS=1`` is in the engine core's environment; then
``gate_methods.install`` calls :func:`install`, which wraps, on the engine thread, each
``session_gate_admit`` / ``session_gate_release`` utility call at three nested levels and
records ``time.perf_counter_ns`` around each:

- ``dispatch``: vLLM's whole handling of the request on the engine thread
  (``EngineCoreProc._handle_client_request``: the method lookup, ``_convert_msgspec_args``,
  our method, wrapping the result, queueing the output);
- ``method``: our utility method, from entry to return;
- ``native``: the one native call inside it (``EngineGateBook.admit`` / ``.release``).

So ``dispatch - method`` is vLLM's part, ``method - native`` our Python glue, ``native`` the
native call (arguments, book, core, usage read, answer dict). Each wrapper's own frame lands in
the level around it; ``wrapper_ns`` (a timed wrapper around a no-op, timed the same way) says
how much. Prefix probes during the run are counted (``prefix_probes``): an admit answered with
the gate open needs none. The summary (median and p99 per part, µs) is read from
``session_gate_stats`` under ``engine_gate.loop_splits``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any

ENV = "SESSION_GATE_LOOP_SPLITS"
#: The calls split; anything else passes through untimed.
CALLS = ("session_gate_admit", "session_gate_release")
#: The nested timers: vLLM's whole dispatch, its ``_invoke_utility_method`` and
#: ``_convert_msgspec_args`` (``inspect.signature`` of the method), our method, the native call.
PARTS = ("dispatch", "invoke", "convert", "method", "native")
#: Samples kept per call and part (the first ones; a bench run takes a few hundred).
MAX_SAMPLES = 100_000

_clock = time.perf_counter_ns


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() == "1"


class Splits:
    """Samples in ns by call and part; a call counts only with all three parts timed (the
    first admit, which builds the driver, has no native timer yet)."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, list[int]]] = {c: {p: [] for p in PARTS} for c in CALLS}
        #: The parts of the call in progress (the engine thread runs one at a time).
        self.current: dict[str, int] = {}

    def add(self, call: str, part: str, ns: int) -> None:
        s = self.samples[call][part]
        if len(s) < MAX_SAMPLES:
            s.append(ns)

    def end_call(self, call: str, dispatch_ns: int) -> None:
        parts, self.current = self.current, {}
        parts["dispatch"] = dispatch_ns
        if all(p in parts for p in PARTS):
            for p in PARTS:
                self.add(call, p, parts[p])

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"wrapper_ns": _wrapper_ns()}
        for call, parts in self.samples.items():
            n = len(parts["dispatch"])
            if n == 0:
                continue
            # Per call: the three parts of the same call, so their differences are per call too.
            d, inv, conv, m, nat = (parts[p] for p in PARTS)
            derived = {
                "dispatch": d,
                "method": m,
                "native": nat,
                "vllm": [a - b for a, b in zip(d, m, strict=True)],
                "vllm_convert_args": conv,
                "vllm_invoke_rest": [a - b - c for a, b, c in zip(inv, conv, m, strict=True)],
                "vllm_outside_invoke": [a - b for a, b in zip(d, inv, strict=True)],
                "glue": [a - b for a, b in zip(m, nat, strict=True)],
            }
            out[call.removeprefix("session_gate_")] = {
                "n": n,
                **{k: _quantiles_us(v) for k, v in derived.items()},
            }
        return out


def _quantiles_us(ns: list[int]) -> dict[str, float]:
    if len(ns) < 2:
        return {"p50": ns[0] / 1e3, "p99": ns[0] / 1e3}
    q = statistics.quantiles(ns, n=100, method="inclusive")
    return {"p50": q[49] / 1e3, "p99": q[98] / 1e3}


def _wrapper_ns(samples: int = 2000) -> float:
    """Median ns one timing wrapper adds to the level around it (a no-op, timed both ways)."""

    def noop() -> None:
        return None

    sink = Splits()

    @functools.wraps(noop)
    def wrapped() -> None:
        t = _clock()
        noop()
        sink.current["native"] = _clock() - t

    extra = []
    for _ in range(samples):
        t0 = _clock()
        noop()
        t1 = _clock()
        wrapped()
        t2 = _clock()
        extra.append((t2 - t1) - (t1 - t0))
    return float(statistics.median(extra))


def install(engine_core_cls: Any, engine_core_proc_cls: Any, driver_attr: str) -> Splits:
    """Wraps vLLM's dispatch and the two utility methods (and, on the first call, the driver's
    native calls) with timers; returns where the samples go."""
    splits = Splits()
    original_handle = engine_core_proc_cls._handle_client_request

    @functools.wraps(original_handle)
    def handle(self: Any, request_type: Any, request: Any) -> None:
        # A utility request is (client_idx, call_id, method_name, args), as msgpack decoded it.
        name = request[2] if isinstance(request, (tuple, list)) and len(request) == 4 else None
        if name not in CALLS:
            return original_handle(self, request_type, request)
        splits.current = {}
        t = _clock()
        original_handle(self, request_type, request)
        splits.end_call(name, _clock() - t)

    engine_core_proc_cls._handle_client_request = handle

    for attr in ("_invoke_utility_method", "_convert_msgspec_args"):
        part = "invoke" if attr == "_invoke_utility_method" else "convert"
        inner = getattr(engine_core_proc_cls, attr)  # both are staticmethods

        def timed_static(*args: Any, _inner: Any = inner, _part: str = part) -> Any:
            t = _clock()
            try:
                return _inner(*args)
            finally:
                splits.current[_part] = _clock() - t

        setattr(engine_core_proc_cls, attr, staticmethod(timed_static))

    for name in CALLS:
        original = getattr(engine_core_cls, name)

        def timed(self: Any, *args: Any, _original: Any = original) -> Any:
            driver = self.__dict__.get(driver_attr)
            if driver is not None and not getattr(driver, "_splits_wrapped", False):
                _wrap_native(driver, splits)
            t = _clock()
            try:
                return _original(self, *args)
            finally:
                splits.current["method"] = _clock() - t

        # functools.wraps keeps ``inspect.signature`` (which vLLM calls on every utility call)
        # as costly as on the original: it follows ``__wrapped__``.
        setattr(engine_core_cls, name, functools.wraps(original)(timed))

    original_stats = engine_core_cls.session_gate_stats

    @functools.wraps(original_stats)
    def stats(self: Any, fmt: Any = "json") -> Any:
        out = original_stats(self, fmt)
        if isinstance(out, dict):
            out.setdefault("engine_gate", {})["loop_splits"] = splits.summary()
        return out

    engine_core_cls.session_gate_stats = stats
    return splits


def _wrap_native(driver: Any, splits: Splits) -> None:
    for attr in ("_admit", "_release"):
        native = getattr(driver, attr)

        def timed(*args: Any, _native: Any = native) -> Any:
            t = _clock()
            try:
                return _native(*args)
            finally:
                splits.current["native"] = _clock() - t

        setattr(driver, attr, timed)
    driver._splits_wrapped = True
