//! The scheduler side of vLLM 0.32's native KV offloading (`OffloadingConnectorScheduler` in
//! `distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`) over the twin's
//! [`HostTier`], with the transfers' timing: what the scheduler calls, when, and how long the
//! DMA takes.
//!
//! What vLLM's source does, and the twin with it:
//! - **Store on compute, prompt only.** At every step, each scheduled request offers the full
//!   blocks it will have computed after the step, up to its prompt (`offload_prompt_only`,
//!   on by default), from the first block it has not offered yet (`next_stored_chunk_idx`,
//!   which starts at 0 so GPU prefix hits are offered too, and jumps past a loaded prefix).
//!   A refused offer is retried at the next step. The store runs on the worker after the
//!   step's forward pass; the chunks become readable when it completes.
//! - **Load at admission, asynchronously.** A waiting request being admitted with no computed
//!   tokens looks up, after its GPU prefix hit, the leading blocks the tier holds (up to its
//!   current length). Any of them still being stored, or being loaded by another request,
//!   defers it to a later step. Otherwise it gets blocks for the GPU hit plus the loaded
//!   blocks (the whole sequence must fit, as for any admission), the load starts, and it
//!   waits in the queue (`WAITING_FOR_REMOTE_KVS`, skipped by the waiting pass, holding its
//!   blocks) until the load completes; then it is scheduled with those tokens computed (a
//!   full hit recomputes its last token).
//! - **Recency at finish.** A request's `on_request_finished` runs after the next step's
//!   stores.
//!
//! Transfers: loads share one host-to-device channel and stores one device-to-host channel
//! (PCIe is full duplex), each first in, first out, at the profile's bandwidths. A
//! completion is seen at the end of the first step that ends after it (the worker reports
//! finished transfers with each step's output).
//!
//! Not modelled: `store_threshold` (0 by default), partial-tail loads (off for plain attention
//! models), the in-flight load reservation of the admission check, a failed transfer.
use std::collections::VecDeque;

use super::BlockHash;
use super::block_pool::IdMap;
use super::cost::CostModel;
use super::host_tier::HostTier;
use crate::{Error, Result};

/// vLLM rounds each host chunk up to the page size (`SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT`,
/// `mmap.PAGESIZE`).
const CHUNK_ALIGNMENT: u64 = 4096;

/// The tier's size and transfer speeds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OffloadConfig {
    /// Capacity in chunks of one GPU block.
    pub num_chunks: u64,
    /// KV bytes of one GPU block.
    pub bytes_per_block: u64,
    /// Host-to-device bytes per second.
    pub load_bytes_per_sec: f64,
    /// Device-to-host bytes per second.
    pub store_bytes_per_sec: f64,
}

impl OffloadConfig {
    /// The tier `--kv-offloading-size gib` gives an engine of `cost`'s profile with blocks of
    /// `block_size` tokens: `gib × 2^30` bytes (vLLM's `cpu_bytes_to_use`) in page-aligned
    /// chunks of one block, at the profile's `[offload]` speeds.
    pub fn from_profile(cost: &CostModel, gib: f64, block_size: u32) -> Result<Self> {
        let speeds = cost.offload.as_ref().ok_or_else(|| {
            Error::InvalidInput(format!(
                "profile `{}` has no [offload] table (the host tier's load and store speeds), \
                 so it cannot run with --offload-gb",
                cost.name
            ))
        })?;
        if !gib.is_finite() || gib <= 0.0 {
            return Err(Error::InvalidInput(format!(
                "offload size {gib} GiB: expected a number > 0"
            )));
        }
        let bytes_per_block = cost.shape.kv_bytes_per_token * u64::from(block_size);
        let aligned = bytes_per_block.div_ceil(CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT;
        let num_chunks = (gib * f64::from(1u32 << 30)) as u64 / aligned;
        if num_chunks == 0 {
            return Err(Error::InvalidInput(format!(
                "offload size {gib} GiB holds no block of {bytes_per_block} bytes"
            )));
        }
        Ok(OffloadConfig {
            num_chunks,
            bytes_per_block,
            load_bytes_per_sec: speeds.load_bytes_per_sec,
            store_bytes_per_sec: speeds.store_bytes_per_sec,
        })
    }
}

/// What the tier answers for a request being admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtHit {
    /// Skip the request this step (a hit block is being stored or loaded).
    Defer,
    /// This many leading blocks after the GPU hit can be loaded (0: none).
    Blocks(u32),
}

