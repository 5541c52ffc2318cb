//! Placement: which replica a session's turn goes to, as a sans-IO policy beside the gate core.
//! The twin's fleet (`crate::sim::fleet`) drives it now; the proxy can drive the same code from
//! its replicas' probes and health checks.
//!
//! Admission (when) and placement (where) are one decision, so placement asks the question the
//! gate asks: where would this turn be admitted soonest?
//! - A **new** session goes to a usable replica with fewer than
//!   [`PlacementConfig::new_backlog`] new sessions already waiting there for their first
//!   admission: first one where it would be admitted now (no turn queued there, the gate's or
//!   the engine's, and room for its prompt in the free blocks, the blocks of its shared prefix
//!   already resident there not counted against it), then the fewest new sessions waiting, the
//!   fewest sessions per unit of speed, the most prefix resident. When every usable replica has
//!   its backlog, [`Placement::place_new`] answers `None`: the caller holds the session and asks
//!   again when something changed (late binding: a session bound early to a busy replica waits
//!   there while another replica idles; each replica's gate still decides when to admit).
//! - A turn **waiting** for admission with nothing of its own resident where it waits (a new
//!   session's first turn, or a cold returning one) is not bound for good: whenever its
//!   replica would not admit it now and another usable replica would, it moves there
//!   ([`Placement::place_waiting`], asked again while it waits). Why: a decision taken when
//!   the turn became ready goes stale; near the end of a stream a turn revoked or queued on
//!   a full replica would otherwise wait minutes while other replicas run dry, and the fleet
//!   ends when its last session does.
//! - A **returning** session whose own prefix is still resident at home stays.
//! - A **cold** returning session (its prefix evicted at home) re-prefills wherever it goes, so
//!   it moves when another replica would admit it now and home would not.
//! - A replica that is down (lost, unhealthy) or slow (its measured speed below
//!   [`PlacementConfig::slow_below`] × the fastest usable replica's) takes no new sessions, and
//!   its sessions move at their next turn. A returning session always gets a replica (the best
//!   by [`eta`]) as long as one is up.
//!
//! Every decision is counted by reason in [`PlacementStats`] (what `/metrics` exports).

/// What placement knows about one replica, read by the caller before each decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaView {
    /// Reachable and healthy; false for a lost or unhealthy replica.
    pub up: bool,
    /// Measured throughput relative to nominal (1.0; 0.5 is half speed).
    pub speed: f64,
    /// KV blocks of the replica (vLLM's `num_gpu_blocks` less the null block).
    pub num_blocks: u64,
    /// Free blocks, evictable cached blocks included (vLLM's free queue).
    pub free_blocks: u64,
    /// Live sessions placed on the replica.
    pub sessions: u32,
    /// Turns waiting for admission there: held by its gate or waiting in its engine queue.
    pub queued: u32,
    /// New sessions placed there whose first turn is not admitted yet.
    pub new_waiting: u32,
}

/// The session being placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionView {
    /// Full blocks of the turn's prompt.
    pub prompt_blocks: u64,
    /// Blocks the turn will add (its outputs), rounded up.
    pub output_blocks: u64,
    /// Leading prompt blocks shared with other sessions (the system prompt).
    pub shared_blocks: u64,
}

impl SessionView {
    /// A turn of `prompt_tokens` (its first `shared_tokens` shared with other sessions) that
    /// adds `output_tokens`, on replicas of `block_size` tokens a block: full prompt blocks,
    /// output blocks rounded up.
    pub fn from_tokens(
        prompt_tokens: u64,
        output_tokens: u64,
        shared_tokens: u64,
        block_size: u64,
    ) -> Self {
        Self {
            prompt_blocks: prompt_tokens / block_size,
            output_blocks: output_tokens.div_ceil(block_size),
            shared_blocks: shared_tokens / block_size,
        }
    }
}

