//! One client session's state in the event loop: where it is in its turns, its history and
//! hash chain, and the timestamps its turn record needs.
use std::sync::Arc;

use super::mode::TurnView;
use super::spec::SessionSpec;
use super::tokens::HashChain;
use crate::error::{Error, Result};
use crate::sim::{BlockHash, SimRequest};

/// Where a session is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Phase {
    /// Not arrived yet, or arrived and not started by the mode.
    Idle,
    /// Its turn is ready, waiting for the mode to admit it.
    Ready,
    /// Its turn is in the replica.
    InFlight,
    /// Its tool is running.
    Tool,
    /// Done.
    Finished,
}

/// One session of the workload, replayed.
#[derive(Debug)]
pub(crate) struct Client {
    pub(crate) spec: SessionSpec,
    pub(crate) chain: HashChain,
    pub(crate) phase: Phase,
    /// Index of the current turn.
    pub(crate) turn: usize,
    /// Tokens of the current prompt (the history).
    pub(crate) history: u64,
    pub(crate) ready_at: f64,
    pub(crate) admitted_at: f64,
    pub(crate) reason: &'static str,
    /// How many times the episode was cancelled and restarted: tool events of an earlier
    /// attempt are ignored when they fire.
    pub(crate) attempt: u32,
}

/// Session `s` of `clients`, which must be in `phase` for a mode to `what` it: the one check
/// the driver and the fleet make before a mode's command acts on a session.
pub(crate) fn client_in<'a>(
    clients: &'a mut [Client],
    s: usize,
    phase: Phase,
    what: &str,
) -> Result<&'a mut Client> {
    match clients.get_mut(s) {
        Some(c) if c.phase == phase => Ok(c),
        Some(c) => Err(Error::InvalidInput(format!(
            "mode asked to {what} session #{s} while it is {:?}",
            c.phase
        ))),
        None => Err(Error::InvalidInput(format!(
            "mode asked to {what} session #{s}, which does not exist"
        ))),
    }
}

impl Client {
    /// The episode was cancelled: it starts again from its first turn, as a new attempt.
    pub(crate) fn restart_episode(&mut self) {
        self.turn = 0;
        self.history = 0;
        self.phase = Phase::Idle;
        self.attempt += 1;
    }

    pub(crate) fn new(spec: SessionSpec, chain: HashChain) -> Self {
        Self {
            spec,
            chain,
            phase: Phase::Idle,
            turn: 0,
            history: 0,
            ready_at: 0.0,
            admitted_at: 0.0,
            reason: "",
            attempt: 0,
        }
    }

    /// Appends the current turn's input (system + task on the first turn, the tool result on
    /// later ones) and hashes the prompt's new full blocks.
    pub(crate) fn prepare_turn(&mut self, now: f64) {
        let t = self.spec.turns[self.turn];
        if self.turn == 0 {
            self.history = u64::from(self.spec.system_tokens) + u64::from(self.spec.task_tokens);
        }
        self.history += u64::from(t.append);
        self.chain.extend_to(self.history);
        self.phase = Phase::Ready;
        self.ready_at = now;
    }

    pub(crate) fn max_tokens(&self) -> u32 {
        self.spec.turns[self.turn].output
    }

    /// The replica request for the current turn: prompt, outputs, and the hashes of every full
    /// block of prompt + outputs (the outputs are known in advance: exactly `max_tokens`).
    pub(crate) fn request(&mut self, id: u64, block_size: u32) -> SimRequest {
        let total = self.history + u64::from(self.max_tokens());
        self.chain.extend_to(total);
        let block_hashes: Arc<[BlockHash]> = self
            .chain
            .snapshot((total / u64::from(block_size)) as usize);
        SimRequest {
            id,
            prompt_tokens: self.history as u32,
            max_tokens: self.max_tokens(),
            block_hashes,
        }
    }

    /// The hashes of every full block of the session's history so far (its last request's
    /// prompt and answer), and how many of them its first prompt filled (the blocks a finish
    /// leaves in place: other sessions may share them).
    pub(crate) fn history_blocks(&self) -> (&[BlockHash], usize) {
        let block = u64::from(self.chain.block_size());
        let first = self.spec.turns.first().map_or(0, |t| u64::from(t.append));
        let first = u64::from(self.spec.system_tokens) + u64::from(self.spec.task_tokens) + first;
        (self.chain.hashes(), (first / block) as usize)
    }

    pub(crate) fn view(&self) -> TurnView<'_> {
        let block = self.chain.block_size() as u64;
        let prompt_blocks = ((self.history / block) as usize).min(self.chain.hashes().len());
        TurnView {
            session_id: &self.spec.session_id,
            turn: self.turn,
            prompt_tokens: self.history as u32,
            max_tokens: self.max_tokens(),
            prompt_hashes: &self.chain.hashes()[..prompt_blocks],
        }
    }
}
