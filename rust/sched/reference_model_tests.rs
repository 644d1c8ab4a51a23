//! Reference-model randomized test of the scheduler and the KV manager
//! together, through the public API only.
//!
//! A simulated device executes every step plan: each KV slot stores a hash
//! of its whole context (salt and every token up to and including its
//! position), computed the way attention would: from the KV the row reads at
//! the previous position through its block table. Per step it checks that
//!
//! - no slot is written twice (the scratch slot aside), copies included;
//! - every row reads, at every position below its `kv_len`, the KV of its
//!   own true prefix (a prefix of some sample of its request);
//!
//! and at the end every sample's output equals an independent decoder's
//! (which knows nothing of blocks, forks or preemption), or a prefix of it
//! for samples the test finished or aborted. Requests use forks (n > 1),
//! salts, priorities, min_tokens, stop tokens; the test aborts in every
//! state (waiting, running, ghost, between schedule and update), finishes
//! requests and samples, resets the prefix cache and tries invalid call
//! orders, which must be typed errors that leave the scheduler usable.
//!
//! The sliding-window variant runs the same model with a window `W`: a row
//! whose first query is at `start` is checked only at positions
//! `start - W + 1..kv_len` (what the kernels read), so a block dropped too
//! early, or recycled while still in a window, reads wrong KV and fails.
//!
//! `KVPAGE_SEED=<seed>` replays one seed (printed on failure);
//! `KVPAGE_SOAK=1` runs far more seeds and steps than CI does.

use std::collections::HashMap;

use crate::error::KvError;
use crate::kv::prefix_cache::hash_block_tokens;
use crate::sched::request::{FinishReason, RequestParams};
use crate::sched::scheduler::{
    DraftMethod, Policy, Scheduler, SchedulerConfig, SpeculativeConfig, TokenEvent,
};
use crate::sched::step_plan::StepPlan;
use crate::test_rng::SplitMix64;

const VOCAB: u64 = 24;
const EOS: u32 = 0;
const SALTS: [Option<&str>; 3] = [None, Some("tenant-a"), Some("tenant-b")];

fn salt_seed(salt: usize) -> u64 {
    0x5a17 + salt as u64
}

/// KV of a position: its context's hash, chained from the previous one.
fn context_hash(previous: u64, token: u32) -> u64 {
    hash_block_tokens(&[previous as u32, (previous >> 32) as u32, token])
}

fn context_hashes(salt: usize, tokens: &[u32]) -> Vec<u64> {
    let mut h = salt_seed(salt);
    tokens
        .iter()
        .map(|&t| {
            h = context_hash(h, t);
            h
        })
        .collect()
}

/// The "model": the token sampled after a context ending in `last`, for one
/// sample; with `suppress_stop`, EOS and the request's stop tokens are masked
/// (the next allowed token wins), as the device sampler does before
/// min_tokens. A quarter of the tokens come from the context's hash (so
/// wrong KV changes the output); the rest continue a cycle from `last`, so
/// outputs repeat and n-gram drafts are often right.
fn sample_token(
    context: u64,
    last: u32,
    sample_index: u32,
    suppress_stop: bool,
    stop_ids: &[u32],
) -> u32 {
    let hash = hash_block_tokens(&[context as u32, (context >> 32) as u32, sample_index]);
    let mut token = if hash.is_multiple_of(4) {
        (hash % VOCAB) as u32
    } else {
        (last + 1 + sample_index) % VOCAB as u32
    };
    while suppress_stop && (token == EOS || stop_ids.contains(&token)) {
        token = (token + 1) % VOCAB as u32;
    }
    token
}

#[derive(Debug, Clone)]
struct RefRequest {
    prompt: Vec<u32>,
    salt: usize,
    params: RequestParams,
    /// Outputs per sample index, as reported by `update`.
    outputs: HashMap<u32, Vec<u32>>,
    finish: HashMap<u32, FinishReason>,
    /// Cut short by the test (abort, finish_request, finish_sample):
    /// outputs need only be a prefix of the decoder's.
    cut: bool,
    live: bool,
}

impl RefRequest {
    /// Token lists a row of this request may legitimately be computing.
    fn contexts(&self) -> impl Iterator<Item = Vec<u32>> + '_ {
        std::iter::once(self.prompt.clone()).chain(self.outputs.values().map(|out| {
            let mut tokens = self.prompt.clone();
            tokens.extend_from_slice(out);
            tokens
        }))
    }
}

