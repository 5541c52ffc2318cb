//! Replica twin speed: 1,000 agentic sessions x 30 turns on one modelled H200 (Qwen2.5-7B
//! profile, 126,000 blocks of 16 tokens), no gate, replayed in virtual time by a minimal
//! closed-loop client (each session's next turn arrives a tool latency after its last answer).
//!
//! Prints the wall time, the simulated (virtual) time, and their ratio — how many times faster
//! than real time the replica runs, measured in the same run — plus steps/s and the replica's
//! counters. `cargo run --release --example sim_replica_speed [sessions] [turns]`; the last line
//! printed is one JSON object.
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Instant;

use session_gate::sim::{CostModel, Replica, ReplicaConfig, SimRequest};

/// A small deterministic generator (SplitMix64), so the example needs no RNG crate.
struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

struct Session {
    turn: u32,
    /// Tokens of the history so far (prompt + outputs of earlier turns).
    history: u32,
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sessions = args.first().copied().unwrap_or(1000);
    let turns = args.get(1).copied().unwrap_or(30);
    let cost = CostModel::profile("h200-qwen2.5-7b").expect("built-in profile");
    let config = ReplicaConfig::from_profile(&cost);
    let bs = config.block_size;
    let mut replica = Replica::new(config, cost).expect("valid profile shape");
    let mut rng = Mix(42);
    const SYSTEM: u32 = 512;
    let mut state: Vec<Session> = (0..sessions)
        .map(|_| Session {
            turn: 0,
            history: SYSTEM + 1000,
        })
        .collect();
    // Virtual time in microseconds for the event heap.
    let mut events: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    for s in 0..sessions {
        events.push(Reverse((rng.range(0, 5_000_000), s)));
    }
    let mut now_us: u64 = 0;
    let mut submitted = 0u64;
    let mut outputs = 0u64;
    let wall = Instant::now();
    loop {
        while let Some(&Reverse((t, s))) = events.peek() {
            if t > now_us {
                break;
            }
            events.pop();
            let st = &mut state[s as usize];
            let append = if st.turn == 0 {
                0
            } else {
                rng.range(200, 1500) as u32
            };
            let prompt = st.history + append;
            let output = rng.range(100, 300) as u32;
            // Hashes: the system prompt's blocks are shared by every session; the rest belong
            // to the session (its history is a prefix of each next prompt).
            let total = prompt + output;
            let hashes: Arc<[u64]> = (0..total / bs)
                .map(|i| {
                    if (i + 1) * bs <= SYSTEM {
                        u64::from(i)
                    } else {
                        (u64::from(s) + 1) << 32 | u64::from(i)
                    }
                })
                .collect();
            let id = u64::from(s) << 32 | u64::from(st.turn);
            replica
                .add_request(SimRequest {
                    id,
                    prompt_tokens: prompt,
                    max_tokens: output,
                    block_hashes: hashes,
                })
                .expect("request fits");
            st.history = total;
            submitted += 1;
        }
        match replica.step() {
            Some(out) => {
                now_us += (out.duration_sec * 1e6) as u64;
                for f in out.finished {
                    let s = (f.id >> 32) as u32;
                    let st = &mut state[s as usize];
                    outputs += 1;
                    st.turn += 1;
                    if st.turn < turns {
                        events.push(Reverse((now_us + rng.range(1_000_000, 5_000_000), s)));
                    }
                }
            }
            None => match events.peek() {
                Some(&Reverse((t, _))) => now_us = now_us.max(t),
                None => break,
            },
        }
    }
    let wall_sec = wall.elapsed().as_secs_f64();
    let sim_sec = now_us as f64 / 1e6;
    let st = replica.stats();
    println!(
        "{sessions} sessions x {turns} turns on h200-qwen2.5-7b ({} blocks x {bs}): {submitted} \
         requests, {} steps, {} preemptions, {:.1}M prefill tokens",
        config.num_blocks,
        st.steps,
        st.preemptions,
        st.prefill_tokens as f64 / 1e6
    );
    println!(
        "wall {wall_sec:.2} s for {sim_sec:.0} s simulated: {:.0}x real time, {:.0} steps/s",
        sim_sec / wall_sec,
        st.steps as f64 / wall_sec
    );
    println!(
        "{{\"sessions\": {sessions}, \"turns\": {turns}, \"requests\": {submitted}, \"finished\": {outputs}, \
         \"steps\": {}, \"preemptions\": {}, \"wall_sec\": {wall_sec:.3}, \"simulated_sec\": {sim_sec:.1}, \
         \"x_real_time\": {:.1}, \"steps_per_sec\": {:.0}}}",
        st.steps,
        st.preemptions,
        sim_sec / wall_sec,
        st.steps as f64 / wall_sec
    );
}
