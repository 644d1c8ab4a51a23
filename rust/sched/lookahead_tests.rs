//! Decode lookahead (`sched/scheduler/lookahead.rs`): how far a plan may
//! run ahead, and the seeded lockstep check that every continuation plan
//! equals the plan `schedule()` makes for the same state.

use crate::sched::request::RequestParams;
use crate::sched::scheduler::{Scheduler, SchedulerConfig, SpeculativeConfig, TokenEvent};
use crate::sched::step_plan::StepPlan;
use crate::test_rng::SplitMix64;

use super::scheduler_tests::EOS;

/// `scheduler_tests`' config with fewer seats and shorter sequences, so small
/// pools preempt.
fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 6,
        max_num_batched_tokens: 32,
        max_model_len: 96,
        ..super::scheduler_tests::config(num_blocks, block_size)
    }
}

fn params(max_tokens: u32, ignore_eos: bool) -> RequestParams {
    RequestParams {
        max_tokens,
        ignore_eos,
        ..RequestParams::default()
    }
}

/// Step until every running sequence decodes (the prompt is done).
fn step_to_decode(sched: &mut Scheduler) {
    let mut events = Vec::new();
    loop {
        let plan = sched.schedule().unwrap();
        let done = plan.decode_only;
        if done {
            return;
        }
        let rows = plan.num_sampled();
        sched.update(&vec![7; rows], &mut events).unwrap();
    }
}

#[test]
fn lookahead_stops_at_the_last_held_block_and_at_max_tokens() {
    let mut sched = Scheduler::new(config(64, 4)).unwrap();
    sched
        .add_request(&[10; 6], params(20, true), 0, None)
        .unwrap();
    step_to_decode(&mut sched);
    // Decoding position 6 of a table of 2 blocks of 4: positions 6 and 7 fit.
    assert_eq!(sched.plan().positions, vec![6]);
    assert_eq!(sched.lookahead_steps(8), 2);
    assert_eq!(sched.lookahead_steps(1), 1);

    let mut sched = Scheduler::new(config(64, 16)).unwrap();
    sched
        .add_request(&[10; 6], params(3, true), 0, None)
        .unwrap();
    step_to_decode(&mut sched);
    // One output token so far: two more reach max_tokens.
    assert_eq!(sched.lookahead_steps(8), 2);
}

#[test]
fn lookahead_is_one_while_anyone_waits_or_prefills() {
    let mut sched = Scheduler::new(config(64, 16)).unwrap();
    sched
        .add_request(&[10; 6], params(20, true), 0, None)
        .unwrap();
    sched.schedule().unwrap();
    assert_eq!(sched.lookahead_steps(8), 1, "a prefill step");
    let mut events = Vec::new();
    sched.update(&[7], &mut events).unwrap();
    sched.schedule().unwrap();
    assert!(sched.lookahead_steps(8) > 1);
    sched.update(&[7], &mut events).unwrap();
    sched
        .add_request(&[11; 6], params(20, true), 0, None)
        .unwrap();
    let mut small = config(64, 16);
    small.max_num_seqs = 1;
    let mut full = Scheduler::new(small).unwrap();
    full.add_request(&[10; 6], params(20, true), 0, None)
        .unwrap();
    full.add_request(&[11; 6], params(20, true), 0, None)
        .unwrap();
    step_to_decode(&mut full);
    assert_eq!(full.lookahead_steps(8), 1, "a request waits for a seat");
}

#[test]
fn continuation_refuses_a_step_that_needs_a_new_block() {
    let mut sched = Scheduler::new(config(64, 4)).unwrap();
    sched
        .add_request(&[10; 6], params(20, true), 0, None)
        .unwrap();
    step_to_decode(&mut sched);
    let mut events = Vec::new();
    assert!(sched.schedule_continuation().is_err(), "before update");
    sched.update(&[7], &mut events).unwrap();
    sched.schedule_continuation().unwrap(); // position 7: the held block
    sched.update(&[7], &mut events).unwrap();
    let free = sched.kv().num_free_blocks();
    assert!(
        sched.schedule_continuation().is_err(),
        "position 8 needs a block"
    );
    assert_eq!(
        sched.kv().num_free_blocks(),
        free,
        "refused with no state changed"
    );
    assert!(!sched.awaiting_update());
    sched.schedule().unwrap();
    sched.check_invariants().unwrap();
}

fn plan_key(p: &StepPlan) -> impl PartialEq + std::fmt::Debug {
    (
        (
            p.token_ids.clone(),
            p.positions.clone(),
            p.slot_mapping.clone(),
        ),
        (
            p.cu_q_lens.clone(),
            p.kv_lens.clone(),
            p.block_tables.clone(),
        ),
        (
            p.logits_indices.clone(),
            p.sample_rows.clone(),
            p.sample_request.clone(),
        ),
        (p.freed_seats.clone(), p.copy_src.clone(), p.decode_only),
    )
}

/// The token a sample emits at each output position (the same for both
/// schedulers however they step): EOS now and then.
fn token_of(e_request: u64, sample: u32, output_len: usize) -> i64 {
    let mut rng =
        SplitMix64::new(e_request ^ ((sample as u64) << 40) ^ ((output_len as u64) << 20));
    if rng.chance(1, 25) {
        EOS as i64
    } else {
        100 + rng.below(50) as i64
    }
}

