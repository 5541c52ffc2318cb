"""The session inference (``SESSION_GATE_SCHEDULER=infer``) audited against the truth: which of
a run's turns landed in their true session. The engine lists its recent inferences
(``session_gate_stats("inferred")``: ``[request_id, session, kind]``); the bench knows which
session and turn each of its request ids carried."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

#: Parses an engine request id into (true session, turn), or None for another run's request.
Parse = Callable[[str], "tuple[str, int] | None"]


def audit(rows: Iterable[list[str]], parse: Parse) -> dict[str, Any]:
    """How the inferences in ``rows`` match the truth ``parse`` reads from their request ids.

    A first turn is right when it starts a session (``first_new``; one that continued another
    session is ``first_merged``); a later turn when it continues the session its own
    previous turn went to (``continued_own``; else ``new_instead`` or ``continued_other``).
    ``in_true_session`` is the share of right turns; ``merged_sessions`` counts inferred
    sessions that served several true sessions."""
    by_session: dict[str, dict[int, tuple[str, str]]] = {}
    for rid, inferred, kind in rows:
        truth = parse(rid)
        if truth is not None:
            by_session.setdefault(truth[0], {})[truth[1]] = (inferred, kind)
    owners: dict[str, set[str]] = {}
    for session, turns in by_session.items():
        for inferred, _ in turns.values():
            owners.setdefault(inferred, set()).add(session)
    counts = dict.fromkeys(
        ("first_new", "first_merged", "continued_own", "new_instead", "continued_other"), 0
    )
    for turns in by_session.values():
        for t, (inferred, kind) in sorted(turns.items()):
            if t - 1 not in turns:
                counts["first_new" if kind == "new" else "first_merged"] += 1
            elif inferred == turns[t - 1][0]:
                counts["continued_own"] += 1
            else:
                counts["new_instead" if kind == "new" else "continued_other"] += 1
    total = sum(counts.values())
    return {
        "turns": total,
        "in_true_session": (counts["first_new"] + counts["continued_own"]) / total
        if total
        else 0.0,
        "merged_sessions": sum(1 for s in owners.values() if len(s) > 1),
        **counts,
    }


def runner_ids(mode: str) -> Parse:
    """Request ids of the in-process runner: ``<mode>-<session>-<turn>.<attempt>``, to which
    vLLM appends ``-<random suffix>``."""

    def parse(rid: str) -> tuple[str, int] | None:
        base = rid.rsplit("-", 1)[0]
        if not base.startswith(f"{mode}-"):
            return None
        session, turn = base.removeprefix(f"{mode}-").rsplit("-", 1)
        return session, int(turn.split(".")[0])

    return parse


def header_ids(run: str) -> Parse:
    """Request ids of ``vllm serve`` for completions sent with ``X-Request-Id:
    <run>|<session>|<turn>``: ``cmpl-<X-Request-Id>-<prompt index>-<random suffix>``."""

    def parse(rid: str) -> tuple[str, int] | None:
        if not rid.startswith(f"cmpl-{run}|"):
            return None
        _run, session, turn = rid.removeprefix("cmpl-").rsplit("-", 2)[0].split("|")
        return session, int(turn)

    return parse
