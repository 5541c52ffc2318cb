//! The twin as a fleet: N modelled replicas, each behind its own [`Mode`] (no gate, the gate,
//! pause or aimd, one instance per replica as each runs in production), and a placement policy
//! ([`policy`]) that decides which replica each session's turn goes to.
//!
//! The event loop is the single-replica loop's (`crate::sim::driver`) with one engine step in
//! flight per replica: clients, virtual time and the records are the fleet's; each replica's
//! step boundaries and its mode's wakes are its own. Placement is asked when a session arrives
//! (a `gate` placement may hold it until a replica would admit it) and when each later turn is
//! ready; a session that moves leaves its old replica's mode (told as a session end) and its
//! turn is handed to the new one. Under `aimd` a session stays where its episode started (the
//! controller counts episodes per replica) unless its replica is lost.
//!
//! Under placement `gate` with the gate per replica, a turn that waits for admission with
//! nothing of its own resident (a new session's first turn, a cold returning turn) is offered
//! a move whenever something finished ([`Placement::place_waiting`]): its replica's gate lets
//! go of it (the attempt is withdrawn, as a client that went away) and the turn goes to the
//! replica that would admit it now.
//!
//! Faults: a straggler replica runs every step `slowdown` times slower; a lost replica
//! disappears once half the workload's turns have finished: its in-flight turns are re-sent
//! elsewhere (they start over: whatever they computed is gone), the sessions it held are cold
//! wherever they go, and under `aimd` their episodes re-run (lost work).
pub mod policy;

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use self::policy::{PlacementKind, Placer, Snapshot, Turn};
use super::driver::client::{Client, Phase, client_in};
use super::driver::events::{Event, Events};
use super::driver::mode::Command;
use super::driver::tokens::HashChain;
use super::driver::{Ctx, LostWork, Mode, ModeSpec, SessionIx, SessionSpec, TurnRecord};
use super::kv_manager::HitMemo;
use super::{BlockHash, Replica, ReplicaStats, StepOutcome};
use crate::error::{Error, Result};
use crate::gate::placement::{
    Placement, PlacementConfig, PlacementStats, ReplicaView, SessionView,
};

/// The fleet: how many replicas, where sessions go, and its faults.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSpec {
    /// Replicas (at least 1).
    pub replicas: usize,
    /// The placement policy.
    pub placement: PlacementKind,
    /// A straggler: (replica index, step-time factor; 2.0 is half speed).
    pub straggler: Option<(usize, f64)>,
    /// A replica lost once half the turns have finished.
    pub lose: Option<usize>,
}

/// Everything one fleet run produced.
#[derive(Debug, Clone)]
pub struct FleetOutput {
    /// One record per turn, in the order the turns finished.
    pub records: Vec<TurnRecord>,
    /// The replica that served each record.
    pub served_by: Vec<usize>,
    /// Virtual seconds from the start to the end of the last session.
    pub makespan_sec: f64,
    /// Placements and moves by reason.
    pub placement: PlacementStats,
    /// Per replica: its counters.
    pub replica_stats: Vec<ReplicaStats>,
    /// Per replica: sessions it served a turn of.
    pub sessions_served: Vec<u64>,
    /// Work thrown away by cancelled episodes (aimd, and lost replicas under aimd).
    pub lost: LostWork,
    /// In-flight turns re-sent after their replica was lost.
    pub resent_turns: u64,
    /// When the replica was lost, if one was.
    pub lost_at: Option<f64>,
}

/// How many loop iterations may pass without virtual time moving.
const STALL_LIMIT: u32 = 1_000_000;

/// Notifications for a replica's mode.
#[derive(Debug, Clone, Copy)]
enum Note {
    Arrived(SessionIx),
    TurnReady(SessionIx),
    TurnFinished(SessionIx),
    SessionFinished(SessionIx),
}