/// Cumulative transfer counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OffloadStats {
    /// Blocks loaded into the GPU.
    pub loaded_blocks: u64,
    /// Blocks stored to the host.
    pub stored_blocks: u64,
    /// Loads started.
    pub loads: u64,
    /// Store offers the tier refused (no room to evict).
    pub refused_stores: u64,
}

#[derive(Debug)]
struct LoadJob {
    keys: Vec<BlockHash>,
    done_at: f64,
    done: bool,
}

/// The connector's scheduler side (see the module docs).
#[derive(Debug)]
pub struct Offload {
    /// The tier's accounting (public for probes and tests).
    pub tier: HostTier,
    cfg: OffloadConfig,
    load_free_at: f64,
    store_free_at: f64,
    loads: IdMap<u64, LoadJob>,
    /// Keys loads in flight read, with how many loads read each.
    being_loaded: IdMap<BlockHash, u32>,
    /// Stores issued in the current step (they start once its forward pass ends).
    issued: Vec<Vec<BlockHash>>,
    /// Stores in flight, by completion time (FIFO, so already in order).
    stores: VecDeque<(f64, Vec<BlockHash>)>,
    /// Next block index each request offers.
    next_stored: IdMap<u64, u32>,
    /// Requests finished or aborted since the last step's stores.
    finished: Vec<u64>,
    stats: OffloadStats,
}

