//! Session inference: which session a request that carries no session id continues, from the
//! block hashes vLLM already computed for it. Sans-IO: the engine gate's scheduler mode
//! (`SESSION_GATE_SCHEDULER=infer`) and the twin's `sched-infer` mode drive the same code.
//!
//! **The rule.** A turn of an agentic session sends the session's whole history again: the
//! previous prompt, the model's previous answer, then what is new (a tool result, a user
//! message). vLLM's block hashes are chained (each full block's hash covers every token before
//! it), so one hash names a whole prefix. When a request of a session finishes, the hashes of
//! its blocks *past its own prompt* (the blocks that hold the model's answer) are the session's
//! **own blocks**: no other session can hold them unless it produced the very same history. A
//! new request **continues** the idle session whose own block it contains at the deepest
//! position; if it contains no own block of any idle session it is a **new** session. Blocks
//! shared by many sessions (a system prompt, a GRPO group's task prompt) are never own blocks,
//! so they never match: eight sessions that start from one task prompt stay eight sessions.
//! Several idle sessions can hold the same own block only if their histories are identical up
//! to it (e.g. greedy decoding from one prompt); the request then continues one of them (the
//! lowest number: the choice cannot change what the cache holds) and is counted **ambiguous**.
//! A session continues at most once per finished request: a session with a request in flight
//! is not idle, so two requests never merge into one session.
//!
//! **What defeats it.** A client that re-renders earlier turns differently (a chat template that
//! drops earlier reasoning, a re-tokenization that splits the answer's text differently) changes
//! the hashes of the answer's blocks, and the request becomes a new session. So does an answer
//! shorter than what completes a block (no own block), and a server without prefix caching (no
//! hashes at all). Both show as `new` in the counts.
use std::collections::{HashMap, VecDeque};

/// A block hash as the inference keys it (vLLM's bytes hashes are folded to one `u64` by the
/// caller; the twin's hashes are already `u64`).
pub type ChainHash = u64;

/// Idle sessions remembered by default: the oldest is forgotten beyond this.
pub const DEFAULT_MAX_IDLE: usize = 65_536;

/// What [`SessionInference::arrive`] decided; each carries the session's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inferred {
    /// Continues the one idle session that holds the deepest own block the request contains.
    Continues(u64),
    /// Continues one of several idle sessions with the same history to that block.
    Ambiguous(u64),
    /// Contains no idle session's own block: a session of its own.
    New(u64),
}

impl Inferred {
    /// The session's number.
    pub fn session(self) -> u64 {
        match self {
            Inferred::Continues(s) | Inferred::Ambiguous(s) | Inferred::New(s) => s,
        }
    }

    /// `"continued"`, `"ambiguous"` or `"new"` (the counters' names).
    pub fn kind(self) -> &'static str {
        match self {
            Inferred::Continues(_) => "continued",
            Inferred::Ambiguous(_) => "ambiguous",
            Inferred::New(_) => "new",
        }
    }
}

/// Counts of what the inference decided, and what it holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct InferCounts {
    /// Requests that continued a session.
    pub continued: u64,
    /// Requests that continued one of several identical sessions.
    pub ambiguous: u64,
    /// Requests that started a session.
    pub new: u64,
    /// Finished requests that left no own block (an answer shorter than a block).
    pub no_own_block: u64,
    /// Idle sessions forgotten to stay under the bound.
    pub forgotten: u64,
}

/// The inference's state: idle sessions' own blocks and an index from hash to session.
#[derive(Debug)]
pub struct SessionInference {
    max_idle: usize,
    next_session: u64,
    /// Idle session → (its own blocks, the finish that made it idle).
    idle: HashMap<u64, (Vec<ChainHash>, u64)>,
    /// Own block → the idle sessions holding it (one, unless histories are identical).
    by_hash: HashMap<ChainHash, Vec<u64>>,
    /// Idle sessions in the order they went idle, with that finish's number; entries whose
    /// session continued since are skipped when met.
    order: VecDeque<(u64, u64)>,
    finishes: u64,
    counts: InferCounts,
}

impl Default for SessionInference {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_IDLE)
    }
}

impl SessionInference {
    /// An empty inference that remembers at most `max_idle` idle sessions (at least one).
    pub fn new(max_idle: usize) -> Self {
        Self {
            max_idle: max_idle.max(1),
            next_session: 0,
            idle: HashMap::new(),
            by_hash: HashMap::new(),
            order: VecDeque::new(),
            finishes: 0,
            counts: InferCounts::default(),
        }
    }