/// One replica and what stands in front of it.
struct Slot {
    replica: Replica,
    mode: Box<dyn Mode>,
    step: Option<(f64, StepOutcome)>,
    stepping: bool,
    commands: Vec<Command>,
    up: bool,
    slowdown: f64,
    /// Measured speed (1.0 until its first step).
    speed: f64,
    /// Live sessions placed here.
    sessions: u32,
    /// Sessions waiting for admission here (arrived and not started, or a turn ready).
    queued: u32,
    /// New sessions placed here whose first turn is not admitted yet.
    new_waiting: u32,
    /// Turns in the replica.
    inflight: u32,
    /// Counted tokens of the live sessions placed here (ThunderAgent's working set).
    tokens: u64,
    served: HashSet<SessionIx>,
}

/// Runs `sessions` on a fleet of `fleet.replicas` replicas from `replica`, each behind a fresh
/// mode of kind `mode` (`none`, `gate`, `seed`, `pause`, `aimd`; the scheduler modes and caps
/// are single-replica modes), placed by `fleet.placement`.
pub fn simulate_fleet(
    sessions: Vec<SessionSpec>,
    seed: u64,
    mut replica: impl FnMut() -> Result<Replica>,
    mode: &ModeSpec,
    fleet: &FleetSpec,
) -> Result<FleetOutput> {
    if fleet.replicas == 0 {
        return Err(Error::InvalidInput(
            "a fleet needs at least 1 replica".into(),
        ));
    }
    for (what, r) in [
        ("straggler", fleet.straggler.map(|s| s.0)),
        ("lost replica", fleet.lose),
    ] {
        if let Some(r) = r.filter(|&r| r >= fleet.replicas) {
            return Err(Error::InvalidInput(format!(
                "{what} {r}: the fleet has replicas 0..{}",
                fleet.replicas
            )));
        }
    }
    if let Some((_, f)) = fleet.straggler
        && !(f.is_finite() && f >= 1.0)
    {
        return Err(Error::InvalidInput(format!(
            "straggler slowdown {f}: expected a finite factor >= 1"
        )));
    }
    // Sessions waiting for their first admission move only where a gate can let go of them.
    let rebinder = (fleet.placement == PlacementKind::Gate && matches!(mode, ModeSpec::Gate(_)))
        .then(|| Placement::new(PlacementConfig::default()));
    let aimd = match mode {
        ModeSpec::None | ModeSpec::Seed(_) | ModeSpec::Gate(_) | ModeSpec::Pause(_) => false,
        ModeSpec::Aimd(_) => true,
        other => {
            return Err(Error::InvalidInput(format!(
                "mode {other:?} is not a fleet mode (none, seed, gate, pause or aimd)"
            )));
        }
    };
    for s in &sessions {
        s.validate()?;
    }
    let n = sessions.len();
    let mut slots = Vec::with_capacity(fleet.replicas);
    for r in 0..fleet.replicas {
        let slowdown = fleet.straggler.filter(|s| s.0 == r).map_or(1.0, |s| s.1);
        slots.push(Slot {
            replica: replica()?,
            mode: mode.build(n)?,
            step: None,
            stepping: false,
            commands: Vec::new(),
            up: true,
            slowdown,
            speed: 1.0,
            sessions: 0,
            queued: 0,
            new_waiting: 0,
            inflight: 0,
            tokens: 0,
            served: HashSet::new(),
        });
    }
    let block_size = slots[0].replica.config().block_size;
    let async_scheduling = slots[0].replica.cost().shape.async_scheduling;
    let mut events = Events::default();
    let total_turns = sessions.iter().map(|s| s.turns.len() as u64).sum();
    let clients: Vec<Client> = sessions
        .into_iter()
        .enumerate()
        .map(|(i, spec)| {
            events.push(spec.arrival, Event::Arrive(i));
            let chain = HashChain::new(seed, i as u64, spec.system_tokens, block_size);
            Client::new(spec, chain)
        })
        .collect();
    let mut sim = Fleet {
        placer: fleet.placement.build(fleet.replicas, n),
        rebinder,
        waiting: BTreeSet::new(),
        slots,
        home: vec![None; n],
        waiting_on: vec![None; n],
        counted: vec![0; n],
        memos: vec![HitMemo::default(); n],
        clients,
        events,
        block_size,
        async_scheduling,
        aimd,
        now: 0.0,
        notes: VecDeque::new(),
        requests: HashMap::new(),
        next_request: 1,
        records: Vec::new(),
        served_by: Vec::new(),
        finished: 0,
        makespan: 0.0,
        aborted: HashSet::new(),
        lost: LostWork::default(),
        held: VecDeque::new(),
        shared: HashMap::new(),
        turns_done: 0,
        total_turns,
        lose: fleet.lose,
        lost_at: None,
        resent: 0,
        dirty: false,
        finished_first: super::finished_blocks_first()?,
    };
    sim.run()?;
    let placement = sim.placement_stats();
    Ok(FleetOutput {
        records: sim.records,
        served_by: sim.served_by,
        makespan_sec: sim.makespan,
        placement,
        replica_stats: sim
            .slots
            .iter()
            .map(|s| s.replica.stats().clone())
            .collect(),
        sessions_served: sim.slots.iter().map(|s| s.served.len() as u64).collect(),
        lost: sim.lost,
        resent_turns: sim.resent,
        lost_at: sim.lost_at,
    })
}

