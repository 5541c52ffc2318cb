"""One mode of one workload on the twin: hand the session specs to the native simulation,
then build the bench's own ``ModeResult`` from its records, so the bench's ``summary()`` and
report serve simulated runs unchanged.

Mode ``limit`` (no gate, the same engine with a GPU cache that never runs out) is simulated
once per (workload, profile, engine shape) in a process and then served from a cache, since
every mode's ``over_limit`` asks for it (:func:`limit_makespan`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from session_gate.modes import LIMIT_KIND, Mode
from session_gate.results import ModeResult, TurnRecord, ideal_cached
from session_gate.workloads import Workload

SHAPE_FIELDS = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")


def profile_args(profile: str) -> dict[str, str]:
    """``simulate`` keyword arguments for a built-in profile name or a profile TOML file."""
    from session_gate import _native

    if profile in _native.sim_profile_names():
        return {"profile": profile}
    path = Path(profile)
    if path.is_file():
        return {"profile_path": str(path), "profile_text": path.read_text()}
    names = ", ".join(_native.sim_profile_names())
    raise ValueError(f"unknown profile {profile!r}: expected one of {names}, or a TOML file")


def profile_label(profile: str) -> str:
    """The name a profile goes by in results: a built-in name, or the TOML file's stem."""
    return Path(profile).stem if profile.endswith(".toml") else profile


def cache_shape(profile: str, engine: dict[str, float]) -> tuple[int, int]:
    """The KV cache the twin's replica gets: ``(num_blocks, block_size)`` from the replica
    shape where it sets them, else from the profile's ``[replica]`` table."""
    if "num_blocks" in engine and "block_size" in engine:
        return int(engine["num_blocks"]), int(engine["block_size"])
    from session_gate import _native

    replica = _native.sim_profile_shape(**profile_args(profile))
    num_blocks = engine.get("num_blocks", replica["num_blocks"])
    block_size = engine.get("block_size", replica["block_size"])
    return int(num_blocks), int(block_size)


def native_sessions(workload: Workload) -> list[tuple[Any, ...]]:
    return [
        (
            s.session_id,
            s.system_tokens,
            s.task_tokens,
            s.arrival,
            [(t.append, t.output, t.tool_latency) for t in s.turns],
        )
        for s in workload.sessions
    ]


def replica_shape(
    workload: Workload, overrides: dict[str, float] | None = None
) -> dict[str, float]:
    """The replica's shape: the workload's engine for the CPU-sized workloads (so the twin
    models the engine the real bench starts), the profile's for scale workloads; then any
    explicit overrides."""
    shape: dict[str, float] = {}
    if not workload.profile_shape:
        e = workload.engine
        shape = {f: getattr(e, f) for f in SHAPE_FIELDS}
    shape.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return shape


def run_twin(
    workload: Workload,
    mode: Mode,
    profile: str,
    knobs: dict[str, Any] | None = None,
    shape: dict[str, float] | None = None,
) -> ModeResult:
    """Simulate ``workload`` in ``mode`` on ``profile`` with the gate ``knobs`` (ignored by
    modes without a gate); the result says ``engine="twin:<profile>"``."""
    return run_twin_steps([workload], mode, profile, knobs, shape)[0]


def run_twin_steps(
    steps: list[Workload],
    mode: Mode,
    profile: str,
    knobs: dict[str, Any] | None = None,
    shape: dict[str, float] | None = None,
) -> list[ModeResult]:
    """Consecutive RL steps (``steps[k]`` is step k's workload) with ONE mode object: the
    gate core, and what it learned, lives across steps; the other modes start afresh each
    step; each step runs on a fresh replica. One result per step, as :func:`run_twin`'s.
    Mode ``limit`` is simulated once per process for the same steps, profile and shape."""
    if mode.kind == LIMIT_KIND:
        return _cached_limit(steps, profile, shape)
    return _simulate(steps, mode, profile, knobs, shape)


def _simulate(
    steps: list[Workload],
    mode: Mode,
    profile: str,
    knobs: dict[str, Any] | None,
    shape: dict[str, int] | None,
) -> list[ModeResult]:
    from session_gate import _native

    if mode.scaled:
        raise ValueError(
            f"mode {mode.name}: the twin runs the baselines with their literal time constants"
        )
    engine = replica_shape(steps[0], shape)
    if mode.kind != LIMIT_KIND:  # the limit's cache never runs out
        num_blocks, block_size = cache_shape(profile, engine)
        for w in steps:
            w.check_fits(num_blocks, block_size)
    config = _native.GateConfig(**(knobs or {})) if mode.gated else None
    outs = _native.simulate_rl_steps(
        [native_sessions(w) for w in steps],
        mode.kind,
        cap=mode.cap,
        config=config,
        seed=steps[0].seed,
        **profile_args(profile),
        **engine,
    )
    return [_result(w, mode, profile, out) for w, out in zip(steps, outs, strict=True)]


