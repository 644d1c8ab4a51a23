//! Behaviour tests of the scheduler, driven by a fake token source, one
//! file per phase of a step (as in `sched/scheduler/`), plus a seeded
//! randomized workload checking invariants after every step (and its
//! sliding-window variant in `sliding_window.rs`). This file holds
//! the shared helpers.

mod admission;
mod budget;
mod plan;
mod preemption;
mod randomized;
mod requests;
mod sliding_window;
mod static_batching;
mod update;

use std::collections::HashMap;

use crate::error::KvError;
use crate::sched::request::{FinishReason, RequestParams};
use crate::sched::scheduler::{Policy, Scheduler, SchedulerConfig, TokenEvent};
use crate::test_rng::SplitMix64;

pub(super) const EOS: u32 = 2;

pub(super) fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        eos_token_ids: vec![EOS],
        ..SchedulerConfig::default()
    }
}

fn params(max_tokens: u32) -> RequestParams {
    RequestParams {
        max_tokens,
        ignore_eos: true,
        ..RequestParams::default()
    }
}

fn prompt(len: usize, base: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 10 + base + i).collect()
}

/// Outputs of every sample of every request, in sample order.
#[derive(Default)]
struct Outputs {
    tokens: HashMap<(u64, u32), Vec<u32>>,
    finish: HashMap<(u64, u32), FinishReason>,
    steps: usize,
}

/// Run until idle, sampling `token(step, row)` for each sampled row.
fn run(sched: &mut Scheduler, mut token: impl FnMut(usize, usize) -> i64) -> Outputs {
    let mut out = Outputs::default();
    let mut events = Vec::new();
    while sched.has_unfinished_requests() {
        let rows = sched.schedule().unwrap().num_sampled();
        let sampled: Vec<i64> = (0..rows).map(|r| token(out.steps, r)).collect();
        events.clear();
        sched.update(&sampled, &mut events).unwrap();
        record(&mut out, &events);
        sched.check_invariants().unwrap();
        out.steps += 1;
        assert!(out.steps < 100_000, "scheduler made no progress");
    }
    out
}

fn record(out: &mut Outputs, events: &[TokenEvent]) {
    for e in events {
        out.tokens
            .entry((e.request, e.sample_index))
            .or_default()
            .push(e.token);
        if let Some(reason) = e.finish {
            out.finish.insert((e.request, e.sample_index), reason);
        }
    }
}

fn assert_all_blocks_back(sched: &Scheduler) {
    sched.check_invariants().unwrap();
    assert_eq!(
        sched.kv().num_referenced_blocks(),
        0,
        "every KV block returns to the pool"
    );
}