struct Fleet {
    placer: Box<dyn Placer>,
    /// Placement `gate` under the gate: moves turns that wait for admission (`place_waiting`).
    rebinder: Option<Placement>,
    /// Sessions counted in a replica's admission queue, by index (arrival order).
    waiting: BTreeSet<SessionIx>,
    slots: Vec<Slot>,
    /// Per session: the replica it is placed on.
    home: Vec<Option<usize>>,
    /// Per session: the replica whose `queued` it counts in.
    waiting_on: Vec<Option<usize>>,
    /// Per session: tokens it counts in its home's `tokens`.
    counted: Vec<u64>,
    /// Per session: its home-residency probe's memo (reset when it moves).
    memos: Vec<HitMemo>,
    clients: Vec<Client>,
    events: Events,
    block_size: u32,
    async_scheduling: bool,
    /// Whether a finished session's blocks go first (`SESSION_GATE_FINISHED_BLOCKS`).
    finished_first: bool,
    aimd: bool,
    now: f64,
    notes: VecDeque<(usize, Note)>,
    requests: HashMap<u64, (SessionIx, usize)>,
    next_request: u64,
    records: Vec<TurnRecord>,
    served_by: Vec<usize>,
    finished: usize,
    makespan: f64,
    aborted: HashSet<u64>,
    lost: LostWork,
    /// New sessions no replica would admit yet (`gate` placement), in arrival order.
    held: VecDeque<SessionIx>,
    /// The shared system prompt's block hashes, by system length.
    shared: HashMap<u32, Vec<BlockHash>>,
    turns_done: u64,
    total_turns: u64,
    lose: Option<usize>,
    lost_at: Option<f64>,
    resent: u64,
    /// Something finished since held sessions were last offered a replica.
    dirty: bool,
}

impl Fleet {
    fn run(&mut self) -> Result<()> {
        let mut stalls = 0u32;
        while self.finished < self.clients.len() {
            self.settle()?;
            for r in 0..self.slots.len() {
                self.boundary(r)?;
            }
            self.offer_held()?;
            let mut next = self.events.next_time();
            for slot in &mut self.slots {
                if !slot.up {
                    continue;
                }
                let times = [
                    slot.step.as_ref().map(|(end, _)| *end),
                    slot.mode.next_wake(),
                ];
                for t in times.into_iter().flatten() {
                    next = Some(next.map_or(t, |n: f64| n.min(t)));
                }
            }
            let Some(next) = next else {
                return Err(self.stalled("nothing left to happen"));
            };
            if next > self.now {
                self.now = next;
                stalls = 0;
            } else {
                stalls += 1;
                if stalls > STALL_LIMIT {
                    return Err(self.stalled("virtual time stopped moving"));
                }
            }
            for r in 0..self.slots.len() {
                let slot = &mut self.slots[r];
                if slot.step.as_ref().is_some_and(|(end, _)| *end <= self.now) {
                    let (_, outcome) = slot.step.take().expect("checked");
                    slot.stepping = false;
                    self.step_done(r, outcome)?;
                }
            }
            while let Some(event) = self.events.pop_due(self.now) {
                self.event(event)?;
            }
            for r in 0..self.slots.len() {
                if self.slots[r].up
                    && self.slots[r]
                        .mode
                        .next_wake()
                        .is_some_and(|t| t <= self.now)
                {
                    self.settle()?;
                    self.with_mode(r, |mode, ctx| mode.wake(ctx))?;
                }
            }
            self.maybe_lose()?;
        }
        self.settle()
    }

