//! The twin's scheduler, rule by rule, as vLLM 0.32's V1 `Scheduler` applies them.
use std::sync::Arc;

use session_gate::sim::{CostModel, Replica, ReplicaConfig, SimRequest};

const BS: u32 = 16;

/// Hashes for a sequence whose first `shared` blocks come from `base` and the rest are unique
/// to `own`: two requests share block i iff they share the hash at i.
fn hashes(base: u64, shared: u32, own: u64, total_tokens: u32) -> Arc<[u64]> {
    (0..total_tokens / BS)
        .map(|i| {
            if i < shared {
                base * 1_000_000 + u64::from(i)
            } else {
                own * 1_000_000 + u64::from(i)
            }
        })
        .collect()
}

fn req(id: u64, prompt: u32, max_tokens: u32, h: Arc<[u64]>) -> SimRequest {
    SimRequest {
        id,
        prompt_tokens: prompt,
        max_tokens,
        block_hashes: h,
    }
}

fn unique(id: u64, prompt: u32, max_tokens: u32) -> SimRequest {
    req(
        id,
        prompt,
        max_tokens,
        hashes(0, 0, 1000 + id, prompt + max_tokens),
    )
}

fn replica(num_blocks: u32, max_seqs: u32, budget: u32) -> Replica {
    let config = ReplicaConfig {
        num_blocks,
        block_size: BS,
        max_num_seqs: max_seqs,
        max_num_batched_tokens: budget,
    };
    Replica::new(config, CostModel::profile("cpu-tiny").unwrap()).unwrap()
}

#[test]
fn a_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes() {
    let mut r = replica(100, 4, 100);
    r.add_request(unique(1, 250, 3)).unwrap();
    let tokens: Vec<u64> = (0..5)
        .map(|_| r.step().unwrap().num_scheduled_tokens)
        .collect();
    assert_eq!(tokens, vec![100, 100, 50, 1, 1]);
    assert!(r.step().is_none(), "finished after its third output");
    assert_eq!(r.stats().prefill_tokens, 250);
}

#[test]
fn running_requests_take_the_budget_first_and_waiting_ones_get_the_rest() {
    let mut r = replica(200, 4, 64);
    r.add_request(unique(1, 40, 10)).unwrap();
    r.step().unwrap(); // prefill of 1 (40 tokens), first output
    r.add_request(unique(2, 500, 2)).unwrap();
    let s = r.step().unwrap();
    // 1 decode token for request 1, then 63 prefill tokens for request 2.
    assert_eq!(s.num_scheduled_tokens, 64);
    assert_eq!(r.scheduler().num_computed(2), Some(63));
    assert_eq!(r.scheduler().running_ids(), &[1, 2]);
}

#[test]
fn max_num_seqs_bounds_the_running_set_and_fcfs_order_is_kept() {
    let mut r = replica(200, 2, 1000);
    for id in 1..=3 {
        r.add_request(unique(id, 20, 2)).unwrap();
    }
    r.step().unwrap();
    assert_eq!(r.scheduler().running_ids(), &[1, 2]);
    assert_eq!(r.scheduler().waiting_ids(), vec![3]);
    let s = r.step().unwrap(); // 1 and 2 decode their 2nd token and finish
    let done: Vec<u64> = s.finished.iter().map(|f| f.id).collect();
    assert_eq!(done, vec![1, 2]);
    r.step().unwrap();
    assert_eq!(r.scheduler().running_ids(), &[3]);
}

#[test]
fn when_blocks_run_out_the_last_admitted_request_is_preempted_to_the_front_of_the_queue() {
    // 9 usable blocks. Requests 1 and 2 each take 4 blocks (64-token prompts); both decode
    // past their 4th block, so the 9th block goes to 1 and request 2 (admitted last) is
    // preempted when it needs its 5th.
    let mut r = replica(10, 4, 1000);
    r.add_request(unique(1, 64, 40)).unwrap();
    r.add_request(unique(2, 64, 40)).unwrap();
    r.add_request(unique(3, 17, 2)).unwrap();
    let first = r.step().unwrap();
    assert_eq!(
        first.num_scheduled_tokens, 128,
        "3 does not fit a full-prompt admission"
    );
    assert_eq!(r.scheduler().waiting_ids(), vec![3]);
    // Step 2: 1 needs block 5 (token 65): gets the last free block. 2 needs block 5: none
    // left, so the last running request (2 itself) is preempted.
    let s = r.step().unwrap();
    assert_eq!(s.preempted, vec![2]);
    assert_eq!(
        r.scheduler().waiting_ids(),
        vec![2, 3],
        "preempted goes to the FRONT"
    );
    assert_eq!(r.scheduler().num_computed(2), Some(0));
    assert_eq!(
        r.scheduler().num_output(2),
        Some(1),
        "its output so far is kept, recomputed"
    );
    assert_eq!(r.stats().preemptions, 1);
}

