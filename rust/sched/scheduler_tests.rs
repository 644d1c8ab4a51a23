//! Behaviour tests of the scheduler, driven by a fake token source, plus a
//! seeded randomized workload checking invariants after every step.

use std::collections::HashMap;

use crate::error::KvError;
use crate::sched::request::{FinishReason, RequestParams};
use crate::sched::scheduler::{Policy, Scheduler, SchedulerConfig, TokenEvent};
use crate::test_rng::SplitMix64;

pub(super) const EOS: u32 = 2;

pub(super) fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        eos_token_ids: vec![EOS],
        ..SchedulerConfig::default()
    }
}

fn params(max_tokens: u32) -> RequestParams {
    RequestParams {
        max_tokens,
        ignore_eos: true,
        ..RequestParams::default()
    }
}

fn prompt(len: usize, base: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 10 + base + i).collect()
}

/// Outputs of every sample of every request, in sample order.
#[derive(Default)]
struct Outputs {
    tokens: HashMap<(u64, u32), Vec<u32>>,
    finish: HashMap<(u64, u32), FinishReason>,
    steps: usize,
}

/// Run until idle, sampling `token(step, row)` for each sampled row.
fn run(sched: &mut Scheduler, mut token: impl FnMut(usize, usize) -> i64) -> Outputs {
    let mut out = Outputs::default();
    let mut events = Vec::new();
    while sched.has_unfinished_requests() {
        let rows = sched.schedule().unwrap().num_sampled();
        let sampled: Vec<i64> = (0..rows).map(|r| token(out.steps, r)).collect();
        events.clear();
        sched.update(&sampled, &mut events).unwrap();
        record(&mut out, &events);
        sched.check_invariants().unwrap();
        out.steps += 1;
        assert!(out.steps < 100_000, "scheduler made no progress");
    }
    out
}

fn record(out: &mut Outputs, events: &[TokenEvent]) {
    for e in events {
        out.tokens
            .entry((e.request, e.sample_index))
            .or_default()
            .push(e.token);
        if let Some(reason) = e.finish {
            out.finish.insert((e.request, e.sample_index), reason);
        }
    }
}

fn assert_all_blocks_back(sched: &Scheduler) {
    sched.check_invariants().unwrap();
    assert_eq!(
        sched.kv().num_referenced_blocks(),
        0,
        "every KV block returns to the pool"
    );
}

#[test]
fn seeds_example_static_batching_is_46_9_percent_efficient() {
    let mut sched = Scheduler::new(SchedulerConfig {
        policy: Policy::Static,
        max_num_seqs: 4,
        max_num_batched_tokens: 4096,
        max_model_len: 512,
        ..config(512, 16)
    })
    .unwrap();
    for (i, len) in [32, 128, 64, 256].into_iter().enumerate() {
        sched
            .add_request(&prompt(8, i as u32 * 100), params(len), 0, None)
            .unwrap();
    }
    let out = run(&mut sched, |_, _| 7);
    let useful: usize = out.tokens.values().map(Vec::len).sum();
    assert_eq!(useful, 480);
    assert_eq!(sched.stats.seq_rows, 1024, "4 seats x 256 steps");
    let efficiency = useful as f64 / sched.stats.seq_rows as f64;
    assert!(
        (efficiency - 0.469).abs() < 0.001,
        "efficiency {efficiency}"
    );
    assert_all_blocks_back(&sched);
}

#[test]
fn static_batch_prefill_respects_the_token_budget() {
    let mut sched = Scheduler::new(SchedulerConfig {
        policy: Policy::Static,
        max_num_seqs: 4,
        max_num_batched_tokens: 16,
        max_model_len: 64,
        ..config(256, 4)
    })
    .unwrap();
    for i in 0..4 {
        sched
            .add_request(&prompt(12, i * 50), params(3), 0, None)
            .unwrap();
    }
    let mut steps = 0;
    let mut out = Outputs::default();
    while sched.has_unfinished_requests() {
        let plan = sched.schedule().unwrap();
        assert!(
            plan.num_tokens() <= 16,
            "step of {} tokens",
            plan.num_tokens()
        );
        let rows = plan.num_sampled();
        let mut events = Vec::new();
        sched.update(&vec![7; rows], &mut events).unwrap();
        record(&mut out, &events);
        steps += 1;
    }
    assert!(steps >= 3, "48 prompt tokens need at least 3 steps of 16");
    assert!(out.tokens.values().all(|t| t.len() == 3));
    assert_eq!(out.tokens.len(), 4);
    assert_all_blocks_back(&sched);
}

