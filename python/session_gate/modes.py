"""The modes a run compares (what stands between the sessions and the engine), by name.

One registry serves the replica twin (``python -m session_gate.sim``) and the lab's real bench:
:func:`mode_names` is what their ``--modes`` help lists and what :meth:`Mode.parse` accepts.
The scheduler modes (:data:`SCHED_KINDS`) put the gate in vLLM's scheduler: the twin models it,
the real bench starts their engine with ``SESSION_GATE_SCHEDULER`` and gates nothing itself.
How each mode runs lives with whatever runs it (the twin's native simulation; the lab bench's
admission control).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Modes named by their kind alone: no gate, the seed's gate (``pressure="engine"``), the default.
PLAIN_KINDS = ("none", "seed", "gate")
#: The controllers users deploy today: prime-rl's adaptive episode concurrency (``aimd``) and
#: ThunderAgent's tool-boundary pausing (``pause``).
BASELINE_KINDS = ("aimd", "pause")
#: The engine gate's scheduler mode: the gate inside vLLM's scheduler, keyed by the session id
#: with each session ended by vllm-router's finish call, as prime-rl and SkyRL send it
#: (``sched``); by the session id alone, never ended (``sched-nofinish``: a plain client); or
#: by the session inferred from the prompt's blocks (``sched-infer``: no id at all).
SCHED_KINDS = ("sched", "sched-infer", "sched-nofinish")
#: The scheduler modes whose requests name their session.
NAMED_SCHED_KINDS = ("sched", "sched-nofinish")
#: The twin's limit: no gate on the same engine with a GPU cache that never runs out (its
#: makespan is the floor every mode's ``over_limit`` is measured against). Twin only.
LIMIT_KIND = "limit"
#: What the twin and the real bench compare unless ``--modes`` says otherwise.
DEFAULT_MODES = "none,cap2,cap4,cap6,cap8,cap12,seed,gate"
#: A baseline run with its time constants scaled to the workload's clock (the real bench only:
#: the twin runs the baselines with their literal constants).
SCALED_SUFFIX = "-scaled"


def mode_names(*, scaled: bool = True, sched: bool = False, limit: bool = False) -> list[str]:
    """Every mode :meth:`Mode.parse` accepts, ``capN`` standing for the static caps (N > 0);
    without the ``-scaled`` baselines when ``scaled`` is false; with the scheduler modes when
    ``sched`` is true; with the limit (the twin's alone) when ``limit`` is true."""
    names = ["none", "capN", "seed", "gate"]
    for kind in BASELINE_KINDS:
        names += [kind, kind + SCALED_SUFFIX] if scaled else [kind]
    if sched:
        names += list(SCHED_KINDS)
    if limit:
        names.append(LIMIT_KIND)
    return names


@dataclass(frozen=True)
class Mode:
    """``kind`` is ``none``, ``cap`` (session-level cap of ``cap`` sessions, held for a session's
    whole life), ``seed`` (the seed's gate, ``pressure="engine"``), ``gate`` (the default),
    ``aimd`` (prime-rl's adaptive episode concurrency), ``pause`` (ThunderAgent's tool-boundary
    pausing), ``sched``, ``sched-infer`` or ``sched-nofinish`` (the gate inside the scheduler),
    ``limit`` (the twin's floor: no gate, a cache that never runs out);
    ``scaled`` runs a baseline with its time constants scaled to the workload's clock."""

    name: str
    kind: str
    cap: int = 0
    scaled: bool = False

    @property
    def gated(self) -> bool:
        """Whether the mode runs the gate core (and so takes the gate's knobs)."""
        return self.kind in ("seed", "gate", *SCHED_KINDS)

    @staticmethod
    def parse(text: str) -> Mode:
        if text in (*PLAIN_KINDS, *BASELINE_KINDS, *SCHED_KINDS, LIMIT_KIND):
            return Mode(text, text)
        if text.endswith(SCALED_SUFFIX) and text.removesuffix(SCALED_SUFFIX) in BASELINE_KINDS:
            return Mode(text, text.removesuffix(SCALED_SUFFIX), scaled=True)
        if text.startswith("cap") and text[3:].isdigit() and int(text[3:]) > 0:
            return Mode(text, "cap", int(text[3:]))
        names = ", ".join(mode_names(sched=True, limit=True))
        raise ValueError(f"unknown mode {text!r}: expected one of {names}")
