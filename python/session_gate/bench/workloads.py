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
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path


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

    @property
    def max_prompt_tokens(self) -> int:
        return max(
            s.system_tokens + s.task_tokens + sum(t.append + t.output for t in s.turns)
            for s in self.sessions
        )

    def describe(self) -> str:
        turns = sum(len(s.turns) for s in self.sessions)
        e = self.engine
        return (
            f"{self.name}: {len(self.sessions)} sessions, {turns} turns, longest prompt "
            f"{self.max_prompt_tokens:,} tokens; KV cache {e.num_blocks} blocks x "
            f"{e.block_size} tokens ({e.num_blocks * e.block_size:,} tokens)"
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


def default_workload(seed: int = 0) -> Workload:
    """16 sessions x 10 turns, 512 shared + 1,000 task tokens, +32 output and +200-600 tool
    tokens a turn, tools 0.3-1.5 s; 1,024 blocks x 32 tokens (~3x oversubscribed at the end)."""
    rng = random.Random(seed)
    return Workload("default", tuple(_sessions(rng, "s", 16, 10, (200, 600))), seed=seed)


def mixed_workload(seed: int = 0) -> Workload:
    """Half short sessions (3 turns, small tool results) and half long ones (12 turns, large
    tool results) on the same cache: early on many sessions fit, late only a few long ones do,
    so no single static cap suits the whole run."""
    rng = random.Random(seed + 1)
    long = _sessions(rng, "long", 8, 12, (500, 900))
    short = _sessions(rng, "short", 12, 3, (100, 300))
    mixed = [s for pair in zip(long, short, strict=False) for s in pair] + short[len(long) :]
    return Workload("mixed", tuple(mixed), seed=seed)


def load_trace(path: str | Path, engine: EngineShape | None = None, seed: int = 0) -> Workload:
    """Read a JSONL trace (format in this module's docstring); errors name the line."""
    sessions = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = tuple(
                Turn(int(t["append"]), int(t["output"]), float(t["tool_latency"]))
                for t in row["turns"]
            )
            spec = SessionSpec(
                str(row["session_id"]), int(row["system_tokens"]), int(row["task_tokens"]), turns
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: bad session record: {exc!r}") from exc
        if not spec.turns or spec.turns[0].append != 0:
            raise ValueError(f"{path}:{lineno}: a session needs turns, the first with append 0")
        sessions.append(spec)
    if not sessions:
        raise ValueError(f"{path}: no sessions")
    return Workload(f"trace:{Path(path).name}", tuple(sessions), engine or EngineShape(), seed)


def dump_trace(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` as a JSONL trace (round-trips through :func:`load_trace`)."""
    with open(path, "w") as f:
        for s in workload.sessions:
            row = asdict(s)
            row["turns"] = [asdict(t) for t in s.turns]
            f.write(json.dumps(row) + "\n")


WORKLOADS = {"default": default_workload, "mixed": mixed_workload}