#[test]
fn continuous_batching_never_idles_a_seat_while_work_waits() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_seqs: 4,
        max_model_len: 512,
        ..config(512, 16)
    })
    .unwrap();
    for round in 0..3 {
        for (i, len) in [32, 128, 64, 256].into_iter().enumerate() {
            sched
                .add_request(
                    &prompt(8, (round * 4 + i) as u32 * 50),
                    params(len),
                    0,
                    None,
                )
                .unwrap();
        }
    }
    let out = run(&mut sched, |_, _| 7);
    assert_eq!(out.tokens.values().map(Vec::len).sum::<usize>(), 3 * 480);
    assert_eq!(sched.stats.idle_seats_while_waiting, 0);
    assert_eq!(sched.stats.ghost_rows, 0);
    assert_all_blocks_back(&sched);
}

#[test]
fn finished_sequence_frees_blocks_and_waiting_one_joins_next_step() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_seqs: 1,
        ..config(64, 4)
    })
    .unwrap();
    let a = sched
        .add_request(&prompt(4, 0), params(2), 0, None)
        .unwrap();
    let b = sched
        .add_request(&prompt(4, 50), params(2), 0, None)
        .unwrap();
    let mut events = Vec::new();
    for _ in 0..2 {
        sched.schedule().unwrap();
        sched.update(&[7], &mut events).unwrap();
    }
    assert_eq!(events.last().unwrap().finish, Some(FinishReason::Length));
    assert_eq!(events.last().unwrap().request, a);
    let plan = sched.schedule().unwrap();
    assert_eq!(
        plan.token_ids.len(),
        4,
        "b's prompt runs in the very next step"
    );
    assert_eq!(plan.sample_request, vec![b]);
    assert_eq!(
        sched.kv().num_referenced_blocks(),
        1,
        "a's blocks are already back"
    );
}

#[test]
fn chunked_prefill_mixes_long_prompt_with_decodes() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 16,
        ..config(128, 4)
    })
    .unwrap();
    sched
        .add_request(&prompt(4, 0), params(20), 0, None)
        .unwrap();
    let mut events = Vec::new();
    sched.schedule().unwrap();
    sched.update(&[7], &mut events).unwrap();
    sched
        .add_request(&prompt(40, 100), params(1), 0, None)
        .unwrap();
    let mut prefill_steps = 0;
    loop {
        let plan = sched.schedule().unwrap();
        assert!(plan.num_tokens() <= 16, "the token budget holds");
        assert_eq!(
            plan.num_decode_tokens, 1,
            "the decode keeps flowing every step"
        );
        let rows = plan.num_sampled();
        prefill_steps += 1;
        events.clear();
        sched.update(&vec![7; rows], &mut events).unwrap();
        if rows == 2 {
            break;
        }
    }
    assert_eq!(
        prefill_steps, 3,
        "40 prompt tokens in chunks of 15 + 15 + 10"
    );
}

#[test]
fn long_prefill_threshold_caps_one_prompt_per_step() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 64,
        long_prefill_token_threshold: 8,
        ..config(128, 4)
    })
    .unwrap();
    sched
        .add_request(&prompt(30, 0), params(1), 0, None)
        .unwrap();
    sched
        .add_request(&prompt(30, 100), params(1), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.kv_lens, vec![8, 8]);
}

#[test]
fn limited_prefix_reuse_computes_the_positions_past_the_limit() {
    let mut sched = Scheduler::new(config(128, 4)).unwrap();
    let long = prompt(20, 0);
    sched.add_request(&long, params(1), 0, None).unwrap();
    run(&mut sched, |_, _| 7);
    // 16 of 20 tokens (4 full blocks) are cached; a limit of 10 reuses 2 blocks.
    let h = sched.add_request(&long, params(1), 0, None).unwrap();
    sched.limit_prefix_reuse(h, 10).unwrap();
    let positions = sched.schedule().unwrap().positions.clone();
    assert_eq!(positions, (8..20).collect::<Vec<_>>());
    assert_eq!(sched.num_cached_tokens(h), Some(8));
    let mut events = Vec::new();
    sched.update(&[7], &mut events).unwrap();
    sched.check_invariants().unwrap();
    // Not after scheduling, nor for an unknown handle.
    assert!(sched.limit_prefix_reuse(h, 4).is_err());
    assert!(sched.limit_prefix_reuse(h + (1 << 40), 4).is_err());
    run(&mut sched, |_, _| 7);
}

