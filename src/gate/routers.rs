//! Placement policies behind one `Placer` interface, shared by the proxy
//! (`crate::proxy::replicas`) and the twin's fleet (`crate::sim::fleet`): the same code runs
//! in both, so what the twin says of a router is what the proxy does with it.
//!
//! - `hash`: vllm-router's `consistent_hash`, a ring of virtual nodes keyed by the session id;
//!   a session always maps to the same replica; a lost replica's sessions go to the next node.
//!   Every proxy given the same replica list computes the same ring.
//! - `sticky-least-loaded`: vllm-router's and prime-rl's sticky placement, a new session goes
//!   to the replica with the fewest requests in flight or waiting, and stays there for good.
//! - `gate`: ours ([`crate::gate::placement`]).
//!
//! The routers that need facts only the twin has (`cache-aware`'s approximate radix tree,
//! `thunder`'s counted tokens) stay in `crate::sim::fleet::policy`, behind the same trait.
use super::placement::{PlaceReason, Placed, Placement, PlacementStats, ReplicaView, SessionView};

/// The fleet's state as a policy reads it for one decision.
pub(crate) struct Snapshot<'a> {
    /// One view per replica.
    pub views: &'a [ReplicaView],
    /// Per replica: requests in flight or waiting (the routers' load). In the proxy, those of
    /// this proxy only.
    pub load: &'a [u32],
    /// Per replica: counted tokens of its live sessions (ThunderAgent's working set; the
    /// twin's only).
    pub tokens: &'a [u64],
    /// Per replica: KV capacity in tokens (the twin's only).
    pub capacity_tokens: &'a [u64],
}

impl<'a> Snapshot<'a> {
    /// The facts the proxy has: `views` and `load`, the twin-only ones left empty.
    pub(crate) fn of(views: &'a [ReplicaView], load: &'a [u32]) -> Self {
        Self {
            views,
            load,
            tokens: &[],
            capacity_tokens: &[],
        }
    }
}

/// One session's turn as a policy reads it.
pub(crate) struct Turn<'a> {
    pub session_id: &'a str,
    /// The session's index (the twin's cache-aware router keeps a slot per session).
    pub session: usize,
    pub prompt_tokens: u64,
    pub system_tokens: u64,
    pub view: SessionView,
}

/// A placement policy.
pub(crate) trait Placer: Send + std::fmt::Debug {
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

    /// Whether a turn waiting for admission at `home` could move, before anything is asked
    /// of home (only `gate` moves waiting turns: [`Placement::may_move_waiting`]).
    fn may_move_waiting(
        &self,
        _snap: &Snapshot<'_>,
        _turn: &Turn<'_>,
        _home: usize,
        _first: bool,
        _shared_hit: &mut dyn FnMut(usize) -> u64,
    ) -> bool {
        false
    }

    /// Where a turn waiting for admission at `home` goes instead, or `None` to leave it
    /// ([`Placement::place_waiting`]; only `gate` moves waiting turns).
    fn place_waiting(
        &mut self,
        _snap: &Snapshot<'_>,
        _turn: &Turn<'_>,
        _home: usize,
        _home_hit: u64,
        _first: bool,
        _shared_hit: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        None
    }

    /// Decisions counted by reason.
    fn stats(&self) -> PlacementStats;

    /// The replica list grew to `replicas` (the proxy's list only grows; the twin's is fixed).
    fn grow(&mut self, _replicas: usize) {}
}

/// The policies both the proxy and the twin run, as `--placement` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Router {
    /// Consistent hashing on the session id.
    Hash,
    /// Least loaded at the first turn, then sticky.
    StickyLeastLoaded,
    /// Ours.
    #[default]
    Gate,
}

impl Router {
    /// Every name, in table order.
    pub const NAMES: [&'static str; 3] = ["hash", "sticky-least-loaded", "gate"];

    /// The policy named `name`, if it is one of [`Self::NAMES`].
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hash" => Some(Self::Hash),
            "sticky-least-loaded" => Some(Self::StickyLeastLoaded),
            "gate" => Some(Self::Gate),
            _ => None,
        }
    }

    /// Whether it moves a turn that waits for admission (only `gate`:
    /// [`Placement::place_waiting`]; the others decide once, at arrival).
    pub fn moves_waiting_turns(self) -> bool {
        self == Self::Gate
    }

    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hash => "hash",
            Self::StickyLeastLoaded => "sticky-least-loaded",
            Self::Gate => "gate",
        }
    }

    /// The policy, over `replicas` replicas.
    pub(crate) fn build(self, replicas: usize) -> Box<dyn Placer> {
        match self {
            Self::Hash => Box::new(HashRing::new(replicas)),
            Self::StickyLeastLoaded => Box::new(Sticky::default()),
            Self::Gate => Box::new(Placement::default()),
        }
    }
}