/// Why a session went where it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlaceReason {
    /// A new session, to where it would be admitted now.
    New,
    /// A new session still waiting for its first admission, moved to a replica that would
    /// admit it now.
    NewMove,
    /// A returning session whose prefix is resident at home.
    Resident,
    /// A cold returning session that stays (home would admit it as soon as anywhere).
    ColdStay,
    /// A cold returning session moved to where it would be admitted sooner.
    ColdMove,
    /// Its home is slow: moved.
    SlowMove,
    /// Its home is down (lost, unhealthy): moved.
    DownMove,
    /// A session this proxy had not seen, found resident on one replica (placed there by
    /// another proxy, or by this one before a restart): it stays there. Decided by the
    /// proxy before the policy (`crate::proxy::placing::find_home`), never by [`Placement`].
    Found,
}

impl PlaceReason {
    /// The label `/metrics` and the twin's tables use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::NewMove => "new_move",
            Self::Resident => "resident",
            Self::ColdStay => "cold_stay",
            Self::ColdMove => "cold_move",
            Self::SlowMove => "slow_move",
            Self::DownMove => "down_move",
            Self::Found => "found",
        }
    }

    /// Whether the session left its home.
    pub fn is_move(self) -> bool {
        matches!(
            self,
            Self::NewMove | Self::ColdMove | Self::SlowMove | Self::DownMove
        )
    }
}

/// Placements and moves by reason, plus new sessions held for lack of room.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlacementStats {
    /// New sessions placed.
    pub new: u64,
    /// New sessions held (no replica would admit them now); each ask counts.
    pub held: u64,
    /// New sessions moved before their first admission (not counted in [`Self::moves`]: they
    /// had no cache to lose).
    pub new_move: u64,
    /// Returning sessions that stayed, resident.
    pub resident: u64,
    /// Cold returning sessions that stayed.
    pub cold_stay: u64,
    /// Cold returning sessions moved.
    pub cold_move: u64,
    /// Sessions moved off a slow replica.
    pub slow_move: u64,
    /// Sessions moved off a down replica.
    pub down_move: u64,
    /// Sessions not seen before, found resident on one replica (see [`PlaceReason::Found`]).
    pub found: u64,
}

impl PlacementStats {
    fn count(&mut self, reason: PlaceReason) {
        let slot = match reason {
            PlaceReason::New => &mut self.new,
            PlaceReason::NewMove => &mut self.new_move,
            PlaceReason::Resident => &mut self.resident,
            PlaceReason::ColdStay => &mut self.cold_stay,
            PlaceReason::ColdMove => &mut self.cold_move,
            PlaceReason::SlowMove => &mut self.slow_move,
            PlaceReason::DownMove => &mut self.down_move,
            PlaceReason::Found => &mut self.found,
        };
        *slot += 1;
    }

    /// Every move of a session that had run a turn, whatever its reason.
    pub fn moves(&self) -> u64 {
        self.cold_move + self.slow_move + self.down_move
    }

    /// `(label, count)` pairs, in a fixed order.
    pub fn by_reason(&self) -> [(&'static str, u64); 9] {
        [
            ("new", self.new),
            ("held", self.held),
            ("new_move", self.new_move),
            ("resident", self.resident),
            ("cold_stay", self.cold_stay),
            ("cold_move", self.cold_move),
            ("slow_move", self.slow_move),
            ("down_move", self.down_move),
            ("found", self.found),
        ]
    }
}

/// Knobs of placement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlacementConfig {
    /// A replica slower than this fraction of the fastest usable one is slow (0.75: a replica
    /// at half speed is slow; one within measurement noise of the others is not).
    pub slow_below: f64,
    /// A returning session is resident at home when at least this fraction of its own (not
    /// shared) prompt blocks is still cached there (0.5).
    pub resident_fraction: f64,
    /// New sessions a replica may have waiting for their first admission before new sessions
    /// are held at the fleet (2): enough that its gate always has one to admit when room
    /// frees, few enough that a replica that frees room later still gets the rest.
    pub new_backlog: u32,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        Self {
            slow_below: 0.75,
            resident_fraction: 0.5,
            new_backlog: 2,
        }
    }
}

