//! The continuous-batching scheduler: every `schedule()` decides which
//! tokens of which sequences run in one step, and `update()` applies the
//! sampled tokens, checks stop conditions and frees finished sequences.
//!
//! One step, in phases (each its own function, in its own file):
//! 1. `preempt_for_priority` (priority policy, `preemption.rs`): a better
//!    waiting sequence takes the seat or the memory of the worst running one.
//! 2. `schedule_running` (`budget.rs`): running sequences first, in priority
//!    order: one token per decode, the next chunk of an unfinished prefill.
//!    When the pool cannot supply a block, preempt by recompute from the back.
//! 3. `admit_waiting` (`admission.rs`): while the token budget and
//!    `max_num_seqs` allow, admit waiting sequences after matching the prefix
//!    cache; only the uncached suffix is prefilled (the last prompt token
//!    always is). A sequence whose prompt shares blocks with one being
//!    prefilled now waits for them (`prefill_grouping.rs`).
//! 4. `build_plan` (`plan.rs`): flatten the scheduled rows into the step
//!    plan, fork n > 1 requests whose prompt completes, cache newly full
//!    blocks. With a sliding window (`SchedulerConfig::sliding_window`), each
//!    row's sequence then drops the blocks that left its next query's window
//!    (the rule and the prefix cache under it: `kv/kv_cache.rs`; what the
//!    plan's block tables hold: `sched/step_plan.rs`).
//!
//! This file holds the scheduler's state, `schedule()` and `update()`;
//! requests come and go in `requests.rs`, structured outputs ride along in
//! `grammar.rs`, and `check_invariants` lives in `invariants.rs`.
//!
//! The `static` policy is the measurable baseline (`static_batching.rs`):
//! fixed batches that start together and end together; each sample reserves
//! its maximum length of KV up front; finished sequences keep their seat (a
//! "ghost" row that recomputes its last position, as padded static batching
//! does) until the whole batch is done.
//!
//! Invariants (see `check_invariants`):
//! - every live sequence is in exactly one of waiting, running or (static)
//!   the ghost set; running ones hold a page table covering `num_computed`
//!   tokens, waiting ones hold none and have `num_computed == 0` (sizing a
//!   waiting candidate never attaches KV to it); with a sliding window, a
//!   running sequence has dropped exactly the blocks entirely before the
//!   window of its next query (position `num_computed`);
//! - `running` is sorted by (priority, arrival, seq) and never exceeds
//!   `max_num_seqs`;
//! - every block is accounted for by the KV manager's invariants, and when
//!   no request is live, every block is free or cached-unreferenced;
//! - seats (rows of the runner's sampling table, `0..max_num_seqs`): each is
//!   either free or held by exactly one running sequence; a sequence binds
//!   one at its first sampled row after admission and frees it when it
//!   finishes (ghosts included) or is preempted. The scheduler is the only
//!   owner of seats: the plan carries each sampled row's seat, the seats
//!   bound in it and those freed since the last plan (see `sched/step_plan.rs`);
//!   seats are handed out last-freed-first;
//! - the phase-specific ones, each at the top of its file: `static_batching.rs`
//!   (seated batches, ghosts), `grammar.rs` (matchers), `lookahead.rs`
//!   (continuation plans); the KV manager's own at the top of `kv/kv_cache.rs`.
//!
//! Which integer names what (the id spaces) and who owns each: `sched/request.rs`.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::error::{KvError, KvResult};
use crate::kv::kv_cache::{BlockCopy, KvCacheManager};
use crate::sched::request::{FinishReason, Request, SeqState, Sequence};
use crate::sched::step_plan::StepPlan;

mod admission;
mod budget;
mod grammar;
mod invariants;
mod lookahead;
mod plan;
mod preemption;
mod prefill_grouping;
mod requests;
mod speculation;
mod static_batching;

pub use speculation::{DraftMethod, SpeculativeConfig};

use crate::sched::suffix_drafter::SuffixIndex;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Fcfs,
    Priority,
    Static,
}

impl Policy {
    pub fn parse(name: &str) -> KvResult<Self> {
        match name {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            "static" => Ok(Policy::Static),
            other => Err(KvError::InvalidArgument(format!(
                "scheduling_policy must be one of 'fcfs', 'priority', 'static'; got {other:?}"
            ))),
        }
    }
}

