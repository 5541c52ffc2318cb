//! Gate benchmark: open-path acquire + release latency through the tokio driver with an instant
//! fake probe (and the bare core as the same-run baseline), and heap bytes per session with
//! 10,000 sessions holding reservations, measured with a counting allocator.
//!
//! `cargo run --release --example bench_gate`; the last line printed is one JSON object.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use session_gate::gate::testing::{ScriptedProbe, usage_report};
use session_gate::gate::{Action, AttemptId, Gate, GateConfig, GateCore, Probe};

/// Counts live heap bytes, so memory per session is measured rather than estimated.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const ITERATIONS: usize = 200_000;
const WARMUP: usize = 20_000;
const SESSIONS: usize = 10_000;
const NUM_BLOCKS: u64 = 10_000_000;
const BLOCK_SIZE: u64 = 16;
const PROMPT: usize = 1024;
const MAX_TOKENS: usize = 256;

fn median_us(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (at(0.5), at(0.99))
}

/// Open path through the tokio driver: `acquire` (usage probe, decision, lease) + `release`.
fn driver_open_path() -> (f64, f64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let probe = Arc::new(ScriptedProbe::new(usage_report(
        0.1, NUM_BLOCKS, BLOCK_SIZE,
    )));
    let gate = Gate::new(probe as Arc<dyn Probe>, GateConfig::default()).unwrap();
    let prompt = vec![1u32; PROMPT];
    rt.block_on(async {
        let mut samples = Vec::with_capacity(ITERATIONS);
        for i in 0..WARMUP + ITERATIONS {
            let t = Instant::now();
            let mut lease = gate
                .acquire("bench", &prompt, MAX_TOKENS, false)
                .await
                .unwrap();
            lease.release();
            let ns = t.elapsed().as_nanos() as u64;
            if i >= WARMUP {
                samples.push(ns);
            }
        }
        median_us(samples)
    })
}

/// Drives one attempt of the bare core to its admission with an idle engine.
fn admit(core: &mut GateCore, id: AttemptId, now: f64) -> session_gate::gate::Admission {
    loop {
        match core.poll(id, now).unwrap() {
            Action::ProbeUsage => core
                .on_usage(id, Ok(usage_report(0.1, NUM_BLOCKS, BLOCK_SIZE)), now)
                .unwrap(),
            Action::Admit(a) => return a,
            other => panic!("open path expected, got {other:?}"),
        }
    }
}

/// The same open path on the bare core: the baseline the driver's overhead is measured against.
fn core_open_path() -> (f64, f64) {
    let mut core = GateCore::new(GateConfig::default()).unwrap();
    let origin = Instant::now();
    let mut samples = Vec::with_capacity(ITERATIONS);
    for i in 0..WARMUP + ITERATIONS {
        let t = Instant::now();
        let now = origin.elapsed().as_secs_f64();
        let id = core.begin("bench", PROMPT, MAX_TOKENS, false, now);
        let a = admit(&mut core, id, now);
        core.release(a.lease, now);
        let ns = t.elapsed().as_nanos() as u64;
        if i >= WARMUP {
            samples.push(ns);
        }
    }
    median_us(samples)
}

/// Heap bytes per session with `SESSIONS` sessions holding reservations: in flight (leases
/// held) or idle (released into their grace window). Session ids are 36-character UUID-like
/// strings, as agent frameworks use.
fn bytes_per_session(release: bool) -> (f64, f64) {
    let before = LIVE.load(Ordering::Relaxed);
    let mut core = GateCore::new(GateConfig::default()).unwrap();
    for i in 0..SESSIONS {
        let sid = format!("{i:08x}-0000-4000-8000-000000000000");
        let id = core.begin(&sid, PROMPT, MAX_TOKENS, true, 0.0);
        let a = admit(&mut core, id, 0.0);
        if release {
            core.release(a.lease, 1.0);
        }
    }
    let s = core.stats();
    assert_eq!(s.reservations_held as usize, SESSIONS);
    let measured = (LIVE.load(Ordering::Relaxed) - before) as f64 / SESSIONS as f64;
    let approx = core.approx_bytes() as f64 / SESSIONS as f64;
    drop(core);
    (measured, approx)
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    println!(
        "bench_gate: {} {}, {cores} cores, {profile} build, {ITERATIONS} iterations after {WARMUP} warm-up",
        std::env::consts::OS,
        std::env::consts::ARCH,
    );
    let (core_med, core_p99) = core_open_path();
    println!("core open path (sans-IO baseline): median {core_med:.3} us, p99 {core_p99:.3} us");
    let (drv_med, drv_p99) = driver_open_path();
    println!(
        "tokio driver open path, acquire+release: median {drv_med:.3} us, p99 {drv_p99:.3} us"
    );
    let (in_flight, approx_in_flight) = bytes_per_session(false);
    let (idle, approx_idle) = bytes_per_session(true);
    println!(
        "bytes/session at {SESSIONS} sessions: in flight {in_flight:.0} (approx_bytes {approx_in_flight:.0}), idle grace {idle:.0} (approx_bytes {approx_idle:.0})"
    );
    let worst = in_flight.max(idle);
    println!(
        "{{\"open_path_rust_us\": {drv_med:.3}, \"open_path_rust_p99_us\": {drv_p99:.3}, \
         \"open_path_core_us\": {core_med:.3}, \"driver_over_core_ratio\": {:.2}, \
         \"bytes_per_session\": {worst:.0}, \"bytes_per_session_in_flight\": {in_flight:.0}, \
         \"bytes_per_session_idle\": {idle:.0}, \"approx_bytes_per_session\": {:.0}, \
         \"sessions\": {SESSIONS}, \"iterations\": {ITERATIONS}, \"cores\": {cores}, \
         \"profile\": \"{profile}\", \"target_open_path_us\": 5, \"target_bytes_per_session\": 1024}}",
        drv_med / core_med,
        approx_in_flight.max(approx_idle),
    );
}
