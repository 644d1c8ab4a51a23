//! The `static` policy: the seeds example's efficiency and the token
//! budget of a static batch's prefill.

use super::*;

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
