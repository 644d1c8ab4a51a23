//! Sliding-window models: blocks that fall out of the window go back to the
//! pool as sequences advance, so a long generation holds a bounded number
//! of blocks; preemption, forks and the prefix cache stay consistent.

use super::*;

/// Blocks one sequence may hold between steps with window `w`.
fn per_seq_bound(w: usize, block_size: usize) -> usize {
    (w - 1).div_ceil(block_size) + 1
}

#[test]
fn a_long_generation_holds_a_bounded_number_of_blocks() {
    let (w, bs) = (64, 4);
    // 40 blocks: far less than the 2048-token generation would need.
    let mut sched = Scheduler::new(SchedulerConfig {
        max_model_len: 4096,
        sliding_window: Some(w as u32),
        ..config(40, bs)
    })
    .unwrap();
    let h = sched
        .add_request(&prompt(100, 0), params(2000), 0, None)
        .unwrap();
    let mut events = Vec::new();
    let mut steps = 0;
    let mut peak = 0;
    while sched.has_unfinished_requests() {
        let plan = sched.schedule().unwrap();
        let rows = plan.num_sampled();
        // Every block of the row's window is a real block; entries before
        // it (but no others) may be the scratch block id.
        if plan.num_seqs() == 1 {
            let start = plan.positions[0] as usize;
            let first_needed = (start + 1).saturating_sub(w) / bs;
            let table = &plan.block_tables[..plan.block_table_width];
            assert!(table[first_needed..].iter().all(|&b| b < 40));
            assert!(table[..first_needed].iter().all(|&b| b == 40));
        }
        events.clear();
        sched.update(&vec![5; rows], &mut events).unwrap();
        sched.check_invariants().unwrap();
        peak = peak.max(sched.kv().num_referenced_blocks());
        steps += 1;
        assert!(steps < 10_000);
    }
    assert!(
        peak <= per_seq_bound(w, bs),
        "{peak} blocks in use > {}",
        per_seq_bound(w, bs)
    );
    assert_eq!(sched.sample_tokens(h, 0), None);
    assert_eq!(sched.stats.num_preemptions, 0);
    assert_all_blocks_back(&sched);
}

#[test]
fn a_window_lets_a_pool_smaller_than_max_model_len_serve() {
    let small = SchedulerConfig {
        max_model_len: 4096,
        max_num_batched_tokens: 32,
        ..config(30, 4)
    };
    assert!(Scheduler::new(small.clone()).is_err(), "without a window");
    assert!(Scheduler::new(SchedulerConfig {
        sliding_window: Some(64),
        ..small.clone()
    })
    .is_ok());
    assert!(Scheduler::new(SchedulerConfig {
        sliding_window: Some(0),
        ..small.clone()
    })
    .is_err());
    // Window plus one chunk must still fit: ceil((64 + 32) / 4) + 1 = 25.
    assert!(Scheduler::new(SchedulerConfig {
        sliding_window: Some(64),
        ..config(24, 4)
    })
    .is_err());
    // The static policy reserves whole lengths: it runs without a window.
    let sched = Scheduler::new(SchedulerConfig {
        policy: Policy::Static,
        sliding_window: Some(64),
        ..config(128, 4)
    })
    .unwrap();
    assert_eq!(sched.kv().sliding_window(), None);
}

#[test]
fn forked_samples_and_preemption_return_every_block() {
    // n = 3 samples of a 40-token prompt generating 120 tokens each, with a
    // pool too small for all of them at once: forks share the prompt's
    // blocks until they slide past them, preemption recomputes.
    let (w, bs) = (16, 4);
    let mut sched = Scheduler::new(SchedulerConfig {
        max_model_len: 512,
        max_num_batched_tokens: 16,
        sliding_window: Some(w as u32),
        ..config(14, bs)
    })
    .unwrap();
    let mut handles = Vec::new();
    for i in 0..4 {
        let request = RequestParams {
            n: 3,
            ..params(120)
        };
        handles.push(sched.add_request(&prompt(40, i), request, 0, None).unwrap());
    }
    let out = run(&mut sched, |step, row| ((step * 3 + row) % 40) as i64 + 100);
    assert!(
        sched.stats.num_preemptions > 0,
        "the pool forces preemption"
    );
    for h in handles {
        for sample in 0..3 {
            assert_eq!(out.tokens[&(h, sample)].len(), 120);
        }
    }
    assert_all_blocks_back(&sched);
}

#[test]
fn randomized_workloads_with_a_window_keep_invariants_and_bounds() {
    let seed = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_51de);
    for (round, policy) in [Policy::Fcfs, Policy::Priority].into_iter().enumerate() {
        let seed = seed + round as u64;
        let mut rng = SplitMix64::new(seed);
        // Pools just above what one sequence needs (window plus a chunk),
        // far below what six running windows take: preemption is frequent.
        let (w, bs, num_blocks) = (10 + round * 5, 4, 14 - round * 2);
        let mut sched = Scheduler::new(SchedulerConfig {
            policy,
            max_num_seqs: 6,
            max_num_batched_tokens: 32,
            max_model_len: 96,
            long_prefill_token_threshold: if round == 1 { 12 } else { 0 },
            sliding_window: Some(w as u32),
            ..config(num_blocks, bs)
        })
        .unwrap();
        let mut live = Vec::new();
        let mut events = Vec::new();
        let mut peak = 0;
        for step in 0..3000 {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if rng.chance(1, 3) {
                    let len = 1 + rng.below(40);
                    let base = rng.below(3) as u32 * 7;
                    let p: Vec<u32> = (0..len as u32).map(|i| base + i % 9).collect();
                    let request = RequestParams {
                        n: 1 + rng.below(3) as u32,
                        max_tokens: 1 + rng.below(50) as u32,
                        ..RequestParams::default()
                    };
                    let salt = [None, Some("x")][rng.below(2)];
                    if let Ok(h) = sched.add_request(&p, request, rng.below(4) as i64, salt) {
                        live.push(h);
                    }
                }
                if !live.is_empty() && rng.chance(1, 25) {
                    let h = live.swap_remove(rng.below(live.len()));
                    sched.abort_request(h).unwrap();
                }
                let rows = sched.schedule().unwrap().num_sampled();
                let sampled: Vec<i64> = (0..rows).map(|_| rng.below(12) as i64).collect();
                events.clear();
                sched.update(&sampled, &mut events).unwrap();
                sched.check_invariants().unwrap();
                // Blocks in use: only the windows of the running sequences.
                let in_use = sched.kv().num_referenced_blocks();
                assert!(in_use <= sched.num_running() * per_seq_bound(w, bs));
                peak = peak.max(in_use);
            }));
            if let Err(panic) = result {
                eprintln!(
                    "failed at step {step} with policy {policy:?}; replay with KVPAGE_SEED={seed}"
                );
                std::panic::resume_unwind(panic);
            }
        }
        run(&mut sched, |_, _| 3);
        assert_all_blocks_back(&sched);
        let cache = sched.kv().prefix_cache_stats();
        eprintln!(
            "window {w}: peak {peak} blocks, {} preemptions, {} hit blocks, {} detached",
            sched.stats.num_preemptions, cache.hit_blocks, cache.detached_blocks
        );
        assert!(sched.stats.num_preemptions > 10, "must exercise preemption");
        assert!(cache.hit_blocks > 10 && cache.detached_blocks > 10);
    }
}
