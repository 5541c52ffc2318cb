"""``python -m session_gate.lab.engine.bench_sched_cost``: what the scheduler mode of the engine
gate (``session_gate.engine.gate_scheduler``, ``SESSION_GATE_SCHEDULER=session-id``) costs
vLLM's engine loop, against a baseline measured in the same run. Two figures, issue 28's
targets:

(a) **No session traffic: the hook's cost in vLLM's step rate (target <= 2 %).** The same plain
workload (requests without a session id: ``--requests`` prompts of 64-768 tokens, 8-48 output
tokens each, all submitted at once to an engine of ``--max-num-seqs`` slots, so vLLM's waiting
queue is looked at step after step) runs with the setting off and on, in pairs of rounds, each
pair's order drawn at random (seeded): drift hits both arms alike. Each round starts from an empty
prefix cache, so both arms do the same work step for step; its wall time (submission and every
``step()``) gives steps/s and generated tokens/s. The figure is the median over round pairs of
``on / off`` (steps/s), with the pairs' min and max as its spread; ``cost = 1 - ratio``. As the
rounds run the same steps, a second figure takes the other load of a shared machine out: step
``i``'s time is the median of step ``i`` over an arm's rounds, an arm's round time the sum of
those (``cost_per_step_medians``); the same estimator between the off rounds of even and odd
pairs (``aa_cost_per_step_medians``: the same code on both sides) shows what it reads where
there is no difference, i.e. the noise floor of this run. A third reads the engine thread's CPU
time per round (``time.thread_time``: not the time it lost its core to other processes; it
includes the thread's wait for the model worker, a polling loop in vLLM): ``cost_engine_cpu`` is
the on arm's added median CPU time over an off round's wall time, ``aa_cost_engine_cpu`` the
same between the off rounds of even and odd pairs.

How the two settings share one process. ``gate_scheduler.install()`` reads the setting once per
process, so the engine starts with it on (the plugin wraps ``Scheduler.
_handle_blocked_waiting_request`` and ``EngineCore.add_request``; the first request builds the
engine gate's driver and gives the scheduler its gate), and an off round takes back exactly
what the setting adds: the two class attributes become vLLM's own functions again (the
wrappers' ``__wrapped__``), and the scheduler and engine core lose their gate and driver (so
``gate_binding``'s ``_free_request`` wrap, installed in both settings, finds no gate, and the
post-step tick finds no driver, as in an engine started off with no lease-door traffic). The on
round puts them back. One engine, one model worker and one KV cache serve both arms: the
difference between them is the code the setting changes and nothing else. (Two engine processes
started with each setting would also differ in what the setting does not touch: memory layout,
the core each worker runs on, their start-up, and each would load the machine while the other
is timed.) The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
its model in a worker process (as ``vllm serve`` runs it on CPU), async scheduling off: one
``step()`` is one scheduler step.

Beside the measured ratios, what noise cannot blur. In place: one more round per setting with
a timer on each call site the setting changes (the look at a waiting request, ``add_request``,
``post_step``, the gate's part of a free), whatever the class holds in that setting: the on
round's sum over the sites (the wrappers and vLLM's own work inside them) bounds the setting's
direct time from above (``in_situ``: us per round by site, and ``upper_bound_cost`` over an off
round's time). And a floor: each added piece timed alone in a
tight loop on the live engine's objects (the look wrapper on a request without an id, the
added part of a free, the add wrapper, the post-step driver check), times how often a round
calls it (counted in a separate round), over an off round's time: ``predicted_cost``. Each
piece is the best of five loops, wrapped minus bare, clamped at 0 (a piece below what a tight
loop resolves on a loaded machine reads 0).

(b) **Gated requests: engine-loop time per gated request, excluding the prefix walk (target
<= 20 us).** Multi-turn sessions (``--sessions`` x ``--turns``; each turn the whole history,
its next turn submitted when the previous one ends) with a session id on every request, on a
cache too small for all of them: some turns are held, and admits under pressure walk the
prefix. Lab-only timers (installed from here on the live engine; the product has no timing
switch, as with ``gate_splits``) time, with ``time.perf_counter_ns``, every call of the
scheduler hook for a request with an id (``Scheduler._handle_blocked_waiting_request``, the
product's wrapper and the vLLM check inside it) and every ``gate_binding._free_scheduled``
(the gate's part of vLLM's ``_free_request``). A look that called the book's ``admit`` is
counted under ``admit``; every other look (a held request's ``done()`` read, the look that
takes its answer, a look behind a held request of the same session, a preempted request's
re-look) under ``ready``; a free under ``release``. The book times its own parts
(``EngineGateBook.time_parts``, ``last_parts()``) and reports the prefix walk's ns
(``prefix``); it is subtracted from the look or free it ran in. Per gated request:
``admit_us`` (total minus walk), ``ready_us`` (all its polls), ``release_us``: every timed ns
divided by the gated requests, their sum against 20 us is ``ratio_to_target``. On a shared
machine a call during which the process lost its core counts that time too (the p99s show it):
``typical_us_per_gated_request`` is the same sum from per-call medians times calls per request,
and ``cpu_us_per_gated_request`` the same sum in the engine thread's CPU time
(``time.thread_time_ns`` around each call, net of what that timer reads timing nothing): what
the calls cost the engine thread, without the time it lost its core to another process. It is
an upper bound (a thread-time read is a system call, dearer on the loop's cold caches than in
the calibration loop), and it shows whether the tails are the thread's own work or time it
lost its core (on the 2-core VMs so far: its own work, cold caches).
A held request is looked at on every step while it is held (the engine keeps stepping), so
``ready_us`` grows with the hold's length in steps: ``ready_looks_per_gated_request`` says how
many. For the admits answered at once the native call's parts are printed too (p50: ``args``,
the argument checks and the prompt read; ``usage``; ``book``; ``answer``, the answer dict) and
``python_rest``, the look's time outside the native call. The driver's ticks (timer
deadlines: a held waiter's next poll, ``max_wait``, lease renewals) run in the engine loop too,
outside the scheduler hook: reported beside (``tick_us_per_gated_request``, prefix walks
included), not in the sum. The timers add their own clock reads to what they time
(``timer_ns``, per timed call, is printed) and ``time_parts`` adds the native part timers: the
figures are an upper bound.

Reading it. The lines print (a) then (b); the last line is JSON (with the machine's load
average). ``a.cost_median`` over ``a.target_cost`` is (a)'s ratio to its target (below 1 is
met), and ``a.cost_per_step_medians_over_target`` the same from per-step medians; read them
beside the pairs' spread and the off-against-off controls (``a.aa_cost_*``): a cost within the
noise floor is not resolved by the run, while ``a.in_situ.upper_bound_cost`` and
``a.predicted_cost`` say what the added code itself costs, at most and at least.
``b.total_us_per_gated_request`` over ``b.target_us`` is (b)'s ratio (below 1 is met).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from typing import Any

#: Issue 28's targets.
TARGET_COST = 0.02
TARGET_US = 20.0

_clock = time.perf_counter_ns
#: The engine thread's CPU time: a call's own cost, without the time its thread lost its core.
_cpu = time.thread_time_ns


# -- the engine ---------------------------------------------------------------------------------


def start_engine(num_blocks: int, block_size: int, max_num_seqs: int) -> Any:
    """The tiny CPU engine in this process, started in scheduler mode (the setting read once,
    when vLLM loads the plugin here)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["SESSION_GATE_SCHEDULER"] = "session-id"
    # Short holds: the gated phase must not stall on the 120 s default bound.
    os.environ.setdefault("SESSION_GATE_MAX_WAIT_SEC", "20")
    os.environ.setdefault("SESSION_GATE_WAIT_POLL_SEC", "0.5")
    from vllm import LLM

    from session_gate.engine import gate_scheduler
    from session_gate.lab.engine.step_timing import EngineSpec

    spec = EngineSpec(num_gpu_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs)
    llm = LLM(**spec.engine_kwargs())
    if not gate_scheduler.installed:
        raise RuntimeError("the plugin did not install the scheduler mode in this process")
    return llm


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