/// The sizes a caller that names none gets: `SchedulerConfig::default()` and
/// the defaults of the PyO3 `Scheduler` constructor (`rust/py/scheduler.rs`)
/// read them from here. Their owner is Python's `EngineConfig`
/// (`python/kvpage/engine/config.py`), which the engine passes in full;
/// these mirror it for Rust callers and direct users of `kvpage._core`, and
/// `tests/core/test_scheduler_defaults.py` checks they agree.
pub mod defaults {
    pub const BLOCK_SIZE: usize = 16;
    pub const MAX_NUM_SEQS: usize = 256;
    pub const MAX_NUM_BATCHED_TOKENS: usize = 2048;
    /// Not an `EngineConfig` default (the engine derives it from the model).
    pub const MAX_MODEL_LEN: usize = 2048;
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub enable_chunked_prefill: bool,
    /// Most tokens one prompt may take in one step (0 = no cap).
    pub long_prefill_token_threshold: usize,
    pub enable_prefix_caching: bool,
    /// A waiting sequence whose prompt shares whole blocks with one being
    /// prefilled waits for those blocks instead of computing them again
    /// (`prefill_grouping.rs`); needs the prefix cache.
    pub group_shared_prefills: bool,
    pub policy: Policy,
    pub eos_token_ids: Vec<u32>,
    /// Sliding-window attention: `Some(W)` only when every attention layer
    /// of the model attends to the last `W` positions (a query at `p` reads
    /// keys `p - W < j <= p`); `None` (full attention, or a model mixing
    /// full and sliding layers) is the behaviour without windows. With a
    /// window, blocks that fall out of it are dropped as sequences advance
    /// (see `kv/kv_cache.rs`); the `static` policy ignores it (it reserves
    /// each sample's whole length up front).
    pub sliding_window: Option<u32>,
    /// Speculative decoding (`speculation.rs`); off by default.
    pub speculative: SpeculativeConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: defaults::BLOCK_SIZE,
            max_num_seqs: defaults::MAX_NUM_SEQS,
            max_num_batched_tokens: defaults::MAX_NUM_BATCHED_TOKENS,
            max_model_len: defaults::MAX_MODEL_LEN,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            enable_prefix_caching: true,
            group_shared_prefills: true,
            policy: Policy::Fcfs,
            eos_token_ids: Vec::new(),
            sliding_window: None,
            speculative: SpeculativeConfig::default(),
        }
    }
}

impl SchedulerConfig {
    /// Most sampled rows a step may carry: `max_num_seqs`, or one row more
    /// than the drafted tokens when that is larger, so that one sequence can
    /// verify all its drafts whatever `max_num_seqs` is (the runner sizes its
    /// heads by this; `kvpage.engine.config.EngineConfig.max_sampled_rows`).
    pub fn max_sampled_rows(&self) -> usize {
        self.max_num_seqs
            .max(1 + self.speculative.num_speculative_tokens)
    }
}

/// Counters cheap enough to read every step.
#[derive(Debug, Clone, Default)]
pub struct SchedulerStats {
    pub num_steps: u64,
    pub num_preemptions: u64,
    pub prompt_tokens_scheduled: u64,
    pub decode_tokens_scheduled: u64,
    pub last_step_tokens: usize,
    pub last_step_seqs: usize,
    /// Sequence rows over all steps, and those that were static ghosts.
    pub seq_rows: u64,
    pub ghost_rows: u64,
    /// Seats left empty in steps where sequences were waiting.
    pub idle_seats_while_waiting: u64,
    pub num_finished_requests: u64,
    /// Steps a waiting sequence was held back for a prompt another one was
    /// prefilling (`prefill_grouping.rs`), summed over sequences.
    pub prefill_waits: u64,
    pub num_aborted_requests: u64,
    /// Speculative decoding: verified sequence rows, their drafted tokens,
    /// and the drafts the model accepted (`speculation.rs`).
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
}

/// One sampled token's outcome, as `update` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenEvent {
    /// The sampled row of the plan this token came from.
    pub row: u32,
    pub request: u64,
    pub sample_index: u32,
    pub token: u32,
    pub finish: Option<FinishReason>,
    /// Stopped (`finish == Some(Stop)`) on a token of the request's
    /// `stop_token_ids`: that token is the output's `stop_reason`.
    pub stop_token: bool,
}

#[derive(Debug, Clone, Copy)]
struct Scheduled {
    seq: u32,
    start: usize,
    len: usize,
    ghost: bool,
}

type WaitKey = (i64, u64, u32);

