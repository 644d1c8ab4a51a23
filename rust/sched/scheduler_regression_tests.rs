//! One regression test per scheduler bug found by the reference-model audit
//! (issue 13); each failed before its fix.

use crate::sched::request::{FinishReason, RequestParams};
use crate::sched::scheduler::{Policy, Scheduler, SchedulerConfig};

fn config(policy: Policy, num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        policy,
        eos_token_ids: vec![2],
        ..SchedulerConfig::default()
    }
}

fn params(n: u32, max_tokens: u32) -> RequestParams {
    RequestParams {
        n,
        max_tokens,
        ignore_eos: true,
        ..RequestParams::default()
    }
}

/// Schedule one step and feed `token` to every sampled row.
fn step(sched: &mut Scheduler, token: i64) -> crate::sched::step_plan::StepPlan {
    let plan = sched.schedule().unwrap().clone();
    let mut events = Vec::new();
    sched
        .update(&vec![token; plan.num_sampled()], &mut events)
        .unwrap();
    sched.check_invariants().unwrap();
    plan
}

fn run_to_end(sched: &mut Scheduler) {
    for _ in 0..10_000 {
        if !sched.has_unfinished_requests() {
            sched.check_invariants().unwrap();
            assert_eq!(sched.kv().num_referenced_blocks(), 0);
            return;
        }
        step(sched, 7);
    }
    panic!("the scheduler made no progress");
}

fn assert_distinct_writes(plan: &crate::sched::step_plan::StepPlan, scratch_slot: i32) {
    let mut slots: Vec<i32> = plan
        .slot_mapping
        .iter()
        .copied()
        .filter(|&s| s != scratch_slot)
        .collect();
    let all = slots.len();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(
        slots.len(),
        all,
        "a slot is written twice: {:?}",
        plan.slot_mapping
    );
}

#[test]
fn static_samples_each_get_their_own_reservation() {
    let mut sched = Scheduler::new(config(Policy::Static, 32, 4)).unwrap();
    let scratch = 32 * 4;
    let h = sched
        .add_request(&[5, 6, 7, 8, 9], params(3, 6), 0, None)
        .unwrap();
    let reserve_blocks = (5usize + 6).div_ceil(4);
    let first = step(&mut sched, 7);
    assert_eq!(
        first.num_sampled(),
        3,
        "every sample samples its first token"
    );
    assert_distinct_writes(&first, scratch);
    assert_eq!(
        sched.kv().num_referenced_blocks(),
        3 * reserve_blocks,
        "three full reservations, nothing shared"
    );
    let decode = step(&mut sched, 7);
    assert_eq!(decode.num_seqs(), 3);
    assert_distinct_writes(&decode, scratch);
    let width = decode.block_table_width;
    let tables: Vec<&[i32]> = (0..3)
        .map(|r| &decode.block_tables[r * width..(r + 1) * width])
        .collect();
    for a in 0..3 {
        for b in a + 1..3 {
            assert!(
                tables[a].iter().all(|x| !tables[b].contains(x)),
                "samples share blocks: {tables:?}"
            );
        }
    }
    run_to_end(&mut sched);
    assert!(sched.sample_tokens(h, 0).is_none());
}

#[test]
fn static_sequence_finished_before_its_prefill_leaves_the_scheduler_usable() {
    for finish_one_sample in [false, true] {
        let mut sched = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: 8,
            ..config(Policy::Static, 32, 4)
        })
        .unwrap();
        let a = sched.add_request(&[9; 8], params(1, 4), 0, None).unwrap();
        let b = sched.add_request(&[3; 4], params(1, 4), 0, None).unwrap();
        let plan = step(&mut sched, 7);
        assert_eq!(plan.row_request, vec![a], "b is seated but got no budget");
        if finish_one_sample {
            assert!(sched.finish_sample(b, 0, FinishReason::Stop).unwrap());
        } else {
            assert!(sched.finish_request(b, FinishReason::Stop).unwrap());
        }
        sched.check_invariants().unwrap();
        let plan = step(&mut sched, 7);
        assert_eq!(
            plan.row_request,
            vec![a],
            "no ghost row without a computed token"
        );
        run_to_end(&mut sched);
    }
}

