//! Admission through the prefix cache: only the uncached suffix is
//! prefilled, a reuse limit is honoured, a shared system prompt is shared
//! from the first step.

use super::*;

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

/// Prompt tokens each request prefilled, and every sample's outputs, with
/// and without prefill grouping, for requests all queued before the first step.
fn prefill_with_grouping(group: bool, prompts: &[(Vec<u32>, Option<&str>)]) -> (u64, Outputs) {
    let mut sched = Scheduler::new(SchedulerConfig {
        group_shared_prefills: group,
        max_num_batched_tokens: 512,
        ..config(256, 4)
    })
    .unwrap();
    for (p, salt) in prompts {
        sched.add_request(p, params(6), 0, *salt).unwrap();
    }
    let out = run(&mut sched, |step, row| (step * 7 + row) as i64 % 50 + 3);
    assert_all_blocks_back(&sched);
    (sched.stats.prompt_tokens_scheduled, out)
}

#[test]
fn copies_of_a_prompt_queued_together_prefill_it_once() {
    // GRPO: 8 copies of one 40-token prompt (10 blocks of 4), sent as requests.
    let copies: Vec<_> = (0..8).map(|_| (prompt(40, 0), None)).collect();
    let (alone, out_alone) = prefill_with_grouping(false, &copies);
    let (grouped, out_grouped) = prefill_with_grouping(true, &copies);
    assert_eq!(
        alone,
        8 * 40,
        "without grouping every copy prefills its prompt"
    );
    // The leader computes 40 tokens; each follower matches 36 and computes the last 4.
    assert_eq!(grouped, 40 + 7 * 4);
    assert_eq!(out_grouped.finish.len(), 8);
    assert!(
        out_grouped.steps > out_alone.steps,
        "followers wait one step"
    );
    for ((request, _), tokens) in &out_grouped.tokens {
        assert_eq!(
            tokens.len(),
            6,
            "request {request} generated all its tokens"
        );
    }
}

#[test]
fn grouping_shares_only_whole_blocks_of_the_same_salt() {
    let system = prompt(22, 0);
    let mut a = system.clone();
    a.extend([900, 901]);
    let mut b = system.clone();
    b.extend([800, 801, 802]);
    // b shares 5 whole blocks (20 tokens) with a; c differs in its first block;
    // d is a's prompt under another salt (its blocks hash differently).
    let c = prompt(24, 100);
    let prompts = vec![(a.clone(), None), (b, None), (c, None), (a, Some("tenant"))];
    let (grouped, _) = prefill_with_grouping(true, &prompts);
    assert_eq!(grouped, 24 + (25 - 20) + 24 + 24);
}

#[test]
fn a_follower_is_admitted_when_its_leader_is_preempted() {
    // A pool too small for both: the leader takes most blocks, the follower
    // may wait for it, and every request still finishes.
    let mut sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 16,
        max_model_len: 64,
        ..config(20, 4)
    })
    .unwrap();
    for _ in 0..3 {
        sched
            .add_request(&prompt(40, 0), params(20), 0, None)
            .unwrap();
    }
    let out = run(&mut sched, |_, _| 5);
    assert_eq!(out.finish.len(), 3);
    assert_all_blocks_back(&sched);
}
