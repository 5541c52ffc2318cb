"""``python -m session_gate.lab.bench.matrix`` (``make bench-matrix``): every mode on every
workload.

The real CPU engine runs ``default`` and ``mixed`` with every mode (no gate, static session
caps, the seed's gate, ``aimd`` and ``pause`` with their literal and their scaled time constants,
the default gate). The replica twin (``session_gate.sim``, when it is installed) runs the same two
on ``cpu-tiny`` and the GPU workloads on the H200 profiles, with the baselines' literal constants.

Per workload, each mode's makespan over the best mode's (its *regret*) and, on the twin's rows,
over the workload's limit (``over_limit``: no gate on the same engine with a GPU cache that
never runs out, simulated once per workload and profile), hit rate, recompute, lost work and
the p90 latency of late turns (real modes: medians over ``--repeats`` runs, as
one run on this machine is noisier than the targets' margins); a table, a PNG (through
``matrix_report``), a JSON file, and last, one JSON line with the matrix, each mode's worst-case
regret and over_limit, and the issues' targets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from typing import Any

from session_gate import report, workloads
from session_gate.lab.bench import matrix_report
from session_gate.modes import LIMIT_KIND, Mode

REAL_WORKLOADS = ("default", "mixed")
REAL_MODES = (
    "none,cap4,cap8,seed,aimd,aimd-scaled,pause,pause-scaled,gate,sched,sched-nofinish,sched-infer"
)
#: The gate in vLLM's scheduler (keyed by session id, or by the inferred session): the same gate
#: as ``gate`` in another place, judged against it (:func:`sched_targets`), not as a rival.
SCHED_MODES = ("sched", "sched-infer", "sched-nofinish")
#: (workload, profile) pairs the twin runs; GPU workloads use the baselines' literal constants.
TWIN_RUNS = (
    ("default", "cpu-tiny"),
    ("mixed", "cpu-tiny"),
    ("rl-rollout", "h200-qwen2.5-7b"),
    ("rl-rollout", "h200-qwen2.5-32b"),
    ("rl-async", "h200-qwen2.5-7b"),
    ("cheap-prefill", "h200-qwen2.5-7b"),
    ("long-tool", "h200-qwen2.5-7b"),
)
#: Static caps: the real bench's on the CPU-sized workloads, GPU-sized ones on the H200 runs.
TWIN_MODES = "none,cap4,cap8,seed,aimd,pause,gate"
TWIN_GPU_MODES = "none,cap16,cap32,cap64,cap128,cap256,seed,aimd,pause,gate"
#: Real rounds per mode: one run of this 2-core VM's CPU engine can be several seconds off the
#: next (the gate against `cap8` on `default` measured 0.98-1.11 in single runs on 3-4 Dec 2026),
#: more than the 5% the regret target allows, so the real half judges medians.
REAL_REPEATS = 3
#: Metrics carried into the matrix from each mode's summary.
KEYS = (
    "engine",
    "makespan_sec",
    "hit_rate",
    "ideal_hit_rate",
    "recompute_ratio",
    "lost_tokens",
    "cancellations",
    "late_turn_p90_sec",
)
#: Figures a repeated real mode reports as the median over its runs: the matrix's figures and
#: the counts behind them.
MEDIAN_KEYS = (*KEYS[1:], "revocations", "prefill_tokens")
#: Each run's headline figures, kept per run under ``repeats`` (real) or ``steps`` (twin).
RUN_KEYS = ("makespan_sec", "recompute_ratio", "hit_rate", "revocations")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m session_gate.lab.bench.matrix", description=__doc__)
    p.add_argument("--real-modes", default=REAL_MODES, help=f"default {REAL_MODES}")
    p.add_argument(
        "--real-workloads",
        default=",".join(REAL_WORKLOADS),
        help="real-engine workloads (empty: skip the real engine)",
    )
    p.add_argument("--twin-modes", default=TWIN_MODES, help=f"cpu-tiny; default {TWIN_MODES}")
    p.add_argument(
        "--twin-gpu-modes", default=TWIN_GPU_MODES, help=f"H200 profiles; default {TWIN_GPU_MODES}"
    )
    p.add_argument("--no-twin", action="store_true", help="skip the twin half")
    p.add_argument(
        "--twin-runs",
        default=",".join(f"{w}@{p}" for w, p in TWIN_RUNS),
        help="the twin's workload@profile pairs",
    )
    p.add_argument(
        "--load",
        nargs="+",
        default=[],
        metavar="JSON",
        help="rebuild the matrix from earlier --out files instead of running anything "
        "(runs of one workload merge, a mode run again replaces the earlier)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=1,
        help="twin only: run each workload as this many consecutive RL steps with ONE gate "
        "object (step k draws the workload with seed SEED + 100k; stateless modes start "
        "afresh each step); a row is the mean of the steps after the first",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=REAL_REPEATS,
        help="real engine only: run every real mode this many times (rounds, each starting "
        "at a different mode) and judge the median of each figure; the twin is deterministic "
        f"(default {REAL_REPEATS})",
    )
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-matrix.json")
    p.add_argument("--plot", default="bench-matrix.png")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def modes(text: str) -> list[Mode]:
    return [Mode.parse(m.strip()) for m in text.split(",") if m.strip()]


def build(by_workload: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and mode: the summary's headline figures plus ``regret`` (makespan over the
    workload's best makespan, a ``limit`` row left out of the best), ``over_limit`` (makespan
    over the workload's limit; None where no limit was computed: the real engine's rows) and
    ``runs`` (how many runs its medians are over)."""
    matrix: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, summaries in by_workload.items():
        rivals = [s["makespan_sec"] for s in summaries if s["mode"] != LIMIT_KIND]
        best = min(rivals or [s["makespan_sec"] for s in summaries])
        limits = [s["limit_makespan_sec"] for s in summaries if "limit_makespan_sec" in s]
        limit = limits[0] if limits else None
        matrix[workload] = {
            s["mode"]: {
                **{k: s.get(k, "vllm-cpu" if k == "engine" else 0) for k in KEYS},
                "regret": s["makespan_sec"] / best,
                "over_limit": s["makespan_sec"] / limit if limit else None,
                "runs": len(s.get("repeats", ())) or 1,
            }
            for s in summaries
        }
    return matrix