/// Rounding room when comparing sessions per speed with the share (exact for equal speeds).
const SHARE_SLACK: f64 = 1e-9;

/// A decision: the replica, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// Index of the replica in the views.
    pub replica: usize,
    /// Why.
    pub reason: PlaceReason,
}

/// The placement policy and its counters.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    config: PlacementConfig,
    stats: PlacementStats,
}

/// The fastest up replica's speed (0 when none is up).
fn fastest(views: &[ReplicaView]) -> f64 {
    views
        .iter()
        .filter(|v| v.up)
        .map(|v| v.speed)
        .fold(0.0, f64::max)
}

/// `sessions` per unit of `view`'s speed.
fn per_speed(sessions: u32, view: &ReplicaView) -> f64 {
    f64::from(sessions) / view.speed.max(1e-9)
}

/// Blocks the turn needs that `view`'s free list must supply, `hit_blocks` being resident.
fn need(session: &SessionView, hit_blocks: u64) -> u64 {
    session.prompt_blocks.saturating_sub(hit_blocks) + session.output_blocks
}

/// A replica's estimated admission delay for the turn, in turns-ahead per unit of speed: 0 when
/// it would admit the turn now (nothing queued, room for it), else the queue ahead plus the
/// fraction of the turn's blocks it lacks, divided by its speed.
pub fn eta(view: &ReplicaView, session: &SessionView, hit_blocks: u64) -> f64 {
    let need = need(session, hit_blocks);
    let lack = need.saturating_sub(view.free_blocks) as f64 / need.max(1) as f64;
    if view.queued == 0 && lack == 0.0 {
        return 0.0;
    }
    (f64::from(view.queued) + lack) / view.speed.max(1e-9)
}

