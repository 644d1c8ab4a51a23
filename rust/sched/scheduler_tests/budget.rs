//! Running sequences first, then admission, under the token budget and
//! `max_num_seqs`: no idle seat while work waits, freed blocks reused at
//! once, chunked prefill mixed with decodes, the long-prefill cap.

use super::*;

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
