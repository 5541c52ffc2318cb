//! The fleet's placement policies: ours ([`crate::gate::placement`]) and the routers people run,
//! modelled from their published code and docs (read, not copied), all behind one [`Placer`].
//!
//! - `hash`: vllm-router's `consistent_hash` — a ring of virtual nodes keyed by the session id;
//!   a session always maps to the same replica; a lost replica's sessions go to the next node.
//! - `sticky-least-loaded`: vllm-router's and prime-rl's sticky placement — a new session goes to
//!   the replica with the fewest requests in flight or waiting, and stays there for good.
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
//! - `gate`: ours.
//!
//! A policy that has nowhere to put a session (every replica down) fails the run.
use crate::gate::placement::{PlaceReason, Placed, Placement, PlacementStats, ReplicaView};
use crate::gate::placement::{PlacementConfig, SessionView};

/// The fleet's state as a policy reads it for one decision.
pub(crate) struct Snapshot<'a> {
    /// One view per replica.
    pub views: &'a [ReplicaView],
    /// Per replica: requests in flight or waiting (the routers' load).
    pub load: &'a [u32],
    /// Per replica: counted tokens of its live sessions (ThunderAgent's working set).
    pub tokens: &'a [u64],
    /// Per replica: KV capacity in tokens.
    pub capacity_tokens: &'a [u64],
}

/// One session's turn as a policy reads it.
pub(crate) struct Turn<'a> {
    pub session_id: &'a str,
    pub session: usize,
    pub prompt_tokens: u64,
    pub system_tokens: u64,
    pub view: SessionView,
}

/// A placement policy in the fleet.
pub(crate) trait Placer {
    /// A new session: where, or `None` to hold it for now (only `gate` holds).
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        shared_hit: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed>;

    /// A returning session's next turn (`home_hit`: its prompt blocks resident at home, asked
    /// lazily: hashing a long prompt costs).
    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        home: usize,
        home_hit: &mut dyn FnMut() -> u64,
    ) -> Option<Placed>;

    /// Decisions counted by reason.
    fn stats(&self) -> PlacementStats;
}

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
            Self::Hash => Box::new(HashRing::new(replicas)),
            Self::StickyLeastLoaded => Box::new(Sticky::default()),
            Self::CacheAware => Box::new(CacheAware::new(replicas, sessions)),
            Self::Thunder => Box::new(Thunder::default()),
            Self::Gate => Box::new(Placement::new(PlacementConfig::default())),
        }
    }
}

fn counted(stats: &mut PlacementStats, home: usize, to: usize, down: bool) -> Placed {
    let reason = match (to == home, down) {
        (true, _) => PlaceReason::Resident,
        (false, true) => PlaceReason::DownMove,
        (false, false) => PlaceReason::ColdMove,
    };
    match reason {
        PlaceReason::Resident => stats.resident += 1,
        PlaceReason::DownMove => stats.down_move += 1,
        _ => stats.cold_move += 1,
    }
    Placed {
        replica: to,
        reason,
    }
}

/// A new session placed on `replica`, counted.
fn placed_new(stats: &mut PlacementStats, replica: usize) -> Placed {
    stats.new += 1;
    Placed {
        replica,
        reason: PlaceReason::New,
    }
}

/// A returning session of a sticky policy: it stays home while home is up, else goes where
/// `pick` says (counted either way).
fn sticky_or(
    stats: &mut PlacementStats,
    snap: &Snapshot<'_>,
    home: usize,
    pick: impl FnOnce() -> Option<usize>,
) -> Option<Placed> {
    let down = !snap.views[home].up;
    let to = if down { pick()? } else { home };
    Some(counted(stats, home, to, down))
}

/// The up replica minimising `key`, lowest index on ties.
fn argmin<K: PartialOrd>(views: &[ReplicaView], key: impl Fn(usize) -> K) -> Option<usize> {
    let mut best: Option<(K, usize)> = None;
    for (r, v) in views.iter().enumerate() {
        if !v.up {
            continue;
        }
        let k = key(r);
        if best.as_ref().is_none_or(|(bk, _)| k < *bk) {
            best = Some((k, r));
        }
    }
    best.map(|(_, r)| r)
}

