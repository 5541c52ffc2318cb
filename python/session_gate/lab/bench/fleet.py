"""``python -m session_gate.lab.bench.fleet`` (``make bench-fleet``): the thrash benchmark on a
fleet of two real CPU ``vllm serve`` replicas with the session_gate plugin.

The ``default`` workload doubled (``default-x2``: twice its sessions, each replica the
``default`` engine) runs once per mode and round:

- ``hash``, ``sticky-least-loaded``, ``gate``: through ``session-gate proxy --placement <mode>``
  in front of both replicas, each replica behind its own gate in the proxy; every turn names its
  session (``x-session-id``) and each session ends with vllm-router's ``/finish_session``, as
  prime-rl's client sends it;
- ``none``: no gate and no proxy: each session's turns go straight to the replica its id hashes
  to (SHA-256 of the id, modulo the replicas), which is what a consistent-hashing router such
  as vllm-router's ``consistent_hash`` does on a fixed fleet: the set-up whose thrashing
  prime-rl reported.

The replicas start once for the whole run (always stopped at the end, on an error or Ctrl-C
too), each with its OpenMP threads bound to its own half of this machine's cores; their prefix
caches are reset before each mode so no mode inherits another's warm cache. Rounds rotate the
mode order (as ``bench.matrix`` does) and each figure is the median over ``--reps`` rounds.

Printed: one table (makespan, the CPU seconds both replicas' processes used, hit rate, hit over
ideal, turns per replica, placements by reason and moves from the proxy's ``/metrics``), then,
last, one JSON line with every figure and the targets of issue 30: ``gate`` placement no slower
than ``sticky-least-loaded`` or ``hash``, and its hit rate at least 0.95 x ideal. The ideal is
the single-engine bench's (nothing evicted, each session at home), with the shared system
prompt prefilled once on each replica that served turns (:func:`fleet_summary`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import platform
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from session_gate.lab.bench.http_turns import SESSION, HttpEngine, PlainClient
from session_gate.lab.bench.matrix import median_rounds
from session_gate.lab.bench.runner import run_mode
from session_gate.lab.soak.cluster import Cluster, Engines, get_text, metric, samples
from session_gate.modes import Mode
from session_gate.results import ModeResult
from session_gate.workloads import Workload, default_workload

#: The proxy's placements, each with the proxy's per-replica gate.
PLACEMENTS = ("hash", "sticky-least-loaded", "gate")
#: Every mode: the placements, then no gate (sessions hashed straight to the replicas).
MODES = (*PLACEMENTS, "none")
REPLICAS = 2
#: The target's tolerance: ``gate``'s hit rate over the ideal.
HIT_VS_IDEAL_TARGET = 0.95
#: KV cache memory per replica, GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``). The blocks come from
#: ``--num-gpu-blocks-override`` (1,024 blocks of the tiny model: 64 MiB); an explicit size
#: also skips the warm-up pass vLLM otherwise runs to size the cache from its RSS, which with
#: two replicas starting together would read each other's memory.
KV_CACHE_GIB = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.bench.fleet", description=__doc__)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, some of {', '.join(MODES)} (default all)",
    )
    p.add_argument("--reps", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument(
        "--sessions",
        type=int,
        default=16 * REPLICAS,
        help="sessions of the default workload (default 32: doubled)",
    )
    p.add_argument("--turns", type=int, default=None, help="only each session's first N turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-fleet.json", help="JSON results file ('' for none)")
    p.add_argument("--debug-proxy", action="store_true", help="debug build of the proxy")
    args = p.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.mode_list:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}: expected some of {', '.join(MODES)}")
    if not args.mode_list or len(set(args.mode_list)) != len(args.mode_list):
        p.error(f"--modes {args.modes!r}: name each mode once, at least one")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: at least 1")
    if args.sessions < 1:
        p.error(f"--sessions {args.sessions}: at least 1")
    if args.turns is not None and args.turns < 1:
        p.error(f"--turns {args.turns}: at least 1")
    return args


def fleet_workload(sessions: int, turns: int | None, seed: int) -> Workload:
    """``default`` with ``sessions`` sessions, each cut to its first ``turns`` turns."""
    workload = default_workload(seed, sessions=sessions)
    if turns is None:
        return workload
    cut = tuple(dataclasses.replace(s, turns=s.turns[:turns]) for s in workload.sessions)
    return dataclasses.replace(workload, name=f"{workload.name}-t{turns}", sessions=cut)


def cpu_halves(replicas: int) -> list[str]:
    """Each replica's ``VLLM_CPU_OMP_THREADS_BIND``: its own share of the cores this process
    may run on. vLLM's ``auto`` binding would give every replica the same cores (it picks from
    NUMA node 0 for rank 0 of each server, less one core it reserves for the scheduler: on a
    2-core machine, core 0 for both); with fewer cores than replicas, ``nobind``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < replicas:
        return ["nobind"] * replicas
    share = len(cpus) // replicas
    return [",".join(str(c) for c in cpus[i * share : (i + 1) * share]) for i in range(replicas)]


