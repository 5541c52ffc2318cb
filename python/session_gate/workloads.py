"""Seeded, reproducible agentic workloads: who says what, how much the tools return, how long
they take. Token *contents* are generated at run time from the same seed; the model's own
outputs join the history as it produces them.

Trace files (``--trace FILE``) are JSONL, one session per line::

    {"session_id": "s0", "system_tokens": 512, "task_tokens": 1000,
     "turns": [{"append": 0, "output": 32, "tool_latency": 0.8},
               {"append": 350, "output": 32, "tool_latency": 1.1}]}

``system_tokens`` is a prefix of one system prompt shared by every session; ``append`` is the
number of tool-result tokens added to the history before the turn (0 on the first turn);
``output`` the turn's ``max_tokens``; ``tool_latency`` the seconds the tool runs after the turn.
An optional ``arrival`` (seconds after the start, default 0) delays the session's first turn.
Errors name the file, the line and the field.

The same definitions feed the real CPU bench and the replica twin (``python -m
session_gate.sim``). The *scale* workloads (:data:`SCALE_WORKLOADS`) model agentic RL rollouts on
one GPU replica; they are far too large for the CPU engine, so only the twin runs them, on the
replica shape of the profile it is given (``Workload.profile_shape``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Turn:
    append: int
    output: int
    tool_latency: float


@dataclass(frozen=True)
class SessionSpec:
    session_id: str
    system_tokens: int
    task_tokens: int
    turns: tuple[Turn, ...]
    arrival: float = 0.0

    @property
    def longest_sequence(self) -> int:
        """Tokens of the session's whole history at its last turn's end: system + task + every
        append and output (the most KV it ever needs at once)."""
        return self.system_tokens + self.task_tokens + sum(t.append + t.output for t in self.turns)


@dataclass(frozen=True)
class EngineShape:
    """The KV cache and batch limits the workload is meant to oversubscribe."""

    num_blocks: int = 1024
    block_size: int = 32
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[SessionSpec, ...]
    engine: EngineShape = field(default_factory=EngineShape)
    seed: int = 0
    #: The twin sizes its replica from the profile instead of ``engine`` (scale workloads).
    profile_shape: bool = False

    @property
    def max_prompt_tokens(self) -> int:
        return max(s.longest_sequence for s in self.sessions)

    def check_fits(self, num_blocks: int, block_size: int) -> None:
        """Refuses the workload when a session's longest sequence can never fit a KV cache of
        ``num_blocks`` blocks (vLLM's null block included) of ``block_size`` tokens: neither vLLM
        nor the twin could ever run that session's last turn. The error names the session."""
        capacity = (num_blocks - 1) * block_size
        for s in self.sessions:
            need = s.longest_sequence
            if need > capacity:
                raise ValueError(
                    f"{self.name}: session {s.session_id!r} needs {need:,} tokens of KV by its "
                    f"last turn (system + task + every append and output), more than the cache "
                    f"holds: {num_blocks - 1:,} usable blocks x {block_size} = {capacity:,} "
                    "tokens; no engine of this shape can run it"
                )

    @property
    def engine_max_model_len(self) -> int:
        """The ``max_model_len`` the real bench starts this workload's engine with: its longest
        sequence + 64, within the cache. ``aimd`` sizes its first cap from it (KV capacity over
        ``max_model_len``, as prime-rl does), so an engine of another length changes that mode's
        result; the twin derives the same number from the same sessions. A workload that can
        never fit the engine is refused here, before any engine starts (:meth:`check_fits`)."""
        e = self.engine
        self.check_fits(e.num_blocks, e.block_size)
        return min(self.max_prompt_tokens + 64, (e.num_blocks - 1) * e.block_size)

    def describe(self) -> str:
        turns = sum(len(s.turns) for s in self.sessions)
        e = self.engine
        cache = (
            "replica shape from the profile"
            if self.profile_shape
            else f"KV cache {e.num_blocks} blocks x {e.block_size} tokens "
            f"({e.num_blocks * e.block_size:,} tokens)"
        )
        return (
            f"{self.name}: {len(self.sessions)} sessions, {turns} turns, longest prompt "
            f"{self.max_prompt_tokens:,} tokens; {cache}"
        )


def _sessions(
    rng: random.Random,
    prefix: str,
    count: int,
    turns: int,
    tool_tokens: tuple[int, int],
    *,
    system: int = 512,
    task: int = 1000,
    output: int = 32,
    latency: tuple[float, float] = (0.3, 1.5),
) -> list[SessionSpec]:
    out = []
    for i in range(count):
        spec_turns = tuple(
            Turn(
                append=0 if t == 0 else rng.randint(*tool_tokens),
                output=output,
                tool_latency=round(rng.uniform(*latency), 3),
            )
            for t in range(turns)
        )
        out.append(SessionSpec(f"{prefix}{i}", system, task, spec_turns))
    return out


def default_workload(seed: int = 0, sessions: int = 16) -> Workload:
    """16 sessions x 10 turns, 512 shared + 1,000 task tokens, +32 output and +200-600 tool
    tokens a turn, tools 0.3-1.5 s; 1,024 blocks x 32 tokens (~3x oversubscribed at the end).

    With ``sessions`` another count of such sessions, named ``default-x<k>`` for ``k`` times 16
    (the fleet bench's two replicas get ``default-x2``): its first 16 sessions are
    ``default``'s own (the same draws in the same order)."""
    if sessions < 1:
        raise ValueError(f"default workload: sessions {sessions}: at least 1")
    rng = random.Random(seed)
    name = "default" if sessions == 16 else f"default-x{sessions / 16:g}"
    return Workload(name, tuple(_sessions(rng, "s", sessions, 10, (200, 600))), seed=seed)


def mixed_workload(seed: int = 0) -> Workload:
    """Half short sessions (3 turns, small tool results) and half long ones (12 turns, large
    tool results) on the same cache: early on many sessions fit, late only a few long ones do,
    so no single static cap suits the whole run."""
    rng = random.Random(seed + 1)
    long = _sessions(rng, "long", 8, 12, (500, 900))
    short = _sessions(rng, "short", 12, 3, (100, 300))
    mixed = [s for pair in zip(long, short, strict=False) for s in pair] + short[len(long) :]
    return Workload("mixed", tuple(mixed), seed=seed)


def unshared_workload(seed: int = 0) -> Workload:
    """20 sessions x 12 turns with no shared prefix (no system prompt; a 1,000-token task each),
    +200-600 tool tokens and +32 output a turn, and log-normal tool times (median 1 s, sigma 0.8,
    0.1-15 s: a few calls run many times longer than the rest). The shape of the unseen trace on
    which the real engine's ``aimd`` once took 1.8x the twin's makespan (issue 29): its engine
    was started for a longer trace (see :attr:`Workload.engine_max_model_len`)."""
    rng = random.Random(f"unshared:{seed}")
    out = [
        SessionSpec(
            f"u{i}",
            0,
            1000,
            tuple(
                Turn(
                    append=0 if t == 0 else rng.randint(200, 600),
                    output=32,
                    tool_latency=round(_lognormal(rng, 1.0, 0.8, 0.1, 15.0), 3),
                )
                for t in range(12)
            ),
        )
        for i in range(20)
    ]
    return Workload("unshared", tuple(out), seed=seed)


def load_trace(path: str | Path, engine: EngineShape | None = None, seed: int = 0) -> Workload:
    """Read a JSONL trace (format in this module's docstring); errors name the file, the line
    and the field. Session ids must be unique: the gate keys everything by them, so two
    sessions under one id would be one session to it."""
    sessions = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            spec = _session_from_json(line, f"{path}:{lineno}")
            if spec.session_id in first_line:
                raise ValueError(
                    f"{path}:{lineno}: session {spec.session_id!r}: duplicate session_id "
                    f"(first on line {first_line[spec.session_id]})"
                )
            first_line[spec.session_id] = lineno
            sessions.append(spec)
    if not sessions:
        raise ValueError(f"{path}: no sessions")
    return Workload(f"trace:{Path(path).name}", tuple(sessions), engine or EngineShape(), seed)


def _session_from_json(line: str, where: str) -> SessionSpec:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    session_id = _field(row, "session_id", str, where)
    where = f"{where}: session {session_id!r}"
    raw_turns = _field(row, "turns", list, where)
    if not raw_turns:
        raise ValueError(f"{where}: field 'turns': a session needs at least one turn")
    turns = []
    for i, t in enumerate(raw_turns):
        at = f"{where}: turns[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{at}: expected a JSON object, got {type(t).__name__}")
        turns.append(
            Turn(
                _field(t, "append", int, at, minimum=0, maximum=0 if i == 0 else None),
                _field(t, "output", int, at, minimum=1),
                _field(t, "tool_latency", float, at, minimum=0),
            )
        )
    return SessionSpec(
        session_id,
        _field(row, "system_tokens", int, where, minimum=0),
        _field(row, "task_tokens", int, where, minimum=0),
        tuple(turns),
        _field(row, "arrival", float, where, minimum=0, default=0.0),
    )


