//! Preemption: by recompute when the pool runs short, and by priority for
//! seats or memory.

use super::*;

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