def engines_for(workload: Workload) -> Engines:
    """The replicas' shape: each is the workload's own engine (the single-engine bench's), with
    the prompt tokens' details in each answer (the cached tokens) and the dev routes (the
    prefix cache's reset)."""
    e = workload.engine
    return Engines(
        num_blocks=e.num_blocks,
        block_size=e.block_size,
        max_model_len=workload.engine_max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)},
        replica_env=[{"VLLM_CPU_OMP_THREADS_BIND": b} for b in cpu_halves(REPLICAS)],
        extra_args=["--enable-prompt-tokens-details"],
    )


def reset_prefix_caches(urls: list[str], timeout: float = 30) -> None:
    """Empties every replica's prefix cache (vLLM's ``POST /reset_prefix_cache``, a dev route).
    vLLM refuses while blocks are held (a request of the last mode still winding down), so it
    is asked again until it succeeds."""
    for url in urls:
        deadline = time.monotonic() + timeout
        while True:
            req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as r:
                if json.loads(r.read() or b"{}").get("success", True):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: the prefix cache would not reset in {timeout} s")
            time.sleep(0.2)


def tree_cpu_sec(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and every live descendant
    (a replica: its API server, engine core and worker), from ``/proc``. A figure the other
    jobs on a shared machine move less than they move wall time."""
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The fields after the command's closing parenthesis: state is field 3.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        child = int(entry.name)
        children.setdefault(int(fields[1]), []).append(child)
        used[child] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += used.get(p, 0.0)
        todo += children.get(p, [])
    return total


def finished_blocks_moved(cluster: Cluster) -> int:
    """Blocks the replicas' engines moved to the front of their free queues for finished
    sessions so far (``finished_blocks``; 0 for a replica that cannot be asked)."""
    total = 0
    for url in cluster.urls:
        try:
            stats = json.loads(get_text(f"{url}/session_gate/v1/stats"))
        except (OSError, ValueError):
            continue
        total += int(stats.get("engine_gate", {}).get("finished_blocks_evicted_first", 0))
    return total


def replicas_cpu_sec(cluster: Cluster) -> list[float]:
    return [tree_cpu_sec(p.pid) if p is not None else 0.0 for p in cluster.procs]


def replica_of(session_id: str, replicas: int) -> int:
    """The replica a session id hashes to: a fixed function of the id, as consistent hashing is
    on a fleet that does not change."""
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big") % replicas


async def _drive(
    workload: Workload, mode: str, generate: Callable[..., Any], finish: Any
) -> ModeResult:
    return await run_mode(
        None,
        workload,
        Mode(mode, "none"),
        None,
        admission=PlainClient(mode),
        generate=generate,
        finish=finish,
    )


def fleet_summary(result: ModeResult, turns_by_replica: list[int]) -> dict[str, Any]:
    """``result``'s summary, its ideal made a fleet's: the runner counts the shared system
    prompt prefilled once, but each replica that served turns has to prefill it once itself,
    so that many first turns (one more per replica past the first) ideally hit nothing."""
    extra = sum(1 for n in turns_by_replica if n > 0) - 1
    for r in result.records:
        if extra <= 0:
            break
        if r.turn == 0 and r.ideal_cached_tokens > 0:
            r.ideal_cached_tokens = 0
            extra -= 1
    summary = result.summary()
    summary["turns_by_replica"] = turns_by_replica
    return summary


def run_through_proxy(cluster: Cluster, workload: Workload, placement: str) -> dict[str, Any]:
    """One run of ``workload`` through a proxy of its own placing by ``placement``: the run's
    summary with the turns each replica served and the placements by reason (``/metrics``)."""
    cluster.start_proxy(["--placement", placement])
    try:
        run = f"{placement}-{time.monotonic_ns()}"

        async def drive() -> ModeResult:
            engine = HttpEngine(cluster.proxy_url, session_header=True, run=run)
            try:
                return await _drive(workload, placement, engine.generate, engine.finish)
            finally:
                await engine.aclose()

        result = run_or_show_logs(cluster, drive)
        text = get_text(f"{cluster.proxy_url}/metrics")
    finally:
        cluster.stop_proxy()
    turns_by_replica = [
        int(
            metric(
                text,
                "session_gate_proxy_requests_total",
                replica=url,
                route="/v1/completions",
                outcome="completed",
            )
        )
        for url in cluster.urls
    ]
    summary = fleet_summary(result, turns_by_replica)
    placements = samples(text, "session_gate_proxy_placements_total")
    summary["placements"] = {
        labels.split('reason="', 1)[1].split('"', 1)[0]: int(n)
        for labels, n in placements.items()
        if 'reason="' in labels and n
    }
    summary["moves"] = int(metric(text, "session_gate_proxy_placement_moves_total"))
    return summary


def log_tails(cluster: Cluster, lines: int = 40) -> str:
    """The last ``lines`` of the proxy's and each replica's log (the cluster's work directory
    goes with it): what a failed run prints before it ends."""
    out = []
    for log in sorted(cluster.workdir.glob("**/*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.relative_to(cluster.workdir)} (last {len(tail)} lines)")
        out += tail
    return "\n".join(out)


def run_or_show_logs(cluster: Cluster, drive: Callable[[], Awaitable[ModeResult]]) -> ModeResult:
    """Runs ``drive()`` to its result; a failure prints the cluster's log tails first (its work
    directory, logs included, goes when the cluster stops)."""
    try:
        return asyncio.run(drive())
    except Exception:
        print(log_tails(cluster), file=sys.stderr, flush=True)
        raise


def run_hashed(cluster: Cluster, workload: Workload) -> dict[str, Any]:
    """One run of ``workload`` with no gate: each session straight to the replica its id
    hashes to."""
    counts = [0] * len(cluster.urls)

    async def drive() -> ModeResult:
        engines = [HttpEngine(url) for url in cluster.urls]

        async def generate(llm: Any, prompt: list[int], max_tokens: int, request_id: str):
            session = SESSION.get()
            assert session is not None
            i = replica_of(session, len(engines))
            counts[i] += 1
            return await engines[i].generate(llm, prompt, max_tokens, request_id)

        try:
            return await _drive(workload, "none", generate, None)
        finally:
            for engine in engines:
                await engine.aclose()

    result = run_or_show_logs(cluster, drive)
    summary = fleet_summary(result, counts)
    summary["placements"] = {}
    summary["moves"] = 0
    return summary


#: Figures each mode reports per round, beside the medians.
ROUND_KEYS = (
    "makespan_sec",
    "replica_cpu_sec",
    "hit_rate",
    "turns_by_replica",
    "placements",
    "moves",
    "finished_blocks_evicted_first",
)


def merge(rounds: list[list[dict[str, Any]]], workload: str) -> list[dict[str, Any]]:
    """One summary per mode: the bench matrix's medians (``median_rounds``), the turns per
    replica, placements and moves as the median over the rounds, every round's figures under
    ``rounds``."""
    merged = median_rounds([{workload: r} for r in rounds])[workload]
    for row in merged:
        runs = [s for r in rounds for s in r if s["mode"] == row["mode"]]
        row["rounds"] = [{k: s[k] for k in ROUND_KEYS} for s in runs]
        row["turns_by_replica"] = [
            statistics.median(s["turns_by_replica"][i] for s in runs)
            for i in range(len(row["turns_by_replica"]))
        ]
        reasons = sorted({k for s in runs for k in s["placements"]})
        row["placements"] = {
            k: statistics.median(s["placements"].get(k, 0) for s in runs) for k in reasons
        }
        row["moves"] = statistics.median(s["moves"] for s in runs)
        row["replica_cpu_sec"] = statistics.median(s["replica_cpu_sec"] for s in runs)
        row["finished_blocks_evicted_first"] = statistics.median(
            s.get("finished_blocks_evicted_first", 0) for s in runs
        )
        row["hit_vs_ideal"] = row["hit_rate"] / max(row["ideal_hit_rate"], 1e-9)
    return merged


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 30's real targets, from the medians: ``gate`` placement's makespan over the faster
    of ``sticky-least-loaded`` and ``hash`` (met at most 1.0) and its hit rate over the ideal
    (met at least 0.95); ``None`` where a mode it needs did not run."""
    by_mode = {r["mode"]: r for r in rows}
    gate = by_mode.get("gate")
    others = [by_mode[m]["makespan_sec"] for m in ("sticky-least-loaded", "hash") if m in by_mode]
    over = gate["makespan_sec"] / min(others) if gate and others else None
    hit = gate["hit_vs_ideal"] if gate else None
    return {
        "gate_makespan_over_best_of_sticky_hash": over,
        "gate_no_slower": None if over is None else over <= 1.0,
        "gate_hit_vs_ideal": hit,
        "gate_hit_at_least_0_95_ideal": None if hit is None else hit >= HIT_VS_IDEAL_TARGET,
    }


