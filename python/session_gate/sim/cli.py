"""Argument handling shared by the twin's commands: workloads, traces, modes and seed (the
flags the real bench shares, ``session_gate.run_flags``), then profiles, gate knobs and
replica-shape overrides (every ``GateConfig`` knob becomes a ``--knob-name`` flag)."""

from __future__ import annotations

import argparse
from typing import Any

from session_gate import run_flags
from session_gate.modes import Mode
from session_gate.workloads import SCALE_WORKLOADS, WORKLOADS, Workload

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


def add_common(
    p: argparse.ArgumentParser, *, modes: str | None, results: tuple[str, str] | None = None
) -> None:
    """The run flags (``run_flags.add_run_flags``; the twin offers no ``-scaled`` modes: it
    runs the baselines with their literal time constants; it offers the scheduler modes),
    ``--profile``, every gate knob and the replica shape."""
    run_flags.add_run_flags(
        p,
        workloads=ALL_WORKLOADS,
        modes=modes,
        scaled_modes=False,
        results=results,
        sched_modes=True,
        limit_mode=True,
    )
    p.add_argument(
        "--profile",
        nargs="+",
        default=["cpu-tiny"],
        help="built-in profile names or profile TOML files (default cpu-tiny)",
    )
    knobs = p.add_argument_group("gate knobs (seed, gate and the sched modes)")
    for name in knob_names():
        knobs.add_argument(
            f"--{name.replace('_', '-')}", dest=f"knob_{name}", type=_knob_value, default=None
        )
    shape = p.add_argument_group("replica shape (default: the workload's, or the profile's)")
    for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        shape.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None)
    shape.add_argument(
        "--offload-gb",
        dest="offload_gb",
        type=float,
        default=None,
        help="a host KV tier of this many GiB (vLLM's --kv-offloading-size, native backend; "
        "the profile's [offload] table gives its speeds; default none)",
    )


def knobs_of(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name in knob_names():
        value = getattr(args, f"knob_{name}")
        if value is not None:
            out[name] = value
    return out


def shape_of(args: argparse.Namespace) -> dict[str, float]:
    """The replica-shape overrides given, the host tier's size (``offload_gb``) included."""
    names = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "offload_gb")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def workloads_of(args: argparse.Namespace) -> list[Workload]:
    """The workloads asked for; checks the profiles too, so a typo fails before any run."""
    from session_gate.sim.twin import profile_args

    for profile in args.profile:
        profile_args(profile)
    # A trace says nothing about the engine: the twin runs it on the profile's replica shape
    # (for cpu-tiny, the bench's engine), so a GPU profile's trace runs on that GPU's cache.
    return run_flags.workloads_of(args, ALL_WORKLOADS, trace_profile_shape=True)


def modes_of(p: argparse.ArgumentParser, text: str) -> list[Mode]:
    return run_flags.modes_of(p, text, scaled=False, sched=True, limit=True)
