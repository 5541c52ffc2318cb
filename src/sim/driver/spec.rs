//! What the clients replay: sessions, their turns and arrival times, as Python's
//! `session_gate.workloads` defines them (the one definition; Rust never generates them).
use crate::error::{Error, Result};

/// One turn as a session sends it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnSpec {
    /// Tool-result tokens appended to the history before this turn (0 on the first turn).
    pub append: u32,
    /// The turn's `max_tokens`; the twin generates exactly this many (the bench uses ignore_eos).
    pub output: u32,
    /// Seconds the tool runs after this turn's answer, before the next turn is sent.
    pub tool_latency: f64,
}

/// One session: a shared system prompt prefix, a unique task, then its turns.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSpec {
    /// The session's id (the gate keys sessions by it).
    pub session_id: String,
    /// Leading tokens of the one system prompt every session shares.
    pub system_tokens: u32,
    /// The session's own task tokens after the system prompt.
    pub task_tokens: u32,
    /// Virtual seconds after the start at which the session begins.
    pub arrival: f64,
    /// At least one turn; the first has `append == 0`.
    pub turns: Vec<TurnSpec>,
}

impl SessionSpec {
    /// Tokens of the history after every turn (the last turn's output included).
    pub fn final_tokens(&self) -> u64 {
        let turns: u64 = self
            .turns
            .iter()
            .map(|t| u64::from(t.append) + u64::from(t.output))
            .sum();
        u64::from(self.system_tokens) + u64::from(self.task_tokens) + turns
    }

    /// Refuses specs the clients could not replay, naming the session, turn and field.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(Error::InvalidInput(format!(
                "session `{}`: {what}",
                self.session_id
            )))
        };
        if self.turns.is_empty() {
            return bad("has no turns".into());
        }
        if !(self.arrival.is_finite() && self.arrival >= 0.0) {
            return bad(format!(
                "arrival {} is not a finite number of seconds >= 0",
                self.arrival
            ));
        }
        if u64::from(self.system_tokens) + u64::from(self.task_tokens) == 0 {
            return bad("system_tokens + task_tokens is 0: the first prompt would be empty".into());
        }
        for (i, t) in self.turns.iter().enumerate() {
            if i == 0 && t.append != 0 {
                return bad(format!("turn 0: append is {}, expected 0", t.append));
            }
            if t.output == 0 {
                return bad(format!("turn {i}: output is 0 (max_tokens must be >= 1)"));
            }
            if !(t.tool_latency.is_finite() && t.tool_latency >= 0.0) {
                return bad(format!(
                    "turn {i}: tool_latency {} is not a finite number of seconds >= 0",
                    t.tool_latency
                ));
            }
        }
        if self.final_tokens() > u64::from(u32::MAX) {
            return bad("history longer than 2^32 tokens".into());
        }
        Ok(())
    }
}
