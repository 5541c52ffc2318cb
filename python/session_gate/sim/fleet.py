"""The twin as a fleet: ``python -m session_gate.sim --replicas N --placement P ...`` runs the
fleet workloads on N replicas of a profile, each behind its own gating mode, with each
placement policy, and prints one SIMULATED table per workload, profile and fault.

Fleet workloads are the single-replica ones scaled to the fleet: ``rl-rollout`` with 256 x N
trajectories starting together, ``rl-async`` with 512 x N arriving at N per second, and
``speed`` (256 x N trajectories of exactly 30 turns, the twin's speed case). Faults: ``none``;
``straggler`` (replica 0 at half speed); ``lost`` (replica 0 lost once half the turns have
finished); ``absent`` (the same sessions on N - 1 replicas: what a straggler or a lost replica
is measured against). ``--sessions-per-replica K`` scales a workload down (or up) to K
sessions per replica for a quick run; ``rl-async`` keeps its arrival rate of one a second per
replica.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from session_gate.sim.twin import native_sessions, profile_args, profile_label
from session_gate.workloads import Workload, rl_rollout_workload

PLACEMENTS = ("hash", "sticky-least-loaded", "cache-aware", "thunder", "gate")
FLEET_MODES = ("none", "gate", "pause", "aimd")
FAULTS = ("none", "straggler", "lost", "absent")
FLEET_WORKLOADS = ("rl-rollout", "rl-async", "speed")
#: The straggler's step-time factor (2.0: half speed).
STRAGGLER_SLOWDOWN = 2.0


def fleet_workload(name: str, replicas: int, seed: int, per_replica: int | None = None) -> Workload:
    """Workload ``name`` scaled to a fleet of ``replicas``: its own sessions per replica (256;
    512 for ``rl-async``), or ``per_replica``."""
    if per_replica is not None and per_replica < 1:
        raise ValueError(f"sessions per replica {per_replica}: at least 1")
    if name == "rl-rollout":
        n = (per_replica or 256) * replicas
        return rl_rollout_workload(seed, sessions=n, name=f"rl-rollout-x{replicas}")
    if name == "rl-async":
        return rl_rollout_workload(
            seed,
            sessions=(per_replica or 512) * replicas,
            turns=(10, 40),
            name=f"rl-async-x{replicas}",
            arrivals_per_sec=float(replicas),
        )
    if name == "speed":
        n = (per_replica or 256) * replicas
        return rl_rollout_workload(seed, sessions=n, turns=(30, 30), name=f"speed-x{replicas}")
    raise ValueError(f"unknown fleet workload {name!r}: expected one of {FLEET_WORKLOADS}")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The fleet's flags (only read when ``--replicas`` is given)."""
    g = p.add_argument_group("fleet (with --replicas)")
    g.add_argument(
        "--replicas", type=int, default=None, help="simulate a fleet of this many replicas"
    )
    g.add_argument(
        "--placement",
        nargs="+",
        default=list(PLACEMENTS),
        choices=PLACEMENTS,
        help="placement policies (default: all)",
    )
    g.add_argument(
        "--fault", nargs="+", default=["none"], choices=FAULTS, help="faults (default none)"
    )
    g.add_argument(
        "--fleet-workload",
        nargs="+",
        default=["rl-rollout", "rl-async"],
        choices=FLEET_WORKLOADS,
        help="fleet workloads, scaled to the fleet (default rl-rollout rl-async)",
    )
    g.add_argument(
        "--sessions-per-replica",
        type=int,
        default=None,
        help="sessions per replica in each fleet workload (default: 256; 512 for rl-async)",
    )


