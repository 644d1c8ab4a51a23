//! Requests coming and going: aborts in any state, and requests rejected
//! with the offending value.

use super::*;

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