#[test]
fn prefix_cache_hit_prefills_only_the_suffix() {
    let mut sched = Scheduler::new(config(128, 4)).unwrap();
    let shared = prompt(16, 0);
    sched.add_request(&shared, params(1), 0, None).unwrap();
    run(&mut sched, |_, _| 7);
    let mut longer = shared.clone();
    longer.extend([500, 501, 502]);
    let h = sched.add_request(&longer, params(1), 0, None).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_tokens(), 3, "16 cached tokens, 3 to compute");
    assert_eq!(plan.positions, vec![16, 17, 18]);
    assert_eq!(sched.num_cached_tokens(h), Some(16));
    let mut events = Vec::new();
    sched.update(&[7], &mut events).unwrap();
    // A fully cached prompt still recomputes its last block for logits.
    sched.add_request(&shared, params(1), 0, None).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.positions, vec![12, 13, 14, 15]);
    assert_eq!(plan.logits_indices, vec![3]);
}

#[test]
fn requests_with_a_shared_system_prompt_share_from_the_first_step() {
    let mut sched = Scheduler::new(config(256, 16)).unwrap();
    let system = prompt(200, 0);
    for user in 0..4u32 {
        let mut p = system.clone();
        p.extend([900 + user, 901, 902]);
        sched.add_request(&p, params(4), 0, None).unwrap();
    }
    let mut events = Vec::new();
    loop {
        let rows = sched.schedule().unwrap().num_sampled();
        sched.update(&vec![7; rows], &mut events).unwrap();
        if events.len() >= 4 {
            break;
        }
    }
    // 12 full system blocks are shared; each request owns its tail block.
    assert_eq!(sched.kv().num_referenced_blocks(), 12 + 4);
}

#[test]
fn preempted_requests_finish_with_exact_length_under_tiny_pool() {
    // 16 blocks of 4 tokens: far less than 8 requests x 40 tokens need.
    let mut sched = Scheduler::new(SchedulerConfig {
        max_model_len: 64,
        ..config(16, 4)
    })
    .unwrap();
    let mut handles = Vec::new();
    for i in 0..8 {
        handles.push(
            sched
                .add_request(&prompt(10, i * 30), params(30), 0, None)
                .unwrap(),
        );
    }
    let out = run(&mut sched, |step, row| (step * 7 + row) as i64 % 50 + 100);
    assert!(
        sched.stats.num_preemptions > 0,
        "the pool is small enough to force preemption"
    );
    for h in handles {
        assert_eq!(out.tokens[&(h, 0)].len(), 30, "exactly max_tokens tokens");
        assert_eq!(out.finish[&(h, 0)], FinishReason::Length);
    }
    assert_all_blocks_back(&sched);
}