#: Limit runs done in this process, by what determines them (:func:`_limit_key`).
_LIMITS: dict[tuple[Any, ...], list[ModeResult]] = {}
#: One lock per key, so threads asking for the same limit wait for one run of it.
_LIMIT_LOCKS: dict[tuple[Any, ...], threading.Lock] = {}
_LIMITS_GUARD = threading.Lock()


def _limit_key(
    steps: list[Workload], profile: str, shape: dict[str, int] | None
) -> tuple[Any, ...]:
    """What a limit run depends on: every step's sessions, the seed, the profile and the
    engine shape except ``num_blocks`` (the limit replaces it)."""
    engine = replica_shape(steps[0], shape)
    engine.pop("num_blocks", None)
    sessions = tuple(
        tuple((s[0], s[1], s[2], s[3], tuple(s[4])) for s in native_sessions(w)) for w in steps
    )
    return (sessions, steps[0].seed, profile, tuple(sorted(engine.items())))


def _cached_limit(
    steps: list[Workload], profile: str, shape: dict[str, int] | None
) -> list[ModeResult]:
    key = _limit_key(steps, profile, shape)
    with _LIMITS_GUARD:
        lock = _LIMIT_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _LIMITS:
            _LIMITS[key] = _simulate(steps, Mode.parse(LIMIT_KIND), profile, None, shape)
        return _LIMITS[key]


def limit_makespan(workload: Workload, profile: str, shape: dict[str, int] | None = None) -> float:
    """The workload's limit on ``profile``: the makespan of no gate on the same engine with a
    GPU cache that never runs out (simulated once per process, then cached)."""
    return run_twin(workload, Mode.parse(LIMIT_KIND), profile, shape=shape).makespan_sec


def _result(workload: Workload, mode: Mode, profile: str, out: dict[str, Any]) -> ModeResult:
    records = _records(workload, out["records"], out["profile"]["block_size"])
    stats = dict(out["replica_stats"])
    stats["wall_sec"] = out["wall_sec"]
    stats["shape"] = {f: out["profile"][f] for f in SHAPE_FIELDS}
    if out["profile"]["engine"]:
        # The engine a calibrated profile was timed on (its [engine] table).
        stats["calibrated_engine"] = out["profile"]["engine"]
    gate_stats = out["gate_stats"] or out["aimd_stats"] or {}
    if out["infer_stats"] is not None:
        # sched-infer: the summary reports the inferred sessions against the true ones.
        gate_stats = {**gate_stats, "inference": out["infer_stats"]}
    return ModeResult(
        mode.name,
        workload.name,
        out["makespan_sec"],
        records,
        gate_stats,
        engine=f"twin:{profile_label(profile)}",
        replica_stats=stats,
        lost_turns=out["lost"]["turns"],
        lost_tokens=out["lost"]["tokens"],
        cancellations=out["lost"]["cancellations"],
    )


def _records(workload: Workload, cols: dict[str, list[Any]], block: int) -> list[TurnRecord]:
    """The bench's records from the native columns, with the ideal hit computed by the bench's
    own rule: the first session to send a first turn prefills the system prompt."""
    n = len(cols["session"])
    order = sorted(range(n), key=lambda i: (cols["session"][i], cols["turn"][i]))
    first_turns = [i for i in range(n) if cols["turn"][i] == 0]
    first = min(first_turns, key=lambda i: (cols["ready_at"][i], cols["session"][i]), default=-1)
    records = []
    prev_sequence: dict[int, int] = {}
    for i in order:
        spec = workload.sessions[cols["session"][i]]
        turn, prompt = cols["turn"][i], cols["prompt_tokens"][i]
        prev = prev_sequence.get(cols["session"][i], 0) if turn else 0
        ideal = ideal_cached(prev, prompt, block, spec.system_tokens, i != first)
        prev_sequence[cols["session"][i]] = prompt + spec.turns[turn].output
        records.append(
            TurnRecord(
                spec.session_id,
                turn,
                prompt,
                cols["cached_tokens"][i],
                ideal,
                cols["latency_sec"][i],
                cols["wait_sec"][i],
                cols["reason"][i],
            )
        )
    return records
