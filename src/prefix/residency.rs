//! `Residency`: how the walk asks the engine whether a block hash is cached.
//!
//! A lookup answers hit or miss, and on a hit it may hand back a *witness*: something the engine
//! side can re-check later, much more cheaply than a lookup, to prove the same block is still
//! cached under the same hash (for vLLM: the block object and the hash object it carried). The
//! walk stores witnesses beside the session's hash chain and re-checks them first; a witness that
//! no longer proves anything is never trusted, the block is looked up again. So a witness can make
//! a walk faster, never different.

use crate::hashing::BlockHash;

/// What one lookup in the engine's prefix map found.
#[derive(Debug)]
pub enum Lookup<W> {
    /// The hash is not cached: vLLM's walk stops here.
    Miss,
    /// The hash is cached; with a witness when the engine side can re-check it later.
    Hit(Option<W>),
}

/// The engine's prefix map as the walk sees it.
pub trait Residency {
    /// Proof of an earlier hit that can be re-checked without a lookup.
    type Witness;

    /// Looks one block hash up in the engine's current state.
    fn lookup(&mut self, hash: &BlockHash) -> Lookup<Self::Witness>;

    /// How many leading `witnesses` still prove, against the engine's current state, that their
    /// block is cached under the hash they were taken for. Stops at the first that does not (or
    /// is `None`); returning 0 is always correct, only slower.
    fn still_resident(&mut self, witnesses: &[Option<Self::Witness>]) -> usize;

    /// A hint that `witnesses` will be re-checked soon: start loading what
    /// [`Residency::still_resident`] will read for them. It must not change any answer; the
    /// default does nothing.
    fn prefetch(&self, witnesses: &[Option<Self::Witness>]) {
        let _ = witnesses;
    }
}

/// The witness of a residency that has none (it cannot be constructed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoWitness {}

/// A plain predicate is a residency without witnesses: every block is looked up.
impl<F: FnMut(&BlockHash) -> bool> Residency for F {
    type Witness = NoWitness;

    fn lookup(&mut self, hash: &BlockHash) -> Lookup<NoWitness> {
        if self(hash) {
            Lookup::Hit(None)
        } else {
            Lookup::Miss
        }
    }

    fn still_resident(&mut self, _: &[Option<NoWitness>]) -> usize {
        0
    }
}
