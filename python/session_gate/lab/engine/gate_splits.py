"""Where the engine loop's time goes in the engine gate's admit and release (lab measurement).

The product carries no timers: this module installs them from outside. A process started with
:data:`HOOK_DIR` on ``PYTHONPATH`` runs its ``sitecustomize``, which calls :func:`hook_plugin`:
the plugin's ``register`` (what vLLM's plugin loader calls in every vLLM process) is wrapped so
that, after the plugin installs the engine gate, :func:`install_in_engine` wraps vLLM's dispatch
and the driver's ``stats``. ``python -m session_gate.lab.bench.clients --loop-splits`` starts
``vllm serve`` that way (:func:`engine_env`). Then, on the engine thread, each
``session_gate_admit`` / ``session_gate_release`` utility call is timed at nested levels with
``time.perf_counter_ns``:

- ``dispatch``: vLLM's whole handling of the request (``EngineCoreProc._handle_client_request``),
  and inside it ``invoke`` (``_invoke_utility_method``: the method lookup, the call, wrapping the
  result, queueing the output) and ``convert`` (``_convert_msgspec_args``: ``inspect.signature``
  of the method, see ``session_gate.engine.utility``);
- ``method``: the call of the bound utility method vLLM looked up;
- ``native``: the native call's own time (``EngineGateBook`` times itself), split into
  ``args`` (argument checks and the prompt read), ``usage`` (the block pool read), ``prefix``
  (the prefix walk), ``answer`` (the answer dict) and ``book`` (the rest: book and core).

``dispatch - method`` is vLLM's part, ``method - native`` what sits between vLLM and the native
code (a ``functools.partial`` and PyO3's argument handling), ``native`` ours. A wrapper's own
frame lands in the level around it: ``wrapper_ns`` (a timed wrapper around a no-op, timed the
same way) says how much. The first admit (which builds the driver) is not split. The summary
(median and p99 per part, µs) is read from ``session_gate_stats`` under
``engine_gate.loop_splits``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path
from typing import Any

#: The folder whose ``sitecustomize`` calls :func:`hook_plugin` (lab only: not in the wheel).
HOOK_DIR = Path(__file__).with_name("splits_hook")
#: Where a driver keeps its :class:`Splits` (set from here, read by the wrapped ``stats``).
SPLITS_ATTR = "_session_gate_lab_loop_splits"
#: The calls split; anything else passes through untimed.
CALLS = ("session_gate_admit", "session_gate_release")
#: The timed levels (ns), outermost first, then the native call's own parts.
PARTS = ("dispatch", "invoke", "convert", "method")
NATIVE_PARTS = ("args", "usage", "prefix", "answer", "book", "total")
#: Samples kept per call and part (the first ones; a bench run takes a few hundred).
MAX_SAMPLES = 100_000

_clock = time.perf_counter_ns


def engine_env() -> dict[str, str]:
    """The environment additions that make a ``vllm serve`` time its gate calls."""
    paths = [str(HOOK_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def hook_plugin() -> None:
    """Wraps the plugin's ``register`` so that :func:`install_in_engine` runs after it (vLLM
    imports the plugin module and then looks ``register`` up, so it finds the wrapper)."""
    from session_gate.engine import plugin

    original = plugin.register
    if getattr(original, "_session_gate_lab_splits", False):
        return

    @functools.wraps(original)
    def register() -> None:
        original()
        install_in_engine()

    register._session_gate_lab_splits = True  # type: ignore[attr-defined]
    plugin.register = register


_installed = False


def install_in_engine() -> None:
    """Times vLLM's dispatch of the gate calls (:func:`install`) and adds the summary to the
    driver's ``stats`` (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.engine.core import EngineCoreProc

    from session_gate.engine.gate_driver import DRIVER_ATTR, EngineGateDriver

    install(EngineCoreProc, DRIVER_ATTR)
    original_stats = EngineGateDriver.stats

    @functools.wraps(original_stats)
    def stats(self: Any) -> dict[str, Any]:
        s = original_stats(self)
        splits = self.__dict__.get(SPLITS_ATTR)
        if splits is not None:
            s["engine_gate"]["loop_splits"] = splits.summary()
        return s

    EngineGateDriver.stats = stats


