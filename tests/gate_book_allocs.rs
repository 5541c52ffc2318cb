//! Heap allocations and time of one admit + release through the engine book with the gate
//! open: the engine-loop path of issue 11 (docs/lab-notes/engine-gate-cost.md), minus
//! Python. A counting global allocator (this test binary only) counts every allocation the
//! pair makes; the engine thread runs each call on cold caches, so each one costs far more
//! there than its arithmetic.
//!
//! `cargo test --release --test gate_book_allocs -- --ignored --nocapture` prints the time
//! per pair (a tight loop: warm caches, so a floor, not the engine-loop figure).
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use session_gate::gate::book::{Answer, BookProbes, EngineBook};
use session_gate::gate::testing::usage_report;
use session_gate::gate::{GateConfig, GateCore, PrefixReport, Reason, UsageReport};

struct Counting;

thread_local! {
    /// Allocations made by this thread (tests run on threads of their own, side by side).
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    ALLOCS.with(|n| n.set(n.get() + 1));
}

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A pool of 1000 blocks of 16 tokens at 10% usage: every admit is open.
struct Open;

impl BookProbes<()> for Open {
    fn usage(&mut self) -> Result<UsageReport, String> {
        Ok(usage_report(0.1, 1000, 16))
    }
    fn prefix(&mut self, _: &str, _: &()) -> (Result<PrefixReport, String>, f64) {
        panic!("an open gate never walks the prefix")
    }
}

/// The benchmark's ids (`bench.clients`: a new session and ticket per admit, one client).
fn ids(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| (format!("ticket-{i:08}"), format!("loop-{i}")))
        .collect()
}

/// One admit + release of `ids[i]`, checked: open, answered in the call, released.
fn pair(book: &mut EngineBook<()>, ticket: &str, session: &str, retain: bool, now: f64) {
    let answer = book
        .admit(
            ticket,
            "client-0",
            session,
            32,
            1,
            retain,
            (),
            now,
            &mut Open,
        )
        .unwrap();
    let Some(Answer::Admitted(a)) = answer else {
        panic!("expected an admission in the call, got {answer:?}");
    };
    assert_eq!(a.reason, Reason::Open);
    assert!(book.release(a.lease.0, Some("client-0"), now, &mut Open));
}

fn book() -> EngineBook<()> {
    EngineBook::new(GateCore::new(GateConfig::default()).unwrap(), 30.0).unwrap()
}

/// Allocations per admit + release, after a warm-up that sized every table. Without an
/// ownership window each pair is a new session (as the benchmark runs it); with one, every
/// pair is a turn of the same session (new sessions' idle windows would fill the pool).
fn allocs_per_pair(retain: bool) -> f64 {
    const N: usize = 1000;
    let ids = ids(2 * N);
    let session = |s: &'static str, own: &str| {
        if retain {
            s.to_string()
        } else {
            own.to_string()
        }
    };
    let mut b = book();
    for (i, (t, s)) in ids[..N].iter().enumerate() {
        pair(&mut b, t, &session("agent", s), retain, i as f64 * 1e-3);
    }
    let sessions: Vec<String> = ids[N..].iter().map(|(_, s)| session("agent", s)).collect();
    let before = allocs();
    for (i, ((t, _), s)) in ids[N..].iter().zip(&sessions).enumerate() {
        pair(&mut b, t, s, retain, 1.0 + i as f64 * 1e-3);
    }
    (allocs() - before) as f64 / N as f64
}

#[test]
fn an_open_admit_and_its_release_allocate_only_their_ids() {
    // One copy of the session id (the core's session table) and one of the ticket (a cancel
    // racing the grant must find its lease); nothing else per call.
    let n = allocs_per_pair(false);
    println!("allocations per open admit + release (retain_session=False): {n}");
    assert!(n <= 2.0, "{n} allocations per admit + release");
    // A session's next turn copies only its ticket: the session table keeps its id while the
    // ownership window holds it (the ledger's B-trees keep their nodes between turns).
    let n = allocs_per_pair(true);
    println!("allocations per open admit + release (retain_session=True): {n}");
    assert!(n <= 1.5, "{n} allocations per admit + release");
}

/// A pool of 1000 blocks at 95% usage with nothing resident: every new admit waits.
struct Full;

impl BookProbes<()> for Full {
    fn usage(&mut self) -> Result<UsageReport, String> {
        Ok(usage_report(0.95, 1000, 16))
    }
    fn prefix(&mut self, _: &str, _: &()) -> (Result<PrefixReport, String>, f64) {
        (Ok(PrefixReport::default()), 0.0)
    }
}

/// Allocations of one release while `waiters` admits wait in line behind it (the cache stays
/// full and another lease stays committed, so the head of the line, woken by the release,
/// waits again).
fn allocs_per_release_before(waiters: usize) -> u64 {
    let mut b = book();
    let mut admit_open = |name: &str| match b
        .admit(name, "client-0", name, 32, 1, false, (), 0.0, &mut Open)
        .unwrap()
    {
        Some(Answer::Admitted(a)) => a.lease.0,
        other => panic!("{name} is admitted on an open cache, got {other:?}"),
    };
    let (held, _kept) = (admit_open("holder"), admit_open("keeper"));
    for i in 0..waiters {
        let (ticket, session) = (format!("ticket-{i}"), format!("waiter-{i}"));
        let answer = b
            .admit(
                &ticket,
                "client-0",
                &session,
                32,
                1,
                false,
                (),
                0.1,
                &mut Full,
            )
            .unwrap();
        assert!(
            answer.is_none(),
            "waiter {i} waits on a full cache: {answer:?}"
        );
    }
    let before = allocs();
    assert!(b.release(held, Some("client-0"), 0.2, &mut Full));
    let n = allocs() - before;
    let resolved = b.take_resolved();
    assert!(
        resolved.is_empty(),
        "every waiter still waits: {resolved:?}"
    );
    n
}

#[test]
fn a_release_polls_only_the_waiters_it_may_let_in() {
    // The release moves the epoch: the head of the line is polled (and waits again); the
    // others would answer the same wait, so they are not polled, and cost nothing each.
    let (few, many) = (allocs_per_release_before(2), allocs_per_release_before(40));
    println!("allocations per release: {few} with 2 waiters, {many} with 40");
    assert_eq!(few, many, "a release costs more with more waiters in line");
}

#[test]
#[ignore = "timing; run with --release --ignored --nocapture"]
fn time_per_open_admit_and_release() {
    const N: usize = 200_000;
    let ids = ids(N);
    for _ in 0..3 {
        let mut b = book();
        let t = Instant::now();
        for (i, (tk, s)) in ids.iter().enumerate() {
            pair(&mut b, tk, s, false, i as f64 * 1e-6);
        }
        let ns = t.elapsed().as_nanos() as f64 / N as f64;
        println!("open admit + release, tight loop: {ns:.0} ns per pair");
    }
}