#[test]
fn priority_sizing_a_waiting_candidate_attaches_no_kv() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 4,
        ..config(Policy::Priority, 32, 4)
    })
    .unwrap();
    // A cached prefix the urgent request would match.
    let shared: Vec<u32> = (100..116).collect();
    sched.add_request(&shared, params(1, 1), 0, None).unwrap();
    run_to_end(&mut sched);
    let evictable_before = sched.kv().num_available_blocks();
    sched.add_request(&[1; 40], params(1, 2), 5, None).unwrap();
    step(&mut sched, 7);
    let mut urgent_prompt = shared.clone();
    urgent_prompt.push(1);
    let urgent = sched
        .add_request(&urgent_prompt, params(1, 2), 0, None)
        .unwrap();
    // The long low-priority prefill takes the whole budget: the urgent one
    // outranks it but needs neither a seat nor memory, so it waits...
    let plan = step(&mut sched, 7);
    assert!(!plan.row_request.contains(&urgent));
    // ...without a page table or pinned prefix blocks.
    assert_eq!(sched.num_waiting(), 1);
    let low_blocks = 8usize.div_ceil(4); // two steps of 4 prompt tokens
    assert_eq!(
        sched.kv().num_available_blocks(),
        evictable_before - low_blocks,
        "the waiting request pins nothing"
    );
    run_to_end(&mut sched);
}

#[test]
fn cached_tokens_are_not_overreported_after_preemption_mid_prefill() {
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 32,
        long_prefill_token_threshold: 4,
        max_model_len: 32,
        ..config(Policy::Fcfs, 8, 4)
    })
    .unwrap();
    let early = sched.add_request(&[50; 16], params(1, 8), 0, None).unwrap();
    for _ in 0..4 {
        step(&mut sched, 7); // prefills 4 tokens per step
    }
    let late_prompt: Vec<u32> = (200..220).collect();
    let late = sched
        .add_request(&late_prompt, params(1, 2), 0, None)
        .unwrap();
    let mut preempted = false;
    while sched.has_unfinished_requests() {
        let plan = step(&mut sched, 7);
        preempted |= plan.preempted.contains(&late);
        if let Some(cached) = sched.num_cached_tokens(late) {
            assert_eq!(cached, 0, "a never-seen prompt reports no cached tokens");
        }
    }
    assert!(
        preempted,
        "the pool is small enough to preempt the late prefill"
    );
    assert!(sched.num_cached_tokens(early).is_none());
    assert!(
        sched.kv().prefix_cache_stats().hit_blocks > 0,
        "the re-admission did reuse its own blocks"
    );
}

#[test]
fn slot_usage_counts_shared_blocks_once_and_reservations_in_full() {
    let mut sched = Scheduler::new(config(Policy::Fcfs, 32, 4)).unwrap();
    sched.add_request(&[1; 8], params(2, 4), 0, None).unwrap();
    step(&mut sched, 7);
    assert_eq!(
        sched.kv_slot_usage(),
        (8, 8),
        "two forks share two full blocks"
    );
    step(&mut sched, 7);
    assert_eq!(
        sched.kv_slot_usage(),
        (16, 10),
        "each fork wrote one decode token"
    );
    run_to_end(&mut sched);
    assert_eq!(sched.kv_slot_usage(), (0, 0));

    let mut sched = Scheduler::new(config(Policy::Static, 32, 4)).unwrap();
    sched.add_request(&[1; 5], params(1, 7), 0, None).unwrap();
    step(&mut sched, 7);
    assert_eq!(
        sched.kv_slot_usage(),
        (12, 5),
        "12 reserved up front, 5 computed"
    );
    step(&mut sched, 7);
    assert_eq!(sched.kv_slot_usage(), (12, 6));
    run_to_end(&mut sched);
    assert_eq!(sched.kv_slot_usage(), (0, 0));
}