/// One sampled row of the last plan: its request (the handle, with its
/// generation, guards the sequence index), sample and sequence, and its
/// offset among the sequence's rows (`speculation.rs`; 0 without drafts).
#[derive(Debug, Clone, Copy)]
struct SampleRow {
    handle: u64,
    sample_index: u32,
    seq: u32,
    offset: u32,
}

pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: Vec<Option<Request>>,
    request_generation: Vec<u32>,
    free_requests: Vec<u32>,
    seqs: Vec<Option<Sequence>>,
    free_seqs: Vec<u32>,
    waiting: BTreeSet<WaitKey>,
    running: Vec<u32>,
    /// Seats promised to samples that running sequences fork later.
    pending_fork_seats: usize,
    /// Static policy: the current batch's finished sequences, still seated.
    ghosts: Vec<u32>,
    /// Seats no sequence holds, taken from the back.
    free_seats: Vec<u32>,
    /// Seats freed since the last plan was built (reported in the next).
    seats_freed: Vec<i32>,
    next_arrival: u64,
    scheduled: Vec<Scheduled>,
    /// Each sampled row of the last plan.
    sample_rows: Vec<SampleRow>,
    awaiting_update: bool,
    copies: Vec<BlockCopy>,
    plan: StepPlan,
    pub stats: SchedulerStats,
    by_handle: FxHashMap<u64, u32>,
    /// Recent sequences' token streams, with `DraftMethod::Suffix`.
    suffix: Option<SuffixIndex>,
    /// Drafts proposed from outside since the last plan (`DraftMethod::DraftModel`).
    proposed: Vec<speculation::Proposal>,
    /// Drafts in a row, across sequences, of which nothing was kept (at most 6),
    /// and the plans left before any sequence drafts again (`speculation.rs`).
    drafter_misses: u32,
    drafter_cooldown: u32,
}