def worst_regret(
    matrix: dict[str, dict[str, dict[str, Any]]], complete: bool = True
) -> dict[str, float]:
    """Each mode's largest regret over the workloads it ran on: only modes that ran on every
    workload when ``complete`` (a static cap is sized per engine, so each cap runs on a few),
    else the others."""
    worst: dict[str, float] = {}
    runs: dict[str, int] = {}
    for rows in matrix.values():
        for mode, row in rows.items():
            if mode == LIMIT_KIND:
                continue
            worst[mode] = max(worst.get(mode, 0.0), row["regret"])
            runs[mode] = runs.get(mode, 0) + 1
    keep = {m: r for m, r in worst.items() if (runs[m] == len(matrix)) == complete}
    return dict(sorted(keep.items(), key=lambda kv: kv[1]))


def worst_over_limit(matrix: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Each mode's largest ``over_limit`` over the rows that have a limit (the twin's), best
    first."""
    worst: dict[str, float] = {}
    for rows in matrix.values():
        for mode, row in rows.items():
            if mode != LIMIT_KIND and row.get("over_limit") is not None:
                worst[mode] = max(worst.get(mode, 0.0), row["over_limit"])
    return dict(sorted(worst.items(), key=lambda kv: kv[1]))


def targets(matrix: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Issue 10's targets, each with the figure it is judged on and whether it is met."""
    worst = worst_regret(matrix)
    out: dict[str, Any] = {}
    if "gate" in worst:
        others = {m: r for m, r in worst.items() if m != "gate" and m not in SCHED_MODES}
        out["gate_worst_regret"] = {"value": worst["gate"], "met": worst["gate"] <= 1.05}
        out["gate_lowest_worst_regret"] = {
            "value": worst["gate"],
            "best_other": min(others.items(), key=lambda kv: kv[1]) if others else None,
            "met": all(worst["gate"] <= r for r in others.values()),
        }
    slower: dict[str, float] = {}
    for workload, rows in matrix.items():
        gate, none = rows.get("gate"), rows.get("none")
        if gate and none:
            slower[workload] = gate["makespan_sec"] / none["makespan_sec"]
        # The H200 target is for the twin's agentic RL workloads (rl-rollout, rl-async).
        if gate and str(gate["engine"]).startswith("twin:h200") and workload.startswith("rl-"):
            entry: dict[str, Any] = {}
            if none:
                entry["speedup_over_none"] = none["makespan_sec"] / gate["makespan_sec"]
            for b in ("aimd", "pause"):
                if b in rows:
                    entry[f"ahead_of_{b}"] = gate["makespan_sec"] < rows[b]["makespan_sec"]
            entry["met"] = entry.get("speedup_over_none", 0) >= 1.8 and all(
                v for k, v in entry.items() if k.startswith("ahead_of_")
            )
            out[f"h200:{workload}"] = entry
        if gate and gate["engine"] == "vllm-cpu":
            hit = gate["hit_rate"] / max(gate["ideal_hit_rate"], 1e-9)
            out[f"real:{workload}"] = {
                "recompute_ratio": gate["recompute_ratio"],
                "hit_over_ideal": hit,
                "met": gate["recompute_ratio"] <= 1.2 and hit >= 0.95,
            }
    if slower:
        out["gate_over_none_makespan"] = {
            "value": slower,
            "met": all(v <= 1.03 for v in slower.values()),
        }
    out.update(sched_targets(matrix))
    return out


