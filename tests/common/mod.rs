//! Helpers shared by the twin's integration tests: a replica whose every step takes the same
//! time, so virtual-time expectations are exact, and sessions run on it.
#![allow(dead_code)] // each test crate uses some of the helpers

use session_gate::sim::driver::{ModeSpec, SessionSpec, SimOutput, TurnRecord, TurnSpec, simulate};
use session_gate::sim::{CostModel, Replica, ReplicaConfig};

/// Seconds every step of [`flat_replica`] takes, whatever it schedules.
pub const STEP: f64 = 0.01;

/// A profile whose steps all take [`STEP`] seconds, whatever they schedule.
pub fn flat_cost() -> CostModel {
    flat_cost_with("")
}

/// [`flat_cost`] with `extra` lines in its `[replica]` table.
pub fn flat_cost_with(extra: &str) -> CostModel {
    let coef = |v: f64| format!("{{ value = {v}, source = \"test\" }}");
    let text = format!(
        "name = \"flat\"\ndescription = \"every step 10 ms\"\n\
         [replica]\nkv_bytes_per_token = 1\nnum_blocks = 1024\nblock_size = 16\n\
         max_num_seqs = 16\nmax_num_batched_tokens = 8192\nsource = \"test\"\n{extra}\n\
         [cost]\nstep_sec = {}\nper_seq_sec = {}\nper_token_sec = {}\nweights_sec = {}\n\
         prefill_attn_sec = {}\ndecode_ctx_sec = {}\n",
        coef(STEP),
        coef(0.0),
        coef(0.0),
        coef(0.0),
        coef(0.0),
        coef(0.0)
    );
    CostModel::from_toml("flat.toml", &text).unwrap()
}

/// A replica of `num_blocks` blocks of 16 tokens (16 sequences, 8,192 tokens a step) on
/// [`flat_cost`].
pub fn flat_replica(num_blocks: u32) -> Replica {
    let config = ReplicaConfig {
        num_blocks,
        block_size: 16,
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
    };
    Replica::new(config, flat_cost()).unwrap()
}

/// A session of `turns` (appended tokens, output tokens, tool latency), arriving at `arrival`.
pub fn session(
    id: &str,
    system: u32,
    task: u32,
    arrival: f64,
    turns: &[(u32, u32, f64)],
) -> SessionSpec {
    SessionSpec {
        session_id: id.into(),
        system_tokens: system,
        task_tokens: task,
        arrival,
        turns: turns
            .iter()
            .map(|&(append, output, tool_latency)| TurnSpec {
                append,
                output,
                tool_latency,
            })
            .collect(),
    }
}

/// `sessions` through `mode` on a [`flat_replica`] of `num_blocks` blocks (seed 7).
pub fn run(sessions: Vec<SessionSpec>, num_blocks: u32, mode: ModeSpec) -> SimOutput {
    let n = sessions.len();
    let mut m = mode.build(n).unwrap();
    simulate(sessions, 7, flat_replica(num_blocks), m.as_mut()).unwrap()
}

/// Session `s`'s turn records, in turn order.
pub fn of(out: &SimOutput, s: usize) -> Vec<&TurnRecord> {
    let mut r: Vec<_> = out.records.iter().filter(|r| r.session == s).collect();
    r.sort_by_key(|r| r.turn);
    r
}
