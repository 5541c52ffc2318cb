"""The bench matrix's table and plot (``python -m session_gate.lab.bench.matrix``): every
workload x mode with its regret and its makespan over the workload's limit (twin rows; "-"
where no limit was computed), real rows beside the twin's, which always say "simulated"."""

from __future__ import annotations

from typing import Any

MATRIX_COLUMNS = (
    ("regret", "regret", "{:.2f}"),
    ("over_limit", "/limit", "{:.2f}"),
    ("makespan_sec", "makespan s", "{:,.1f}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("ideal_hit_rate", "ideal", "{:.3f}"),
    ("recompute_ratio", "recompute", "{:.2f}"),
    ("lost_tokens", "lost tok", "{:,}"),
    ("late_turn_p90_sec", "late p90 s", "{:.2f}"),
)


def _simulated(engine: Any) -> bool:
    return str(engine).startswith("twin:")


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def matrix_table(
    matrix: dict[str, dict[str, dict[str, Any]]],
    worst: dict[str, float],
    partial: dict[str, float] | None = None,
    markdown: bool = False,
    over_limit: dict[str, float] | None = None,
) -> str:
    """Every workload x mode with its regret (makespan over the workload's best) and its
    makespan over the workload's limit (``/limit``), then each mode's worst-case regret
    (``partial``: modes that did not run on every workload) and worst ``over_limit`` (over
    the rows with a limit). Twin rows say "simulated", repeated real rows how many runs their
    medians are over."""
    head = ["workload", "engine", "mode"] + [h for _, h, _ in MATRIX_COLUMNS]
    rows = []
    for workload, modes in matrix.items():
        for mode, r in modes.items():
            engine = f"{r['engine']} (simulated)" if _simulated(r["engine"]) else r["engine"]
            if r.get("runs", 1) > 1:
                engine += f" (median of {r['runs']})"
            rows.append(
                [workload, engine, mode] + [_cell(r.get(k), fmt) for k, _, fmt in MATRIX_COLUMNS]
            )
    worst_line = "worst-case regret (modes run on every workload): " + ", ".join(
        f"{m} {v:.2f}" for m, v in worst.items()
    )
    if partial:
        worst_line += "; on the workloads they ran on: " + ", ".join(
            f"{m} {v:.2f}" for m, v in partial.items()
        )
    if over_limit:
        worst_line += (
            "\nworst makespan over the limit (rows with a limit: no gate, the same engine with a "
            "GPU cache that never runs out; a floor no finite cache reaches): "
            + ", ".join(f"{m} {v:.2f}" for m, v in over_limit.items())
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n\n" + worst_line
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt_row = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    lines = [fmt_row(head), "-" * (sum(widths) + 2 * len(widths))]
    last = None
    for r in rows:
        if last is not None and r[0] != last:
            lines.append("")
        lines.append(fmt_row(r))
        last = r[0]
    return "\n".join(lines) + "\n\n" + worst_line


def matrix_plot(matrix: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    """One panel per workload: each mode's regret (bars), makespan over the limit (crosses,
    where there is one) and hit rate (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(matrix)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (workload, modes) in zip(axes.flat, matrix.items(), strict=False):
        names = list(modes)
        regrets = [modes[m]["regret"] for m in names]
        colors = ["tab:green" if m == "gate" else "tab:gray" for m in names]
        ax.bar(names, regrets, color=colors)
        ax.axhline(1.05, color="tab:red", ls="--", lw=1, label="regret 1.05")
        limits = [modes[m].get("over_limit") for m in names]
        if any(v is not None for v in limits):
            shown = [float("nan") if v is None else v for v in limits]
            ax.plot(names, shown, "x", color="k", label="makespan / limit")
        ax.set_ylim(0.9, max(regrets + [v for v in limits if v is not None]) * 1.1)
        engine = next(iter(modes.values()))["engine"]
        label = f"{engine}, SIMULATED" if _simulated(engine) else f"{engine}, measured"
        ax.set_title(f"{workload} ({label})", fontsize=9)
        ax.set_ylabel("makespan / best mode's (x: / limit)")
        ax.tick_params(axis="x", rotation=45)
        hit = ax.twinx()
        hit.plot(names, [modes[m]["hit_rate"] for m in names], "o", color="tab:blue")
        hit.set_ylim(0, 1)
        hit.set_ylabel("hit rate (dots)")
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