def table(rows: list[dict[str, Any]], reps: int) -> str:
    """One line per mode: medians over ``reps`` rounds."""
    head = ["mode", "makespan s", "rounds s", "cpu s", "hit", "ideal", "hit/ideal"]
    head += ["turns r0/r1", "moves"]
    cells = []
    for r in rows:
        cells.append(
            [
                r["mode"],
                f"{r['makespan_sec']:.1f}",
                "/".join(f"{x['makespan_sec']:.1f}" for x in r["rounds"]),
                f"{r['replica_cpu_sec']:.0f}",
                f"{r['hit_rate']:.3f}",
                f"{r['ideal_hit_rate']:.3f}",
                f"{r['hit_vs_ideal']:.3f}",
                "/".join(f"{n:g}" for n in r["turns_by_replica"]),
                f"{r['moves']:g}",
            ]
        )
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(head)]
    line = " ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))
    lines = [f"medians of {reps} round(s)", line + "   placements by reason", "-" * len(line)]
    for r, c in zip(rows, cells, strict=True):
        reasons = ", ".join(f"{k} {v:g}" for k, v in r["placements"].items()) or "-"
        lines.append(" ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)) + "   " + reasons)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of every mode on one pair of replicas, merged; always stops them."""
    workload = fleet_workload(args.sessions, args.turns, args.seed)
    print(time.strftime("%H:%M:%S ") + workload.describe() + f"; {REPLICAS} replicas", flush=True)
    engines = engines_for(workload)
    cluster = Cluster(engines, proxy_args=[], release=not args.debug_proxy)
    rounds: list[list[dict[str, Any]]] = []
    try:
        started = time.perf_counter()
        cluster.start_replicas()
        binds = [e["VLLM_CPU_OMP_THREADS_BIND"] for e in engines.replica_env]
        print(
            f"replicas up in {time.perf_counter() - started:.0f} s: {cluster.urls} "
            f"(OpenMP threads bound to cores {binds})",
            flush=True,
        )
        order = list(args.mode_list)
        for r in range(args.reps):
            shift = r % len(order)
            summaries = []
            for mode in order[shift:] + order[:shift]:
                reset_prefix_caches(cluster.urls)
                began, cpu = time.perf_counter(), replicas_cpu_sec(cluster)
                moved = finished_blocks_moved(cluster)
                if mode == "none":
                    summary = run_hashed(cluster, workload)
                else:
                    summary = run_through_proxy(cluster, workload, mode)
                used = [b - a for a, b in zip(cpu, replicas_cpu_sec(cluster), strict=True)]
                summary["replica_cpu_sec"] = sum(used)
                summary["finished_blocks_evicted_first"] = finished_blocks_moved(cluster) - moved
                summaries.append(summary)
                print(
                    f"round {r + 1}/{args.reps} {mode}: makespan {summary['makespan_sec']:.1f} s, "
                    f"hit {summary['hit_rate']:.3f}, turns by replica "
                    f"{summary['turns_by_replica']}, replicas' CPU {sum(used):.0f} s, "
                    f"finished sessions' blocks evicted first "
                    f"{summary['finished_blocks_evicted_first']} "
                    f"({time.perf_counter() - began:.0f} s)",
                    flush=True,
                )
            rounds.append(sorted(summaries, key=lambda s: order.index(s["mode"])))
    finally:
        stopping = time.perf_counter()
        cluster.close()
        print(f"replicas stopped in {time.perf_counter() - stopping:.0f} s", flush=True)
    rows = merge(rounds, workload.name)
    return {
        "workload": workload.name,
        "sessions": len(workload.sessions),
        "turns": sum(len(s.turns) for s in workload.sessions),
        "replicas": REPLICAS,
        "reps": args.reps,
        "cpu_binding": [e["VLLM_CPU_OMP_THREADS_BIND"] for e in engines.replica_env],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU vLLM (tiny dummy Llama)",
        "rows": rows,
        "targets": targets(rows),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM (a killed make) ends the run as Ctrl-C does: through the replicas' shutdown.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    print("\n" + table(results["rows"], args.reps))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")
    keys = ("makespan_sec", "replica_cpu_sec", "hit_rate", "ideal_hit_rate", "hit_vs_ideal")
    keys += ("recompute_ratio", "prefill_tokens")
    keys += ("turns", "turns_by_replica", "placements", "moves", "finished_blocks_evicted_first")
    keys += ("rounds",)
    figures = {r["mode"]: {k: r[k] for k in keys} for r in results["rows"]}
    line = {k: v for k, v in results.items() if k != "rows"}
    print(json.dumps({**line, "figures": figures}, sort_keys=True))


if __name__ == "__main__":
    main()
