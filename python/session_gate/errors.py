"""Exceptions the gate raises. They carry attributes, so callers never parse messages.

Invalid knobs are refused by Rust with a plain ``ValueError`` naming the knob and the value.
"""

from __future__ import annotations

__all__ = ["AdmissionPreempted", "SessionGateError"]


class SessionGateError(Exception):
    """Base class of the gate's own exceptions."""


class AdmissionPreempted(SessionGateError):
    """A newer admission attempt for the same session took over while this one waited.

    Only the newest attempt of a session competes for admission (attempt preemption): a
    harness that retried a turn should let the older attempt go.
    """

    def __init__(self, session_id: str, num_preempted: int = 0) -> None:
        super().__init__(
            f"admission attempt for session {session_id!r} was preempted by a newer attempt"
        )
        #: The session whose older attempt lost.
        self.session_id = session_id
        #: How many attempts of this session have been preempted so far (this one included).
        self.num_preempted = num_preempted

    def __reduce__(self):  # keep attributes across pickling (multiprocessing, logging)
        return (type(self), (self.session_id, self.num_preempted))