#[test]
fn priority_preempts_lower_priority_when_seats_are_full() {
    let mut sched = Scheduler::new(SchedulerConfig {
        policy: Policy::Priority,
        max_num_seqs: 2,
        ..config(128, 4)
    })
    .unwrap();
    let low_a = sched
        .add_request(&prompt(4, 0), params(50), 5, None)
        .unwrap();
    let low_b = sched
        .add_request(&prompt(4, 40), params(50), 5, None)
        .unwrap();
    let mut events = Vec::new();
    sched.schedule().unwrap();
    sched.update(&[7, 7], &mut events).unwrap();
    let urgent = sched
        .add_request(&prompt(4, 80), params(3), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(
        plan.preempted,
        vec![low_b],
        "the latest low-priority request yields its seat"
    );
    assert!(plan.sample_request.contains(&urgent) && plan.sample_request.contains(&low_a));
    let rows = plan.num_sampled();
    sched.update(&vec![7; rows], &mut events).unwrap();
    let out = run(&mut sched, |_, _| 7);
    assert_eq!(
        out.tokens[&(low_b, 0)].len() + 1,
        50,
        "the preempted request resumes and finishes"
    );
    assert_all_blocks_back(&sched);
}

#[test]
fn priority_preempts_lower_priority_when_memory_is_short() {
    let mut sched = Scheduler::new(SchedulerConfig {
        policy: Policy::Priority,
        max_num_seqs: 8,
        max_model_len: 32,
        ..config(8, 4)
    })
    .unwrap();
    let low = sched
        .add_request(&prompt(24, 0), params(4), 9, None)
        .unwrap();
    let mut events = Vec::new();
    sched.schedule().unwrap();
    sched.update(&[7], &mut events).unwrap();
    let high = sched
        .add_request(&prompt(24, 100), params(2), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.preempted, vec![low]);
    assert_eq!(plan.sample_request, vec![high]);
    let rows = plan.num_sampled();
    sched.update(&vec![7; rows], &mut events).unwrap();
    run(&mut sched, |_, _| 7);
    assert_all_blocks_back(&sched);
}

#[test]
fn abort_during_prefill_and_decode_frees_everything() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 8,
        ..config(64, 4)
    })
    .unwrap();
    let prefilling = sched
        .add_request(&prompt(30, 0), params(5), 0, None)
        .unwrap();
    let decoding = sched
        .add_request(&prompt(3, 100), params(50), 0, None)
        .unwrap();
    let waiting = sched
        .add_request(&prompt(3, 200), params(5), 0, None)
        .unwrap();
    sched.schedule().unwrap();
    let mut events = Vec::new();
    sched.update(&[], &mut events).unwrap();
    assert!(sched.abort_request(prefilling).unwrap());
    let rows = sched.schedule().unwrap().num_sampled();
    sched.update(&vec![7; rows], &mut events).unwrap();
    assert!(sched.abort_request(decoding).unwrap());
    assert!(sched.abort_request(waiting).unwrap());
    assert!(
        !sched.abort_request(waiting).unwrap(),
        "aborting twice is a no-op"
    );
    assert!(!sched.has_unfinished_requests());
    assert_all_blocks_back(&sched);
}

#[test]
fn abort_between_schedule_and_update_drops_that_row() {
    let mut sched = Scheduler::new(config(64, 4)).unwrap();
    let a = sched
        .add_request(&prompt(3, 0), params(5), 0, None)
        .unwrap();
    let b = sched
        .add_request(&prompt(3, 100), params(5), 0, None)
        .unwrap();
    sched.schedule().unwrap();
    sched.abort_request(a).unwrap();
    let mut events = Vec::new();
    sched.update(&[7, 8], &mut events).unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].request, b);
    sched.check_invariants().unwrap();
}

#[test]
fn parallel_sampling_prefills_once_and_forks() {
    let mut sched = Scheduler::new(config(64, 4)).unwrap();
    let h = sched
        .add_request(&prompt(10, 0), RequestParams { n: 3, ..params(5) }, 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_tokens(), 10, "the prompt is prefilled once");
    assert_eq!(plan.logits_indices, vec![9, 9, 9]);
    assert_eq!(plan.sample_index, vec![0, 1, 2]);
    assert_eq!(
        sched.kv().num_referenced_blocks(),
        3,
        "children share the prompt's blocks"
    );
    let mut events = Vec::new();
    sched.update(&[7, 8, 9], &mut events).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(
        plan.copy_src.len(),
        2,
        "two of three samples copy the shared partial block"
    );
    let rows = plan.num_sampled();
    sched.update(&vec![7; rows], &mut events).unwrap();
    let out = run(&mut sched, |_, r| r as i64 + 20);
    for i in 0..3 {
        assert_eq!(out.tokens[&(h, i)].len() + 2, 5);
    }
    assert_all_blocks_back(&sched);
}

#[test]
fn stop_conditions_eos_min_tokens_stop_ids_and_max_model_len() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_model_len: 12,
        ..config(64, 4)
    })
    .unwrap();
    let eos = sched
        .add_request(
            &prompt(3, 0),
            RequestParams {
                max_tokens: 9,
                ..Default::default()
            },
            0,
            None,
        )
        .unwrap();
    let min = sched
        .add_request(
            &prompt(3, 0),
            RequestParams {
                max_tokens: 9,
                min_tokens: 3,
                ..Default::default()
            },
            0,
            None,
        )
        .unwrap();
    let ignore = sched
        .add_request(&prompt(3, 0), params(2), 0, None)
        .unwrap();
    let stop_id = sched
        .add_request(
            &prompt(3, 0),
            RequestParams {
                max_tokens: 9,
                stop_token_ids: vec![77],
                ..Default::default()
            },
            0,
            None,
        )
        .unwrap();
    let model_len = sched
        .add_request(&prompt(10, 0), params(u32::MAX), 0, None)
        .unwrap();
    let out = run(&mut sched, |step, row| {
        if row == 3 {
            77
        } else if step >= 1 {
            EOS as i64
        } else {
            5
        }
    });
    assert_eq!(out.tokens[&(eos, 0)], vec![5, EOS]);
    assert_eq!(
        out.tokens[&(min, 0)],
        vec![5, EOS, EOS],
        "EOS ignored until min_tokens"
    );
    assert_eq!(out.tokens[&(ignore, 0)].len(), 2);
    assert_eq!(out.finish[&(ignore, 0)], FinishReason::Length);
    assert_eq!(out.tokens[&(stop_id, 0)], vec![77]);
    assert_eq!(out.finish[&(stop_id, 0)], FinishReason::Stop);
    assert_eq!(
        out.tokens[&(model_len, 0)].len(),
        2,
        "10 prompt + 2 = max_model_len 12"
    );
    assert_eq!(out.finish[&(model_len, 0)], FinishReason::Length);
}

