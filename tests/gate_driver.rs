//! The tokio driver with the scripted fake probe: leases, waking, preemption, cancellation,
//! probes that fail or hang (tokio's paused clock), and a multi-threaded run for lost wake-ups.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use session_gate::Error;
use session_gate::gate::testing::{Behaviour, ScriptedProbe, usage_report};
use session_gate::gate::{Gate, GateConfig, Lease, Pressure, Probe, ProbeKind, Reason};

const BS: usize = 16;

fn probe(usage: f64) -> Arc<ScriptedProbe> {
    Arc::new(ScriptedProbe::new(usage_report(usage, 100, BS as u64)))
}

fn gate_with(p: &Arc<ScriptedProbe>, cfg: GateConfig) -> Gate {
    Gate::new(Arc::clone(p) as Arc<dyn Probe>, cfg).unwrap()
}

fn gate(p: &Arc<ScriptedProbe>) -> Gate {
    gate_with(p, GateConfig::default())
}

/// A prompt of `blocks` KV blocks.
fn prompt(blocks: usize) -> Vec<u32> {
    vec![7; blocks * BS]
}

async fn acquire(g: &Gate, session: &str, blocks: usize, retain: bool) -> Lease {
    g.acquire(session, &prompt(blocks), 0, retain)
        .await
        .unwrap()
}

fn spawn_acquire(
    g: &Gate,
    session: &str,
    blocks: usize,
    retain: bool,
) -> tokio::task::JoinHandle<session_gate::Result<Lease>> {
    let (g, session) = (g.clone(), session.to_string());
    tokio::spawn(async move { g.acquire(&session, &prompt(blocks), 0, retain).await })
}

/// Awaits a spawned acquire; a waiter nobody wakes fails the test instead of hanging it
/// (under the paused clock the minute passes at once).
async fn admitted(
    task: tokio::task::JoinHandle<session_gate::Result<Lease>>,
) -> session_gate::Result<Lease> {
    tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("the waiter was never admitted")
        .unwrap()
}

/// Lets spawned tasks run until they block, without moving the paused clock much.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 0.01
}

#[tokio::test(start_paused = true)]
async fn the_open_path_admits_and_a_release_frees_the_reservation() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut lease = acquire(&g, "s", 10, false).await;
    assert_eq!(lease.reason(), Reason::Open);
    assert_eq!(lease.session_id(), "s");
    assert_eq!(lease.wait_sec(), 0.0);
    assert_eq!(lease.usage(), Some(0.1));
    assert_eq!(g.stats().committed_blocks, 10);
    assert!(lease.release());
    assert!(!lease.release(), "second release is a no-op");
    drop(lease);
    let s = g.stats();
    assert_eq!((s.leases_released, s.leases_dropped_unreleased), (1, 0));
    assert_eq!((s.committed_blocks, s.sessions), (0, 0));
    assert_eq!((p.usage_calls(), p.prefix_calls()), (1, 0));
    assert_eq!(s.probe(ProbeKind::Usage).latency.count, 1);
}