impl Placement {
    /// A policy with `config`.
    pub fn new(config: PlacementConfig) -> Self {
        Self {
            config,
            stats: PlacementStats::default(),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> PlacementStats {
        self.stats
    }

    /// The fleet's share of live sessions per unit of speed: the mean of `sessions / speed`
    /// over the usable replicas (infinite when none is usable). A replica over it takes no new
    /// session: a session's remaining turns are unknown, so a replica's remaining work is best
    /// told by its live sessions, and a stream ends when the replica with the most work does.
    pub fn share(&self, views: &[ReplicaView]) -> f64 {
        let fastest = fastest(views);
        let (mut sum, mut n) = (0.0, 0u32);
        for v in views.iter().filter(|v| self.usable_at(v, fastest)) {
            sum += per_speed(v.sessions, v);
            n += 1;
        }
        if n == 0 {
            f64::INFINITY
        } else {
            sum / f64::from(n)
        }
    }

    /// Whether replica `r` may take sessions: up, and not slow against the fastest usable one.
    pub fn usable(&self, views: &[ReplicaView], r: usize) -> bool {
        self.usable_at(&views[r], fastest(views))
    }

    /// Whether `view` is usable, `fastest` being the fastest up replica's speed.
    fn usable_at(&self, view: &ReplicaView, fastest: f64) -> bool {
        view.up && view.speed >= self.config.slow_below * fastest
    }

    /// Where a new session goes, or `None` to hold it (no usable replica would admit it now).
    /// `shared_hit(r)` is how many of its shared blocks are resident on replica `r` (asked only
    /// of candidates).
    pub fn place_new(
        &mut self,
        views: &[ReplicaView],
        session: &SessionView,
        mut shared_hit: impl FnMut(usize) -> u64,
    ) -> Option<Placed> {
        // (waits, new sessions waiting, sessions per speed, shared hit) of the best so far.
        let mut best: Option<(bool, u32, f64, u64, usize)> = None;
        let (fastest, share) = (fastest(views), self.share(views));
        for (r, v) in views.iter().enumerate() {
            if !self.usable_at(v, fastest)
                || v.new_waiting >= self.config.new_backlog
                || per_speed(v.sessions, v) > share + SHARE_SLACK
            {
                continue;
            }
            let hit = shared_hit(r).min(session.shared_blocks);
            let waits = eta(v, session, hit) > 0.0;
            let load = per_speed(v.sessions + 1, v);
            let better = match best {
                None => true,
                Some((w, n, l, h, _)) => (waits, v.new_waiting, load, std::cmp::Reverse(hit))
                    .partial_cmp(&(w, n, l, std::cmp::Reverse(h)))
                    .is_some_and(|o| o.is_lt()),
            };
            if better {
                best = Some((waits, v.new_waiting, load, hit, r));
            }
        }
        match best {
            Some((_, _, _, _, replica)) => {
                self.stats.count(PlaceReason::New);
                Some(Placed {
                    replica,
                    reason: PlaceReason::New,
                })
            }
            None => {
                self.stats.held += 1;
                None
            }
        }
    }

    /// Where a turn that waits at `home` for admission goes instead, or `None` to leave it
    /// there; asked again while it waits (whenever something finished), since a replica that
    /// would admit it may appear long after it was placed. `views` count it at home (in
    /// `queued`, and in `new_waiting` for a `first` turn), as the caller's do while it waits.
    /// It moves only when it has nothing of its own resident at home (a first turn never has;
    /// a returning one whose own blocks are under [`PlacementConfig::resident_fraction`]
    /// resident, as for [`Placement::place_returning`]), home would not admit it now (a turn
    /// queued ahead of it, or no room) and another usable replica would (nothing queued,
    /// room): it starts sooner and pays nothing it would not pay at home. A first turn goes
    /// only to a replica with room in its backlog of new sessions, ranked as
    /// [`Placement::place_new`] ranks; a returning one as a cold move. `home_hit`: the
    /// prompt blocks resident at home; `shared_hit(r)` as for `place_new`.
    pub fn place_waiting(
        &mut self,
        views: &[ReplicaView],
        session: &SessionView,
        home: usize,
        home_hit: u64,
        first: bool,
        shared_hit: impl FnMut(usize) -> u64,
    ) -> Option<Placed> {
        let replica = self.waiting_target(views, session, home, home_hit, first, shared_hit)?;
        let reason = if first {
            PlaceReason::NewMove
        } else {
            PlaceReason::ColdMove
        };
        self.stats.count(reason);
        Some(Placed { replica, reason })
    }

    /// Whether [`Placement::place_waiting`] could move the turn whatever is resident at home:
    /// the answer for `home_hit` 0, since more resident at home only keeps it there (its own
    /// blocks make it resident; a larger hit lowers home's delay). Asks nothing, counts
    /// nothing: the caller probes home only when this says yes.
    pub fn may_move_waiting(
        &self,
        views: &[ReplicaView],
        session: &SessionView,
        home: usize,
        first: bool,
        shared_hit: impl FnMut(usize) -> u64,
    ) -> bool {
        self.waiting_target(views, session, home, 0, first, shared_hit)
            .is_some()
    }

    /// The replica [`Placement::place_waiting`] moves the turn to, uncounted.
    fn waiting_target(
        &self,
        views: &[ReplicaView],
        session: &SessionView,
        home: usize,
        home_hit: u64,
        first: bool,
        mut shared_hit: impl FnMut(usize) -> u64,
    ) -> Option<usize> {
        let own = session.prompt_blocks.saturating_sub(session.shared_blocks);
        let own_hit = home_hit.saturating_sub(session.shared_blocks);
        if !first && own > 0 && own_hit as f64 >= self.config.resident_fraction * own as f64 {
            return None;
        }
        if home < views.len() && self.usable(views, home) {
            let mut without = views[home];
            without.queued = without.queued.saturating_sub(1);
            if eta(&without, session, home_hit) == 0.0 {
                return None;
            }
        }
        // (new sessions waiting, sessions per speed, shared hit, replica) of the best so far.
        let mut best: Option<(u32, f64, u64, usize)> = None;
        let (fastest, share) = (fastest(views), self.share(views));
        for (r, v) in views.iter().enumerate() {
            if r == home || !self.usable_at(v, fastest) {
                continue;
            }
            // A first turn is a new session: the backlog and the share hold for it.
            if first
                && (v.new_waiting >= self.config.new_backlog
                    || per_speed(v.sessions, v) > share + SHARE_SLACK)
            {
                continue;
            }
            let hit = shared_hit(r).min(session.shared_blocks);
            if eta(v, session, hit) > 0.0 {
                continue;
            }
            let backlog = if first { v.new_waiting } else { 0 };
            let load = per_speed(v.sessions + 1, v);
            let better = best.is_none_or(|(n, l, h, _)| {
                (backlog, load, std::cmp::Reverse(hit))
                    .partial_cmp(&(n, l, std::cmp::Reverse(h)))
                    .is_some_and(|o| o.is_lt())
            });
            if better {
                best = Some((backlog, load, hit, r));
            }
        }
        best.map(|(_, _, _, replica)| replica)
    }

    /// Where session's next turn goes, its home being `home` with `home_hit` of its prompt
    /// blocks resident there. `None` only when no replica is up.
    pub fn place_returning(
        &mut self,
        views: &[ReplicaView],
        session: &SessionView,
        home: usize,
        home_hit: u64,
    ) -> Option<Placed> {
        let own = session.prompt_blocks.saturating_sub(session.shared_blocks);
        let own_hit = home_hit.saturating_sub(session.shared_blocks);
        let resident = own > 0 && own_hit as f64 >= self.config.resident_fraction * own as f64;
        let home_view = views.get(home);
        let forced = match home_view {
            Some(v) if !v.up => Some(PlaceReason::DownMove),
            None => Some(PlaceReason::DownMove),
            Some(_) if !self.usable(views, home) => Some(PlaceReason::SlowMove),
            Some(_) => None,
        };
        let decision = match forced {
            None if resident => Placed {
                replica: home,
                reason: PlaceReason::Resident,
            },
            None => {
                // Cold: it re-prefills wherever it goes; move only to strictly sooner.
                let at_home = eta(&views[home], session, home_hit);
                match self.soonest(views, session, Some(home)) {
                    Some((r, e)) if at_home > 0.0 && e < at_home => Placed {
                        replica: r,
                        reason: PlaceReason::ColdMove,
                    },
                    _ => Placed {
                        replica: home,
                        reason: PlaceReason::ColdStay,
                    },
                }
            }
            Some(reason) => match self.soonest(views, session, Some(home)) {
                Some((replica, _)) => Placed { replica, reason },
                // Nowhere else to go: a slow home still serves; a down one cannot.
                None if reason == PlaceReason::SlowMove => Placed {
                    replica: home,
                    reason: PlaceReason::ColdStay,
                },
                None => return None,
            },
        };
        self.stats.count(decision.reason);
        Some(decision)
    }

    /// The usable replica (other than `except`) with the lowest [`eta`] for a cold turn (only
    /// its shared prefix could be resident there; counted as not, which is conservative), ties
    /// to the fewest sessions per unit of speed, then the lowest index; falls back to any up
    /// replica when none is usable.
    fn soonest(
        &self,
        views: &[ReplicaView],
        session: &SessionView,
        except: Option<usize>,
    ) -> Option<(usize, f64)> {
        let pick = |usable_only: bool| {
            let mut best: Option<(f64, f64, usize)> = None;
            for (r, v) in views.iter().enumerate() {
                if Some(r) == except || !v.up || (usable_only && !self.usable(views, r)) {
                    continue;
                }
                let e = eta(v, session, 0);
                let load = f64::from(v.sessions) / v.speed.max(1e-9);
                if best.is_none_or(|(be, bl, _)| e < be || (e == be && load < bl)) {
                    best = Some((e, load, r));
                }
            }
            best.map(|(e, _, r)| (r, e))
        };
        pick(true).or_else(|| pick(false))
    }
}
