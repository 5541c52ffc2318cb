"""``python -m session_gate.lab.soak``: the soak run (``make soak``); a summary, then one JSON line.
Exit status 1 when a target was missed."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from session_gate.lab.soak.cluster import Engines
from session_gate.lab.soak.run import SoakConfig, run
from session_gate.lab.soak.sessions import Workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.soak", description=__doc__)
    p.add_argument("--sessions", type=int, default=300, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=6, help="turns per session")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn")
    p.add_argument("--storm-size", type=int, default=8, help="requests in a retry storm")
    p.add_argument("--idle-grace-sec", type=float, default=10.0)
    p.add_argument("--kill-at", type=float, default=0.3, help="share of turns ended at the kill")
    p.add_argument("--down-sec", type=float, default=10.0, help="seconds before the restart")
    p.add_argument("--gate-at", choices=["proxy", "engine"], default="proxy")
    p.add_argument("--num-blocks", type=int, default=128, help="KV blocks per replica")
    p.add_argument("--debug-proxy", action="store_true", help="debug build of the proxy")
    p.add_argument("--traffic-timeout-sec", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = SoakConfig(
        workload=Workload(
            sessions=a.sessions,
            turns=a.turns,
            max_tokens=a.max_tokens,
            storm_size=a.storm_size,
            seed=a.seed,
        ),
        engines=Engines(num_blocks=a.num_blocks),
        idle_grace_sec=a.idle_grace_sec,
        kill_at=a.kill_at,
        down_sec=a.down_sec,
        gate_at=a.gate_at,
        release=not a.debug_proxy,
        traffic_timeout_sec=a.traffic_timeout_sec,
    )
    report = asyncio.run(run(cfg))
    print()
    for key in ("turns_sent", "completed", "failed_cleanly", "broken_streams",
                "client_disconnects", "lost", "leases_held_end", "reservations_held_end",
                "proxy_rss_kib", "engines_serving", "traffic_sec", "wall_sec"):  # fmt: skip
        print(f"{key:>24}: {report[key]}")
    for name, met in report["targets"].items():
        print(f"{'target':>24}: {'met   ' if met else 'MISSED'} {name}")
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