#[test]
fn a_prompt_of_max_model_len_tokens_gets_one_token_and_needs_no_more_kv() {
    // Scoring a rollout that stopped at max_model_len (LLM.score: prompt + completion,
    // max_tokens = 1) must be accepted: the sampled token's KV is never written.
    let mut sched = Scheduler::new(SchedulerConfig {
        max_model_len: 16,
        max_num_batched_tokens: 16,
        ..config(4, 4)
    })
    .unwrap();
    let full = sched
        .add_request(&prompt(16, 0), params(u32::MAX), 0, None)
        .unwrap();
    let scored = sched
        .add_request(&prompt(16, 5), params(1), 0, None)
        .unwrap();
    let out = run(&mut sched, |_, _| 5);
    for handle in [full, scored] {
        assert_eq!(out.tokens[&(handle, 0)], vec![5]);
        assert_eq!(out.finish[&(handle, 0)], FinishReason::Length);
    }
    assert_all_blocks_back(&sched);
}

#[test]
fn bad_requests_are_rejected_with_the_offending_value() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_model_len: 64,
        ..config(64, 4)
    })
    .unwrap();
    let err = |r: Result<u64, KvError>| r.unwrap_err().to_string();
    assert!(err(sched.add_request(&[], params(1), 0, None)).contains("empty"));
    assert!(err(sched.add_request(&prompt(65, 0), params(1), 0, None)).contains("65 tokens"));
    assert!(
        err(sched.add_request(&prompt(3, 0), RequestParams { n: 0, ..params(1) }, 0, None))
            .contains("n must")
    );
    assert!(err(sched.add_request(&prompt(3, 0), params(0), 0, None)).contains("max_tokens"));
    assert!(
        err(sched.add_request(&prompt(65, 0), params(1), 0, None)).contains("max_model_len is 64"),
        "a prompt past max_model_len is refused"
    );
    let unreachable = RequestParams {
        min_tokens: 10,
        ..params(100)
    };
    assert!(
        err(sched.add_request(&prompt(60, 0), unreachable, 0, None))
            .contains("min_tokens=10 cannot be reached: only 4 tokens fit"),
        "min_tokens is checked against max_tokens clamped to the room left"
    );
    assert!(err(sched.add_request(
        &prompt(3, 0),
        RequestParams {
            min_tokens: 9,
            ..params(8)
        },
        0,
        None
    ))
    .contains("min_tokens (9) must be <= max_tokens (8)"));
    let pool_too_small = SchedulerConfig {
        max_model_len: 1000,
        ..config(8, 4)
    };
    assert!(
        Scheduler::new(pool_too_small).is_err(),
        "a pool that cannot hold one max-length sequence"
    );
}

#[test]
fn update_with_wrong_token_count_changes_nothing() {
    let mut sched = Scheduler::new(config(64, 4)).unwrap();
    sched
        .add_request(&prompt(3, 0), params(5), 0, None)
        .unwrap();
    sched.schedule().unwrap();
    let mut events = Vec::new();
    assert!(sched.update(&[1, 2], &mut events).is_err());
    assert!(sched.update(&[-5], &mut events).is_err());
    assert!(
        sched.schedule().is_err(),
        "the step still awaits its update"
    );
    sched.update(&[1], &mut events).unwrap();
    assert_eq!(events.len(), 1);
    sched.check_invariants().unwrap();
}