class Setting:
    """Switches the live engine between the setting's two states (see the module docstring)."""

    def __init__(self, core: Any) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore

        from session_gate.engine import gate_binding, gate_scheduler
        from session_gate.engine.gate_driver import DRIVER_ATTR

        self._core = core
        self._scheduler = core.scheduler
        self._attrs = [
            (Scheduler, "_handle_blocked_waiting_request"),
            (EngineCore, "add_request"),
        ]
        self._wrapped = {key: key[0].__dict__[key[1]] for key in self._attrs}
        for (cls, name), fn in self._wrapped.items():
            if getattr(fn, "__wrapped__", None) is None:
                raise RuntimeError(f"{cls.__name__}.{name} is not wrapped by gate_scheduler")
        self._instance_attrs = [
            (core, gate_scheduler.SCHEDULER_GATE_ATTR),
            (core, DRIVER_ATTR),
            (self._scheduler, gate_scheduler.SCHEDULER_GATE_ATTR),
            (self._scheduler, gate_binding.SCHEDULER_DRIVER_ATTR),
            (self._scheduler, gate_scheduler.LOOK_ATTR),
        ]
        self._saved: dict[tuple[int, str], Any] = {}
        self.state = "on"

    def off(self) -> None:
        for (cls, name), fn in self._wrapped.items():
            setattr(cls, name, fn.__wrapped__)
        for obj, attr in self._instance_attrs:
            if attr in obj.__dict__:
                self._saved[(id(obj), attr)] = obj.__dict__.pop(attr)
        self.state = "off"

    def on(self) -> None:
        for (cls, name), fn in self._wrapped.items():
            setattr(cls, name, fn)
        for obj, attr in self._instance_attrs:
            key = (id(obj), attr)
            if key in self._saved:
                obj.__dict__[attr] = self._saved.pop(key)
        self.state = "on"

    def set(self, state: str) -> None:
        self.on() if state == "on" else self.off()


