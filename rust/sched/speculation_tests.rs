//! Speculative decoding with drafts proposed from outside the core
//! (`DraftMethod::DraftModel`): what `draft_requests` asks for, proposals
//! that go stale, and drafters that stay out of the way when they miss.

use crate::sched::request::RequestParams;
use crate::sched::scheduler::{DraftMethod, Scheduler, SchedulerConfig, SpeculativeConfig};

fn draft_model_scheduler() -> Scheduler {
    let config = SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        max_model_len: 512,
        speculative: SpeculativeConfig {
            method: DraftMethod::DraftModel,
            num_speculative_tokens: 3,
            max_running: 4,
            ..SpeculativeConfig::default()
        },
        ..super::scheduler_tests::config(128, 16)
    };
    Scheduler::new(config).unwrap()
}

fn params(max_tokens: u32) -> RequestParams {
    RequestParams {
        max_tokens,
        ignore_eos: true,
        ..RequestParams::default()
    }
}

#[test]
fn proposals_are_drafted_once_and_only_for_the_tokens_they_were_made_from() {
    let mut sched = draft_model_scheduler();
    let handle = sched.add_request(&[1, 2, 3], params(50), 0, None).unwrap();
    let mut events = Vec::new();
    assert!(sched.draft_requests().is_empty(), "a prompt does not draft");
    sched.schedule().unwrap();
    sched.update(&[4], &mut events).unwrap();
    assert_eq!(sched.draft_requests(), vec![(handle, 0, 3)]);
    // More tokens than the limit: the first three are drafted.
    sched.propose_drafts(handle, 0, &[5, 6, 7, 8]).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.token_ids, vec![4, 5, 6, 7]);
    sched.update(&[5, 6, 9, 10], &mut events).unwrap();
    assert_eq!(sched.stats.num_accepted_tokens, 2);
    // A proposal not used by the next schedule() is dropped.
    sched.propose_drafts(handle, 0, &[1]).unwrap();
    let _ = sched.draft_requests();
    assert_eq!(sched.schedule().unwrap().num_sampled(), 2);
    sched.update(&[11, 12], &mut events).unwrap();
    assert_eq!(
        sched.schedule().unwrap().num_sampled(),
        1,
        "nothing proposed"
    );
    // One made before the sequence moved on is not used.
    sched.propose_drafts(handle, 0, &[13, 1]).unwrap();
    sched.update(&[13], &mut events).unwrap();
    assert_eq!(
        sched.schedule().unwrap().num_sampled(),
        1,
        "a stale proposal"
    );
    sched.update(&[14], &mut events).unwrap();
    assert!(
        sched.propose_drafts(handle + 1, 0, &[1]).is_err(),
        "unknown request"
    );
}

#[test]
fn a_drafter_that_always_misses_drafts_once_in_32_steps() {
    let mut sched = draft_model_scheduler();
    let mut events = Vec::new();
    let mut verified = 0;
    for round in 0..2u32 {
        let handle = sched.add_request(&[1, 2, 3], params(200), 0, None).unwrap();
        sched.schedule().unwrap();
        sched.update(&[4], &mut events).unwrap();
        let mut steps_with_drafts = 0;
        while sched.has_unfinished_requests() {
            for (h, sample, k) in sched.draft_requests() {
                sched.propose_drafts(h, sample, &vec![9; k]).unwrap(); // never sampled
            }
            let rows = sched.schedule().unwrap().num_sampled();
            steps_with_drafts += usize::from(rows > 1);
            sched.update(&vec![5; rows], &mut events).unwrap();
        }
        // 1, 2, 4, ... 32 steps apart; the second request starts cooled down.
        let most = if round == 0 { 12 } else { 8 };
        assert!(
            steps_with_drafts <= most,
            "request {handle}: {steps_with_drafts} drafts"
        );
        verified += steps_with_drafts;
    }
    assert_eq!(sched.stats.num_accepted_tokens, 0);
    assert_eq!(sched.stats.num_drafts as usize, verified);
}

#[test]
fn a_drafter_that_always_misses_pauses_for_every_sequence() {
    let mut sched = draft_model_scheduler();
    let mut events = Vec::new();
    let mut plans_with_drafts = 0;
    // Four requests arriving a few steps apart, so their own cool-downs interleave.
    for step in 0..400 {
        if step % 9 == 0 && step < 36 {
            sched
                .add_request(&[1, 2, 3 + step as u32], params(200), 0, None)
                .unwrap();
        }
        if !sched.has_unfinished_requests() {
            break;
        }
        for (h, sample, k) in sched.draft_requests() {
            sched.propose_drafts(h, sample, &vec![9; k]).unwrap(); // never sampled
        }
        let plan = sched.schedule().unwrap();
        let rows = plan.num_sampled();
        plans_with_drafts += usize::from(rows > plan.num_seqs());
        sched.update(&vec![5; rows], &mut events).unwrap();
    }
    assert!(!sched.has_unfinished_requests());
    // Alone, each of the four would draft ~11 times in its 200 steps.
    assert!(
        plans_with_drafts <= 14,
        "{plans_with_drafts} plans with drafts"
    );
    assert_eq!(sched.kv().num_referenced_blocks(), 0);
}