#[test]
fn randomized_workloads_keep_invariants_and_return_every_block() {
    let seed = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xbeef);
    for (round, policy) in [Policy::Fcfs, Policy::Priority, Policy::Static]
        .into_iter()
        .enumerate()
    {
        let seed = seed + round as u64;
        let mut rng = SplitMix64::new(seed);
        let mut sched = Scheduler::new(SchedulerConfig {
            policy,
            max_num_seqs: 6,
            max_num_batched_tokens: 32,
            max_model_len: 48,
            long_prefill_token_threshold: if round == 1 { 12 } else { 0 },
            ..config(24, 4)
        })
        .unwrap();
        let mut live = Vec::new();
        let mut events = Vec::new();
        for step in 0..4000 {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if rng.chance(1, 3) {
                    let len = 1 + rng.below(20);
                    let base = rng.below(3) as u32 * 7;
                    let p: Vec<u32> = (0..len as u32).map(|i| base + i % 9).collect();
                    let n = 1 + rng.below(3) as u32;
                    let max_tokens = 1 + rng.below(20) as u32;
                    let request = RequestParams {
                        n,
                        max_tokens,
                        ..RequestParams::default()
                    };
                    let salt = [None, Some("x")][rng.below(2)];
                    if let Ok(h) = sched.add_request(&p, request, rng.below(4) as i64, salt) {
                        live.push(h);
                    }
                }
                if !live.is_empty() && rng.chance(1, 25) {
                    let h = live.swap_remove(rng.below(live.len()));
                    sched.abort_request(h).unwrap();
                }
                let rows = sched.schedule().unwrap().num_sampled();
                let sampled: Vec<i64> = (0..rows).map(|_| rng.below(12) as i64).collect();
                events.clear();
                sched.update(&sampled, &mut events).unwrap();
                sched.check_invariants().unwrap();
            }));
            if let Err(panic) = result {
                eprintln!(
                    "failed at step {step} with policy {policy:?}; replay with KVPAGE_SEED={seed}"
                );
                std::panic::resume_unwind(panic);
            }
        }
        run(&mut sched, |_, _| 3);
        assert_all_blocks_back(&sched);
        if policy != Policy::Static {
            assert!(
                sched.stats.num_preemptions > 10,
                "the workload must exercise preemption"
            );
        } else {
            assert!(
                sched.stats.ghost_rows > 10,
                "static batches must keep finished seats"
            );
        }
    }
}

// ---- what the plan carries for the engine: seats, first schedules, decode_only

#[test]
fn seats_are_bound_at_the_first_sampled_row_and_freed_into_the_next_plan() {
    let mut sched = Scheduler::new(config(128, 4)).unwrap();
    let a = sched
        .add_request(&prompt(4, 0), params(2), 0, None)
        .unwrap();
    let b = sched
        .add_request(&prompt(4, 10), params(5), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.sample_request, vec![a, b]);
    assert_eq!(plan.sample_rows, vec![0, 1], "seats are handed out from 0");
    assert_eq!(plan.sample_new_seat, vec![true, true]);
    assert!(plan.freed_seats.is_empty());
    let mut events = Vec::new();
    sched.update(&[7, 7], &mut events).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(
        plan.sample_rows,
        vec![0, 1],
        "a running sample keeps its seat"
    );
    assert_eq!(plan.sample_new_seat, vec![false, false]);
    events.clear();
    sched.update(&[7, 7], &mut events).unwrap();
    assert_eq!(events[0].finish, Some(FinishReason::Length));
    // `a` finished: its seat is reported freed, then taken by the next sample.
    let c = sched
        .add_request(&prompt(1, 20), params(1), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.freed_seats, vec![0]);
    assert_eq!(plan.sample_request, vec![b, c]);
    assert_eq!(
        plan.sample_rows,
        vec![1, 0],
        "the last freed seat goes first"
    );
    assert_eq!(plan.sample_new_seat, vec![false, true]);
    let rows = plan.num_sampled();
    sched.check_invariants().unwrap();
    sched.update(&vec![7; rows], &mut events).unwrap();
    run(&mut sched, |_, _| 7);
    assert_all_blocks_back(&sched);
}