#[test]
fn preemption_pops_later_requests_before_the_one_that_needs_blocks() {
    // 1, 2, 3 each hold 3 blocks of the 9 usable; request 1 needs a 4th: the last admitted
    // (3) is preempted, not 1 itself, and 2 still runs.
    let mut r = replica(10, 4, 1000);
    r.add_request(unique(1, 48, 30)).unwrap();
    r.add_request(unique(2, 40, 30)).unwrap();
    r.add_request(unique(3, 40, 30)).unwrap();
    r.step().unwrap();
    assert_eq!(r.scheduler().running_ids(), &[1, 2, 3]);
    let s = r.step().unwrap(); // 1 crosses into block 4 (token 49)
    assert_eq!(s.preempted, vec![3]);
    assert_eq!(r.scheduler().running_ids(), &[1, 2]);
    assert_eq!(r.scheduler().waiting_ids(), vec![3]);
}

#[test]
fn no_waiting_request_is_admitted_in_a_step_that_preempted() {
    let mut r = replica(10, 4, 1000);
    r.add_request(unique(1, 64, 40)).unwrap();
    r.add_request(unique(2, 64, 40)).unwrap();
    r.step().unwrap();
    r.add_request(unique(4, 16, 2)).unwrap();
    let s = r.step().unwrap();
    assert_eq!(s.preempted, vec![2]);
    // 2 freed 4 blocks, enough for 4's 1 block, but the waiting pass is skipped this step.
    assert_eq!(r.scheduler().waiting_ids(), vec![2, 4]);
    assert_eq!(s.num_scheduled_tokens, 1);
}

#[test]
fn admission_needs_the_whole_prompt_to_fit_not_just_the_first_chunk() {
    let mut r = replica(10, 4, 48); // 9 usable blocks, 48-token budget
    r.add_request(unique(1, 48, 40)).unwrap();
    r.step().unwrap(); // 3 blocks
    r.add_request(unique(2, 96, 1)).unwrap();
    // 1 decodes into its 4th block; 47 tokens of budget are left for 2, whose first chunk
    // (3 blocks) would fit in the 5 free blocks, but its whole prompt (6 blocks) does not.
    let s = r.step().unwrap();
    assert_eq!(s.num_scheduled_tokens, 1);
    assert_eq!(r.scheduler().waiting_ids(), vec![2]);
}

#[test]
fn num_cached_tokens_is_the_hit_at_first_admission_capped_below_the_prompt() {
    let mut r = replica(100, 4, 1000);
    // Request 1: 64 prompt + 16 output tokens = 5 full blocks, all cached when computed.
    r.add_request(req(1, 64, 17, hashes(7, 6, 7, 96))).unwrap();
    while r.step().is_some() {}
    // Request 2 continues the same conversation: the 80 tokens of 1 plus 16 new = 96 tokens;
    // 5 blocks are cached but the hit is capped at (96 - 1) // 16 = 5 blocks = 80 tokens.
    r.add_request(req(2, 96, 1, hashes(7, 6, 7, 112))).unwrap();
    let s = r.step().unwrap();
    assert_eq!(s.finished[0].num_cached_tokens, 80);
    assert_eq!(s.num_scheduled_tokens, 16);
    // A prompt that is exactly the cached 5 blocks hits only 4 (one token must be computed).
    r.add_request(req(3, 80, 1, hashes(7, 6, 7, 96))).unwrap();
    assert_eq!(r.probe_prefix(&hashes(7, 6, 7, 96), 80).hit_tokens, 64);
    let s = r.step().unwrap();
    assert_eq!(s.finished[0].num_cached_tokens, 64);
}

#[test]
fn a_preempted_request_keeps_the_num_cached_tokens_of_its_first_admission() {
    let mut r = replica(10, 4, 1000);
    // Warm 2 blocks of conversation 9.
    r.add_request(req(1, 33, 1, hashes(9, 4, 9, 48))).unwrap();
    while r.step().is_some() {}
    r.add_request(unique(2, 64, 40)).unwrap();
    r.add_request(req(3, 60, 40, hashes(9, 4, 9, 112))).unwrap();
    // 3 hits 2 blocks (32 tokens) at admission; later it is preempted and readmitted.
    let mut cached = None;
    let mut preempted = false;
    while let Some(s) = r.step() {
        preempted |= s.preempted.contains(&3);
        for f in s.finished {
            if f.id == 3 {
                cached = Some((f.num_cached_tokens, f.num_preemptions));
            }
        }
    }
    assert!(preempted);
    let (tokens, times) = cached.unwrap();
    assert_eq!(tokens, 32);
    assert!(times >= 1);
}

