"""``python -m session_gate.lab.bench.clients --clients K``: the thrash benchmark with its sessions
split among K client processes, each with its own connection to one ``vllm serve`` (as rollout
workers would have), instead of one process driving every session.

Modes: ``gate`` (a local ``SessionGate`` + ``HttpProbe`` in each client: every client believes it
owns the whole cache), ``engine-gate`` (``HttpGate``: the one gate in the engine, shared),
``middleware`` (a plain client: each request carries only an ``x-session-id`` header, the engine's
middleware gates it, and nobody ever finishes a session), ``sched`` (the same plain client against
an engine started with ``SESSION_GATE_SCHEDULER=session-id`` and no middleware: vLLM's scheduler
asks the gate; a server of its own; at each episode's end the client sends vllm-router's
``POST /finish_session?session_id=``, as prime-rl does), ``sched-nofinish`` (``sched`` without that
call: ids only), ``sched-infer`` (a client that names nothing at all against
an engine started with ``SESSION_GATE_SCHEDULER=infer``: the gate infers each turn's session from
its blocks; a server of its own, and the inference is audited against the truth: each request
carries vLLM's standard ``X-Request-Id``, which the gate does not read, and the engine's list of
recent inferences is matched to it), ``none``; and ``gate@1``, the
single-client gate (all sessions in one process) the targets compare against.
Sessions go to clients round-robin. The table is the bench's own report; the last line is JSON.

Also measured, in the same server run: the middleware's added latency (the same short completion
with and without ``x-session-id``, gate open) and the engine-loop cost of admit + release (our
native code in the engine loop, from the engine's own timers; see ``_engine_loop_cost``).
``--loop-splits`` also times vLLM's dispatch around it and the native call's parts
(``session_gate.lab.engine.gate_splits``); its timers add to what they measure, so the headline
figures come from runs without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from session_gate import report
from session_gate.lab.bench import infer_audit
from session_gate.lab.bench.admission import Admission
from session_gate.lab.bench.http_turns import HttpEngine, PlainClient
from session_gate.lab.bench.runner import run_mode
from session_gate.modes import Mode
from session_gate.results import ModeResult, TurnRecord
from session_gate.workloads import WORKLOADS

MODES = (
    "gate",
    "engine-gate",
    "middleware",
    "sched",
    "sched-nofinish",
    "sched-infer",
    "none",
    "gate@1",
)
#: Modes that need the engine started in the gate's scheduler mode (a server of their own), and
#: the ``SESSION_GATE_SCHEDULER`` setting each needs.
SCHEDULER_MODES = {"sched": "session-id", "sched-nofinish": "session-id", "sched-infer": "infer"}
#: Modes with no admission in the client.
PLAIN_MODES = ("middleware", "sched", "sched-nofinish", "sched-infer")
#: Plain modes whose client names each turn's session (an ``x-session-id`` header).
NAMED_MODES = ("middleware", "sched", "sched-nofinish")
MIDDLEWARE = "session_gate.engine.gate_middleware.SessionGateMiddleware"


def _admission(mode: str, url: str) -> Admission:
    from session_gate import HttpGate, HttpProbe

    if mode == "engine-gate":
        admission = Admission(Mode("none", "none"), None)
        admission.gate = HttpGate(url)
        # Its counters live in the engine: run_clients reads them once, after every client.
        admission.stats = dict  # type: ignore[method-assign]
        return admission
    if mode in PLAIN_MODES:
        return PlainClient(mode)
    kind = "gate" if mode.startswith("gate") else "none"
    return Admission(Mode(kind, kind), HttpProbe(url))


def _client(
    url: str, workload: str, seed: int, mode: str, only: list[int], run: str, queue: Any
) -> None:
    """One client process: drives its sessions and sends back its turn records."""

    async def main() -> list[TurnRecord]:
        engine = HttpEngine(
            url, session_header=mode in NAMED_MODES, run=run, request_ids=mode == "sched-infer"
        )
        admission = _admission(mode, url)
        result = await run_mode(
            None,
            WORKLOADS[workload](seed),
            Mode(mode, "gate" if "gate" in mode else "none"),
            None,
            only=set(only),
            admission=admission,
            generate=engine.generate,
            finish=engine.finish if mode == "sched" else None,
        )
        if hasattr(admission.gate, "aclose"):
            await admission.gate.aclose()
        return result.records

    queue.put(asyncio.run(main()))


def run_clients(url: str, workload: str, seed: int, mode: str, k: int) -> ModeResult:
    import httpx

    httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    spec = WORKLOADS[workload](seed)
    n = len(spec.sessions)
    k = 1 if mode == "gate@1" else k
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    slices = [list(range(i, n, k)) for i in range(k)]
    run = f"{mode}-{time.monotonic_ns()}"
    procs = [
        ctx.Process(target=_client, args=(url, workload, seed, mode, s, run, queue)) for s in slices
    ]
    started = time.perf_counter()
    for p in procs:
        p.start()
    records: list[TurnRecord] = []
    for _ in procs:
        records += queue.get()
    makespan = time.perf_counter() - started
    for p in procs:
        p.join()
    # Each client counts the shared system prompt as unseen once; ideally it is prefilled once.
    block = spec.engine.block_size
    firsts = [r for r in records if r.turn == 0 and r.ideal_cached_tokens == 0]
    system = min(s.system_tokens for s in spec.sessions)
    for r in firsts[1:]:
        r.ideal_cached_tokens = (system // block) * block
    stats = (
        httpx.get(f"{url}/session_gate/v1/stats", timeout=60).json()
        if mode in ("engine-gate", *PLAIN_MODES)
        else {}
    )
    if mode == "sched-infer":
        rows = httpx.get(
            f"{url}/session_gate/v1/stats", params={"format": "inferred"}, timeout=60
        ).json()
        stats["infer_audit"] = infer_audit.audit(rows, infer_audit.header_ids(run))
    return ModeResult(
        mode if k == 1 or mode == "gate@1" else f"{mode}×{k}", workload, makespan, records, stats
    )


async def _middleware_overhead(url: str, n: int) -> dict[str, float]:
    """p50/p99 of one short completion, alternating with and without ``x-session-id``.

    Both kinds get the same surroundings, so that the difference is the gate's alone: each
    request is followed by the same ``finish`` call (which the gated one needs, to drop its
    session), so neither starts while the server still winds down the request before it (that
    tail used to land on the gated request only: +0.5 ms); and the order alternates.

    Also reported: how the gated turns' leases were released, from the engine gate's counters:
    by the engine when their request ended (``gate_binding``: no call) or by a release call."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        before = (await http.get(f"{url}/session_gate/v1/stats")).json()["engine_gate"]
        times: dict[str, list[float]] = {"plain": [], "gated": []}
        body = {"model": "tiny", "prompt": list(range(10, 42)), "max_tokens": 1}
        for i in range(n):
            for kind in ("plain", "gated") if i % 2 else ("gated", "plain"):
                headers = {"x-session-id": f"overhead-{i}"} if kind == "gated" else {}
                t = time.perf_counter()
                r = await http.post(f"{url}/v1/completions", json=body, headers=headers)
                times[kind].append(time.perf_counter() - t)
                r.raise_for_status()
                gated = r.headers.get("x-session-gate-reason")
                assert gated == ("open" if kind == "gated" else None), r.headers
                await http.post(
                    f"{url}/session_gate/v1/finish", json={"session_id": f"overhead-{i}"}
                )
        after = (await http.get(f"{url}/session_gate/v1/stats")).json()["engine_gate"]
    by_request = after.get("leases_released_by_request", 0) - before.get(
        "leases_released_by_request", 0
    )
    calls = after["release_loop_calls"] - before["release_loop_calls"]
    q = {k: statistics.quantiles(v, n=100, method="inclusive") for k, v in times.items()}
    return {
        "plain_p50_ms": q["plain"][49] * 1e3,
        "gated_p50_ms": q["gated"][49] * 1e3,
        "plain_p99_ms": q["plain"][98] * 1e3,
        "gated_p99_ms": q["gated"][98] * 1e3,
        "added_p50_ms": (q["gated"][49] - q["plain"][49]) * 1e3,
        # Every native release (the engine's own or a call's) and the engine's own among them.
        "releases": calls,
        "released_by_request": by_request,
        "release_engine_us_mean": (after["release_loop_us_total"] - before["release_loop_us_total"])
        / max(calls, 1),
    }