    /// A request arrives with the hashes of its prompt's full blocks, in order: the session it
    /// continues (which is no longer idle), or a new one.
    pub fn arrive(&mut self, prompt: &[ChainHash]) -> Inferred {
        // Deepest first: chained hashes make a deeper match imply every shallower one.
        let hit = prompt
            .iter()
            .rev()
            .find_map(|h| self.by_hash.get(h).filter(|owners| !owners.is_empty()));
        let inferred = match hit {
            Some(owners) if owners.len() == 1 => Inferred::Continues(owners[0]),
            Some(owners) => Inferred::Ambiguous(*owners.iter().min().expect("not empty")),
            None => {
                let s = self.next_session;
                self.next_session += 1;
                Inferred::New(s)
            }
        };
        match inferred {
            Inferred::Continues(s) | Inferred::Ambiguous(s) => self.unindex(s),
            Inferred::New(_) => {}
        }
        match inferred {
            Inferred::Continues(_) => self.counts.continued += 1,
            Inferred::Ambiguous(_) => self.counts.ambiguous += 1,
            Inferred::New(_) => self.counts.new += 1,
        }
        inferred
    }

    /// The request of `session` is done (finished, stopped or aborted): `chain` is the hashes
    /// of all its full blocks (prompt and answer), `prompt_blocks` how many of them the prompt
    /// alone filled. The blocks past those become the session's own blocks and the session is
    /// idle, ready to be continued.
    pub fn finish(&mut self, session: u64, chain: &[ChainHash], prompt_blocks: usize) {
        self.unindex(session);
        let own: Vec<ChainHash> = chain.get(prompt_blocks..).unwrap_or_default().to_vec();
        if own.is_empty() {
            self.counts.no_own_block += 1;
            return;
        }
        for h in &own {
            self.by_hash.entry(*h).or_default().push(session);
        }
        self.finishes += 1;
        self.idle.insert(session, (own, self.finishes));
        self.order.push_back((session, self.finishes));
        while self.idle.len() > self.max_idle {
            let Some((oldest, at)) = self.order.pop_front() else {
                break;
            };
            if self.idle.get(&oldest).is_some_and(|(_, f)| *f == at) {
                self.unindex(oldest);
                self.counts.forgotten += 1;
            }
        }
        // Stale entries (sessions that continued) are dropped once they outnumber the live.
        if self.order.len() > 2 * self.idle.len() + 64 {
            let idle = &self.idle;
            self.order
                .retain(|(s, at)| idle.get(s).is_some_and(|(_, f)| f == at));
        }
    }

    /// Drops `session`'s own blocks: it continued, or is forgotten.
    fn unindex(&mut self, session: u64) {
        let Some((own, _)) = self.idle.remove(&session) else {
            return;
        };
        for h in own {
            if let Some(owners) = self.by_hash.get_mut(&h) {
                owners.retain(|s| *s != session);
                if owners.is_empty() {
                    self.by_hash.remove(&h);
                }
            }
        }
    }

    /// What the inference decided so far.
    pub fn counts(&self) -> InferCounts {
        self.counts
    }