def replace_look(scheduler: Any, make: Any) -> Any:
    """Puts ``make(look)`` where ``scheduler`` finds its look, ``look`` being what it calls
    now (the native look in its ``__dict__`` when on, else the class's function, bound):
    returns the undo."""
    from session_gate.engine.gate_scheduler import LOOK_ATTR

    had = scheduler.__dict__.get(LOOK_ATTR)
    scheduler.__dict__[LOOK_ATTR] = make(getattr(scheduler, LOOK_ATTR))

    def undo() -> None:
        if had is None:
            scheduler.__dict__.pop(LOOK_ATTR, None)
        else:
            scheduler.__dict__[LOOK_ATTR] = had

    return undo


# -- (a) the plain workload -------------------------------------------------------------------


def plain_workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` requests: (prompt token ids, max_tokens), fixed by ``seed``."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 4000) for _ in range(rng.randrange(64, 769))], rng.randrange(8, 49))
        for _ in range(n)
    ]


def run_plain(llm: Any, workload: list[tuple[list[int], int]], tag: str) -> dict[str, Any]:
    """One round: the workload submitted at once, stepped to the end; wall time (and each
    ``step()``'s), steps and generated tokens."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    gc.collect()
    tokens = 0
    step_times: list[float] = []
    clock = time.perf_counter
    cpu0 = time.thread_time()
    t0 = clock()
    for i, (prompt, max_tokens) in enumerate(workload):
        engine.add_request(
            f"{tag}-{i}",
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        )
    added = clock() - t0
    while engine.has_unfinished_requests():
        t = clock()
        outputs = engine.step()
        step_times.append(clock() - t)
        for out in outputs:
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    seconds = clock() - t0
    return {
        "seconds": seconds,
        "cpu_seconds": time.thread_time() - cpu0,
        "steps": len(step_times),
        "tokens": tokens,
        "add_seconds": added,
        "step_times": step_times,
    }


def robust_seconds(rounds: list[dict[str, Any]]) -> float | None:
    """A round's time with bursts of the machine's other load taken out: every round runs the
    same steps, so step ``i``'s time is the median of step ``i`` over the rounds; the sum over
    ``i`` (plus the median submission time). None if the rounds' steps differ."""
    if len({r["steps"] for r in rounds}) != 1:
        return None
    per_step = zip(*(r["step_times"] for r in rounds), strict=True)
    return statistics.median(r["add_seconds"] for r in rounds) + sum(
        statistics.median(times) for times in per_step
    )


#: The call sites whose time the setting changes for a request without an id.
_SITES = ("look", "add", "post_step", "free")


def _in_situ(llm: Any, setting: Setting, workload: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One timed round per setting: how often the round calls each site the setting changes and
    the ns spent in it (whatever the class holds in that setting: vLLM's function, or the
    wrapper with vLLM's function inside; the gate's part of a free exists only when on). The
    on round's sum over the sites bounds the setting's direct time in the engine loop from
    above: it holds the wrappers and vLLM's own work inside them."""
    from vllm.v1.engine.core import EngineCore

    from session_gate.engine import gate_binding

    scheduler = _core(llm).scheduler
    out: dict[str, Any] = {}
    for state in ("off", "on"):
        setting.set(state)
        calls = dict.fromkeys(_SITES, 0)
        ns = dict.fromkeys(_SITES, 0)
        add = EngineCore.add_request
        post = EngineCore.post_step
        free = gate_binding._free_scheduled

        def timed(
            site: str, fn: Any, ns: dict[str, int] = ns, calls: dict[str, int] = calls
        ) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                t = _clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    ns[site] += _clock() - t
                    calls[site] += 1

            return call

        undo_look = replace_look(scheduler, lambda look: timed("look", look))
        EngineCore.add_request = timed("add", add)
        EngineCore.post_step = timed("post_step", post)
        gate_binding._free_scheduled = timed("free", free)
        try:
            r = run_plain(llm, workload, f"situ-{state}")
        finally:
            undo_look()
            EngineCore.add_request = add
            EngineCore.post_step = post
            gate_binding._free_scheduled = free
        out[state] = {"calls": calls, "ns": ns, "seconds": r["seconds"], "steps": r["steps"]}
    setting.on()
    bound = sum(out["on"]["ns"].values())
    return {
        "calls_on": out["on"]["calls"],
        "us_per_round_off": {k: v / 1e3 for k, v in out["off"]["ns"].items()},
        "us_per_round_on": {k: v / 1e3 for k, v in out["on"]["ns"].items()},
        "upper_bound_us_per_round": bound / 1e3,
        "upper_bound_cost": bound / 1e9 / out["off"]["seconds"],
    }


def _best_ns(fn: Any, args: tuple[Any, ...], n: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = _clock()
        for _ in range(n):
            fn(*args)
        best = min(best, (_clock() - t) / n)
    return best


def floor_ns(llm: Any, calls: int) -> dict[str, float]:
    """Each piece the setting adds for a request without an id, timed alone on the live
    engine's objects (setting on): ns per call, wrapped minus bare (best of 5 tight loops)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from session_gate.engine import gate_binding, gate_scheduler
    from session_gate.engine.gate_methods import _wrap_post_step

    core = _core(llm)
    scheduler = core.scheduler
    request = Request("floor-0", [5, 6, 7], SamplingParams(max_tokens=1), None)
    wrapped_look = scheduler._handle_blocked_waiting_request  # the native look when on
    bare_look = Scheduler._handle_blocked_waiting_request.__wrapped__.__get__(scheduler)

    def noop(self: Any, *args: Any) -> None:
        return None

    def get_gate(scheduler: Any, request: Any) -> None:
        # The line _free_request runs in both settings, then what only the on setting runs.
        g = scheduler.__dict__.get(gate_binding.SCHEDULER_GATE_ATTR)
        if g is not None:
            gate_binding._free_scheduled(g, request)

    def get_none(scheduler: Any, request: Any) -> None:
        g = scheduler.__dict__.get("_session_gate_lab_absent")
        if g is not None:
            gate_binding._free_scheduled(g, request)

    add_wrapped = gate_scheduler._wrap_add_request(noop)
    post_wrapped = _wrap_post_step(noop)

    class _NoDriver:  # an engine core without the driver (what an off engine's post_step sees)
        pass

    out = {
        "look_ns": _best_ns(wrapped_look, (request,), calls)
        - _best_ns(bare_look, (request,), calls),
        "free_ns": _best_ns(get_gate, (scheduler, request), calls)
        - _best_ns(get_none, (scheduler, request), calls),
        "add_ns": _best_ns(add_wrapped, (core, request), calls)
        - _best_ns(noop, (core, request), calls),
        "post_step_ns": _best_ns(post_wrapped, (core, True), calls)
        - _best_ns(post_wrapped, (_NoDriver(), True), calls),
    }
    return {k: round(max(v, 0.0), 1) for k, v in out.items()}


def measure_plain(
    llm: Any, setting: Setting, rounds: int, requests: int, seed: int, floor_calls: int
) -> dict[str, Any]:
    workload = plain_workload(requests, seed)
    # Warm-up, both arms (the first on request builds the engine gate's driver).
    for state in ("on", "off"):
        setting.set(state)
        run_plain(llm, workload, f"warm-{state}")
    arms: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    orders = random.Random(seed).choices((("off", "on"), ("on", "off")), k=rounds)
    for i, order in enumerate(orders):
        for state in order:
            setting.set(state)
            arms[state].append(run_plain(llm, workload, f"a{i}-{state}"))
    setting.on()
    situ = _in_situ(llm, setting, workload)
    c = situ["calls_on"]
    counts = {"looks": c["look"], "frees": c["free"], "adds": c["add"], "steps": c["post_step"]}
    floor = floor_ns(llm, floor_calls)

    def rate(r: dict[str, Any], key: str) -> float:
        return r[key] / r["seconds"]

    ratios = [
        rate(on, "steps") / rate(off, "steps")
        for off, on in zip(arms["off"], arms["on"], strict=True)
    ]
    steps = {int(r["steps"]) for rs in arms.values() for r in rs}
    tokens = {int(r["tokens"]) for rs in arms.values() for r in rs}
    off_seconds = statistics.median(r["seconds"] for r in arms["off"])
    added_ns = (
        counts["looks"] * floor["look_ns"]
        + counts["frees"] * floor["free_ns"]
        + counts["adds"] * floor["add_ns"]
        + counts["steps"] * floor["post_step_ns"]
    )
    ratio = statistics.median(ratios)
    # Per step index (bursts out): on against off, and off's even rounds against its odd ones
    # (the same code both sides: what this estimator reads where there is no difference).
    robust = {state: robust_seconds(rs) for state, rs in arms.items()}
    halves = (robust_seconds(arms["off"][0::2]), robust_seconds(arms["off"][1::2]))
    robust_ratio = robust["off"] / robust["on"] if robust["off"] and robust["on"] else None
    aa_ratio = halves[0] / halves[1] if len(arms["off"]) > 1 and all(halves) else None
    # The engine thread's CPU time (not the time it lost its core): what the on arm adds, over
    # an off round's wall time; and the same between the off rounds of even and odd pairs.
    cpu = {state: statistics.median(r["cpu_seconds"] for r in rs) for state, rs in arms.items()}
    aa_cpu = None
    if len(arms["off"]) > 1:  # one round pair has no off-against-off control
        even, odd = (statistics.median(r["cpu_seconds"] for r in arms["off"][k::2]) for k in (0, 1))
        aa_cpu = (odd - even) / off_seconds
    return {
        "rounds": rounds,
        "requests": requests,
        "steps_per_round": sorted(steps),
        "tokens_per_round": sorted(tokens),
        "off": {
            "steps_per_s_median": statistics.median(rate(r, "steps") for r in arms["off"]),
            "tokens_per_s_median": statistics.median(rate(r, "tokens") for r in arms["off"]),
            "round_sec_median": off_seconds,
            "round_sec_per_step_medians": robust["off"],
        },
        "on": {
            "steps_per_s_median": statistics.median(rate(r, "steps") for r in arms["on"]),
            "tokens_per_s_median": statistics.median(rate(r, "tokens") for r in arms["on"]),
            "round_sec_median": statistics.median(r["seconds"] for r in arms["on"]),
            "round_sec_per_step_medians": robust["on"],
        },
        "pair_ratios": [round(r, 4) for r in ratios],
        "ratio_median": ratio,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "cost_median": 1.0 - ratio,
        "ratio_per_step_medians": robust_ratio,
        "cost_per_step_medians": None if robust_ratio is None else 1.0 - robust_ratio,
        "aa_cost_per_step_medians": None if aa_ratio is None else 1.0 - aa_ratio,
        "engine_thread_cpu_sec_median": cpu,
        "cost_engine_cpu": (cpu["on"] - cpu["off"]) / off_seconds,
        "aa_cost_engine_cpu": aa_cpu,
        "target_cost": TARGET_COST,
        "cost_over_target": (1.0 - ratio) / TARGET_COST,
        "cost_per_step_medians_over_target": None
        if robust_ratio is None
        else (1.0 - robust_ratio) / TARGET_COST,
        "calls_per_round": counts,
        "floor_ns": floor,
        "predicted_cost": added_ns / 1e9 / off_seconds,
        "in_situ": situ,
    }


# -- (b) gated requests -----------------------------------------------------------------------


class GateTimers:
    """Lab-only timers around the scheduler hook's calls on the live engine (module docstring)."""

    def __init__(self, core: Any) -> None:
        from session_gate.engine import gate_scheduler
        from session_gate.engine.gate_driver import DRIVER_ATTR

        self.core = core
        self.gate = core.scheduler.__dict__[gate_scheduler.SCHEDULER_GATE_ATTR]
        self.driver = core.__dict__[DRIVER_ATTR]
        self.book = self.driver._book
        #: Admits and releases: (ns, the native call's parts, whether the admit was deferred).
        self.admit: list[tuple[int, dict[str, int], bool]] = []
        self.release: list[tuple[int, dict[str, int]]] = []
        #: Other looks by what the request was before the look: held (its admit pending),
        #: queued (behind a held request of its session), decided (admitted, re-queued).
        self.ready: dict[str, list[int]] = {"held": [], "queued": [], "decided": []}
        self.ticks: list[int] = []
        #: The same calls' CPU time on the engine thread (ns), by kind: admit, ready, release.
        self.cpu: dict[str, list[int]] = {"admit": [], "ready": [], "release": []}
        self._undo: list[Any] = []

    def install(self) -> None:
        from session_gate.engine import gate_binding
        from session_gate.engine.gate_driver import EngineGateDriver

        gate, book = self.gate, self.book
        counters = gate.counters
        held_map, queued, decided = gate._held, gate._queued, gate._decided
        free = gate_binding._free_scheduled
        tick = EngineGateDriver.tick
        admit, ready, release, ticks = self.admit, self.ready, self.release, self.ticks
        cpu = self.cpu

        def gated_count() -> int:  # the Python gate's and the native look's admits
            return counters["gated"] + (gate.look.gated if gate.look is not None else 0)

        def timed_look(look: Any) -> Any:
            def call(request: Any) -> bool:
                if not request.session_id:
                    return look(request)
                rid = request.request_id
                kind = (
                    "held"
                    if rid in held_map
                    else "queued"
                    if rid in queued
                    else "decided"
                    if rid in decided
                    else "first"
                )
                gated, held = gated_count(), counters["held"]
                c = _cpu()
                t = _clock()
                try:
                    return look(request)
                finally:
                    ns = _clock() - t
                    c = _cpu() - c
                    if gated_count() != gated:
                        admit.append((ns, dict(book.last_parts()), counters["held"] != held))
                        cpu["admit"].append(c)
                    else:
                        ready["queued" if kind == "first" else kind].append(ns)
                        cpu["ready"].append(c)

            return call

        def timed_free(g: Any, request: Any) -> None:
            before = book.bound_releases
            c = _cpu()
            t = _clock()
            try:
                return free(g, request)
            finally:
                ns = _clock() - t
                c = _cpu() - c
                release.append(
                    (ns, dict(book.last_parts()) if book.bound_releases != before else {})
                )
                cpu["release"].append(c)

        def timed_tick(self: Any) -> None:
            t = _clock()
            try:
                return tick(self)
            finally:
                ticks.append(_clock() - t)

        book.time_parts = True
        undo_look = replace_look(self.core.scheduler, timed_look)
        gate_binding._free_scheduled = timed_free
        EngineGateDriver.tick = timed_tick

        def undo() -> None:
            book.time_parts = False
            undo_look()
            gate_binding._free_scheduled = free
            EngineGateDriver.tick = tick

        self._undo.append(undo)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


def _timer_ns(samples: int = 5000) -> float:
    """Median ns a timer (two clock reads and a list append) adds to what it times."""
    sink: list[int] = []
    extra = []
    for _ in range(samples):
        t0 = _clock()
        t1 = _clock()
        sink.append(t1 - t0)
        t2 = _clock()
        extra.append(t2 - t0)
    return float(statistics.median(extra))


def _cpu_timer_ns(samples: int = 5000) -> float:
    """Median CPU ns a timed call's CPU timer (two thread-time reads around the wall timer's
    two clock reads) reads when it times nothing."""
    extra = []
    for _ in range(samples):
        c0 = _cpu()
        t0 = _clock()
        _ = _clock() - t0
        extra.append(_cpu() - c0)
    return float(statistics.median(extra))


def run_sessions(
    llm: Any, sessions: int, turns: int, prompt: int, append: int, max_tokens: int, seed: int
) -> dict[str, int]:
    """``sessions`` sessions of ``turns`` turns, each turn the whole history (a shared system
    prompt, the session's task, every earlier turn); a session's next turn goes in when its
    previous one ends. Every request carries its session's id."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(seed)
    system = [rng.randrange(3, 4000) for _ in range(prompt // 2)]
    history = [
        system + [rng.randrange(3, 4000) for _ in range(prompt // 2)] for _ in range(sessions)
    ]
    left = [turns] * sessions
    live: dict[str, int] = {}
    ids = iter(range(1 << 30))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    max_len = engine.vllm_config.model_config.max_model_len

    def submit(s: int) -> None:
        if left[s] == 0 or len(history[s]) + append + max_tokens > max_len:
            return
        left[s] -= 1
        history[s] += [rng.randrange(3, 4000) for _ in range(append)]
        rid = f"b-{next(ids)}"
        live[rid] = s
        engine.add_request(
            rid, {"prompt_token_ids": list(history[s])}, params, session_id=f"sess-{s}"
        )

    for s in range(sessions):
        submit(s)
    steps = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in live:
                s = live.pop(out.request_id)
                history[s] += list(out.outputs[0].token_ids)
                submit(s)
        steps += 1
    return {"steps": steps, "seconds": time.perf_counter() - started}


def _q(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"n": 0, "p50_us": 0.0, "p99_us": 0.0}
    if len(ns) == 1:
        return {"n": 1, "p50_us": ns[0] / 1e3, "p99_us": ns[0] / 1e3}
    q = statistics.quantiles(ns, n=100, method="inclusive")
    return {"n": len(ns), "p50_us": q[49] / 1e3, "p99_us": q[98] / 1e3}


def _native_parts_p50(
    calls: list[tuple[int, dict[str, int]]], parts: tuple[str, ...]
) -> dict[str, float]:
    """The p50 of each of the book's timed ``parts`` over ``calls`` (each its ns and the book's
    ``last_parts()``), and of the time around the native call (``python_rest``)."""
    p50 = {part: _q([p.get(part, 0) for _, p in calls])["p50_us"] for part in parts}
    p50["python_rest"] = _q([ns - p.get("total", 0) for ns, p in calls])["p50_us"]
    return p50


def measure_gated(
    llm: Any, sessions: int, turns: int, prompt: int, append: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    core = _core(llm)
    # Warm-up: the book's first admits and releases (lazy set-up), not timed.
    run_sessions(llm, 2, 1, prompt, append, max_tokens, seed + 1)
    llm.reset_prefix_cache()
    timers = GateTimers(core)
    before = timers.gate.stats()  # counters, the native look's included
    walks_before = timers.book.stats()["probes"]["prefix"]["count"]
    timers.install()
    try:
        run = run_sessions(llm, sessions, turns, prompt, append, max_tokens, seed)
    finally:
        timers.uninstall()
    after = timers.gate.stats()
    walks = timers.book.stats()["probes"]["prefix"]["count"] - walks_before

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    gated = delta("gated")
    if gated == 0 or len(timers.admit) != gated:
        raise RuntimeError(f"{gated} gated requests but {len(timers.admit)} timed admits")
    admit_net = [ns - parts.get("prefix", 0) for ns, parts, _ in timers.admit]
    release_net = [ns - parts.get("prefix", 0) for ns, parts in timers.release]
    looks = [ns for kind in timers.ready.values() for ns in kind]
    mean = {
        "admit": sum(admit_net) / gated / 1e3,
        "ready": sum(looks) / gated / 1e3,
        "release": sum(release_net) / gated / 1e3,
    }
    p50 = {
        "admit": _q(admit_net)["p50_us"],
        "ready": _q(looks)["p50_us"] * len(looks) / gated,
        "release": _q(release_net)["p50_us"] * len(timers.release) / gated,
    }
    total, typical = sum(mean.values()), sum(p50.values())
    # The timers' own clock reads, per gated request (every admit, look and release is timed).
    timer_ns = _timer_ns()
    timer_us = timer_ns * (len(timers.admit) + len(looks) + len(timers.release)) / gated / 1e3
    # The same sum in the engine thread's CPU time: what the calls cost, without the time the
    # thread lost its core to another process (walks' wall ns taken out, as above).
    cpu_timer_ns = _cpu_timer_ns()
    walks_ns = [p.get("prefix", 0) for _, p, _ in timers.admit] + [
        p.get("prefix", 0) for _, p in timers.release
    ]
    cpu_calls = timers.cpu["admit"] + timers.cpu["release"]
    cpu_ns = sum(max(0, c - w) for c, w in zip(cpu_calls, walks_ns, strict=True))
    cpu_ns += sum(timers.cpu["ready"])
    n_timed = len(cpu_calls) + len(timers.cpu["ready"])
    cpu_us = (cpu_ns - cpu_timer_ns * n_timed) / gated / 1e3
    native = _native_parts_p50(
        [(ns, parts) for ns, parts, deferred in timers.admit if not deferred],
        ("args", "usage", "prefix", "answer", "book", "total"),
    )
    release_native = _native_parts_p50(
        [(ns, parts) for ns, parts in timers.release if parts],
        ("usage", "prefix", "book", "total"),
    )
    return {
        "sessions": sessions,
        "turns": turns,
        "steps": run["steps"],
        "seconds": run["seconds"],
        "gated_requests": gated,
        "held": delta("held"),
        "held_behind_session": delta("held_behind_session"),
        "max_wait": delta("max_wait"),
        "prefix_walks": walks,
        "admit_us_per_gated_request": mean["admit"],
        "admit_prefix_walk_us_per_gated_request": sum(
            parts.get("prefix", 0) for _, parts, _ in timers.admit
        )
        / gated
        / 1e3,
        "ready_us_per_gated_request": mean["ready"],
        "ready_looks_per_gated_request": len(looks) / gated,
        "ready_looks_by_kind": {k: len(v) for k, v in timers.ready.items()},
        "release_us_per_gated_request": mean["release"],
        "release_prefix_walk_us_per_gated_request": sum(
            parts.get("prefix", 0) for _, parts in timers.release
        )
        / gated
        / 1e3,
        "total_us_per_gated_request": total,
        "typical_us_per_gated_request": typical,
        "timer_us_per_gated_request": timer_us,
        "total_net_of_timers_us_per_gated_request": total - timer_us,
        "typical_net_of_timers_us_per_gated_request": typical - timer_us,
        "typical_by_part_us": p50,
        "cpu_us_per_gated_request": cpu_us,
        "cpu_timer_ns": cpu_timer_ns,
        "target_us": TARGET_US,
        "ratio_to_target": total / TARGET_US,
        "typical_ratio_to_target": typical / TARGET_US,
        "tick_us_per_gated_request": sum(timers.ticks) / gated / 1e3,
        "ticks": len(timers.ticks),
        "per_call": {
            "admit_minus_walk": _q(admit_net),
            "admit_walk": _q([p["prefix"] for _, p, _ in timers.admit if p.get("prefix")]),
            **{f"ready_{kind}": _q(ns) for kind, ns in timers.ready.items()},
            "release_minus_walk": _q(release_net),
            "tick": _q(timers.ticks),
        },
        "admit_native_parts_p50_us": native,
        "release_native_parts_p50_us": release_native,
        "timer_ns": timer_ns,
    }


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m session_gate.lab.engine.bench_sched_cost",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--rounds", type=int, default=20, help="(a) round pairs (off and on)")
    p.add_argument("--requests", type=int, default=32, help="(a) requests per round")
    p.add_argument("--sessions", type=int, default=16, help="(b) sessions")
    p.add_argument("--turns", type=int, default=6, help="(b) turns per session")
    p.add_argument("--prompt", type=int, default=512, help="(b) first turn's prompt tokens")
    p.add_argument("--append", type=int, default=128, help="(b) tokens each turn adds")
    p.add_argument("--max-tokens", type=int, default=32, help="(b) output tokens per turn")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--floor-calls", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.sessions < 1 or args.turns < 1:
        p.error("--rounds, --requests, --sessions and --turns must be at least 1")

    import vllm

    llm = start_engine(args.num_blocks, args.block_size, args.max_num_seqs)
    core = _core(llm)
    setting = Setting(core)
    started = time.perf_counter()
    a = measure_plain(llm, setting, args.rounds, args.requests, args.seed, args.floor_calls)
    robust = a["cost_per_step_medians"]
    aa = a["aa_cost_per_step_medians"]
    print(
        f"(a) plain workload, {a['rounds']} round pairs of {a['requests']} requests "
        f"({a['steps_per_round']} steps): off {a['off']['steps_per_s_median']:.1f} steps/s "
        f"{a['off']['tokens_per_s_median']:.0f} tok/s, on {a['on']['steps_per_s_median']:.1f} "
        f"steps/s {a['on']['tokens_per_s_median']:.0f} tok/s; on/off median "
        f"{a['ratio_median']:.4f} [{a['ratio_min']:.4f}, {a['ratio_max']:.4f}]: cost "
        f"{a['cost_median'] * 100:+.2f} % (target <= {TARGET_COST * 100:.0f} %, "
        f"{a['cost_over_target']:.2f}x)",
        flush=True,
    )
    print(
        "    per-step medians: cost "
        + ("n/a" if robust is None else f"{robust * 100:+.2f} % ({robust / TARGET_COST:.2f}x)")
        + ", off against off (no difference) "
        + ("n/a" if aa is None else f"{aa * 100:+.2f} %")
        + f"; engine thread CPU: cost {a['cost_engine_cpu'] * 100:+.2f} %, off against off "
        + ("n/a" if a["aa_cost_engine_cpu"] is None else f"{a['aa_cost_engine_cpu'] * 100:+.2f} %")
        + f"; every call site the setting changes, timed in place (on, vLLM's work inside "
        f"included): {a['in_situ']['upper_bound_us_per_round']:.0f} us per round, at most "
        f"{a['in_situ']['upper_bound_cost'] * 100:.3f} %"
        + f"; predicted from the added code alone {a['predicted_cost'] * 100:.4f} % "
        f"(ns per call {a['floor_ns']}, calls per round {a['calls_per_round']})",
        flush=True,
    )
    b = measure_gated(
        llm, args.sessions, args.turns, args.prompt, args.append, args.max_tokens, args.seed
    )
    print(
        f"(b) {b['gated_requests']} gated requests ({b['held']} held, {b['prefix_walks']} "
        f"prefix walks): per request admit {b['admit_us_per_gated_request']:.2f} us (+ walk "
        f"{b['admit_prefix_walk_us_per_gated_request']:.2f} us, excluded), ready "
        f"{b['ready_us_per_gated_request']:.2f} us ({b['ready_looks_per_gated_request']:.1f} "
        f"looks), release {b['release_us_per_gated_request']:.2f} us (+ walk "
        f"{b['release_prefix_walk_us_per_gated_request']:.2f} us, excluded): "
        f"{b['total_us_per_gated_request']:.2f} us (target <= {TARGET_US:.0f} us, "
        f"{b['ratio_to_target']:.2f}x); from per-call medians "
        f"{b['typical_us_per_gated_request']:.2f} us ({b['typical_ratio_to_target']:.2f}x); "
        f"net of the timers' own {b['timer_us_per_gated_request']:.2f} us: "
        f"{b['total_net_of_timers_us_per_gated_request']:.2f} / "
        f"{b['typical_net_of_timers_us_per_gated_request']:.2f} us; "
        f"ticks beside {b['tick_us_per_gated_request']:.2f} us; "
        f"in the engine thread's CPU time (the core it lost to other processes left out; an "
        f"upper bound: a thread-time read costs more in the loop than its calibration says) "
        f"{b['cpu_us_per_gated_request']:.2f} us",
        flush=True,
    )
    pc = b["per_call"]
    print(
        "    per call p50/p99 us: "
        + ", ".join(f"{k} {v['p50_us']:.2f}/{v['p99_us']:.2f} (n {v['n']})" for k, v in pc.items())
        + f"; admit's native parts p50 {b['admit_native_parts_p50_us']}; release's "
        f"{b['release_native_parts_p50_us']}; "
        f"timer {b['timer_ns']:.0f} ns per timed call",
        flush=True,
    )
    record = {
        "a": a,
        "b": b,
        "engine": {
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "vllm_version": vllm.__version__,
            "cpus": os.cpu_count(),
        },
        # The machine's load while it ran (1, 5, 15 min): others' work lands in both figures.
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "seconds": time.perf_counter() - started,
    }
    del llm, core, setting
    gc.collect()
    print(json.dumps(record, sort_keys=True))


if __name__ == "__main__":
    main()
