//! The fleet's placement policies: ours ([`crate::gate::placement`]) and the routers people run,
//! modelled from their published code and docs (read, not copied), all behind one `Placer`.
//! `hash`, `sticky-least-loaded` and `gate` are the proxy's own code ([`crate::gate::routers`]);
//! the two here need facts only the twin has.
//!
//! - `cache-aware`: SGLang's (and vllm-router's) cache-aware router, per request. With
//!   `load` = requests the router has in flight on a replica, the fleet is imbalanced when
//!   `max − min > balance_abs_threshold` AND `max > balance_rel_threshold × min`; then the
//!   request goes to the least loaded replica. Otherwise it goes to the replica whose
//!   approximate radix tree matches the longest prefix of the prompt, if the match ratio is
//!   over `cache_threshold`; else to the replica with the smallest tree (here: the most free KV
//!   blocks). The defaults are SGLang router's `RouterConfig` defaults (sgl-project/sglang,
//!   sgl-router: `cache_threshold: 0.3, balance_abs_threshold: 64, balance_rel_threshold:
//!   1.5`; its first README listed `--cache-threshold` 0.5). The tree is
//!   approximate, as upstream's: it records what the router sent (the system prompt on every
//!   replica it reached, each session's last prompt on the replica that got it), not what the
//!   cache still holds.
//! - `thunder`: ThunderAgent's placement by token capacity — a new program goes to the replica
//!   with the most capacity left in counted tokens (`num_blocks × block_size` less the live
//!   programs' tokens, `buffer_per_program` = 100 each, as in `crate::baselines::pause`); it
//!   stays there (programs pause and resume in place).
//!
//! A policy that has nowhere to put a session (every replica down) fails the run.
use crate::gate::placement::{Placed, PlacementStats};
pub(crate) use crate::gate::routers::{Placer, Snapshot, Turn};
use crate::gate::routers::{Router, Sticky, argmin, counted, placed_new};

/// The policies by name, as `--placement` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementKind {
    /// Consistent hashing on the session id.
    Hash,
    /// Least loaded at the first turn, then sticky.
    StickyLeastLoaded,
    /// SGLang / vllm-router cache-aware.
    CacheAware,
    /// ThunderAgent's capacity placement.
    Thunder,
    /// Ours.
    Gate,
}

impl PlacementKind {
    /// Every name, in table order.
    pub const NAMES: [&'static str; 5] = [
        "hash",
        "sticky-least-loaded",
        "cache-aware",
        "thunder",
        "gate",
    ];

    /// The policy named `name`.
    pub fn from_name(name: &str) -> crate::Result<Self> {
        Ok(match name {
            "hash" => Self::Hash,
            "sticky-least-loaded" => Self::StickyLeastLoaded,
            "cache-aware" => Self::CacheAware,
            "thunder" => Self::Thunder,
            "gate" => Self::Gate,
            other => {
                return Err(crate::Error::InvalidInput(format!(
                    "unknown placement `{other}` (expected one of {})",
                    Self::NAMES.join(", ")
                )));
            }
        })
    }

    pub(crate) fn build(self, replicas: usize, sessions: usize) -> Box<dyn Placer> {
        match self {
            Self::Hash => Router::Hash.build(replicas),
            Self::StickyLeastLoaded => Router::StickyLeastLoaded.build(replicas),
            Self::CacheAware => Box::new(CacheAware::new(replicas, sessions)),
            Self::Thunder => Box::new(Sticky::new(thunder_pick)),
            Self::Gate => Router::Gate.build(replicas),
        }
    }
}

/// SGLang's cache-aware router (module docs).
#[derive(Debug)]
struct CacheAware {
    /// Per replica: whether the system prompt was ever sent there (in its tree).
    has_system: Vec<bool>,
    /// Per session: (replica, prompt tokens) of the last turn sent.
    last: Vec<Option<(usize, u64)>>,
    stats: PlacementStats,
}

/// SGLang router defaults (module docs).
const CACHE_THRESHOLD: f64 = 0.3;
const BALANCE_ABS_THRESHOLD: u32 = 64;
const BALANCE_REL_THRESHOLD: f64 = 1.5;

impl CacheAware {
    fn new(replicas: usize, sessions: usize) -> Self {
        Self {
            has_system: vec![false; replicas],
            last: vec![None; sessions],
            stats: PlacementStats::default(),
        }
    }

    fn route(&mut self, snap: &Snapshot<'_>, turn: &Turn<'_>) -> Option<usize> {
        let up = |r: &usize| snap.views[*r].up;
        let loads = (0..snap.views.len()).filter(up).map(|r| snap.load[r]);
        let (min, max) = loads.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let imbalanced = max.saturating_sub(min) > BALANCE_ABS_THRESHOLD
            && f64::from(max) > BALANCE_REL_THRESHOLD * f64::from(min);
        let to = if imbalanced {
            argmin(snap.views, |r| snap.load[r])?
        } else {
            let prompt = turn.prompt_tokens.max(1) as f64;
            let matched = |r: usize| -> u64 {
                let own = match self.last[turn.session] {
                    Some((lr, tokens)) if lr == r => tokens.min(turn.prompt_tokens),
                    _ => 0,
                };
                let system = if self.has_system[r] {
                    turn.system_tokens
                } else {
                    0
                };
                own.max(system)
            };
            // Longest match, lowest index on ties.
            let best = argmin(snap.views, |r| std::cmp::Reverse(matched(r)))?;
            if matched(best) as f64 / prompt > CACHE_THRESHOLD {
                best
            } else {
                argmin(snap.views, |r| std::cmp::Reverse(snap.views[r].free_blocks))?
            }
        };
        self.has_system[to] = true;
        self.last[turn.session] = Some((to, turn.prompt_tokens));
        Some(to)
    }
}

impl Placer for CacheAware {
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        _: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        let replica = self.route(snap, turn)?;
        Some(placed_new(&mut self.stats, replica))
    }

    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        home: usize,
        _: &mut dyn FnMut() -> u64,
    ) -> Option<Placed> {
        let to = self.route(snap, turn)?;
        Some(counted(&mut self.stats, home, to, !snap.views[home].up))
    }

    fn stats(&self) -> PlacementStats {
        self.stats
    }
}

/// ThunderAgent's `buffer_per_program` (tokens counted per live program).
const THUNDER_BUFFER: u64 = 100;

/// ThunderAgent's token-capacity placement (module docs): the replica with the most capacity
/// left in counted tokens; sticky after ([`Sticky`]).
fn thunder_pick(snap: &Snapshot<'_>) -> Option<usize> {
    argmin(snap.views, |r| {
        let used = snap.tokens[r] + THUNDER_BUFFER * u64::from(snap.views[r].sessions);
        std::cmp::Reverse(snap.capacity_tokens[r] as i64 - used as i64)
    })
}