#[test]
fn abort_frees_the_blocks_and_usage_reports_them_free() {
    let mut r = replica(20, 4, 1000);
    r.add_request(unique(1, 64, 10)).unwrap();
    r.step().unwrap();
    let u = r.usage();
    assert_eq!(u.num_blocks, 19);
    assert_eq!(u.num_free_blocks, 19 - 4);
    assert_eq!(u.num_cached_free_blocks, Some(0));
    assert!(r.abort_request(1));
    assert!(!r.abort_request(1));
    let u = r.usage();
    assert_eq!(u.num_free_blocks, 19);
    assert_eq!(
        u.num_cached_free_blocks,
        Some(4),
        "the 4 full prompt blocks stay cached"
    );
    assert_eq!(u.kv_cache_usage, 0.0);
    assert_eq!(r.num_running() + r.num_waiting(), 0);
}

#[test]
fn bad_requests_and_configs_are_refused_with_the_reason() {
    let mut r = replica(10, 4, 100);
    assert!(
        r.add_request(unique(1, 0, 1))
            .unwrap_err()
            .to_string()
            .contains("empty prompt")
    );
    assert!(
        r.add_request(unique(1, 10, 0))
            .unwrap_err()
            .to_string()
            .contains("max_tokens")
    );
    assert!(
        r.add_request(unique(1, 140, 10))
            .unwrap_err()
            .to_string()
            .contains("never fit")
    );
    r.add_request(unique(1, 10, 1)).unwrap();
    assert!(
        r.add_request(unique(1, 10, 1))
            .unwrap_err()
            .to_string()
            .contains("already")
    );
    let bad = ReplicaConfig {
        num_blocks: 1,
        block_size: 16,
        max_num_seqs: 1,
        max_num_batched_tokens: 1,
    };
    let err = Replica::new(bad, CostModel::profile("cpu-tiny").unwrap()).unwrap_err();
    assert!(err.to_string().contains("num_blocks"));
}

#[test]
fn the_same_inputs_give_the_same_run() {
    let run = || {
        let mut r = replica(40, 4, 64);
        for id in 0..12 {
            r.add_request(req(
                id,
                30 + (id as u32 * 37) % 200,
                5 + (id as u32 % 7),
                hashes(id % 3, 5, id, 400),
            ))
            .unwrap();
        }
        let mut log = Vec::new();
        while let Some(s) = r.step() {
            log.push((s.duration_sec.to_bits(), s.finished, s.preempted));
        }
        log
    };
    assert_eq!(run(), run());
}

/// Holds the requests whose ids it lists; counts the looks and keeps the queue counts each
/// look was given.
struct Hold(Vec<u64>, u32, Vec<(usize, usize)>);

impl session_gate::sim::scheduler::WaitingGate for Hold {
    fn may_schedule(
        &mut self,
        req: &SimRequest,
        _kv: &session_gate::sim::kv_manager::KvManager,
        queues: (usize, usize),
    ) -> bool {
        self.1 += 1;
        self.2.push(queues);
        !self.0.contains(&req.id)
    }
}

#[test]
fn a_waiting_gate_skips_held_requests_in_place_and_schedules_the_ones_behind() {
    let mut r = replica(100, 4, 1000);
    for id in 1..=3 {
        r.add_request(unique(id, 40, 2)).unwrap();
    }
    let mut gate = Hold(vec![1], 0, Vec::new());
    r.step_gated(Some(&mut gate)).unwrap();
    let ids: Vec<u64> = r.last_scheduled().iter().map(|e| e.0).collect();
    assert_eq!(ids, vec![2, 3]);
    assert_eq!(r.scheduler().waiting_ids(), vec![1], "held in place");
    assert_eq!(gate.1, 3);
    // Each look sees the queues as the step left them: a request let through leaves the
    // waiting queue for the running list before the next look, as in vLLM's `schedule()`.
    assert_eq!(gate.2, vec![(0, 3), (0, 3), (1, 2)]);
    // Once let through, it is scheduled with the running ones; a gate holding everything
    // waiting and nothing running is a step with no work.
    gate.0.clear();
    r.step_gated(Some(&mut gate)).unwrap();
    assert_eq!(r.scheduler().waiting_ids(), Vec::<u64>::new());
    let mut r = replica(100, 4, 1000);
    r.add_request(unique(9, 40, 2)).unwrap();
    assert!(
        r.step_gated(Some(&mut Hold(vec![9], 0, Vec::new())))
            .is_none()
    );
    assert_eq!(r.scheduler().waiting_ids(), vec![9]);
}
