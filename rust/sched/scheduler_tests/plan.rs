//! What the plan carries for the engine: forks of n > 1 requests, seats,
//! first schedules, decode_only.

use super::*;

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