/// The independent decoder: one sample's output and finish reason.
fn decode(
    request: &RefRequest,
    sample_index: u32,
    eos_ids: &[u32],
    max_model_len: usize,
) -> (Vec<u32>, FinishReason) {
    let p = &request.params;
    let mut tokens = request.prompt.clone();
    let mut context = *context_hashes(request.salt, &tokens)
        .last()
        .expect("prompt");
    let mut out = Vec::new();
    loop {
        let suppress = (out.len() as u32) < p.min_tokens;
        let last = *tokens.last().expect("a prompt is never empty");
        let token = sample_token(context, last, sample_index, suppress, &p.stop_token_ids);
        out.push(token);
        tokens.push(token);
        context = context_hash(context, token);
        let may_stop = out.len() >= p.min_tokens as usize;
        if may_stop && !p.ignore_eos && eos_ids.contains(&token) {
            return (out, FinishReason::Stop);
        }
        if may_stop && p.stop_token_ids.contains(&token) {
            return (out, FinishReason::Stop);
        }
        if out.len() >= p.max_tokens as usize || tokens.len() >= max_model_len {
            return (out, FinishReason::Length);
        }
    }
}

struct Harness {
    sched: Scheduler,
    rng: SplitMix64,
    device: Vec<u64>,
    block_size: usize,
    scratch_slot: usize,
    requests: HashMap<u64, RefRequest>,
    live: Vec<u64>,
    events: Vec<TokenEvent>,
    steps_with_work: usize,
}

/// Half the seeds speculate, with random draft lengths and n-gram sizes
/// (from their own stream, so the other settings stay those of the seed).
fn speculative(seed: u64) -> SpeculativeConfig {
    let mut rng = SplitMix64::new(seed ^ 0x5bec_0de5);
    if rng.chance(1, 2) {
        return SpeculativeConfig::default();
    }
    let prompt_lookup_min = 1 + rng.below(2);
    SpeculativeConfig {
        method: [
            DraftMethod::Ngram,
            DraftMethod::Suffix,
            DraftMethod::DraftModel,
        ][rng.below(3)],
        num_speculative_tokens: 1 + rng.below(4),
        prompt_lookup_min,
        prompt_lookup_max: prompt_lookup_min + rng.below(3),
        max_running: 1 + rng.below(6),
        suffix_capacity: 8 + rng.below(200),
    }
}

impl Harness {
    /// With `windowed`, a sliding window of 2..14 tokens and a non-static policy.
    fn new(seed: u64, windowed: bool) -> Option<Self> {
        let mut rng = SplitMix64::new(seed);
        let mut policy = [Policy::Fcfs, Policy::Priority, Policy::Static][rng.below(3)];
        let mut sliding_window = None;
        if windowed {
            let mut window_rng = SplitMix64::new(seed ^ 0x51de_51de);
            sliding_window = Some(2 + window_rng.below(13) as u32);
            if policy == Policy::Static {
                policy = Policy::Fcfs;
            }
        }
        let block_size = 1 + rng.below(4);
        let max_model_len = 12 + rng.below(30);
        let chunked = rng.chance(3, 4);
        let budget = if chunked {
            4 + rng.below(28)
        } else {
            max_model_len + rng.below(16)
        };
        let config = SchedulerConfig {
            num_blocks: max_model_len.div_ceil(block_size) + rng.below(40),
            block_size,
            max_num_seqs: 1 + rng.below(6),
            max_num_batched_tokens: budget,
            max_model_len,
            enable_chunked_prefill: chunked,
            long_prefill_token_threshold: [0, 0, 3, 7][rng.below(4)],
            enable_prefix_caching: rng.chance(4, 5),
            group_shared_prefills: rng.chance(3, 4),
            policy,
            eos_token_ids: vec![EOS],
            sliding_window,
            speculative: speculative(seed),
        };
        let slots = (config.num_blocks + 1) * block_size;
        let scratch_slot = config.num_blocks * block_size;
        let sched = Scheduler::new(config).ok()?;
        Some(Self {
            sched,
            rng,
            device: vec![u64::MAX; slots],
            block_size,
            scratch_slot,
            requests: HashMap::new(),
            live: Vec::new(),
            events: Vec::new(),
            steps_with_work: 0,
        })
    }

