"""``python -m session_gate.sim``: run workloads on the replica twin in every mode and print
the bench's tables (labelled simulated); write the bench's JSON schema and a PNG; the last line
is JSON. Every mode's makespan is shown over the best mode's (``regret``) and over the
workload's limit (``over_limit``: the limit is no gate on the same engine with a GPU cache that
never runs out, simulated once per workload and profile). ``python -m session_gate.sim tune
...`` sweeps the gate's knobs (see its ``--help``).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from session_gate import report
from session_gate.modes import DEFAULT_MODES, LIMIT_KIND, Mode
from session_gate.sim import cli, fleet
from session_gate.sim.twin import profile_label, run_twin


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.sim", description=__doc__)
    cli.add_common(p, modes=DEFAULT_MODES, results=("sim-results.json", "sim-results.png"))
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs simulated at once (threads: the native simulation releases the GIL; each "
        "run is deterministic, so the results do not depend on it; default 1)",
    )
    fleet.add_flags(p)
    args = p.parse_args(argv)
    args.mode_list = cli.modes_of(p, args.modes)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: at least 1")
    try:
        args.knobs = cli.knobs_of(args)
        from session_gate import _native

        _native.GateConfig(**args.knobs)
        args.workloads = cli.workloads_of(args)
    except (ValueError, TypeError, OSError) as exc:
        p.error(str(exc))
    return args


def run(
    args: argparse.Namespace, results: list[Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every (workload, profile, mode) run and each (workload, profile)'s limit, ``args.jobs``
    at a time; tables in input order. Each mode run's ``ModeResult`` is appended to
    ``results``."""
    by_workload: dict[str, list[dict[str, Any]]] = {}
    shape = cli.shape_of(args)
    limit = Mode.parse(LIMIT_KIND)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        groups = [
            (
                workload,
                profile,
                [
                    pool.submit(run_twin, workload, mode, profile, args.knobs, shape)
                    for mode in args.mode_list
                ],
                # Cached: a `limit` in --modes and this share one run.
                pool.submit(run_twin, workload, limit, profile, None, shape),
            )
            for workload in args.workloads
            for profile in args.profile
        ]
        for workload, profile, futures, limit_run in groups:
            key = f"{workload.name} @ {profile_label(profile)}"
            done = [f.result() for f in futures]
            if results is not None:
                results += done
            summaries = [r.summary() for r in done]
            report.add_relative(summaries, limit_run.result().makespan_sec)
            by_workload[key] = summaries
            print(f"{workload.describe()}; profile {profile} (SIMULATED)")
            print("\n" + report.table(summaries))
            print(report.limit_line(summaries))
            print("\n" + report.turn_latency_table(summaries) + "\n")
            inference = report.inference_lines(summaries)
            if inference:
                print(inference + "\n")
            sys.stdout.flush()
    return by_workload


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "tune":
        from session_gate.sim import tune

        tune.main(argv[1:])
        return
    args = parse_args(argv)
    if args.replicas is not None:
        # The default modes are the single replica's; a fleet runs its own unless told.
        modes = [m.name for m in args.mode_list]
        fleet.main(args, list(fleet.FLEET_MODES) if args.modes == DEFAULT_MODES else modes)
        return
    runs: list[Any] = []
    try:
        by_workload = run(args, runs)
    except ValueError as exc:
        # A workload the twin cannot run (a session that never fits the cache, ...): the
        # message names it; no traceback.
        print(f"python -m session_gate.sim: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.records:
        report.write_records(args.records, runs)
    targets = report.targets(by_workload)
    results = {
        "engine": "twin (SIMULATED)",
        "profiles": args.profile,
        "knobs": args.knobs,
        "seed": args.seed,
        "workloads": by_workload,
        # Each workload's limit (no gate, a GPU cache that never runs out), in seconds.
        "limits": {k: v[0].get("limit_makespan_sec") for k, v in by_workload.items() if v},
        "targets": targets,
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    report.plot(by_workload, args.plot)
    also = f" and {args.records}" if args.records else ""
    print(f"wrote {args.out}, {args.plot}{also} (SIMULATED)")
    figures = report.figures(by_workload)
    print(json.dumps({"simulated": True, "figures": figures, "targets": targets}))


if __name__ == "__main__":
    main()