impl Placer for Placement {
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        shared_hit: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        Placement::place_new(self, snap.views, &turn.view, shared_hit)
    }

    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        home: usize,
        home_hit: &mut dyn FnMut() -> u64,
    ) -> Option<Placed> {
        let hit = if snap.views[home].up { home_hit() } else { 0 };
        Placement::place_returning(self, snap.views, &turn.view, home, hit)
    }

    fn stats(&self) -> PlacementStats {
        Placement::stats(self)
    }
}

/// SplitMix64's finaliser.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn hash_str(s: &str) -> u64 {
    s.bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| mix64(h ^ u64::from(b)))
}

/// Consistent hashing: `VNODES` points per replica on a ring.
struct HashRing {
    ring: Vec<(u64, usize)>,
    stats: PlacementStats,
}

/// Virtual nodes per replica (ketama's 160; enough that 16 replicas split the ring within a
/// few percent).
const VNODES: u64 = 160;

impl HashRing {
    fn new(replicas: usize) -> Self {
        let mut ring: Vec<(u64, usize)> = (0..replicas)
            .flat_map(|r| (0..VNODES).map(move |v| (mix64(((r as u64) << 32) | v), r)))
            .collect();
        ring.sort_unstable();
        Self {
            ring,
            stats: PlacementStats::default(),
        }
    }

    fn lookup(&self, views: &[ReplicaView], id: &str) -> Option<usize> {
        let h = hash_str(id);
        let start = self.ring.partition_point(|(p, _)| *p < h);
        (0..self.ring.len())
            .map(|i| self.ring[(start + i) % self.ring.len()].1)
            .find(|&r| views[r].up)
    }
}

impl Placer for HashRing {
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        _: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        let replica = self.lookup(snap.views, turn.session_id)?;
        Some(placed_new(&mut self.stats, replica))
    }

    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        home: usize,
        _: &mut dyn FnMut() -> u64,
    ) -> Option<Placed> {
        let to = self.lookup(snap.views, turn.session_id)?;
        Some(counted(&mut self.stats, home, to, !snap.views[home].up))
    }

    fn stats(&self) -> PlacementStats {
        self.stats
    }
}

/// Least loaded at the first turn, sticky after.
#[derive(Default)]
struct Sticky {
    stats: PlacementStats,
}

impl Placer for Sticky {
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        _: &Turn<'_>,
        _: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        // Ties (every replica idle at once) go to the fewest sessions, so a burst spreads.
        let replica = argmin(snap.views, |r| (snap.load[r], snap.views[r].sessions))?;
        Some(placed_new(&mut self.stats, replica))
    }

    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        _: &Turn<'_>,
        home: usize,
        _: &mut dyn FnMut() -> u64,
    ) -> Option<Placed> {
        sticky_or(&mut self.stats, snap, home, || {
            argmin(snap.views, |r| (snap.load[r], snap.views[r].sessions))
        })
    }

    fn stats(&self) -> PlacementStats {
        self.stats
    }
}

/// SGLang's cache-aware router (module docs).
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

/// ThunderAgent's token-capacity placement (module docs).
#[derive(Default)]
struct Thunder {
    stats: PlacementStats,
}

/// ThunderAgent's `buffer_per_program` (tokens counted per live program).
const THUNDER_BUFFER: u64 = 100;

impl Thunder {
    fn pick(snap: &Snapshot<'_>) -> Option<usize> {
        argmin(snap.views, |r| {
            let used = snap.tokens[r] + THUNDER_BUFFER * u64::from(snap.views[r].sessions);
            std::cmp::Reverse(snap.capacity_tokens[r] as i64 - used as i64)
        })
    }
}

impl Placer for Thunder {
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        _: &Turn<'_>,
        _: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        let replica = Self::pick(snap)?;
        Some(placed_new(&mut self.stats, replica))
    }

    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        _: &Turn<'_>,
        home: usize,
        _: &mut dyn FnMut() -> u64,
    ) -> Option<Placed> {
        sticky_or(&mut self.stats, snap, home, || Self::pick(snap))
    }

    fn stats(&self) -> PlacementStats {
        self.stats
    }
}