    fn add_random_request(&mut self) {
        let rng = &mut self.rng;
        let len = 1 + rng.below(self.sched.config().max_model_len.min(20));
        let family = rng.below(3) as u32;
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| {
                if rng.chance(9, 10) {
                    1 + (family * 5 + i % 7) % (VOCAB as u32 - 1)
                } else {
                    1 + rng.below(VOCAB as usize - 1) as u32
                }
            })
            .collect();
        let max_tokens = 1 + rng.below(12) as u32;
        let params = RequestParams {
            n: 1 + rng.below(3) as u32,
            max_tokens,
            min_tokens: if rng.chance(1, 3) {
                rng.below(max_tokens as usize + 1) as u32
            } else {
                0
            },
            ignore_eos: rng.chance(1, 5),
            stop_token_ids: (0..rng.below(3))
                .map(|_| 1 + rng.below(VOCAB as usize - 1) as u32)
                .collect(),
        };
        let salt = rng.below(SALTS.len());
        let priority = rng.below(4) as i64;
        if let Ok(handle) = self
            .sched
            .add_request(&prompt, params.clone(), priority, SALTS[salt])
        {
            self.requests.insert(
                handle,
                RefRequest {
                    prompt,
                    salt,
                    params,
                    outputs: HashMap::new(),
                    finish: HashMap::new(),
                    cut: false,
                    live: true,
                },
            );
            self.live.push(handle);
        }
    }

    /// Abort, finish or cut a random live request (any state), or try an
    /// invalid call, or reset the prefix cache.
    fn disturb(&mut self) {
        let choice = self.rng.below(100);
        if choice < 3 {
            self.sched.reset_prefix_cache().unwrap();
            return;
        }
        if choice < 6 {
            // Invalid calls: typed errors or no-ops, never a panic.
            let _ = self.sched.abort_request(u64::MAX).unwrap();
            if !self.sched.awaiting_update() {
                assert!(matches!(
                    self.sched.update(&[1], &mut self.events),
                    Err(KvError::InvalidArgument(_))
                ));
            }
            if let Some(&h) = self.live.first() {
                assert!(self.sched.finish_sample(h, 99, FinishReason::Stop).is_err());
            }
            return;
        }
        if self.live.is_empty() || choice >= 20 {
            return;
        }
        let index = self.rng.below(self.live.len());
        let handle = self.live[index];
        let reason =
            [FinishReason::Abort, FinishReason::Stop, FinishReason::Error][self.rng.below(3)];
        self.requests.get_mut(&handle).expect("live").cut = true;
        if self.rng.chance(1, 2) {
            let n = self.requests[&handle].params.n;
            let sample = self.rng.below(n as usize) as u32;
            // A sample not forked yet is an error, and changes nothing.
            let _ = self.sched.finish_sample(handle, sample, reason);
        } else {
            assert!(self.sched.finish_request(handle, reason).unwrap());
        }
        self.forget_finished();
    }

    /// Hand the sampled tokens to the scheduler and record its events per sample.
    fn update(&mut self, sampled: &[i64]) {
        self.events.clear();
        self.sched.update(sampled, &mut self.events).unwrap();
        for e in &self.events {
            let request = self.requests.get_mut(&e.request).expect("known");
            request
                .outputs
                .entry(e.sample_index)
                .or_default()
                .push(e.token);
            if let Some(reason) = e.finish {
                request.finish.insert(e.sample_index, reason);
            }
        }
        self.forget_finished();
        self.sched.check_invariants().unwrap();
    }

    fn forget_finished(&mut self) {
        let sched = &self.sched;
        let requests = &mut self.requests;
        self.live.retain(|&h| {
            let live = sched.sample_tokens(h, 0).is_some();
            requests.get_mut(&h).expect("known").live = live;
            live
        });
    }

    /// Execute one plan on the simulated device and check every row.
    fn execute(&mut self, plan: &StepPlan) -> Vec<i64> {
        let bs = self.block_size;
        let width = plan.block_table_width;
        for (&src, &dst) in plan.copy_src.iter().zip(&plan.copy_dst) {
            assert_ne!(src, dst, "a copy onto itself");
            let (src, dst) = (src as usize * bs, dst as usize * bs);
            self.device.copy_within(src..src + bs, dst);
        }
        // Compute every new token's KV from what its row reads, then write.
        let mut computed = vec![0u64; plan.num_tokens()];
        for row in 0..plan.num_seqs() {
            let table = &plan.block_tables[row * width..(row + 1) * width];
            let (from, to) = (
                plan.cu_q_lens[row] as usize,
                plan.cu_q_lens[row + 1] as usize,
            );
            let salt = self.requests[&plan.row_request[row]].salt;
            for i in from..to {
                let pos = plan.positions[i] as usize;
                let previous = if i > from {
                    computed[i - 1]
                } else if pos == 0 {
                    salt_seed(salt)
                } else {
                    let q = pos - 1;
                    self.device[table[q / bs] as usize * bs + q % bs]
                };
                computed[i] = context_hash(previous, plan.token_ids[i] as u32);
            }
        }
        let mut written = vec![false; self.device.len()];
        for (i, &slot) in plan.slot_mapping.iter().enumerate() {
            let slot = slot as usize;
            if slot == self.scratch_slot {
                continue;
            }
            assert!(!written[slot], "slot {slot} written twice in one step");
            written[slot] = true;
            self.device[slot] = computed[i];
        }
        // Every row reads KV of its own true prefix at every position.
        for row in 0..plan.num_seqs() {
            let request = &self.requests[&plan.row_request[row]];
            if !request.live {
                continue; // cut between schedule and update: nobody reads it
            }
            let kv_len = plan.kv_lens[row] as usize;
            let table = &plan.block_tables[row * width..(row + 1) * width];
            let (from, to) = (
                plan.cu_q_lens[row] as usize,
                plan.cu_q_lens[row + 1] as usize,
            );
            // A verification row's drafts (one sampled row each after its
            // first) are guesses: only its committed tokens are the context's.
            let mut sampled_at: Vec<i32> = (0..plan.num_sampled())
                .map(|r| plan.logits_indices[r])
                .filter(|&i| (from as i32..to as i32).contains(&i))
                .collect();
            sampled_at.dedup();
            let drafts = sampled_at.len().saturating_sub(1);
            let kv_len = kv_len - drafts;
            let row_tokens: Vec<u32> = plan.token_ids[from..to - drafts]
                .iter()
                .map(|&t| t as u32)
                .collect();
            let start = plan.positions[from] as usize;
            // With a window, the row's queries read nothing before its first
            // query's window.
            let lo = match self.sched.config().sliding_window {
                Some(w) => (start + 1).saturating_sub(w as usize),
                None => 0,
            };
            let reads: Vec<u64> = (lo..kv_len)
                .map(|q| self.device[table[q / bs] as usize * bs + q % bs])
                .collect();
            let ok = request.contexts().any(|tokens| {
                tokens.len() >= kv_len
                    && tokens[start..start + row_tokens.len()] == row_tokens[..]
                    && context_hashes(request.salt, &tokens[..kv_len])[lo..] == reads[..]
            });
            assert!(
                ok,
                "row {row} of request {} reads KV of another context (kv_len {kv_len})",
                plan.row_request[row]
            );
        }
        // Sample from the KV the device computed.
        (0..plan.num_sampled())
            .map(|r| {
                let request = &self.requests[&plan.sample_request[r]];
                let context = computed[plan.logits_indices[r] as usize];
                sample_token(
                    context,
                    plan.token_ids[plan.logits_indices[r] as usize] as u32,
                    plan.sample_index[r] as u32,
                    plan.sample_suppress_stop[r],
                    &request.params.stop_token_ids,
                ) as i64
            })
            .collect()
    }

    /// With `DraftMethod::DraftModel`, propose drafts for the samples that ask:
    /// the independent decoder's next tokens (sometimes cut short or with one
    /// token changed) or random ones, as a draft model right or wrong would.
    fn propose_drafts(&mut self) {
        let config = self.sched.config().clone();
        if config.speculative.method != DraftMethod::DraftModel {
            return;
        }
        for (handle, sample, k) in self.sched.draft_requests() {
            let request = &self.requests[&handle];
            let tokens = self
                .sched
                .sample_tokens(handle, sample)
                .expect("live")
                .to_vec();
            let produced = tokens.len() - request.prompt.len();
            let (want, _) = decode(request, sample, &config.eos_token_ids, config.max_model_len);
            let rng = &mut self.rng;
            let mut drafts: Vec<u32> = if rng.chance(2, 3) {
                want[produced.min(want.len())..].to_vec()
            } else {
                (0..k).map(|_| rng.below(VOCAB as usize) as u32).collect()
            };
            drafts.truncate(rng.below(k + 3));
            if !drafts.is_empty() && rng.chance(1, 4) {
                let at = rng.below(drafts.len());
                drafts[at] = rng.below(VOCAB as usize) as u32;
            }
            self.sched.propose_drafts(handle, sample, &drafts).unwrap();
        }
    }

    fn step(&mut self) {
        if self.rng.chance(1, 2) {
            self.add_random_request();
        }
        self.disturb();
        self.propose_drafts();
        let plan = self.sched.schedule().unwrap().clone();
        if !plan.is_empty() {
            self.steps_with_work += 1;
            assert!(
                matches!(self.sched.schedule(), Err(KvError::InvalidArgument(_))),
                "schedule twice is a typed error"
            );
        }
        if self.rng.chance(1, 10) {
            self.disturb(); // between schedule and update
        }
        let sampled = self.execute(&plan);
        if !sampled.is_empty() {
            let too_many = vec![1i64; sampled.len() + 1];
            assert!(self.sched.update(&too_many, &mut self.events).is_err());
        }
        self.update(&sampled);
        let (reserved, used) = self.sched.kv_slot_usage();
        assert!(used <= reserved, "{used} used slots of {reserved} reserved");
    }

    fn drain(&mut self) {
        let mut guard = 0;
        while self.sched.has_unfinished_requests() {
            self.propose_drafts();
            let plan = self.sched.schedule().unwrap().clone();
            let sampled = self.execute(&plan);
            self.update(&sampled);
            guard += 1;
            assert!(guard < 20_000, "the scheduler made no progress");
        }
        assert_eq!(
            self.sched.kv().num_referenced_blocks(),
            0,
            "every block comes back"
        );
        assert_eq!(self.sched.kv_slot_usage(), (0, 0));
    }

    /// Every output against the independent decoder.
    fn check_outputs(&self) {
        let config = self.sched.config();
        for (handle, request) in &self.requests {
            for (&sample, out) in &request.outputs {
                let (want, reason) =
                    decode(request, sample, &config.eos_token_ids, config.max_model_len);
                if request.cut {
                    assert!(
                        want.starts_with(out),
                        "request {handle} sample {sample}: {out:?} is not a prefix of {want:?}"
                    );
                } else {
                    assert_eq!(out, &want, "request {handle} sample {sample}");
                    assert_eq!(request.finish.get(&sample), Some(&reason));
                }
            }
            if !request.cut {
                assert_eq!(
                    request.outputs.len(),
                    request.params.n as usize,
                    "request {handle}: every sample produced output"
                );
            }
        }
    }
}