#[test]
fn seeded_continuations_equal_plain_schedules_in_lockstep() {
    for seed in 0..40u64 {
        let mut rng = SplitMix64::new(seed);
        let block_size = [2, 4, 16][rng.below(3)];
        let num_blocks = 96 / block_size + 4 + rng.below(40);
        let mut ahead = Scheduler::new(config(num_blocks, block_size)).unwrap();
        let mut plain = Scheduler::new(config(num_blocks, block_size)).unwrap();
        let (mut ev_a, mut ev_p): (Vec<TokenEvent>, Vec<TokenEvent>) = (Vec::new(), Vec::new());
        let mut added = 0;
        let mut lookaheads = 0;
        for _step in 0..400 {
            if added < 12 && rng.chance(1, 6) {
                let len = 1 + rng.below(30);
                let prompt: Vec<u32> = (0..len).map(|_| 10 + rng.below(20) as u32).collect();
                let p = params(1 + rng.below(40) as u32, rng.chance(1, 2));
                let a = ahead.add_request(&prompt, p.clone(), 0, None).unwrap();
                let b = plain.add_request(&prompt, p, 0, None).unwrap();
                assert_eq!(a, b);
                added += 1;
            }
            if !ahead.has_unfinished_requests() {
                if added >= 12 {
                    break;
                }
                continue;
            }
            let plan = plan_key(ahead.schedule().unwrap());
            assert_eq!(plan, plan_key(plain.schedule().unwrap()));
            let steps = ahead.lookahead_steps(1 + rng.below(8));
            lookaheads += usize::from(steps > 1);
            for k in 0..steps {
                if k > 0 {
                    if rng.chance(1, 10) {
                        // A client aborts mid-lookahead (between update and the next plan).
                        let handle = ahead.plan().sample_request[0];
                        ahead.abort_request(handle).unwrap();
                        plain.abort_request(handle).unwrap();
                    }
                    let cont = plan_key(ahead.schedule_continuation().unwrap());
                    assert_eq!(cont, plan_key(plain.schedule().unwrap()), "seed {seed}");
                }
                let p = ahead.plan();
                let sampled: Vec<i64> = (0..p.num_sampled())
                    .map(|r| {
                        let out_len = p.sample_output_len[r] as usize;
                        token_of(p.sample_request[r], p.sample_index[r] as u32, out_len)
                    })
                    .collect();
                ev_a.clear();
                ev_p.clear();
                ahead.update(&sampled, &mut ev_a).unwrap();
                plain.update(&sampled, &mut ev_p).unwrap();
                assert_eq!(ev_a, ev_p);
                ahead.check_invariants().unwrap();
                if !ahead.has_unfinished_requests() {
                    break;
                }
            }
        }
        assert!(lookaheads > 0, "seed {seed} never looked ahead");
        assert_eq!(
            ahead.kv().num_referenced_blocks(),
            0,
            "seed {seed}: blocks back"
        );
    }
}

#[test]
fn continuation_plans_never_draft_though_schedule_does() {
    let mut c = config(64, 16);
    c.speculative = SpeculativeConfig {
        num_speculative_tokens: 3,
        prompt_lookup_min: 1,
        prompt_lookup_max: 2,
        max_running: 4,
        ..SpeculativeConfig::default()
    };
    let mut sched = Scheduler::new(c).unwrap();
    sched
        .add_request(&[1, 2, 3, 4, 5, 6], params(40, true), 0, None)
        .unwrap();
    let mut events = Vec::new();
    sched.schedule().unwrap(); // the prompt
    sched.update(&[7], &mut events).unwrap();
    // Nothing repeats yet: a plain decode, run as a lookahead.
    assert_eq!(sched.schedule().unwrap().num_tokens(), 1);
    assert!(sched.lookahead_steps(8) > 1);
    sched.update(&[6], &mut events).unwrap(); // "6" occurred before, followed by 7 6
    let plan = sched.schedule_continuation().unwrap();
    assert_eq!((plan.num_tokens(), plan.num_sampled()), (1, 1), "no drafts");
    sched.update(&[7], &mut events).unwrap();
    sched.check_invariants().unwrap();
    // A full schedule() drafts: the last "6 7" was followed by "6 7".
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.token_ids, vec![7, 6, 7]);
    assert_eq!(plan.num_sampled(), 3);
    assert_eq!(
        sched.lookahead_steps(8),
        1,
        "a verification step runs alone"
    );
    // The model agrees with the first draft only: its second row's token is
    // kept, the third row is dropped.
    events.clear();
    sched.update(&[6, 8, 9], &mut events).unwrap();
    let kept: Vec<u32> = events.iter().map(|e| e.token).collect();
    assert_eq!(kept, vec![6, 8]);
    sched.check_invariants().unwrap();
    assert_eq!(sched.stats.num_accepted_tokens, 1);
    assert_eq!(sched.stats.num_draft_tokens, 2);
    // The next step decodes after "... 7 6 8" from the accepted position.
    assert_eq!(sched.schedule().unwrap().positions[0], 10);
}