async def _engine_loop_cost(url: str, n: int) -> dict[str, Any]:
    """The engine-loop cost of one admit + release, from the engine's own timers: each call's
    native time from entry to return (``engine_us`` in the admit's answer; the engine's
    ``release_loop_us_last`` read after each release), which is all of our code in the call:
    argument checks, the clock, the usage read, the book and the core, the answer dict. Not
    included: vLLM's dispatch of the utility call around it (``--loop-splits`` measures that)
    and the prefix walk, which an admit with the gate open does not run (checked: the core's
    prefix probe count must not move). A 32-token prompt, gate open; beside it the same run's
    O(1) usage probe, the cheapest utility call that reads the block pool."""
    from session_gate import HttpGate, HttpProbe

    admit_us, release_us, usage_us = [], [], []
    async with HttpGate(url) as gate, HttpProbe(url) as probe:
        before = await gate.stats()
        for i in range(n):
            lease = await gate.acquire(f"loop-{i}", list(range(10, 42)), 1, retain_session=False)
            admit_us.append(lease.engine_us)
            await lease.arelease()
            release_us.append((await gate.stats())["engine_gate"]["release_loop_us_last"])
            usage_us.append((await probe.usage())["engine_us"])
        after = await gate.stats()
    walks = after["probes"]["prefix"]["count"] - before["probes"]["prefix"]["count"]
    if walks:
        raise RuntimeError(f"{walks} prefix walks during the engine-loop cost run (gate not open)")
    qa, qr = (statistics.quantiles(v, n=100, method="inclusive") for v in (admit_us, release_us))
    b, a = before["engine_gate"], after["engine_gate"]
    released = a["release_loop_calls"] - b["release_loop_calls"]
    usage_p50 = statistics.median(usage_us)
    splits = after["engine_gate"].get("loop_splits")
    return {
        "samples": n,
        "admit_engine_us_p50": qa[49],
        "admit_engine_us_p99": qa[98],
        "release_engine_us_p50": qr[49],
        "release_engine_us_p99": qr[98],
        # As earlier rounds reported it (from the engine's totals).
        "release_engine_us_mean": (a["release_loop_us_total"] - b["release_loop_us_total"])
        / max(released, 1),
        "admit_plus_release_us": qa[49] + qr[49],
        "prefix_walks": walks,
        "usage_probe_engine_us_p50": usage_p50,
        "admit_plus_release_over_usage_probe": (qa[49] + qr[49]) / max(usage_p50, 1e-9),
        **({"loop_splits": splits} if splits else {}),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m session_gate.lab.bench.clients", description=__doc__
    )
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated modes: {', '.join(MODES)} (default all; empty runs only the "
        "overhead measurements)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument(
        "--loop-splits",
        action="store_true",
        help="time vLLM's dispatch, our glue and the native call of each admit and release "
        "inside the engine (the lab's timers, installed from outside the plugin; they add to "
        "what they measure)",
    )
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}: expected some of {', '.join(MODES)}")
    if args.clients < 1:
        p.error("--clients must be at least 1")

    from session_gate.lab.engine import gate_splits
    from session_gate.lab.engine.serve import start_vllm, stop

    spec = WORKLOADS[args.workload](args.seed)
    print(spec.describe(), flush=True)
    e = spec.engine
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache between modes
    max_len = spec.engine_max_model_len

    @contextlib.contextmanager
    def served(scheduler: str | None):
        """One ``vllm serve`` for a group of modes: with the middleware, or with the scheduler
        mode ``scheduler`` of the engine gate and nothing else."""
        workdir = Path(tempfile.mkdtemp(prefix="session-gate-bench-clients-"))
        extra = [
            "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens),
            "--enable-prompt-tokens-details", "--seed", "0",
        ]  # fmt: skip
        env = gate_splits.engine_env() if args.loop_splits else {}
        if scheduler:
            env = {**env, "SESSION_GATE_SCHEDULER": scheduler}
        else:
            extra += ["--middleware", MIDDLEWARE]
        proc, url = start_vllm(
            workdir,
            num_blocks=e.num_blocks,
            block_size=e.block_size,
            max_model_len=max_len,
            extra_args=extra,
            env=env or None,
        )
        try:
            yield url
        finally:
            stop(proc)
            shutil.rmtree(workdir, ignore_errors=True)

    def run(url: str, group: list[str]) -> None:
        for mode in group:
            started = time.perf_counter()
            result = run_clients(url, args.workload, args.seed, mode, args.clients)
            summaries.append(result.summary())
            print(f"{result.mode}: {time.perf_counter() - started:.0f} s", flush=True)

    summaries = []
    with served(scheduler=None) as url:
        run(url, [m for m in modes if m not in SCHEDULER_MODES])
        overhead = asyncio.run(_middleware_overhead(url, args.overhead_requests))
        loop_cost = asyncio.run(_engine_loop_cost(url, args.overhead_requests))
    for mode in (m for m in modes if m in SCHEDULER_MODES):
        with served(scheduler=SCHEDULER_MODES[mode]) as url:
            run(url, [mode])
    if summaries:
        print("\n" + report.table(summaries))
    by_mode = {s["mode"]: s for s in summaries}
    targets: dict[str, Any] = {}
    eg = by_mode.get(f"engine-gate×{args.clients}") or by_mode.get("engine-gate")
    single = by_mode.get("gate@1")
    if eg is not None:
        targets["engine_gate_hit_vs_ideal"] = eg["hit_rate"] / max(eg["ideal_hit_rate"], 1e-9)
    if eg is not None and single is not None:
        targets["engine_gate_recompute_minus_single_gate"] = (
            eg["recompute_ratio"] - single["recompute_ratio"]
        )
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU vLLM (tiny dummy Llama)"
    print(f"middleware (gate open, loopback): {json.dumps(overhead)}")
    print(f"engine loop: {json.dumps(loop_cost)}")
    figures = {
        s["mode"]: {
            k: s[k] for k in ("hit_rate", "ideal_hit_rate", "recompute_ratio", "makespan_sec")
        }
        for s in summaries
    }
    for s in summaries:
        audit = s.get("infer_audit")
        if audit is not None:
            figures[s["mode"]]["infer_audit"] = audit
            print(f"{s['mode']} inference: {json.dumps(audit)}")
    print(
        json.dumps(
            {
                "clients": args.clients,
                "workload": args.workload,
                "machine": machine,
                "figures": figures,
                "targets": targets,
                "middleware": overhead,
                "engine_loop": loop_cost,
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
