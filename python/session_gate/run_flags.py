"""The flags every run command shares: the replica twin's ``python -m session_gate.sim`` (and
its ``tune``) and the lab's real bench (``python -m session_gate.lab.bench``) name the same
things the same way — which workloads, traces, modes and seed, and where results go.

Help texts are built from the registries (``session_gate.workloads``, ``session_gate.modes``),
so every ``--help`` lists the workloads and modes that exist. With ``--trace`` and no
``--workload`` only the traces run.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping

from session_gate.modes import LIMIT_KIND, SCHED_KINDS, Mode, mode_names
from session_gate.workloads import Workload, load_trace

#: What runs when neither ``--workload`` nor ``--trace`` is given.
DEFAULT_WORKLOADS = ("default", "mixed")


def add_run_flags(
    p: argparse.ArgumentParser,
    *,
    workloads: Mapping[str, Callable[[int], Workload]],
    modes: str | None,
    scaled_modes: bool = True,
    results: tuple[str, str] | None = None,
    sched_modes: bool = False,
    limit_mode: bool = False,
) -> None:
    """``--workload`` (one of ``workloads``), ``--trace``, ``--seed``; ``--modes`` with
    ``modes`` its default (none: no flag; ``scaled_modes``: whether the ``-scaled`` baselines
    are offered; ``sched_modes``: whether the scheduler modes are; ``limit_mode``: whether the
    twin's ``limit`` is); with
    ``results`` (the default JSON and PNG paths) ``--out``, ``--plot`` and ``--records``."""
    names = sorted(workloads)
    p.add_argument(
        "--workload",
        nargs="+",
        default=None,
        choices=names,
        metavar="NAME",
        help=f"built-in workloads: {', '.join(names)} (default: "
        f"{' and '.join(DEFAULT_WORKLOADS)}, unless --trace is given)",
    )
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="a JSONL trace (format: session_gate.workloads; repeatable); with no --workload "
        "only the traces run",
    )
    if modes is not None:
        p.add_argument(
            "--modes",
            default=modes,
            help="comma-separated modes: "
            f"{', '.join(mode_names(scaled=scaled_modes, sched=sched_modes, limit=limit_mode))} "
            f"(default {modes})",
        )
    p.add_argument("--seed", type=int, default=0, help="the workloads' seed (default 0)")
    if results is not None:
        out, plot = results
        p.add_argument("--out", default=out, help=f"the JSON results (default {out})")
        p.add_argument("--plot", default=plot, help=f"the PNG plot (default {plot})")
        p.add_argument(
            "--records",
            default=None,
            metavar="FILE",
            help="also write every turn of every run as JSON lines (the twin and the real "
            "bench write the same format)",
        )


def workloads_of(
    args: argparse.Namespace,
    workloads: Mapping[str, Callable[[int], Workload]],
    *,
    trace_profile_shape: bool = False,
) -> list[Workload]:
    """The workloads ``args`` ask for: the named ones (the defaults only when no trace is
    given), then the traces (``trace_profile_shape``: run on the profile's replica shape)."""
    names = args.workload
    if names is None:
        names = [] if args.trace else list(DEFAULT_WORKLOADS)
    out = [workloads[n](args.seed) for n in names]
    for path in args.trace:
        trace = load_trace(path, seed=args.seed)
        if trace_profile_shape:
            # The twin checks it against the cache it will really get (the profile's).
            out.append(dataclasses.replace(trace, profile_shape=True))
        else:
            # Runs on the bench's engine: a session that could never fit it is refused now,
            # not after an engine has started.
            trace.check_fits(trace.engine.num_blocks, trace.engine.block_size)
            out.append(trace)
    return out


def modes_of(
    p: argparse.ArgumentParser,
    text: str,
    *,
    scaled: bool = True,
    sched: bool = False,
    limit: bool = False,
) -> list[Mode]:
    """``--modes`` parsed; an unknown mode (or a ``-scaled`` one where ``scaled`` is false, a
    scheduler mode where ``sched`` is false, the limit where ``limit`` is false) is the
    parser's usage error."""
    try:
        modes = [Mode.parse(m.strip()) for m in text.split(",") if m.strip()]
    except ValueError as exc:
        p.error(str(exc))
    for mode in modes:
        if (
            (mode.scaled and not scaled)
            or (mode.kind in SCHED_KINDS and not sched)
            or (mode.kind == LIMIT_KIND and not limit)
        ):
            names = ", ".join(mode_names(scaled=scaled, sched=sched, limit=limit))
            p.error(f"mode {mode.name}: expected one of {names}")
    return modes