/// What one seed exercised: (steps with work, preemptions, ghost rows,
/// prefix-cache hit blocks, drafted tokens, accepted drafts).
fn run_seed(seed: u64, steps: usize, windowed: bool) -> [u64; 7] {
    let Some(mut h) = Harness::new(seed, windowed) else {
        return [0; 7];
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for _ in 0..steps {
            h.step();
        }
        h.drain();
        h.check_outputs();
    }));
    if let Err(panic) = result {
        eprintln!(
            "reference-model test failed; replay with KVPAGE_SEED={seed} ({:?}, block size {}, \
             sliding window {:?})",
            h.sched.config().policy,
            h.block_size,
            h.sched.config().sliding_window
        );
        std::panic::resume_unwind(panic);
    }
    let stats = &h.sched.stats;
    [
        h.steps_with_work as u64,
        stats.num_preemptions,
        stats.ghost_rows,
        h.sched.kv().prefix_cache_stats().hit_blocks,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        if h.sched.config().speculative.method == DraftMethod::DraftModel {
            stats.num_accepted_tokens
        } else {
            0
        },
    ]
}

#[test]
fn scheduler_matches_the_reference_model() {
    if let Some(seed) = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run_seed(seed, 1500, false);
        return;
    }
    let (seeds, steps) = if std::env::var_os("KVPAGE_SOAK").is_some() {
        (2000, 1500)
    } else {
        (120, 300)
    };
    let mut total = [0u64; 7];
    for seed in 0..seeds {
        for (sum, n) in total.iter_mut().zip(run_seed(seed, steps, false)) {
            *sum += n;
        }
    }
    eprintln!(
        "steps with work, preemptions, ghost rows, prefix hit blocks, drafted, accepted, \
         accepted from proposed drafts: {total:?}"
    );
    // Drafts need a quiet queue, which this workload rarely leaves.
    assert!(
        total[..5].iter().all(|&n| n > 100) && total[5] > 40 && total[6] > 10,
        "the workload must exercise preemption, static ghosts, prefix hits and accepted and \
         rejected drafts: {total:?}"
    );
}

#[test]
fn scheduler_with_a_sliding_window_matches_the_reference_model() {
    if let Some(seed) = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run_seed(seed, 1500, true);
        return;
    }
    let (seeds, steps) = if std::env::var_os("KVPAGE_SOAK").is_some() {
        (2000, 1500)
    } else {
        (80, 300)
    };
    let mut total = [0u64; 6];
    for seed in 0..seeds {
        for (sum, n) in total.iter_mut().zip(run_seed(seed, steps, true)) {
            *sum += n;
        }
    }
    eprintln!("windowed: steps with work, preemptions, ghost rows, prefix hit blocks: {total:?}");
    assert!(
        total[0] > 100 && total[1] > 100 && total[3] > 100,
        "the workload must exercise preemption and prefix hits: {total:?}"
    );
}