impl Offload {
    /// An empty tier of this size and speed.
    pub fn new(cfg: OffloadConfig) -> Self {
        Offload {
            tier: HostTier::new(cfg.num_chunks),
            cfg,
            load_free_at: 0.0,
            store_free_at: 0.0,
            loads: IdMap::default(),
            being_loaded: IdMap::default(),
            issued: Vec::new(),
            stores: VecDeque::new(),
            next_stored: IdMap::default(),
            finished: Vec::new(),
            stats: OffloadStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &OffloadConfig {
        &self.cfg
    }

    /// Cumulative counters.
    pub fn stats(&self) -> &OffloadStats {
        &self.stats
    }

    /// Whether `req` has a load in flight or done but not yet consumed.
    pub fn is_loading(&self, req: u64) -> bool {
        self.loads.contains_key(&req)
    }

    /// Whether `req`'s load has completed.
    pub fn load_done(&self, req: u64) -> bool {
        self.loads.get(&req).is_some_and(|l| l.done)
    }

    /// The admission lookup: blocks `gpu_hit..num_tokens / block_size` of `hashes`.
    pub fn lookup(&self, hashes: &[BlockHash], gpu_hit: u32, num_full_blocks: u32) -> ExtHit {
        let end = (num_full_blocks as usize).min(hashes.len());
        let start = (gpu_hit as usize).min(end);
        let keys = &hashes[start..end];
        let (n, pending) = self.tier.leading_hits(keys);
        if pending {
            return ExtHit::Defer;
        }
        if !self.being_loaded.is_empty()
            && keys[..n as usize]
                .iter()
                .any(|k| self.being_loaded.contains_key(k))
        {
            return ExtHit::Defer;
        }
        ExtHit::Blocks(n)
    }

    /// Starts loading blocks `from..from + n` of `hashes` for `req` at time `now`; the
    /// request's stores continue after them.
    pub fn start_load(&mut self, req: u64, hashes: &[BlockHash], from: u32, n: u32, now: f64) {
        let keys: Vec<(u32, BlockHash)> =
            (from..from + n).map(|i| (i, hashes[i as usize])).collect();
        self.tier.prepare_load(req, &keys);
        let bytes = f64::from(n) * self.cfg.bytes_per_block as f64;
        let start = now.max(self.load_free_at);
        let done_at = start + bytes / self.cfg.load_bytes_per_sec;
        self.load_free_at = done_at;
        for &(_, k) in &keys {
            *self.being_loaded.entry(k).or_default() += 1;
        }
        self.loads.insert(
            req,
            LoadJob {
                keys: keys.into_iter().map(|(_, k)| k).collect(),
                done_at,
                done: false,
            },
        );
        self.next_stored.insert(req, from + n);
        self.stats.loads += 1;
        self.stats.loaded_blocks += u64::from(n);
    }

    /// The request whose load completed is scheduled: forget the job.
    pub fn consume_load(&mut self, req: u64) {
        let job = self.loads.remove(&req);
        debug_assert!(job.is_some_and(|j| j.done));
    }

    /// `req` (scheduled in this step) will have `computed` tokens of its `prompt_tokens`
    /// computed after the step: offer its new full prompt blocks.
    pub fn offer(
        &mut self,
        req: u64,
        hashes: &[BlockHash],
        computed: u32,
        prompt_tokens: u32,
        block_size: u32,
    ) {
        let full = (computed.min(prompt_tokens) / block_size).min(hashes.len() as u32);
        let from = self.next_stored.get(&req).copied().unwrap_or(0);
        if full <= from {
            return;
        }
        let keys: Vec<(u32, BlockHash)> = (from..full).map(|i| (i, hashes[i as usize])).collect();
        match self.tier.prepare_store(req, &keys) {
            None => self.stats.refused_stores += 1,
            Some(stored) => {
                self.next_stored.insert(req, full);
                if !stored.keys.is_empty() {
                    self.stats.stored_blocks += stored.keys.len() as u64;
                    self.issued.push(stored.keys);
                }
            }
        }
    }

    /// `req` finished or was aborted: its recency update runs after the next step's stores.
    pub fn finish(&mut self, req: u64) {
        if let Some(job) = self.loads.remove(&req) {
            // An aborted load: the twin ends it at once.
            if !job.done {
                self.end_load(&job.keys);
            }
        }
        self.next_stored.remove(&req);
        self.finished.push(req);
    }

    /// After this step's stores were offered: the finished requests' recency updates.
    pub fn after_stores(&mut self) {
        for req in std::mem::take(&mut self.finished) {
            self.tier.request_finished(req);
        }
    }

    fn end_load(&mut self, keys: &[BlockHash]) {
        self.tier.complete_load(keys);
        for k in keys {
            if let Some(c) = self.being_loaded.get_mut(k) {
                *c -= 1;
                if *c == 0 {
                    self.being_loaded.remove(k);
                }
            }
        }
    }

    /// The step ended at `end`: this step's stores start, and the transfers done by then are
    /// reported.
    pub fn end_step(&mut self, end: f64) {
        for keys in std::mem::take(&mut self.issued) {
            let bytes = keys.len() as f64 * self.cfg.bytes_per_block as f64;
            let start = end.max(self.store_free_at);
            let done_at = start + bytes / self.cfg.store_bytes_per_sec;
            self.store_free_at = done_at;
            self.stores.push_back((done_at, keys));
        }
        // Stores issued at this very step end later than `end` (bytes > 0), so only earlier
        // ones complete here.
        while self.stores.front().is_some_and(|(t, _)| *t <= end) {
            let (_, keys) = self.stores.pop_front().expect("checked");
            self.tier.complete_store(&keys);
        }
        let mut ended = Vec::new();
        for job in self.loads.values_mut() {
            if !job.done && job.done_at <= end {
                job.done = true;
                ended.push(std::mem::take(&mut job.keys));
            }
        }
        for keys in ended {
            self.end_load(&keys);
        }
    }

    /// When the next transfer in flight completes, if any (an engine with nothing else to run
    /// keeps stepping until then).
    pub fn next_completion(&self) -> Option<f64> {
        let load = self
            .loads
            .values()
            .filter(|l| !l.done)
            .map(|l| l.done_at)
            .min_by(f64::total_cmp);
        let store = self.stores.front().map(|(t, _)| *t);
        let issued = (!self.issued.is_empty()).then_some(f64::NEG_INFINITY);
        [load, store, issued]
            .into_iter()
            .flatten()
            .min_by(f64::total_cmp)
    }
}