#[tokio::test(start_paused = true)]
async fn a_waiting_acquire_is_admitted_as_soon_as_the_holder_releases() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut holder = acquire(&g, "holder", 80, false).await;
    let waiter = spawn_acquire(&g, "cold", 20, false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiter.is_finished());
    assert_eq!(g.stats().waiting, 1);
    holder.release();
    let lease = admitted(waiter).await.unwrap();
    assert_eq!(lease.reason(), Reason::Open);
    assert!(
        close(lease.wait_sec(), 1.0),
        "woken, not polled: {}",
        lease.wait_sec()
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_lease_is_released_and_counted() {
    let p = probe(0.1);
    let g = gate(&p);
    let holder = acquire(&g, "holder", 80, false).await;
    let waiter = spawn_acquire(&g, "cold", 20, false);
    settle().await;
    drop(holder);
    let lease = admitted(waiter).await.unwrap();
    assert_eq!(lease.reason(), Reason::Open);
    let s = g.stats();
    assert_eq!((s.leases_dropped_unreleased, s.leases_released), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_prefix_probe_that_raises_is_a_miss_until_room_frees() {
    let p = probe(0.1);
    let g = gate(&p);
    let holder = acquire(&g, "holder", 80, false).await;
    p.set_prefix(Behaviour::Fail("no engine half".into()));
    let waiter = spawn_acquire(&g, "cold", 20, false);
    settle().await;
    assert!(
        !waiter.is_finished(),
        "committed mode waits instead of failing open"
    );
    assert!(g.stats().probe(ProbeKind::Prefix).failures >= 1);
    drop(holder);
    let lease = admitted(waiter).await.unwrap();
    assert_eq!(lease.reason(), Reason::Open);
}

fn engine_mode(p: &Arc<ScriptedProbe>) -> Gate {
    gate_with(
        p,
        GateConfig {
            pressure: Pressure::Engine,
            ..Default::default()
        },
    )
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_raises_admits_with_prefix_probe_unavailable_in_engine_mode() {
    let p = probe(0.9);
    let g = engine_mode(&p);
    p.set_prefix(Behaviour::Fail("no engine half".into()));
    let lease = acquire(&g, "cold", 20, false).await;
    assert_eq!(lease.reason(), Reason::PrefixProbeUnavailable);
    assert_eq!(lease.hit_ratio(), None);
    assert_eq!(g.stats().probe(ProbeKind::Prefix).failures, 1);
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_hangs_times_out_and_counts_as_unavailable() {
    let p = probe(0.9);
    let g = engine_mode(&p);
    p.set_prefix(Behaviour::Hang);
    let lease = acquire(&g, "cold", 20, false).await;
    assert_eq!(lease.reason(), Reason::PrefixProbeUnavailable);
    assert!(close(lease.wait_sec(), 2.0), "{}", lease.wait_sec());
    let prefix = g.stats().probe(ProbeKind::Prefix).clone();
    assert_eq!(prefix.failures, 1);
    assert!(close(prefix.latency.sum, 2.0));
}

#[tokio::test(start_paused = true)]
async fn a_hanging_usage_probe_does_not_hang_the_gate() {
    let p = probe(0.1);
    p.set_usage(Behaviour::Hang);
    let g = gate_with(
        &p,
        GateConfig {
            probe_timeout_sec: 0.5,
            ..Default::default()
        },
    );
    let lease = acquire(&g, "s", 10, false).await;
    assert_eq!(
        lease.reason(),
        Reason::Open,
        "nothing committed: never held"
    );
    assert!(close(lease.wait_sec(), 0.5));
    assert_eq!(lease.usage(), None);
    assert_eq!(g.stats().probe(ProbeKind::Usage).failures, 1);
}

#[tokio::test(start_paused = true)]
async fn a_resident_prefix_is_admitted_under_pressure() {
    let p = probe(0.1);
    let g = gate(&p);
    let _holder = acquire(&g, "holder", 80, false).await;
    p.set_hit("hot", 0.9);
    let lease = acquire(&g, "hot", 20, false).await;
    assert_eq!(lease.reason(), Reason::ResidentPrefix);
    assert_eq!(lease.hit_ratio(), Some(0.9));
}

#[tokio::test(start_paused = true)]
async fn cancelling_a_waiting_acquire_leaves_no_trace() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut holder = acquire(&g, "holder", 80, false).await;
    let doomed = spawn_acquire(&g, "doomed", 20, false);
    let behind = spawn_acquire(&g, "behind", 20, false);
    settle().await;
    assert_eq!(g.stats().waiting, 2);
    doomed.abort();
    assert!(doomed.await.unwrap_err().is_cancelled());
    let s = g.stats();
    assert_eq!((s.waiting, s.pending, s.cancellations), (1, 1, 1));
    // A caller-side timeout is a cancellation too.
    let timed_out = tokio::time::timeout(
        Duration::from_secs(1),
        g.acquire("impatient", &prompt(20), 0, false),
    )
    .await;
    assert!(timed_out.is_err());
    let s = g.stats();
    assert_eq!((s.waiting, s.pending, s.cancellations), (1, 1, 2));
    holder.release();
    let lease = admitted(behind).await.unwrap();
    assert_eq!(lease.reason(), Reason::Open);
    assert_eq!(g.stats().sessions, 1, "only `behind` is known");
    g.inspect(|c| c.check_invariants()).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_newer_acquire_preempts_a_waiting_one() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut holder = acquire(&g, "holder", 80, false).await;
    let first = spawn_acquire(&g, "s", 20, false);
    settle().await;
    let retry = spawn_acquire(&g, "s", 20, false);
    match admitted(first).await {
        Err(Error::Preempted { session_id }) => assert_eq!(session_id, "s"),
        other => panic!("expected Preempted, got {other:?}"),
    }
    assert_eq!(g.num_preempted("s"), 1);
    holder.release();
    let lease = admitted(retry).await.unwrap();
    assert_eq!(lease.admission().num_preempted, 1);
    assert_eq!(g.stats().preemptions, 1);
}

#[tokio::test(start_paused = true)]
async fn finish_session_forgets_the_session_and_wakes_a_waiter() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut agent = acquire(&g, "agent", 80, true).await;
    agent.release();
    let waiter = spawn_acquire(&g, "cold", 20, false);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiter.is_finished(), "the idle window holds the room");
    assert!(g.finish_session("agent").await);
    assert_eq!(p.forgotten(), vec!["agent".to_string()]);
    let lease = admitted(waiter).await.unwrap();
    assert!(close(lease.wait_sec(), 2.0));
    assert!(!g.finish_session("agent").await);
}

#[tokio::test(start_paused = true)]
async fn the_tool_result_turn_reenters_without_a_prefix_probe() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut agent = acquire(&g, "agent", 30, true).await;
    agent.release();
    let _other = acquire(&g, "other", 50, false).await;
    let calls = p.prefix_calls();
    let lease = acquire(&g, "agent", 40, true).await;
    assert_eq!(lease.reason(), Reason::ReservedSession);
    assert_eq!(p.prefix_calls(), calls);
    assert!(g.inspect(|c| c.has_reservation("agent")));
}

#[tokio::test(start_paused = true)]
async fn grace_expiry_wakes_the_head_waiter() {
    let p = probe(0.1);
    let g = gate_with(
        &p,
        GateConfig {
            wait_poll_sec: 100.0,
            idle_grace_sec: 10.0,
            ..Default::default()
        },
    );
    let mut agent = acquire(&g, "agent", 80, true).await;
    // A 2 s turn: 8 of them (16 s) outlast the 10 s window, so it never yields to the waiter
    // (gate::core, "Yielding idle room") and only the window's end lets it in.
    tokio::time::sleep(Duration::from_secs(2)).await;
    agent.release();
    let lease = acquire(&g, "cold", 20, false).await;
    assert_eq!(lease.reason(), Reason::Open);
    assert!(close(lease.wait_sec(), 10.0), "{}", lease.wait_sec());
    assert_eq!(g.stats().grace_expired, 1);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_looks_again_every_wait_poll_sec() {
    let p = probe(0.9);
    let g = gate_with(
        &p,
        GateConfig {
            pressure: Pressure::Engine,
            ..Default::default()
        },
    );
    let waiter = spawn_acquire(&g, "s", 10, false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    p.set_usage(Behaviour::Answer(usage_report(0.2, 100, BS as u64)));
    let lease = admitted(waiter).await.unwrap();
    assert_eq!(lease.reason(), Reason::Open);
    assert!(close(lease.wait_sec(), 5.0), "{}", lease.wait_sec());
    assert_eq!(p.usage_calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn max_wait_admits_through_the_driver() {
    let p = probe(0.1);
    let g = gate_with(
        &p,
        GateConfig {
            max_wait_sec: Some(12.0),
            ..Default::default()
        },
    );
    let _holder = acquire(&g, "holder", 80, false).await;
    let lease = acquire(&g, "cold", 20, false).await;
    assert_eq!(lease.reason(), Reason::MaxWait);
    assert!(close(lease.wait_sec(), 12.0));
}

#[tokio::test(start_paused = true)]
async fn waiters_are_admitted_in_arrival_order() {
    let p = probe(0.1);
    let g = gate(&p);
    let mut holder = acquire(&g, "holder", 80, false).await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (g, order) = (g.clone(), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let mut lease = g
                .acquire(&format!("w{i}"), &prompt(30), 0, false)
                .await
                .unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_secs(1)).await;
            lease.release();
        }));
        settle().await;
    }
    holder.release();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_on_threads_never_lose_a_wake_up() {
    let p = probe(0.1);
    // A lost wake-up would park a waiter for a minute and trip the timeout below.
    let g = gate_with(
        &p,
        GateConfig {
            wait_poll_sec: 60.0,
            idle_grace_sec: 0.05,
            ..Default::default()
        },
    );
    let mut tasks = Vec::new();
    for i in 0..64 {
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            let session = format!("s{i}");
            for turn in 0..5 {
                let blocks = 5 + (i % 7) + turn * 3;
                let mut lease = g
                    .acquire(&session, &prompt(blocks), 16, true)
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
                lease.release();
            }
            g.finish_session(&session).await;
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(30), all)
        .await
        .expect("every session finished");
    let s = g.stats();
    assert_eq!(s.admissions_total(), 64 * 5);
    assert_eq!((s.reservations_held, s.pending, s.sessions), (0, 0, 0));
    g.inspect(|c| c.check_invariants()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_racing_a_waiter_going_to_sleep_still_wakes_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let p = probe(0.1);
    let g = gate_with(
        &p,
        GateConfig {
            wait_poll_sec: 60.0,
            ..Default::default()
        },
    );
    for round in 0..1_000u32 {
        let mut holder = acquire(&g, "holder", 80, false).await;
        let go = Arc::new(AtomicBool::new(false));
        let (g2, go2) = (g.clone(), Arc::clone(&go));
        let waiter = tokio::spawn(async move {
            while !go2.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            g2.acquire("cold", &prompt(20), 0, false).await
        });
        // Release from a plain thread after a delay swept across rounds, so the release lands
        // at every point of the waiter's poll-then-sleep sequence.
        let spins = (round % 250) * 4;
        let releaser = std::thread::spawn(move || {
            go.store(true, Ordering::Release);
            for _ in 0..spins {
                std::hint::spin_loop();
            }
            holder.release();
        });
        let lease = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the waiter slept through the release"))
            .unwrap()
            .unwrap();
        releaser.join().unwrap();
        drop(lease);
    }
}
