//! A seeded randomized workload checking invariants after every step
//! (`KVPAGE_SEED` picks the seed).

use super::*;

#[test]
fn randomized_workloads_keep_invariants_and_return_every_block() {
    let seed = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xbeef);
    for (round, policy) in [Policy::Fcfs, Policy::Priority, Policy::Static]
        .into_iter()
        .enumerate()
    {
        let seed = seed + round as u64;
        let mut rng = SplitMix64::new(seed);
        let mut sched = Scheduler::new(SchedulerConfig {
            policy,
            max_num_seqs: 6,
            max_num_batched_tokens: 32,
            max_model_len: 48,
            long_prefill_token_threshold: if round == 1 { 12 } else { 0 },
            ..config(24, 4)
        })
        .unwrap();
        let mut live = Vec::new();
        let mut events = Vec::new();
        for step in 0..4000 {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if rng.chance(1, 3) {
                    let len = 1 + rng.below(20);
                    let base = rng.below(3) as u32 * 7;
                    let p: Vec<u32> = (0..len as u32).map(|i| base + i % 9).collect();
                    let n = 1 + rng.below(3) as u32;
                    let max_tokens = 1 + rng.below(20) as u32;
                    let request = RequestParams {
                        n,
                        max_tokens,
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
        if policy != Policy::Static {
            assert!(
                sched.stats.num_preemptions > 10,
                "the workload must exercise preemption"
            );
            assert!(
                sched.stats.prefill_waits > 10,
                "the workload must exercise prefill grouping"
            );
        } else {
            assert!(
                sched.stats.ghost_rows > 10,
                "static batches must keep finished seats"
            );
        }
    }
}