#[test]
fn forked_samples_each_take_a_seat_and_preemption_frees_them() {
    let mut sched = Scheduler::new(SchedulerConfig {
        policy: Policy::Priority,
        max_num_seqs: 3,
        ..config(128, 4)
    })
    .unwrap();
    let low = sched
        .add_request(&prompt(4, 0), RequestParams { n: 3, ..params(50) }, 5, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.sample_rows, vec![0, 1, 2]);
    assert_eq!(plan.sample_new_seat, vec![true; 3]);
    let mut events = Vec::new();
    sched.update(&[7, 7, 7], &mut events).unwrap();
    let urgent = sched
        .add_request(&prompt(4, 40), params(3), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.preempted, vec![low], "the last sample yields its seat");
    assert_eq!(plan.preempted_index, vec![2]);
    assert_eq!(plan.freed_seats, vec![2]);
    let row = plan
        .sample_request
        .iter()
        .position(|&h| h == urgent)
        .unwrap();
    assert_eq!(
        plan.sample_rows[row], 2,
        "the urgent request takes the freed seat"
    );
    assert!(plan.sample_new_seat[row]);
    let rows = plan.num_sampled();
    sched.check_invariants().unwrap();
    sched.update(&vec![7; rows], &mut events).unwrap();
    run(&mut sched, |_, _| 7);
    assert_all_blocks_back(&sched);
}

#[test]
fn aborted_samples_free_their_seats_into_the_next_plan() {
    let mut sched = Scheduler::new(config(128, 4)).unwrap();
    let a = sched
        .add_request(&prompt(4, 0), params(9), 0, None)
        .unwrap();
    sched
        .add_request(&prompt(4, 10), params(9), 0, None)
        .unwrap();
    sched.schedule().unwrap();
    let mut events = Vec::new();
    sched.update(&[7, 7], &mut events).unwrap();
    sched.abort_request(a).unwrap();
    sched.check_invariants().unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.freed_seats, vec![0]);
    assert_eq!(plan.sample_rows, vec![1]);
}

#[test]
fn plan_reports_first_schedules_with_their_cache_hits() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 8,
        ..config(128, 4)
    })
    .unwrap();
    let shared = prompt(8, 0);
    sched.add_request(&shared, params(1), 0, None).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.first_scheduled_cached, vec![0]);
    let mut events = Vec::new();
    sched.update(&[7], &mut events).unwrap();
    let mut longer = shared.clone();
    longer.extend(prompt(12, 100));
    let h = sched.add_request(&longer, params(1), 0, None).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.first_scheduled, vec![h]);
    assert_eq!(plan.first_scheduled_cached, vec![8]);
    assert_eq!(sched.num_cached_tokens(h), Some(8));
    sched.update(&[], &mut events).unwrap();
    // The prompt's next chunk: not a first schedule any more.
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_tokens(), 4);
    assert!(plan.first_scheduled.is_empty());
}

#[test]
fn decode_only_marks_plans_whose_rows_all_have_one_token() {
    let mut sched = Scheduler::new(config(128, 4)).unwrap();
    sched
        .add_request(&prompt(5, 0), params(3), 0, None)
        .unwrap();
    sched
        .add_request(&prompt(1, 10), params(3), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert!(!plan.decode_only, "a 5-token prefill row");
    let mut events = Vec::new();
    sched.update(&[7, 7], &mut events).unwrap();
    let plan = sched.schedule().unwrap();
    assert!(plan.decode_only);
    sched.update(&[7, 7], &mut events).unwrap();
    let only_one_token = sched
        .add_request(&prompt(1, 20), params(1), 0, None)
        .unwrap();
    let plan = sched.schedule().unwrap();
    assert!(plan.sample_request.contains(&only_one_token));
    assert!(
        plan.decode_only,
        "a one-token prompt is one query token too"
    );
}

#[test]
fn update_flags_a_stop_on_a_stop_token_but_not_on_eos() {
    let mut sched = Scheduler::new(config(64, 4)).unwrap();
    let stop = RequestParams {
        max_tokens: 9,
        stop_token_ids: vec![77],
        ..Default::default()
    };
    sched
        .add_request(&prompt(3, 0), stop.clone(), 0, None)
        .unwrap();
    sched.add_request(&prompt(3, 0), stop, 0, None).unwrap();
    sched.schedule().unwrap();
    let mut events = Vec::new();
    sched.update(&[77, EOS as i64], &mut events).unwrap();
    assert_eq!(events[0].finish, Some(FinishReason::Stop));
    assert!(events[0].stop_token);
    assert_eq!(events[1].finish, Some(FinishReason::Stop));
    assert!(!events[1].stop_token, "EOS is no stop token of the request");
}