_MISSING: Any = object()


def _field(
    row: dict[str, Any],
    name: str,
    kind: type,
    where: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    default: Any = _MISSING,
) -> Any:
    """``row[name]`` checked to be a ``kind`` (ints accepted as floats) within bounds."""
    if name not in row:
        if default is not _MISSING:
            return default
        raise ValueError(f"{where}: missing field {name!r}")
    value = row[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if kind is float and ok and not math.isfinite(value):
        ok = False
    if not ok:
        raise ValueError(
            f"{where}: field {name!r}: expected {'a number' if kind is float else kind.__name__}"
            f", got {value!r}"
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: field {name!r}: {value!r} is below {minimum}")
    if maximum is not None and value > maximum:
        what = "the first turn's append must be 0" if name == "append" else f"above {maximum}"
        raise ValueError(f"{where}: field {name!r}: {value!r}: {what}")
    return value


def dump_trace(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` as a JSONL trace (round-trips through :func:`load_trace`)."""
    with open(path, "w") as f:
        for s in workload.sessions:
            row = asdict(s)
            row["turns"] = [asdict(t) for t in s.turns]
            f.write(json.dumps(row) + "\n")


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))


def rl_rollout_workload(
    seed: int = 0,
    *,
    sessions: int = 256,
    turns: tuple[int, int] = (20, 50),
    name: str = "rl-rollout",
    arrivals_per_sec: float | None = None,
) -> Workload:
    """One synchronous agentic RL rollout step on one GPU replica: 256 trajectories start
    together, each 20-50 turns (uniform) of a tool-using agent.

    Each turn the model writes 100-600 tokens (reasoning plus a tool call; uniform) and the tool
    returns a heavy-tailed result: log-normal tokens (median 500, sigma 0.8, 20-8,000) after a
    log-normal latency (median 2 s, sigma 0.7, 0.2-60 s: most calls take 1-5 s, a few far
    longer). A 2,048-token system prompt is shared; each task adds 1,000 tokens. Contexts grow
    to ~39K tokens on average (past 32K for most trajectories, the longest ~60K), so the live
    sessions' contexts are several times one H200's KV cache. With ``arrivals_per_sec`` the
    trajectories arrive as a Poisson stream instead (an asynchronous RL pipeline)."""
    rng = random.Random(f"{name}:{seed}")
    out = []
    clock = 0.0
    for i in range(sessions):
        n = rng.randint(*turns)
        spec_turns = tuple(
            Turn(
                append=0 if t == 0 else round(_lognormal(rng, 500, 0.8, 20, 8000)),
                output=rng.randint(100, 600),
                tool_latency=round(_lognormal(rng, 2.0, 0.7, 0.2, 60.0), 3),
            )
            for t in range(n)
        )
        arrival = 0.0
        if arrivals_per_sec:
            arrival = round(clock, 3)
            clock += rng.expovariate(arrivals_per_sec)
        out.append(SessionSpec(f"traj{i}", 2048, 1000, spec_turns, arrival))
    return Workload(name, tuple(out), seed=seed, profile_shape=True)


def rl_async_workload(seed: int = 0) -> Workload:
    """An asynchronous RL pipeline: 512 trajectories of 10-40 turns arriving as a Poisson
    stream at 1 per second (~8.5 minutes of arrivals), otherwise as ``rl-rollout``: the load
    builds up, peaks and drains, so the right number of concurrent sessions changes over the
    run."""
    return rl_rollout_workload(
        seed, sessions=512, turns=(10, 40), name="rl-async", arrivals_per_sec=1.0
    )


def speed_workload(seed: int = 0) -> Workload:
    """The twin's speed case: 1,000 trajectories x 30 turns shaped like ``rl-rollout``."""
    return rl_rollout_workload(seed, sessions=1000, turns=(30, 30), name="speed-1000x30")


def cheap_prefill_workload(seed: int = 0) -> Workload:
    """Short prompts, long tools: 512 sessions x 16 turns, a 512-token shared system prompt and
    300-token tasks, 50-200 tool tokens and 100-300 output tokens a turn, tools of 5-20 s
    (uniform). Contexts stay under ~8K tokens, so a re-prefill costs a fraction of a second on a
    GPU while the tools take seconds: holding sessions back to save prefill costs more than it
    saves. The live contexts still outgrow one replica's cache (the issue's cheap-prefill case)."""
    rng = random.Random(f"cheap-prefill:{seed}")
    out = [
        SessionSpec(
            f"c{i}",
            512,
            300,
            tuple(
                Turn(
                    append=0 if t == 0 else rng.randint(50, 200),
                    output=rng.randint(100, 300),
                    tool_latency=round(rng.uniform(5.0, 20.0), 3),
                )
                for t in range(16)
            ),
        )
        for i in range(512)
    ]
    return Workload("cheap-prefill", tuple(out), seed=seed, profile_shape=True)


def long_tool_workload(seed: int = 0) -> Workload:
    """Tools of 10-60 s (uniform): 256 sessions x 20 turns shaped like ``rl-rollout`` otherwise
    (2,048 shared + 1,000 task tokens, log-normal tool results of median 500 tokens, 100-600
    output tokens). A session sits idle far longer than it runs, so whether its prefix survives
    the tool call (the gate's idle grace window) decides the hit rate."""
    rng = random.Random(f"long-tool:{seed}")
    out = [
        SessionSpec(
            f"l{i}",
            2048,
            1000,
            tuple(
                Turn(
                    append=0 if t == 0 else round(_lognormal(rng, 500, 0.8, 20, 8000)),
                    output=rng.randint(100, 600),
                    tool_latency=round(rng.uniform(10.0, 60.0), 3),
                )
                for t in range(20)
            ),
        )
        for i in range(256)
    ]
    return Workload("long-tool", tuple(out), seed=seed, profile_shape=True)


WORKLOADS = {"default": default_workload, "mixed": mixed_workload, "unshared": unshared_workload}
#: Workloads only the twin runs (on the profile's replica shape); see the module docstring.
SCALE_WORKLOADS = {"rl-rollout": rl_rollout_workload, "rl-async": rl_async_workload}
SCALE_WORKLOADS.update({"cheap-prefill": cheap_prefill_workload, "long-tool": long_tool_workload})