/// A returning session's decision of a router that does not grade residency: home if it
/// stays, else a move (down or cold), counted.
pub(crate) fn counted(stats: &mut PlacementStats, home: usize, to: usize, down: bool) -> Placed {
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
pub(crate) fn placed_new(stats: &mut PlacementStats, replica: usize) -> Placed {
    stats.new += 1;
    Placed {
        replica,
        reason: PlaceReason::New,
    }
}

/// A returning session of a sticky policy: it stays home while home is up, else goes where
/// `pick` says (counted either way).
pub(crate) fn sticky_or(
    stats: &mut PlacementStats,
    snap: &Snapshot<'_>,
    home: usize,
    pick: impl FnOnce() -> Option<usize>,
) -> Option<Placed> {
    let down = !snap.views.get(home).is_some_and(|v| v.up);
    let to = if down { pick()? } else { home };
    Some(counted(stats, home, to, down))
}

/// The up replica minimising `key`, lowest index on ties.
pub(crate) fn argmin<K: PartialOrd>(
    views: &[ReplicaView],
    key: impl Fn(usize) -> K,
) -> Option<usize> {
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
        let hit = if snap.views.get(home).is_some_and(|v| v.up) {
            home_hit()
        } else {
            0
        };
        Placement::place_returning(self, snap.views, &turn.view, home, hit)
    }

    fn may_move_waiting(
        &self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        home: usize,
        first: bool,
        shared_hit: &mut dyn FnMut(usize) -> u64,
    ) -> bool {
        Placement::may_move_waiting(self, snap.views, &turn.view, home, first, shared_hit)
    }

    fn place_waiting(
        &mut self,
        snap: &Snapshot<'_>,
        turn: &Turn<'_>,
        home: usize,
        home_hit: u64,
        first: bool,
        shared_hit: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        Placement::place_waiting(
            self, snap.views, &turn.view, home, home_hit, first, shared_hit,
        )
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
#[derive(Debug)]
pub(crate) struct HashRing {
    ring: Vec<(u64, usize)>,
    replicas: usize,
    stats: PlacementStats,
}

/// Virtual nodes per replica (ketama's 160; enough that 16 replicas split the ring within a
/// few percent).
const VNODES: u64 = 160;

impl HashRing {
    pub(crate) fn new(replicas: usize) -> Self {
        let mut ring = Self {
            ring: Vec::new(),
            replicas: 0,
            stats: PlacementStats::default(),
        };
        ring.grow(replicas);
        ring
    }

    fn lookup(&self, views: &[ReplicaView], id: &str) -> Option<usize> {
        let h = hash_str(id);
        let start = self.ring.partition_point(|(p, _)| *p < h);
        (0..self.ring.len())
            .map(|i| self.ring[(start + i) % self.ring.len()].1)
            .find(|&r| views.get(r).is_some_and(|v| v.up))
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
        let down = !snap.views.get(home).is_some_and(|v| v.up);
        Some(counted(&mut self.stats, home, to, down))
    }

    fn stats(&self) -> PlacementStats {
        self.stats
    }

    /// Adds the new replicas' points: a replica's points depend on its index only, so the ring
    /// over `n` replicas is the same whether built at once or grown (consistent hashing: only
    /// sessions whose arc the new points take move).
    fn grow(&mut self, replicas: usize) {
        if replicas <= self.replicas {
            return;
        }
        let added = (self.replicas..replicas)
            .flat_map(|r| (0..VNODES).map(move |v| (mix64(((r as u64) << 32) | v), r)));
        self.ring.extend(added);
        self.ring.sort_unstable();
        self.replicas = replicas;
    }
}

/// A sticky router: a new session goes where `pick` says, and stays there while its home is up
/// (where `pick` says again when it is down). With [`Sticky::least_loaded`] it is
/// `sticky-least-loaded`; the twin's `thunder` picks by token capacity.
#[derive(Debug)]
pub(crate) struct Sticky {
    pick: fn(&Snapshot<'_>) -> Option<usize>,
    stats: PlacementStats,
}

impl Default for Sticky {
    /// `sticky-least-loaded`.
    fn default() -> Self {
        Self::new(Self::least_loaded)
    }
}

impl Sticky {
    /// Sticky placement with `pick` choosing the replica.
    pub(crate) fn new(pick: fn(&Snapshot<'_>) -> Option<usize>) -> Self {
        Self {
            pick,
            stats: PlacementStats::default(),
        }
    }

    /// Fewest requests in flight or waiting; ties (every replica idle at once) go to the
    /// fewest sessions, so a burst spreads.
    fn least_loaded(snap: &Snapshot<'_>) -> Option<usize> {
        argmin(snap.views, |r| {
            (
                snap.load.get(r).copied().unwrap_or(0),
                snap.views[r].sessions,
            )
        })
    }
}

impl Placer for Sticky {
    fn place_new(
        &mut self,
        snap: &Snapshot<'_>,
        _: &Turn<'_>,
        _: &mut dyn FnMut(usize) -> u64,
    ) -> Option<Placed> {
        let replica = (self.pick)(snap)?;
        Some(placed_new(&mut self.stats, replica))
    }

    fn place_returning(
        &mut self,
        snap: &Snapshot<'_>,
        _: &Turn<'_>,
        home: usize,
        _: &mut dyn FnMut() -> u64,
    ) -> Option<Placed> {
        sticky_or(&mut self.stats, snap, home, || (self.pick)(snap))
    }

    fn stats(&self) -> PlacementStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(up: bool, sessions: u32) -> ReplicaView {
        ReplicaView {
            up,
            speed: 1.0,
            num_blocks: 100,
            free_blocks: 100,
            sessions,
            queued: 0,
            new_waiting: 0,
        }
    }

    fn turn(id: &str) -> Turn<'_> {
        Turn {
            session_id: id,
            session: 0,
            prompt_tokens: 320,
            system_tokens: 0,
            view: SessionView::from_tokens(320, 32, 0, 16),
        }
    }

    #[test]
    fn names_round_trip_and_unknown_is_none() {
        for name in Router::NAMES {
            assert_eq!(Router::from_name(name).unwrap().as_str(), name);
        }
        assert_eq!(Router::from_name("cache-aware"), None);
        assert_eq!(Router::default(), Router::Gate);
        assert!(Router::Gate.moves_waiting_turns());
        assert!(
            !Router::Hash.moves_waiting_turns() && !Router::StickyLeastLoaded.moves_waiting_turns()
        );
    }

    #[test]
    fn a_grown_ring_is_the_ring_built_at_once() {
        let mut grown = HashRing::new(2);
        grown.grow(4);
        assert_eq!(grown.ring, HashRing::new(4).ring);
        grown.grow(3);
        assert_eq!(grown.replicas, 4, "a ring never shrinks");
    }

    #[test]
    fn hash_maps_a_session_to_one_replica_and_skips_a_down_one() {
        let mut ring = HashRing::new(4);
        let views = [view(true, 0); 4];
        let load = [0; 4];
        let s = Snapshot::of(&views, &load);
        let mut spread = [0; 4];
        for k in 0..400 {
            let id = format!("s{k}");
            let first = ring.place_new(&s, &turn(&id), &mut |_| 0).unwrap();
            let again = ring
                .place_returning(&s, &turn(&id), first.replica, &mut || 0)
                .unwrap();
            assert_eq!(
                (again.replica, again.reason),
                (first.replica, PlaceReason::Resident)
            );
            spread[first.replica] += 1;
        }
        assert!(spread.iter().all(|&n| n > 50), "{spread:?}");
        let home = ring.place_new(&s, &turn("x"), &mut |_| 0).unwrap().replica;
        let mut down = views;
        down[home].up = false;
        let moved = ring
            .place_returning(&Snapshot::of(&down, &load), &turn("x"), home, &mut || 0)
            .unwrap();
        assert_ne!(moved.replica, home);
        assert_eq!(moved.reason, PlaceReason::DownMove);
        assert_eq!(ring.stats().down_move, 1);
    }

    #[test]
    fn sticky_goes_to_the_least_loaded_then_stays() {
        let mut sticky = Sticky::default();
        let views = [view(true, 0), view(true, 0), view(true, 0)];
        let load = [3, 1, 2];
        let s = Snapshot::of(&views, &load);
        let first = sticky.place_new(&s, &turn("a"), &mut |_| 0).unwrap();
        assert_eq!(first.replica, 1);
        // Busier now, still home.
        let busier = [3, 9, 2];
        let again = sticky
            .place_returning(&Snapshot::of(&views, &busier), &turn("a"), 1, &mut || 0)
            .unwrap();
        assert_eq!((again.replica, again.reason), (1, PlaceReason::Resident));
        // Equal load: the fewest sessions.
        let views = [view(true, 2), view(true, 1), view(false, 0)];
        let tie = sticky
            .place_new(&Snapshot::of(&views, &[0, 0, 0]), &turn("b"), &mut |_| 0)
            .unwrap();
        assert_eq!(tie.replica, 1);
        let stats = sticky.stats();
        assert_eq!((stats.new, stats.resident), (2, 1));
    }
}
