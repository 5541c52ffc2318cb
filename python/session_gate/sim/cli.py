"""Argument handling shared by the twin's commands: workloads, profiles, modes, gate knobs and
replica-shape overrides (every ``GateConfig`` knob becomes a ``--knob-name`` flag)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from session_gate.bench.modes import Mode
from session_gate.bench.workloads import SCALE_WORKLOADS, WORKLOADS, Workload, load_trace

ALL_WORKLOADS = {**WORKLOADS, **SCALE_WORKLOADS}


def knob_names() -> list[str]:
    """Every gate knob, from the one place the defaults live (Rust's ``GateConfig``)."""
    from session_gate import _native

    return list(_native.GateConfig().to_dict())


def _knob_value(text: str) -> Any:
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def add_common(p: argparse.ArgumentParser, *, modes: str | None) -> None:
    p.add_argument(
        "--workload",
        nargs="+",
        default=None,
        choices=sorted(ALL_WORKLOADS),
        help="built-in workloads (default: default and mixed, unless --trace is given)",
    )
    p.add_argument("--trace", action="append", default=[], help="a JSONL trace (repeatable)")
    p.add_argument(
        "--profile",
        nargs="+",
        default=["cpu-tiny"],
        help="built-in profile names or profile TOML files (default cpu-tiny)",
    )
    if modes is not None:
        p.add_argument("--modes", default=modes, help=f"comma-separated (default {modes})")
    p.add_argument("--seed", type=int, default=0)
    knobs = p.add_argument_group("gate knobs (seed and gate modes)")
    for name in knob_names():
        knobs.add_argument(
            f"--{name.replace('_', '-')}", dest=f"knob_{name}", type=_knob_value, default=None
        )
    shape = p.add_argument_group("replica shape (default: the workload's, or the profile's)")
    for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        shape.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None)


def knobs_of(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name in knob_names():
        value = getattr(args, f"knob_{name}")
        if value is not None:
            out[name] = value
    return out


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    names = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def workloads_of(args: argparse.Namespace) -> list[Workload]:
    """The workloads asked for; checks the profiles too, so a typo fails before any run."""
    from session_gate.sim.twin import profile_args

    for profile in args.profile:
        profile_args(profile)
    names = args.workload
    if names is None:
        names = [] if args.trace else ["default", "mixed"]
    out = [ALL_WORKLOADS[n](args.seed) for n in names]
    # A trace says nothing about the engine: the twin runs it on the profile's replica shape
    # (for cpu-tiny, the bench's engine), so a GPU profile's trace runs on that GPU's cache.
    out += [
        dataclasses.replace(load_trace(path, seed=args.seed), profile_shape=True)
        for path in args.trace
    ]
    return out


def modes_of(p: argparse.ArgumentParser, text: str) -> list[Mode]:
    try:
        return [Mode.parse(m.strip()) for m in text.split(",") if m.strip()]
    except ValueError as exc:
        p.error(str(exc))
