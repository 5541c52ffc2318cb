//! Virtual time and the client events waiting on it: a min-heap ordered by time, then by the
//! order the events were scheduled in (so equal times replay deterministically).
use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::mode::SessionIx;
pub(crate) use crate::gate::TimeKey as Time;

/// Something a client does at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Event {
    /// The session arrives.
    Arrive(SessionIx),
    /// The session's tool call returns.
    /// The session's tool finished; the number is the session's attempt (a cancelled episode's
    /// tool events are stale and ignored).
    ToolDone(SessionIx, u32),
}

/// Pending client events.
#[derive(Debug, Default)]
pub(crate) struct Events {
    heap: BinaryHeap<Reverse<(Time, u64, Event)>>,
    seq: u64,
}

impl Events {
    pub(crate) fn push(&mut self, at: f64, event: Event) {
        self.heap.push(Reverse((Time(at), self.seq, event)));
        self.seq += 1;
    }

    /// Time of the earliest event.
    pub(crate) fn next_time(&self) -> Option<f64> {
        self.heap.peek().map(|Reverse((t, _, _))| t.0)
    }

    /// The earliest event if it is due by `now`.
    pub(crate) fn pop_due(&mut self, now: f64) -> Option<Event> {
        match self.heap.peek() {
            Some(Reverse((t, _, _))) if t.0 <= now => self.heap.pop().map(|Reverse((_, _, e))| e),
            _ => None,
        }
    }
}