    /// Replica `r`'s step boundary, when it has no step in flight (the single-replica loop's).
    fn boundary(&mut self, r: usize) -> Result<()> {
        if !self.slots[r].up || self.slots[r].step.is_some() {
            return Ok(());
        }
        loop {
            if self.async_scheduling {
                self.step_replica(r);
            }
            self.with_mode(r, |mode, ctx| mode.step_boundary(ctx))?;
            if !self.async_scheduling {
                self.step_replica(r);
            }
            let reacted = !self.slots[r].commands.is_empty() || !self.notes.is_empty();
            self.settle()?;
            if self.slots[r].step.is_some() || !reacted {
                return Ok(());
            }
        }
    }

    fn step_replica(&mut self, r: usize) {
        let slot = &mut self.slots[r];
        let outcome = slot.replica.step();
        slot.stepping = outcome.is_some();
        slot.step = outcome.map(|mut o| {
            // A straggler: the same work, `slowdown` times slower. The fleet measures it after
            // one step (a proxy would compare per-token latencies at equal batch sizes).
            o.duration_sec *= slot.slowdown;
            slot.speed = 1.0 / slot.slowdown;
            (self.now + o.duration_sec, o)
        });
    }

    /// Calls replica `r`'s mode with a context over that replica.
    fn with_mode(
        &mut self,
        r: usize,
        call: impl FnOnce(&mut dyn Mode, &mut Ctx<'_>) -> Result<()>,
    ) -> Result<()> {
        let Slot {
            replica,
            mode,
            commands,
            stepping,
            ..
        } = &mut self.slots[r];
        let engine_busy = *stepping || replica.num_running() > 0 || replica.num_waiting() > 0;
        let mut ctx = Ctx {
            now: self.now,
            replica,
            clients: &self.clients,
            commands,
            engine_busy,
        };
        call(mode.as_mut(), &mut ctx)
    }

    fn stalled(&self, why: &str) -> Error {
        Error::InvalidInput(format!(
            "fleet simulation stalled at t={:.3} s ({why}): {} of {} sessions unfinished, {} held \
             for a replica",
            self.now,
            self.clients.len() - self.finished,
            self.clients.len(),
            self.held.len(),
        ))
    }

    /// Applies every replica's commands and delivers notes until both run dry.
    fn settle(&mut self) -> Result<()> {
        loop {
            for r in 0..self.slots.len() {
                let commands = std::mem::take(&mut self.slots[r].commands);
                for command in commands {
                    self.apply(r, command)?;
                }
            }
            let Some((r, note)) = self.notes.pop_front() else {
                if self.slots.iter().all(|s| s.commands.is_empty()) {
                    return Ok(());
                }
                continue;
            };
            if !self.slots[r].up {
                continue;
            }
            self.with_mode(r, |mode, ctx| match note {
                Note::Arrived(s) => mode.session_arrived(ctx, s),
                Note::TurnReady(s) => mode.turn_ready(ctx, s),
                Note::TurnFinished(s) => mode.turn_finished(ctx, s),
                Note::SessionFinished(s) => mode.session_finished(ctx, s),
            })?;
        }
    }

    /// Moves session `s`'s count in a replica's admission queue to `to`.
    fn set_waiting(&mut self, s: SessionIx, to: Option<usize>) {
        if let Some(r) = self.waiting_on[s].take() {
            self.slots[r].queued -= 1;
        }
        if let Some(r) = to {
            self.slots[r].queued += 1;
            self.waiting.insert(s);
        } else {
            self.waiting.remove(&s);
        }
        self.waiting_on[s] = to;
    }

    /// Session `s`'s home becomes `to` (or none, once it ended): counts move with it.
    fn set_home(&mut self, s: SessionIx, to: Option<usize>) {
        if let Some(r) = self.home[s].take() {
            let slot = &mut self.slots[r];
            slot.sessions -= 1;
            slot.tokens -= self.counted[s];
        }
        self.counted[s] = 0;
        if let Some(r) = to {
            self.slots[r].sessions += 1;
            self.memos[s] = HitMemo::default();
        }
        self.home[s] = to;
        self.recount(s);
    }

    /// Brings session `s`'s counted tokens at home up to its history.
    fn recount(&mut self, s: SessionIx) {
        let Some(r) = self.home[s] else { return };
        let now = self.clients[s].history;
        let slot = &mut self.slots[r];
        slot.tokens = slot.tokens - self.counted[s] + now;
        self.counted[s] = now;
    }

    fn apply(&mut self, r: usize, command: Command) -> Result<()> {
        match command {
            Command::Start(s) => {
                let now = self.now;
                let client = self.client(s, Phase::Idle, "start")?;
                client.prepare_turn(now);
                self.recount(s);
                self.notes.push_back((r, Note::TurnReady(s)));
            }
            Command::Admit(s, reason) => {
                let (id, bs, now) = (self.next_request, self.block_size, self.now);
                let client = self.client(s, Phase::Ready, "admit")?;
                let first = client.turn == 0;
                client.phase = Phase::InFlight;
                client.admitted_at = now;
                client.reason = reason;
                let request = client.request(id, bs);
                self.next_request += 1;
                self.requests.insert(id, (s, r));
                self.set_waiting(s, None);
                let slot = &mut self.slots[r];
                if first {
                    slot.new_waiting = slot.new_waiting.saturating_sub(1);
                    self.dirty = true;
                }
                slot.inflight += 1;
                slot.served.insert(s);
                slot.replica.add_request(request)?;
            }
            Command::Cancel(s) => {
                let ids: Vec<u64> = self
                    .requests
                    .iter()
                    .filter(|(_, v)| v.0 == s)
                    .map(|(k, _)| *k)
                    .collect();
                for id in ids {
                    self.requests.remove(&id);
                    self.slots[r].replica.abort_request(id);
                    self.slots[r].inflight -= 1;
                    self.aborted.insert(id);
                }
                self.reset_episode(s)?;
                self.set_waiting(s, Some(r));
            }
            Command::EvictFirst(s) => {
                if self.finished_first {
                    let (hashes, keep) = self.clients[s].history_blocks();
                    self.slots[r].replica.evict_first(hashes, keep);
                }
            }
        }
        Ok(())
    }

    /// Session `s`'s episode starts over (aimd): its turns so far are lost work.
    fn reset_episode(&mut self, s: SessionIx) -> Result<()> {
        if self.clients[s].phase == Phase::Finished {
            return Err(Error::InvalidInput(format!(
                "mode asked to cancel session #{s}, which is finished"
            )));
        }
        let c = &mut self.clients[s];
        let mut lost = LostWork {
            cancellations: 1,
            ..Default::default()
        };
        let mut keep = Vec::with_capacity(self.records.len());
        for rec in &self.records {
            keep.push(rec.session != s);
            if rec.session == s {
                lost.turns += 1;
                let output = c.spec.turns[rec.turn as usize].output;
                lost.tokens += u64::from(rec.prompt_tokens - rec.cached_tokens) + u64::from(output);
            }
        }
        let mut flags = keep.iter();
        self.records
            .retain(|_| *flags.next().expect("one flag a record"));
        let mut flags = keep.iter();
        self.served_by
            .retain(|_| *flags.next().expect("one flag a record"));
        self.turns_done -= lost.turns;
        self.lost.cancellations += lost.cancellations;
        self.lost.turns += lost.turns;
        self.lost.tokens += lost.tokens;
        c.restart_episode();
        self.recount(s);
        Ok(())
    }

    fn client(&mut self, s: SessionIx, phase: Phase, what: &str) -> Result<&mut Client> {
        client_in(&mut self.clients, s, phase, what)
    }

    fn step_done(&mut self, r: usize, outcome: StepOutcome) -> Result<()> {
        for done in &outcome.finished {
            if self.aborted.remove(&done.id) {
                continue;
            }
            let (s, _) = self.requests.remove(&done.id).ok_or_else(|| {
                Error::InvalidInput(format!("replica {r} finished unknown request {}", done.id))
            })?;
            let now = self.now;
            self.slots[r].inflight -= 1;
            let c = &mut self.clients[s];
            let (reason, admitted_at) = self.slots[r]
                .mode
                .admission(s)
                .unwrap_or((c.reason, c.admitted_at));
            self.records.push(TurnRecord {
                session: s,
                turn: c.turn as u32,
                prompt_tokens: c.history as u32,
                cached_tokens: done.num_cached_tokens,
                latency_sec: now - c.ready_at,
                wait_sec: admitted_at - c.ready_at,
                reason,
                ready_at: c.ready_at,
                finished_at: now,
                engine_preemptions: done.num_preemptions,
            });
            self.served_by.push(r);
            c.history += u64::from(c.max_tokens());
            c.phase = Phase::Tool;
            let tool = c.spec.turns[c.turn].tool_latency;
            self.events.push(now + tool, Event::ToolDone(s, c.attempt));
            self.recount(s);
            self.turns_done += 1;
            self.dirty = true;
            self.notes.push_back((r, Note::TurnFinished(s)));
        }
        Ok(())
    }

    fn event(&mut self, event: Event) -> Result<()> {
        match event {
            Event::Arrive(s) => {
                if !self.place_new(s)? {
                    self.held.push_back(s);
                }
            }
            Event::ToolDone(s, attempt) => {
                let now = self.now;
                let c = &mut self.clients[s];
                if attempt != c.attempt {
                    return Ok(());
                }
                if c.turn + 1 < c.spec.turns.len() {
                    c.turn += 1;
                    c.prepare_turn(now);
                    self.recount(s);
                    self.place_turn(s)?;
                } else {
                    c.phase = Phase::Finished;
                    self.finished += 1;
                    self.makespan = now;
                    self.dirty = true;
                    let home = self.home[s].expect("a live session has a home");
                    self.notes.push_back((home, Note::SessionFinished(s)));
                    self.set_home(s, None);
                }
            }
        }
        Ok(())
    }

    fn views(&self) -> Vec<ReplicaView> {
        self.slots
            .iter()
            .map(|slot| {
                let usage = slot.replica.usage();
                ReplicaView {
                    up: slot.up,
                    speed: slot.speed,
                    num_blocks: usage.num_blocks,
                    free_blocks: usage.num_free_blocks,
                    sessions: slot.sessions,
                    queued: slot.queued + slot.replica.num_waiting() as u32,
                    new_waiting: slot.new_waiting,
                }
            })
            .collect()
    }

    /// The policy's inputs: replica views, loads, counted tokens and capacities.
    fn snapshot_parts(&self) -> (Vec<ReplicaView>, Vec<u32>, Vec<u64>, Vec<u64>) {
        let views = self.views();
        let load = self.slots.iter().map(|s| s.inflight + s.queued).collect();
        let tokens = self.slots.iter().map(|s| s.tokens).collect();
        let capacity = self
            .slots
            .iter()
            .map(|s| {
                let c = s.replica.config();
                u64::from(c.num_blocks) * u64::from(c.block_size)
            })
            .collect();
        (views, load, tokens, capacity)
    }

    /// The session's next turn as placement sees it (the first turn before it is prepared).
    fn session_view(&self, s: SessionIx) -> (u64, SessionView) {
        let c = &self.clients[s];
        let bs = u64::from(self.block_size);
        let prompt = if c.phase == Phase::Idle {
            u64::from(c.spec.system_tokens) + u64::from(c.spec.task_tokens)
        } else {
            c.history
        };
        let output = u64::from(c.spec.turns[c.turn].output);
        let view = SessionView::from_tokens(prompt, output, u64::from(c.spec.system_tokens), bs);
        (prompt, view)
    }

    /// Offers new session `s` a replica; false when the policy holds it.
    fn place_new(&mut self, s: SessionIx) -> Result<bool> {
        let (views, load, tokens, capacity) = self.snapshot_parts();
        let (prompt, view) = self.session_view(s);
        let system = self.shared_hashes(s);
        let shared = &self.shared[&system];
        let slots = &self.slots;
        let mut shared_hit = |r: usize| {
            let report = slots[r].replica.probe_prefix(shared, system + 1);
            report.hit_blocks
        };
        let snap = Snapshot {
            views: &views,
            load: &load,
            tokens: &tokens,
            capacity_tokens: &capacity,
        };
        let turn = Turn {
            session_id: &self.clients[s].spec.session_id,
            session: s,
            prompt_tokens: prompt,
            system_tokens: u64::from(system),
            view,
        };
        let Some(placed) = self.placer.place_new(&snap, &turn, &mut shared_hit) else {
            if !views.iter().any(|v| v.up) {
                return Err(Error::InvalidInput(
                    "every replica of the fleet is down".into(),
                ));
            }
            return Ok(false);
        };
        let r = placed.replica;
        self.slots[r].new_waiting += 1;
        self.set_home(s, Some(r));
        self.set_waiting(s, Some(r));
        self.notes.push_back((r, Note::Arrived(s)));
        Ok(true)
    }

    /// Places session `s`'s ready turn (a returning session): stays, or moves.
    fn place_turn(&mut self, s: SessionIx) -> Result<()> {
        let home = self.home[s].expect("a live session has a home");
        let (views, load, tokens, capacity) = self.snapshot_parts();
        let (prompt, view) = self.session_view(s);
        let placed = if self.aimd && self.slots[home].up {
            // aimd counts episodes per replica: a session stays with its controller.
            home
        } else {
            let Fleet {
                slots,
                clients,
                memos,
                placer,
                ..
            } = self;
            let c = &clients[s];
            let memo = &mut memos[s];
            let mut home_hit = || {
                let t = c.view();
                slots[home]
                    .replica
                    .probe_prefix_memo(s as u64, t.prompt_hashes, t.prompt_tokens, memo)
                    .hit_blocks
            };
            let snap = Snapshot {
                views: &views,
                load: &load,
                tokens: &tokens,
                capacity_tokens: &capacity,
            };
            let turn = Turn {
                session_id: &c.spec.session_id,
                session: s,
                prompt_tokens: prompt,
                system_tokens: u64::from(c.spec.system_tokens),
                view,
            };
            placer
                .place_returning(&snap, &turn, home, &mut home_hit)
                .ok_or_else(|| Error::InvalidInput("every replica of the fleet is down".into()))?
                .replica
        };
        if placed != home {
            if self.slots[home].up {
                // The old replica's mode lets go of the session (its reservations, its slot).
                self.notes.push_back((home, Note::SessionFinished(s)));
            }
            self.set_home(s, Some(placed));
        }
        self.set_waiting(s, Some(placed));
        self.notes.push_back((placed, Note::TurnReady(s)));
        Ok(())
    }

    /// Offers held sessions a replica, in arrival order, while one takes them; then offers
    /// the sessions waiting for their first admission a move.
    fn offer_held(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        self.dirty = false;
        while let Some(&s) = self.held.front() {
            if !self.place_new(s)? {
                break;
            }
            self.held.pop_front();
            self.settle()?;
        }
        self.rebind_waiting()
    }

    /// Placement's counters, the rebinder's moves of waiting new sessions included.
    fn placement_stats(&self) -> PlacementStats {
        let mut stats = self.placer.stats();
        if let Some(rebinder) = &self.rebinder {
            let moved = rebinder.stats();
            stats.new_move += moved.new_move;
            stats.cold_move += moved.cold_move;
        }
        stats
    }

    /// The shared system prompt's block hashes for session `s`'s system length.
    fn shared_hashes(&mut self, s: SessionIx) -> u32 {
        let system = self.clients[s].spec.system_tokens;
        let bs = self.block_size;
        let seed_chain = &self.clients[s].chain;
        self.shared.entry(system).or_insert_with(|| {
            let mut chain = seed_chain.clone();
            chain.extend_to(u64::from(system));
            chain.hashes()[..(system / bs) as usize].to_vec()
        });
        system
    }

    /// Whether some usable replica has nothing queued (a waiting turn could move there).
    fn any_open(&self, views: &[ReplicaView]) -> bool {
        let Some(rebinder) = &self.rebinder else {
            return false;
        };
        (0..views.len()).any(|r| views[r].queued == 0 && rebinder.usable(views, r))
    }

    /// Offers the turns waiting for admission (oldest session first) a move to a replica that
    /// would admit them now, where placement says so.
    fn rebind_waiting(&mut self) -> Result<()> {
        if self.rebinder.is_none() || self.waiting.is_empty() {
            return Ok(());
        }
        let mut views = self.views();
        // Nothing can move unless some usable replica has an empty queue (a straggler's stays
        // empty: it takes nothing, and asking every waiting turn about it would cost a pass
        // per event).
        if !self.any_open(&views) {
            return Ok(());
        }
        let candidates: Vec<SessionIx> = self.waiting.iter().copied().collect();
        for s in candidates {
            let Some(home) = self.waiting_on[s] else {
                continue;
            };
            if self.home[s] != Some(home) || self.clients[s].phase != Phase::Ready {
                continue;
            }
            let first = self.clients[s].turn == 0;
            let (_, view) = self.session_view(s);
            let system = self.shared_hashes(s);
            let Fleet {
                slots,
                shared,
                rebinder,
                clients,
                memos,
                ..
            } = self;
            let hashes = &shared[&system];
            let home_hit = if first {
                slots[home]
                    .replica
                    .probe_prefix(hashes, system + 1)
                    .hit_blocks
            } else {
                let t = clients[s].view();
                slots[home]
                    .replica
                    .probe_prefix_memo(s as u64, t.prompt_hashes, t.prompt_tokens, &mut memos[s])
                    .hit_blocks
            };
            let shared_hit =
                |r: usize| slots[r].replica.probe_prefix(hashes, system + 1).hit_blocks;
            let rebinder = rebinder.as_mut().expect("checked");
            let Some(placed) =
                rebinder.place_waiting(&views, &view, home, home_hit, first, shared_hit)
            else {
                continue;
            };
            let mut withdrawn = false;
            self.with_mode(home, |mode, ctx| {
                withdrawn = mode.withdraw(ctx, s)?;
                Ok(())
            })?;
            if !withdrawn {
                return Err(Error::InvalidInput(format!(
                    "replica {home}'s gate did not let go of waiting session #{s}"
                )));
            }
            let to = placed.replica;
            self.set_waiting(s, None);
            if first {
                self.slots[home].new_waiting = self.slots[home].new_waiting.saturating_sub(1);
                self.slots[to].new_waiting += 1;
            }
            self.set_home(s, Some(to));
            self.set_waiting(s, Some(to));
            self.notes.push_back((to, Note::TurnReady(s)));
            self.settle()?;
            views = self.views();
            if !self.any_open(&views) {
                break;
            }
        }
        Ok(())
    }

    /// Loses the configured replica once half the turns have finished.
    fn maybe_lose(&mut self) -> Result<()> {
        let Some(r) = self.lose else { return Ok(()) };
        if self.turns_done * 2 < self.total_turns {
            return Ok(());
        }
        self.lose = None;
        self.lost_at = Some(self.now);
        let slot = &mut self.slots[r];
        slot.up = false;
        slot.step = None;
        slot.stepping = false;
        slot.commands.clear();
        slot.queued = 0;
        slot.new_waiting = 0;
        slot.inflight = 0;
        self.notes.retain(|(to, _)| *to != r);
        let lost_requests: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, v)| v.1 == r)
            .map(|(k, _)| *k)
            .collect();
        for id in lost_requests {
            self.requests.remove(&id);
        }
        self.dirty = true;
        for s in 0..self.clients.len() {
            if self.home[s] != Some(r) {
                continue;
            }
            self.waiting_on[s] = None;
            let phase = self.clients[s].phase;
            if self.aimd && phase != Phase::Idle {
                // aimd's episodes re-run from the start, as its cancellations do.
                self.reset_episode(s)?;
            }
            match self.clients[s].phase {
                Phase::Idle => {
                    self.set_home(s, None);
                    if !self.place_new(s)? {
                        self.held.push_back(s);
                    }
                }
                Phase::InFlight | Phase::Ready => {
                    if phase == Phase::InFlight {
                        self.resent += 1;
                    }
                    self.clients[s].phase = Phase::Ready;
                    self.place_turn(s)?;
                }
                // Placed anew when its tool returns (its home is down then).
                Phase::Tool => {}
                Phase::Finished => unreachable!("a finished session has no home"),
            }
        }
        self.settle()
    }
}