impl Scheduler {
    pub fn new(mut config: SchedulerConfig) -> KvResult<Self> {
        let config_spec = config.speculative;
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        if config.max_num_seqs == 0 {
            return invalid("max_num_seqs must be >= 1".into());
        }
        if config.max_num_batched_tokens == 0 {
            return invalid("max_num_batched_tokens must be >= 1".into());
        }
        if config.max_model_len == 0 {
            return invalid("max_model_len must be >= 1".into());
        }
        if config.sliding_window == Some(0) {
            return invalid("sliding_window must be >= 1 (or None for full attention)".into());
        }
        if config.policy == Policy::Static {
            config.sliding_window = None;
        }
        if Self::blocks_one_sequence_needs(&config) > config.num_blocks {
            let window = match config.sliding_window {
                Some(w) => format!(" (sliding window {w})"),
                None => String::new(),
            };
            return invalid(format!(
                "a KV pool of {} blocks of {} tokens cannot hold one sequence of max_model_len={} tokens{window}; \
                 lower max_model_len or give the pool more blocks",
                config.num_blocks, config.block_size, config.max_model_len
            ));
        }
        if !config.enable_chunked_prefill && config.max_num_batched_tokens < config.max_model_len {
            return invalid(format!(
                "without chunked prefill, max_num_batched_tokens ({}) must be >= max_model_len ({})",
                config.max_num_batched_tokens, config.max_model_len
            ));
        }
        if config.policy == Policy::Static {
            config.enable_prefix_caching = false;
        }
        let free_seats = (0..config.max_num_seqs as u32).rev().collect();
        let kv = KvCacheManager::new_with_window(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.sliding_window,
        )?;
        Ok(Self {
            config,
            kv,
            requests: Vec::new(),
            request_generation: Vec::new(),
            free_requests: Vec::new(),
            seqs: Vec::new(),
            free_seqs: Vec::new(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            pending_fork_seats: 0,
            ghosts: Vec::new(),
            free_seats,
            seats_freed: Vec::new(),
            next_arrival: 0,
            scheduled: Vec::new(),
            sample_rows: Vec::new(),
            awaiting_update: false,
            copies: Vec::new(),
            plan: StepPlan::default(),
            stats: SchedulerStats::default(),
            by_handle: FxHashMap::default(),
            suffix: (config_spec.method == DraftMethod::Suffix).then(|| {
                SuffixIndex::new(
                    config_spec.prompt_lookup_min,
                    config_spec.prompt_lookup_max,
                    config_spec.suffix_capacity,
                )
            }),
            proposed: Vec::new(),
            drafter_misses: 0,
            drafter_cooldown: 0,
        })
    }

    /// The most blocks one sequence can need at once: its whole
    /// `max_model_len`, or with a sliding window `W` and chunks of at most
    /// `L` tokens, `ceil((W + L) / B) + 1`. That covers a running sequence
    /// (the `W - 1` positions its next query reads, the window's first block
    /// partly out of it, plus the chunk's) and an admission (a matched
    /// prefix, at most `floor((W + B - 2) / B)` blocks since sequences stop
    /// caching when they first slide, plus the first chunk), so one
    /// sequence alone always fits and never waits forever.
    fn blocks_one_sequence_needs(config: &SchedulerConfig) -> usize {
        let bs = config.block_size.max(1);
        let full = config.max_model_len.div_ceil(bs);
        match config.sliding_window {
            Some(window) => {
                let mut chunk = config.max_num_batched_tokens.min(config.max_model_len);
                if config.long_prefill_token_threshold > 0 {
                    chunk = chunk.min(config.long_prefill_token_threshold.max(1));
                }
                let windowed = (window as usize + chunk).div_ceil(bs) + 1;
                full.min(windowed)
            }
            None => full,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_live_requests(&self) -> usize {
        self.by_handle.len()
    }

    /// True between a non-empty `schedule()` and its `update()`.
    pub fn awaiting_update(&self) -> bool {
        self.awaiting_update
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.by_handle.is_empty()
    }

    fn new_seq(&mut self, seq: Sequence) -> u32 {
        match self.free_seqs.pop() {
            Some(index) => {
                self.seqs[index as usize] = Some(seq);
                index
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as u32
            }
        }
    }

    fn seq(&self, index: u32) -> &Sequence {
        self.seqs[index as usize].as_ref().expect("live sequence")
    }

    fn seq_mut(&mut self, index: u32) -> &mut Sequence {
        self.seqs[index as usize].as_mut().expect("live sequence")
    }

    fn request_of(&self, seq: u32) -> &Request {
        let index = self.seq(seq).request;
        self.requests[index as usize]
            .as_ref()
            .expect("live request")
    }

    fn key(&self, seq: u32) -> WaitKey {
        let request = self.request_of(seq);
        (request.priority, request.arrival, seq)
    }

    // ---- one step -------------------------------------------------------

    /// Plan the next step. An empty plan means there is nothing to run.
    pub fn schedule(&mut self) -> KvResult<&StepPlan> {
        if self.awaiting_update {
            return Err(KvError::InvalidArgument(
                "schedule() called twice without update(): apply the sampled tokens of the previous step first"
                    .into(),
            ));
        }
        self.plan.clear();
        self.scheduled.clear();
        self.copies.clear();
        self.drafter_cooldown = self.drafter_cooldown.saturating_sub(1);
        let mut budget = self.config.max_num_batched_tokens;
        match self.config.policy {
            Policy::Static => self.schedule_static()?,
            policy => {
                if policy == Policy::Priority {
                    self.preempt_for_priority()?;
                }
                let preempted = self.schedule_running(&mut budget, true)?;
                if !preempted {
                    self.admit_waiting(&mut budget)?;
                }
            }
        }
        self.build_plan()?;
        self.proposed.clear();
        self.awaiting_update = !self.plan.is_empty();
        Ok(&self.plan)
    }

    /// Apply one sampled token per sampled row of the last plan; returns
    /// what happened to each. Finished sequences free their blocks at once.
    pub fn update(&mut self, sampled: &[i64], events: &mut Vec<TokenEvent>) -> KvResult<()> {
        if !self.awaiting_update {
            if sampled.is_empty() {
                return Ok(()); // the last plan was empty: nothing to apply
            }
            return Err(KvError::InvalidArgument(
                "update() called without a scheduled step".into(),
            ));
        }
        if sampled.len() != self.sample_rows.len() {
            return Err(KvError::InvalidArgument(format!(
                "update() got {} sampled tokens, but the step sampled {} rows",
                sampled.len(),
                self.sample_rows.len()
            )));
        }
        if let Some(bad) = sampled
            .iter()
            .find(|&&t| !(0..=u32::MAX as i64).contains(&t))
        {
            return Err(KvError::InvalidArgument(format!(
                "sampled token id {bad} is out of range"
            )));
        }
        self.awaiting_update = false;
        let rows = std::mem::take(&mut self.sample_rows);
        // Whether the current sequence's rows are still being kept, and the
        // verified sequences with their accepted drafts (`speculation.rs`).
        let mut keeping = false;
        let mut verified: Vec<(u32, usize, usize)> = Vec::new();
        for (row, (r, &token)) in rows.iter().zip(sampled).enumerate() {
            let seq = r.seq;
            if r.offset == 0 {
                // The sequence may have been aborted (and its index reused)
                // since the plan was made: its request handle must still match.
                keeping = match &self.seqs[seq as usize] {
                    Some(s) if s.state == SeqState::Running => self.requests[s.request as usize]
                        .as_ref()
                        .is_some_and(|q| q.handle == r.handle),
                    _ => false,
                };
                let drafted = if keeping {
                    self.seq(seq).draft.len()
                } else {
                    0
                };
                if drafted > 0 {
                    verified.push((seq, 0, drafted));
                }
            } else if keeping {
                // Row `offset` is the model's only if it agreed with the
                // draft before it (a sequence that finished stopped keeping).
                let s = self.seq(seq);
                keeping = s.tokens.last() == Some(&s.draft[r.offset as usize - 1]);
                if keeping {
                    verified.last_mut().expect("a verified sequence").1 += 1;
                }
            }
            if !keeping {
                continue;
            }
            let token = token as u32;
            self.seq_mut(seq).tokens.push(token);
            let finish = match self.advance_grammar(seq, token) {
                Some(reason) => Some(reason),
                None => self.stop_reason(seq, token),
            };
            // Decided before finishing: the request's records may go with it.
            let stop_token = finish == Some(FinishReason::Stop)
                && self.request_of(seq).params.stop_token_ids.contains(&token);
            if let Some(reason) = finish {
                self.finish_seq(seq, reason)?;
                keeping = false; // its later rows (drafts past the end) are dropped
            }
            events.push(TokenEvent {
                row: row as u32,
                request: r.handle,
                sample_index: r.sample_index,
                token,
                finish,
                stop_token,
            });
        }
        for (seq, accepted, drafted) in verified {
            self.settle_verified(seq, accepted, drafted)?;
        }
        self.sample_rows = rows;
        self.sample_rows.clear();
        self.end_static_batch_if_done()
    }

    fn stop_reason(&self, seq: u32, token: u32) -> Option<FinishReason> {
        let s = self.seq(seq);
        let request = self.request_of(seq);
        let p = &request.params;
        let output_len = s.tokens.len() - request.prompt_len;
        let may_stop = output_len >= p.min_tokens as usize;
        if may_stop && !p.ignore_eos && self.config.eos_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if may_stop && p.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if output_len >= p.max_tokens as usize || s.tokens.len() >= self.config.max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }

    /// Forget the prefix cache (e.g. new weights). Live sequences keep
    /// their blocks.
    /// Record the prefix cache's stored / removed / cleared blocks for
    /// cache-aware routers (`kv_cache::KvCacheManager::take_kv_events`).
    pub fn set_kv_events_enabled(&mut self, enabled: bool) {
        self.kv.set_kv_events_enabled(enabled);
    }

    pub fn take_kv_events(&mut self) -> Vec<crate::kv::prefix_cache::events::CacheEvent> {
        self.kv.take_kv_events()
    }

    pub fn reset_prefix_cache(&mut self) -> KvResult<()> {
        self.kv.reset_prefix_cache()
    }

    /// The tokens of one sample (prompt followed by output).
    pub fn sample_tokens(&self, handle: u64, sample_index: u32) -> Option<&[u32]> {
        let index = *self.by_handle.get(&handle)?;
        let request = self.requests[index as usize].as_ref()?;
        let seq = *request.seqs.get(sample_index as usize)?;
        Some(&self.seq(seq).tokens)
    }

    /// Prompt tokens found in the prefix cache when the request was admitted.
    pub fn num_cached_tokens(&self, handle: u64) -> Option<usize> {
        let index = *self.by_handle.get(&handle)?;
        let request = self.requests[index as usize].as_ref()?;
        Some(self.seq(request.seqs[0]).num_cached_tokens)
    }

    /// KV slots reserved by live sequences (blocks in use x block size)
    /// and the slots of those blocks holding computed tokens (scheduled in
    /// an issued step); a block shared by several sequences counts once.
    /// O(1): both are counters the KV manager maintains.
    pub fn kv_slot_usage(&self) -> (usize, usize) {
        (
            self.kv.num_referenced_blocks() * self.config.block_size,
            self.kv.num_written_slots(),
        )
    }
}