    /// Idle sessions remembered now.
    pub fn idle_sessions(&self) -> usize {
        self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chained hash over `blocks` (each block a token value), like vLLM's.
    fn chain(blocks: &[u64]) -> Vec<ChainHash> {
        let mut out = Vec::with_capacity(blocks.len());
        let mut parent = 0xcbf2_9ce4_8422_2325u64;
        for b in blocks {
            parent = (parent ^ b).wrapping_mul(0x100_0000_01b3).rotate_left(17);
            out.push(parent);
        }
        out
    }

    #[test]
    fn a_turn_that_carries_the_answer_continues_its_session() {
        let mut inf = SessionInference::default();
        let sys = [1, 2];
        let t1 = [&sys[..], &[10]].concat();
        let s = inf.arrive(&chain(&t1));
        assert!(matches!(s, Inferred::New(_)));
        // Prompt 3 blocks, answer 2 blocks.
        inf.finish(s.session(), &chain(&[&t1[..], &[11, 12]].concat()), 3);
        let t2 = [&t1[..], &[11, 12, 13]].concat();
        assert_eq!(inf.arrive(&chain(&t2)), Inferred::Continues(s.session()));
    }

    #[test]
    fn sessions_sharing_a_task_prompt_are_never_merged() {
        let mut inf = SessionInference::default();
        let task = [1, 2, 3];
        let group: Vec<u64> = (0..8)
            .map(|_| inf.arrive(&chain(&task)).session())
            .collect();
        let distinct: std::collections::HashSet<u64> = group.iter().copied().collect();
        assert_eq!(distinct.len(), 8, "eight first turns are eight sessions");
        for (i, s) in group.iter().enumerate() {
            let answer = [&task[..], &[100 + i as u64]].concat();
            inf.finish(*s, &chain(&answer), task.len());
        }
        // A ninth first turn of the same task prompt matches no one.
        assert!(matches!(inf.arrive(&chain(&task)), Inferred::New(_)));
        for (i, s) in group.iter().enumerate().rev() {
            let t2 = [&task[..], &[100 + i as u64, 500]].concat();
            assert_eq!(inf.arrive(&chain(&t2)), Inferred::Continues(*s));
        }
        assert_eq!(inf.counts().continued, 8);
    }

    #[test]
    fn identical_histories_are_ambiguous_and_continue_once_each() {
        let mut inf = SessionInference::default();
        let a = inf.arrive(&chain(&[1])).session();
        let b = inf.arrive(&chain(&[1])).session();
        inf.finish(a, &chain(&[1, 7]), 1);
        inf.finish(b, &chain(&[1, 7]), 1);
        let first = inf.arrive(&chain(&[1, 7, 8]));
        assert_eq!(first, Inferred::Ambiguous(a.min(b)));
        // The other one is left for the second.
        assert_eq!(
            inf.arrive(&chain(&[1, 7, 9])),
            Inferred::Continues(a.max(b))
        );
        // Nobody is idle now: a third is new.
        assert!(matches!(inf.arrive(&chain(&[1, 7, 9])), Inferred::New(_)));
    }

    #[test]
    fn a_busy_session_is_not_continued_and_the_deepest_match_wins() {
        let mut inf = SessionInference::default();
        let a = inf.arrive(&chain(&[1])).session();
        inf.finish(a, &chain(&[1, 2]), 1);
        let t2 = inf.arrive(&chain(&[1, 2, 3]));
        assert_eq!(t2, Inferred::Continues(a));
        // Its next request before the answer: not idle, so a new session.
        assert!(matches!(inf.arrive(&chain(&[1, 2, 3])), Inferred::New(_)));
        inf.finish(a, &chain(&[1, 2, 3, 4]), 3);
        let b = inf.arrive(&chain(&[9])).session();
        inf.finish(b, &chain(&[9, 5]), 1);
        assert_eq!(inf.arrive(&chain(&[1, 2, 3, 4, 6])), Inferred::Continues(a));
    }

    #[test]
    fn short_answers_and_missing_hashes_start_new_sessions() {
        let mut inf = SessionInference::default();
        let a = inf.arrive(&chain(&[1, 2])).session();
        inf.finish(a, &chain(&[1, 2]), 2);
        assert_eq!(inf.counts().no_own_block, 1);
        assert!(matches!(inf.arrive(&chain(&[1, 2, 3])), Inferred::New(_)));
        assert!(matches!(inf.arrive(&[]), Inferred::New(_)));
        // A prompt count past the chain (a client's bad number) leaves no own block either.
        inf.finish(a, &chain(&[1]), 5);
        assert_eq!(inf.counts().no_own_block, 2);
    }

    #[test]
    fn the_oldest_idle_session_is_forgotten_past_the_bound() {
        let mut inf = SessionInference::new(2);
        let ids: Vec<u64> = (0..3).map(|i| inf.arrive(&chain(&[i])).session()).collect();
        for (i, s) in ids.iter().enumerate() {
            inf.finish(*s, &chain(&[i as u64, 50]), 1);
        }
        assert_eq!(inf.idle_sessions(), 2);
        assert_eq!(inf.counts().forgotten, 1);
        assert!(matches!(inf.arrive(&chain(&[0, 50, 1])), Inferred::New(_)));
        assert_eq!(inf.arrive(&chain(&[2, 50, 1])), Inferred::Continues(ids[2]));
        // Churn through many continuations keeps the order queue bounded.
        let s = ids[2];
        for k in 0..1000u64 {
            let mut blocks = vec![2, 50];
            blocks.extend(0..=k);
            inf.finish(s, &chain(&blocks), blocks.len() - 1);
            blocks.push(9999);
            assert_eq!(inf.arrive(&chain(&blocks)), Inferred::Continues(s));
        }
        assert!(inf.order.len() <= 2 * inf.idle.len() + 65);
    }
}
