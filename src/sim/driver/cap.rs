//! Modes `none` and `capN`: no gate; `capN` lets at most N sessions live at once, holding a
//! slot for a session's whole life and handing it to the longest-waiting arrival (the bench's
//! `asyncio.Semaphore`, FIFO).
use std::collections::VecDeque;

use super::mode::{Ctx, Mode, SessionIx};
use crate::error::Result;

/// `none` (`cap = None`) or a session-level cap.
#[derive(Debug)]
pub(crate) struct CapMode {
    cap: Option<usize>,
    live: usize,
    queue: VecDeque<SessionIx>,
}

impl CapMode {
    pub(crate) fn new(cap: Option<usize>) -> Self {
        Self {
            cap,
            live: 0,
            queue: VecDeque::new(),
        }
    }
}

impl Mode for CapMode {
    fn session_arrived(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        if self.cap.is_none_or(|cap| self.live < cap) {
            self.live += 1;
            ctx.start(s);
        } else {
            self.queue.push_back(s);
        }
        Ok(())
    }

    fn turn_ready(&mut self, ctx: &mut Ctx<'_>, s: SessionIx) -> Result<()> {
        ctx.admit(s, "none");
        Ok(())
    }

    fn session_finished(&mut self, ctx: &mut Ctx<'_>, _s: SessionIx) -> Result<()> {
        self.live -= 1;
        if let Some(next) = self.queue.pop_front() {
            self.live += 1;
            ctx.start(next);
        }
        Ok(())
    }
}
