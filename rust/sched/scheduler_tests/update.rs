//! `update`: stop conditions, the last token of a full-length prompt, a
//! wrong token count, stop-token flags.

use super::*;

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
