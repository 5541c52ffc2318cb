"""``python -m session_gate.lab.sim.speed`` (``make bench-sim``): how fast the twin runs.

The case from issue 9: 1,000 sessions x 30 turns (``speed-1000x30``, shaped like
``rl-rollout``) on a 126,000-block cache (the ``h200-qwen2.5-7b`` profile's shape), in modes
``none`` and ``gate``. Prints the wall time of each native run, the virtual time it simulated,
and their ratio (simulated seconds per wall second: the baseline is real time, measured in the
same run). Targets: <= 10 s wall and >= 1,000x real time. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from session_gate.modes import Mode
from session_gate.sim.twin import run_twin
from session_gate.workloads import speed_workload


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.sim.speed", description=__doc__)
    p.add_argument("--profile", default="h200-qwen2.5-7b")
    p.add_argument("--num-blocks", type=int, default=126_000)
    p.add_argument("--modes", default="none,gate")
    args = p.parse_args(argv)
    workload = speed_workload(0)
    turns = sum(len(s.turns) for s in workload.sessions)
    print(f"{workload.describe()}; {args.num_blocks:,} blocks, profile {args.profile}")
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    out = {"machine": machine, "sessions": len(workload.sessions), "turns": turns, "modes": {}}
    for name in args.modes.split(","):
        started = time.perf_counter()
        result = run_twin(
            workload, Mode.parse(name), args.profile, shape={"num_blocks": args.num_blocks}
        )
        total = time.perf_counter() - started
        native = result.replica_stats["wall_sec"]
        speedup = result.makespan_sec / native
        out["modes"][name] = {
            "wall_sec": native,
            "wall_sec_with_python": total,
            "simulated_sec": result.makespan_sec,
            "simulated_per_wall_sec": speedup,
            "engine_steps": result.replica_stats["steps"],
            "turns_per_wall_sec": turns / native,
        }
        print(
            f"{name:<5} wall {native:6.2f} s (with Python {total:6.2f} s)  simulated "
            f"{result.makespan_sec:9.1f} s  {speedup:8.0f}x real time  "
            f"{result.replica_stats['steps']:,} engine steps"
        )
    worst_wall = max(m["wall_sec_with_python"] for m in out["modes"].values())
    worst_speed = min(m["simulated_per_wall_sec"] for m in out["modes"].values())
    out["targets_hold"] = {"wall_le_10s": worst_wall <= 10.0, "ge_1000x": worst_speed >= 1000}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