def sched_targets(matrix: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Issue 28's targets for the scheduler modes on the real engine: ``sched`` within 3% of
    ``gate``'s makespan with hit >= 0.95 x ideal, ``sched-infer`` hit >= 0.93 x ideal, both
    >= 1.4x faster than no gate; and on no workload of the matrix slower than no gate by more
    than 3%. ``sched-nofinish`` (ids only, no finish call) is shown beside them, not judged:
    it measures what not ending sessions costs."""
    out: dict[str, Any] = {}
    slower: dict[str, dict[str, float]] = {}
    for workload, rows in matrix.items():
        none = rows.get("none")
        for mode, min_hit in (("sched", 0.95), ("sched-infer", 0.93)):
            row = rows.get(mode)
            if row is None or none is None:
                continue
            slower.setdefault(mode, {})[workload] = row["makespan_sec"] / none["makespan_sec"]
            if row["engine"] != "vllm-cpu":
                continue
            hit = row["hit_rate"] / max(row["ideal_hit_rate"], 1e-9)
            entry: dict[str, Any] = {
                "hit_over_ideal": hit,
                "speedup_over_none": none["makespan_sec"] / row["makespan_sec"],
            }
            met = hit >= min_hit and entry["speedup_over_none"] >= 1.4
            if mode == "sched" and "gate" in rows:
                entry["over_gate"] = row["makespan_sec"] / rows["gate"]["makespan_sec"]
                met = met and entry["over_gate"] <= 1.03
            entry["met"] = met
            out[f"real:{workload}:{mode}"] = entry
    for mode, by_workload in slower.items():
        out[f"{mode}_over_none_makespan"] = {
            "value": by_workload,
            "met": all(v <= 1.03 for v in by_workload.values()),
        }
    return out


def run_real(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``--repeats`` rounds of every real mode on every real workload (each round starting at
    another mode), merged by medians."""
    from session_gate.lab.bench.__main__ import run_rounds

    names = [w for w in args.real_workloads.split(",") if w]
    if not names:
        return {}
    chosen = [workloads.WORKLOADS[n](args.seed) for n in names]
    rounds = run_rounds(chosen, modes(args.real_modes), args.seed, args.repeats)
    return median_rounds(rounds)


def median_rounds(
    rounds: list[dict[str, list[dict[str, Any]]]],
) -> dict[str, list[dict[str, Any]]]:
    """One summary per workload and mode from several rounds: each of ``MEDIAN_KEYS`` is the
    median over the rounds (so a row's figures may come from different runs), the rest is
    the first round's, and ``repeats`` keeps every run's headline figures. One round is
    returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    merged: dict[str, list[dict[str, Any]]] = {}
    for workload, first in rounds[0].items():
        merged[workload] = []
        for summary in first:
            runs = [
                s for rnd in rounds for s in rnd.get(workload, []) if s["mode"] == summary["mode"]
            ]
            row = dict(summary)
            for k in MEDIAN_KEYS:
                if all(k in s for s in runs):
                    row[k] = statistics.median(s[k] for s in runs)
            row["repeats"] = [run_figures(s) for s in runs]
            merged[workload].append(row)
    return merged


def run_twin(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The twin half, or nothing when the twin is not installed."""
    try:
        from session_gate.sim.twin import run_twin as simulate
        from session_gate.sim.twin import run_twin_steps as simulate_steps
    except ImportError:
        print("the replica twin (session_gate.sim) is not installed: twin half skipped")
        return {}

    table = {**workloads.WORKLOADS, **getattr(workloads, "SCALE_WORKLOADS", {})}
    limit = Mode.parse(LIMIT_KIND)
    out: dict[str, list[dict[str, Any]]] = {}
    for pair in (r for r in args.twin_runs.split(",") if r):
        workload_name, _, profile = pair.partition("@")
        workload = table[workload_name](args.seed)
        key = f"{workload_name}@{profile}"
        print(f"twin: {key}", flush=True)
        names = args.twin_modes if profile == "cpu-tiny" else args.twin_gpu_modes
        if args.steps <= 1:
            out[key] = [simulate(workload, m, profile).summary() for m in modes(names)]
            # The limit is simulated once per (workload, profile) and cached.
            report.add_relative(out[key], simulate(workload, limit, profile).makespan_sec)
            continue
        steps = [table[workload_name](args.seed + STEP_SEED * k) for k in range(args.steps)]
        limit_row = later_steps([r.summary() for r in simulate_steps(steps, limit, profile)])
        out[key] = []
        for m in modes(names):
            summaries = [r.summary() for r in simulate_steps(steps, m, profile)]
            row = later_steps(summaries)
            print(
                f"  {m.name}: steps "
                + " ".join(
                    f"{s['makespan_sec']:.1f}s/rc{s['recompute_ratio']:.2f}" for s in summaries
                )
                + f" -> later mean {row['makespan_sec']:.1f}s",
                flush=True,
            )
            out[key].append(row)
        report.add_relative(out[key], limit_row["makespan_sec"])
    return out


#: Step k of a multi-step twin run draws its workload with seed ``--seed + STEP_SEED * k``.
STEP_SEED = 100


def later_steps(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One matrix row for a multi-step run: the mean of the steps after the first (where a
    gate that learns across steps has something learned), with every step's makespan and
    recompute kept under ``steps``."""
    later = summaries[1:] or summaries
    row = dict(later[-1])
    for k in ("makespan_sec", "hit_rate", "ideal_hit_rate", "recompute_ratio", "late_turn_p90_sec"):
        row[k] = sum(s[k] for s in later) / len(later)
    for k in ("lost_tokens", "cancellations", "revocations"):
        row[k] = sum(s.get(k, 0) for s in later)
    row["steps"] = [run_figures(s) for s in summaries]
    return row


def run_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """One run's headline figures (``RUN_KEYS``), as a repeated or multi-step row keeps them."""
    return {k: summary.get(k) for k in RUN_KEYS}


def cpu_tiny_note() -> str:
    """What the ``cpu-tiny`` twin rows beside this machine's real rows are: projections by a
    profile fitted wherever it says, not a fidelity check unless it was fitted here."""
    from session_gate import _native
    from session_gate.lab.sim import machine as machines

    text = _native.sim_profile_text("cpu-tiny")
    diffs = machines.differences(machines.profile_machine(text), machines.this_machine())
    if not diffs:
        return "the cpu-tiny twin rows use a profile fitted on this machine"
    return (
        f"note: the cpu-tiny twin rows use a profile fitted on other hardware ({'; '.join(diffs)})"
        ": read them as projections, not as the real rows' errors; `make sim-fidelity` "
        "compares the twin with this engine after calibrating here"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    by_workload: dict[str, list[dict[str, Any]]] = {}
    if args.load:
        for path in args.load:
            with open(path) as f:
                for workload, summaries in json.load(f)["workloads"].items():
                    # Runs of the same workload merge; a mode run again replaces the earlier.
                    rows = {s["mode"]: s for s in by_workload.get(workload, [])}
                    rows.update({s["mode"]: s for s in summaries})
                    by_workload[workload] = list(rows.values())
    else:
        by_workload = run_real(args)
        if not args.no_twin:
            twin = run_twin(args)
            if by_workload and any(k.endswith("@cpu-tiny") for k in twin):
                print(cpu_tiny_note())
            by_workload.update(twin)
    matrix = build(by_workload)
    worst = worst_regret(matrix)
    partial = worst_regret(matrix, complete=False)
    over_limit = worst_over_limit(matrix)
    goals = targets(matrix)
    print("\n" + matrix_report.matrix_table(matrix, worst, partial, over_limit=over_limit))
    if args.markdown:
        table = matrix_report.matrix_table(
            matrix, worst, partial, markdown=True, over_limit=over_limit
        )
        print("\n" + table)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    with open(args.out, "w") as f:
        json.dump(
            {"machine": machine, "seed": args.seed, "workloads": by_workload, "matrix": matrix},
            f,
            indent=2,
        )
    matrix_report.matrix_plot(matrix, args.plot)
    print(f"wrote {args.out} and {args.plot} ({machine})")
    last = {
        "matrix": matrix,
        "worst_regret": worst,
        "partial_worst_regret": partial,
        "worst_over_limit": over_limit,
    }
    last["targets"] = goals
    print(json.dumps(last, sort_keys=True))


if __name__ == "__main__":
    main()
