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