def run_one(
    workload: Workload,
    mode: str,
    placement: str,
    profile: str,
    knobs: dict[str, Any],
    replicas: int,
    fault: str,
) -> dict[str, Any]:
    """One fleet run's summary."""
    from session_gate import _native

    n = replicas - 1 if fault == "absent" else replicas
    out = _native.simulate_fleet(
        native_sessions(workload),
        mode,
        replicas=n,
        placement=placement,
        config=_native.GateConfig(**knobs) if mode == "gate" else None,
        straggler=(0, STRAGGLER_SLOWDOWN) if fault == "straggler" else None,
        lose=0 if fault == "lost" else None,
        seed=workload.seed,
        **profile_args(profile),
    )
    cols = out["records"]
    prompt = sum(cols["prompt_tokens"])
    served = [r["sessions_served"] for r in out["replica_stats"]]
    return {
        "workload": workload.name,
        "profile": profile_label(profile),
        "fault": fault,
        "replicas": n,
        "placement": placement,
        "mode": mode,
        "makespan_sec": out["makespan_sec"],
        "hit": sum(cols["cached_tokens"]) / prompt if prompt else 0.0,
        "placement_stats": out["placement"],
        "moves": out["placement"]["moves"],
        "resent_turns": out["resent_turns"],
        "lost_at": out["lost_at"],
        "lost_turns": out["lost"]["turns"],
        "sessions_served": [min(served), max(served)],
        "wall_sec": out["wall_sec"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Rows of one workload x profile x fault, with each row's regret to the group's best."""
    best = min(r["makespan_sec"] for r in rows)
    head = f"{'placement':<20} {'mode':<6} {'makespan s':>11} {'regret':>7} {'hit':>6} "
    head += f"{'moves':>6} {'served min/max':>15} {'wall s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lo, hi = r["sessions_served"]
        lines.append(
            f"{r['placement']:<20} {r['mode']:<6} {r['makespan_sec']:>11,.0f} "
            f"{r['makespan_sec'] / best:>7.3f} {r['hit']:>6.3f} {r['moves']:>6} "
            f"{f'{lo}/{hi}':>15} {r['wall_sec']:>7.1f}"
        )
    return "\n".join(lines)


def targets(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Placement gate with the gate: lowest makespan and worst regret per group; with a fault,
    its makespan over the same fleet's with that replica absent."""
    out: dict[str, Any] = {}
    absent = {
        (r["workload"], r["profile"]): r["makespan_sec"]
        for rows in groups.values()
        for r in rows
        if r["fault"] == "absent" and r["placement"] == "gate" and r["mode"] == "gate"
    }
    for key, rows in groups.items():
        ours = [r for r in rows if r["placement"] == "gate" and r["mode"] == "gate"]
        if not ours:
            continue
        best = min(rows, key=lambda r: r["makespan_sec"])
        entry: dict[str, Any] = {
            "regret": round(ours[0]["makespan_sec"] / best["makespan_sec"], 4),
            "lowest": best is ours[0] or best["makespan_sec"] == ours[0]["makespan_sec"],
            "best": f"{best['placement']}+{best['mode']}",
        }
        fault = rows[0]["fault"]
        ref = absent.get((rows[0]["workload"], rows[0]["profile"]))
        if fault in ("straggler", "lost") and ref:
            entry["over_absent"] = round(ours[0]["makespan_sec"] / ref, 4)
        out[key] = entry
    return out


def main(args: argparse.Namespace, modes: list[str]) -> None:
    """Every (workload, profile, fault, placement, mode) run, ``args.jobs`` at a time."""
    bad = [m for m in modes if m not in FLEET_MODES]
    if bad:
        raise SystemExit(f"--modes {','.join(bad)}: a fleet runs {', '.join(FLEET_MODES)}")
    if args.replicas < 1 or ("absent" in args.fault and args.replicas < 2):
        raise SystemExit(f"--replicas {args.replicas}: at least 1 (2 with --fault absent)")
    if args.sessions_per_replica is not None and args.sessions_per_replica < 1:
        raise SystemExit(f"--sessions-per-replica {args.sessions_per_replica}: at least 1")
    groups: dict[str, list[dict[str, Any]]] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        jobs = []
        for name in args.fleet_workload:
            workload = fleet_workload(name, args.replicas, args.seed, args.sessions_per_replica)
            for profile in args.profile:
                for fault in args.fault:
                    key = f"{workload.name} @ {profile_label(profile)} fault={fault}"
                    runs = [
                        pool.submit(
                            run_one, workload, m, pl, profile, args.knobs, args.replicas, fault
                        )
                        for pl in args.placement
                        for m in modes
                    ]
                    jobs.append((key, runs))
        for key, runs in jobs:
            rows = [f.result() for f in runs]
            groups[key] = rows
            print(f"{key}: {args.replicas} replicas (SIMULATED)\n\n{table(rows)}\n")
            sys.stdout.flush()
    result = {"engine": "twin fleet (SIMULATED)", "groups": groups, "targets": targets(groups)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out} (SIMULATED)")
    print(json.dumps({"simulated": True, "targets": result["targets"]}))
