//! The per-session table: a slab of compact session records addressed by a small slot number,
//! so the queue, the lease table and the reservation ledger never copy session ids around.
use std::collections::HashMap;
use std::sync::Arc;

/// A session's ownership of part of the cache: held while its turns run and through its idle
/// grace window (see [`crate::gate::core`], "Committed" and "Yielding idle room").
#[derive(Debug, Clone)]
pub(crate) struct Reservation {
    /// When the reservation was obtained, as a sequence number: the age order key.
    pub(crate) age: u64,
    /// FIFO key of the attempt that obtained it: a revoked session waits in this place.
    pub(crate) order: u64,
    /// Prompt + max_tokens of the latest admission, kept so blocks can be recomputed if the
    /// block size only becomes known later.
    pub(crate) ws_tokens: u64,
    /// Working set in blocks (0 while the block size is unknown).
    pub(crate) ws_blocks: u64,
    /// Leases in flight that hold it.
    pub(crate) holders: u32,
    /// Whether the latest admission asked for an ownership window.
    pub(crate) retain: bool,
    /// End of the idle grace window, while no lease holds it.
    pub(crate) idle_until: Option<f64>,
    /// Admission-to-release seconds of the turns released while it was held, summed, and
    /// how many: their mean is the session's own turn time, which decides when an idle
    /// window may yield (`gate::core`, "Yielding idle room").
    pub(crate) turn_sec_sum: f64,
    pub(crate) turns: u32,
}

impl Reservation {
    /// Mean admission-to-release time of the session's turns under this reservation; `None`
    /// before one was released.
    pub(crate) fn mean_turn_sec(&self) -> Option<f64> {
        (self.turns > 0).then(|| self.turn_sec_sum / f64::from(self.turns))
    }
}

/// What the core remembers about one session. Dropped as soon as nothing refers to it.
#[derive(Debug)]
pub(crate) struct Session {
    /// Shared with the id index's key: one allocation per session.
    pub(crate) id: Arc<str>,
    pub(crate) reservation: Option<Reservation>,
    /// The newest attempt not yet admitted (older ones are preempted on `begin`).
    pub(crate) pending: Option<u64>,
    /// Attempts in the attempt table, preempted ones included.
    pub(crate) attempts: u32,
    /// Leases not yet released.
    pub(crate) leases: u32,
    pub(crate) num_preempted: u32,
}

impl Session {
    fn idle(&self) -> bool {
        self.reservation.is_none() && self.attempts == 0 && self.leases == 0
    }
}

/// Slab of sessions plus the id → slot index.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    slots: Vec<Option<Session>>,
    free: Vec<u32>,
    by_id: HashMap<Arc<str>, u32>,
}

impl Sessions {
    pub(crate) fn slot_of(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    pub(crate) fn get_or_insert(&mut self, id: &str) -> u32 {
        if let Some(slot) = self.slot_of(id) {
            return slot;
        }
        let id: Arc<str> = id.into();
        let session = Session {
            id: id.clone(),
            reservation: None,
            pending: None,
            attempts: 0,
            leases: 0,
            num_preempted: 0,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(session);
                slot
            }
            None => {
                self.slots.push(Some(session));
                u32::try_from(self.slots.len() - 1).expect("more than 4 billion sessions")
            }
        };
        self.by_id.insert(id, slot);
        slot
    }

    /// The session in `slot`. Slots handed out by this table stay valid while anything refers
    /// to them, because [`Sessions::gc`] only frees idle sessions.
    pub(crate) fn get(&self, slot: u32) -> &Session {
        self.slots[slot as usize]
            .as_ref()
            .expect("live session slot")
    }

    pub(crate) fn get_mut(&mut self, slot: u32) -> &mut Session {
        self.slots[slot as usize]
            .as_mut()
            .expect("live session slot")
    }

    /// Frees the slot if nothing refers to the session any more.
    pub(crate) fn gc(&mut self, slot: u32) {
        let entry = &mut self.slots[slot as usize];
        if entry.as_ref().is_some_and(Session::idle) {
            let session = entry.take().expect("checked above");
            self.by_id.remove(&session.id);
            self.free.push(slot);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Session)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Session> {
        self.slots.iter_mut().flatten()
    }

    /// Heap bytes, approximately: slab, free list, index buckets and each id once, with its
    /// two reference counts (allocations rounded up to 16 bytes, as glibc's malloc does).
    pub(crate) fn approx_bytes(&self) -> usize {
        let ids: usize = self
            .by_id
            .keys()
            .map(|k| (k.len() + 16).div_ceil(16) * 16)
            .sum();
        self.slots.capacity() * size_of::<Option<Session>>()
            + self.free.capacity() * size_of::<u32>()
            + self.by_id.capacity() * (size_of::<(Arc<str>, u32)>() + 1)
            + ids
    }
}