class Splits:
    """Samples in ns by call and part; a call counts only with every part timed."""

    def __init__(self) -> None:
        self.samples: dict[str, list[dict[str, int]]] = {c: [] for c in CALLS}
        #: The parts of the call in progress (the engine thread runs one at a time).
        self.current: dict[str, int] = {}

    def end_call(self, call: str, dispatch_ns: int) -> None:
        parts, self.current = self.current, {}
        parts["dispatch"] = dispatch_ns
        if all(p in parts for p in PARTS) and "total" in parts:
            s = self.samples[call]
            if len(s) < MAX_SAMPLES:
                s.append(parts)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"wrapper_ns": _wrapper_ns()}
        for call, rows in self.samples.items():
            if not rows:
                continue
            derived = {
                "dispatch": [r["dispatch"] for r in rows],
                "vllm": [r["dispatch"] - r["method"] for r in rows],
                "vllm_convert_args": [r["convert"] for r in rows],
                "vllm_invoke_rest": [r["invoke"] - r["convert"] - r["method"] for r in rows],
                "vllm_outside_invoke": [r["dispatch"] - r["invoke"] for r in rows],
                "method": [r["method"] for r in rows],
                "between": [r["method"] - r["total"] for r in rows],
                "native": [r["total"] for r in rows],
                **{f"native_{p}": [r[p] for r in rows] for p in NATIVE_PARTS[:-1]},
            }
            out[call.removeprefix("session_gate_")] = {
                "n": len(rows),
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

    sink: dict[str, int] = {}

    def wrapped() -> None:
        t = _clock()
        try:
            return noop()
        finally:
            sink["method"] = _clock() - t

    extra = []
    for _ in range(samples):
        t0 = _clock()
        noop()
        t1 = _clock()
        wrapped()
        t2 = _clock()
        extra.append((t2 - t1) - (t1 - t0))
    return float(statistics.median(extra))


def install(engine_core_proc_cls: Any, driver_attr: str) -> Splits:
    """Wraps vLLM's dispatch (and, once an engine's methods are bound, the bound methods) with
    timers; returns where the samples go."""
    splits = Splits()
    original_handle = engine_core_proc_cls._handle_client_request

    @functools.wraps(original_handle)
    def handle(self: Any, request_type: Any, request: Any) -> None:
        # A utility request is (client_idx, call_id, method_name, args), as msgpack decoded it.
        name = request[2] if isinstance(request, (tuple, list)) and len(request) == 4 else None
        if name not in CALLS:
            return original_handle(self, request_type, request)
        _time_bound_method(self, name, splits, driver_attr)
        splits.current = {}
        t = _clock()
        original_handle(self, request_type, request)
        splits.end_call(name, _clock() - t)

    engine_core_proc_cls._handle_client_request = handle

    for attr, part in (("_invoke_utility_method", "invoke"), ("_convert_msgspec_args", "convert")):
        inner = getattr(engine_core_proc_cls, attr)  # both are staticmethods

        def timed_static(*args: Any, _inner: Any = inner, _part: str = part) -> Any:
            t = _clock()
            try:
                return _inner(*args)
            finally:
                splits.current[_part] = _clock() - t

        setattr(engine_core_proc_cls, attr, staticmethod(timed_static))

    return splits


def _time_bound_method(core: Any, name: str, splits: Splits, driver_attr: str) -> None:
    """Replaces the engine's cached bound method (``utility.Utility``) by a timed one
    with the same precomputed signature, and turns on the native call's part timers."""
    bound = core.__dict__.get(name)
    driver = core.__dict__.get(driver_attr)
    if bound is None or driver is None or getattr(bound, "_session_gate_timed", False):
        return
    book = driver._book
    book.time_parts = True
    driver.__dict__[SPLITS_ATTR] = splits

    def timed(*args: Any) -> Any:
        t = _clock()
        try:
            return bound(*args)
        finally:
            cur = splits.current
            cur["method"] = _clock() - t
            cur.update(book.last_parts())

    wrapper = functools.partial(timed)
    wrapper.__signature__ = bound.__signature__  # type: ignore[attr-defined]
    wrapper._session_gate_timed = True  # type: ignore[attr-defined]
    core.__dict__[name] = wrapper
