//! The continuous-batching scheduler: every `schedule()` decides which
//! tokens of which sequences run in one step, and `update()` applies the
//! sampled tokens, checks stop conditions and frees finished sequences.
//!
//! One step, in phases (each its own function):
//! 1. `preempt_for_priority` (priority policy): a better waiting sequence
//!    takes the seat or the memory of the worst running one.
//! 2. `schedule_running`: running sequences first, in priority order: one
//!    token per decode, the next chunk of an unfinished prefill. When the
//!    pool cannot supply a block, preempt by recompute from the back.
//! 3. `admit_waiting`: while the token budget and `max_num_seqs` allow,
//!    admit waiting sequences after matching the prefix cache; only the
//!    uncached suffix is prefilled (the last prompt token always is).
//! 4. `build_plan`: flatten the scheduled rows into the step plan, fork
//!    n > 1 requests whose prompt completes, cache newly full blocks.
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
//!   waiting candidate never attaches KV to it);
//! - `running` is sorted by (priority, arrival, seq) and never exceeds
//!   `max_num_seqs`;
//! - every block is accounted for by the KV manager's invariants, and when
//!   no request is live, every block is free or cached-unreferenced;
//! - seats (rows of the runner's sampling table, `0..max_num_seqs`): each is
//!   either free or held by exactly one running sequence; a sequence binds
//!   one at its first sampled row after admission and frees it when it
//!   finishes (ghosts included) or is preempted. The scheduler is the only
//!   owner of seats: the plan carries each sampled row's seat, the seats
//!   bound in it and those freed since the last plan (see `step_plan.rs`);
//!   seats are handed out last-freed-first.
//!
//! Id spaces (request index, handle, seq, seat, KV `SeqId`): `request.rs`.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::error::{KvError, KvResult};
use crate::kv::block_pool::block_ids_as_i32;
use crate::kv::kv_cache::{BlockCopy, KvCacheManager};
use crate::sched::request::{FinishReason, Request, RequestParams, SeqState, Sequence};
use crate::sched::step_plan::StepPlan;

mod grammar;
mod static_batching;

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
    pub policy: Policy,
    pub eos_token_ids: Vec<u32>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 2048,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            enable_prefix_caching: true,
            policy: Policy::Fcfs,
            eos_token_ids: Vec::new(),
        }
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
    pub num_aborted_requests: u64,
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
    /// (request handle, sample index, sequence) of each sampled row of the
    /// last plan; the handle (with its generation) guards the sequence index.
    sample_rows: Vec<(u64, u32, u32)>,
    awaiting_update: bool,
    copies: Vec<BlockCopy>,
    plan: StepPlan,
    pub stats: SchedulerStats,
    by_handle: FxHashMap<u64, u32>,
}

impl Scheduler {
    pub fn new(mut config: SchedulerConfig) -> KvResult<Self> {
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
        if config.max_model_len.div_ceil(config.block_size.max(1)) > config.num_blocks {
            return invalid(format!(
                "a KV pool of {} blocks of {} tokens cannot hold one sequence of max_model_len={} tokens; \
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
        let kv = KvCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
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
        })
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

    // ---- requests -------------------------------------------------------

    /// Queue a request; returns its handle. Rejects, with a message naming
    /// the value, prompts that are empty or leave no room to generate within
    /// `max_model_len`, requests that could not fit in the whole KV pool, and
    /// stop conditions that cannot be met. `max_tokens` is clamped to the
    /// room the prompt leaves (`u32::MAX` = until `max_model_len`): this is
    /// the one place these limits are checked.
    pub fn add_request(
        &mut self,
        prompt: &[u32],
        mut params: RequestParams,
        priority: i64,
        salt: Option<&str>,
    ) -> KvResult<u64> {
        self.validate_request(prompt, &mut params)?;
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let index = match self.free_requests.pop() {
            Some(index) => index,
            None => {
                self.requests.push(None);
                self.request_generation.push(0);
                (self.requests.len() - 1) as u32
            }
        };
        let handle = ((self.request_generation[index as usize] as u64) << 32) | index as u64;
        let priority = if self.config.policy == Policy::Priority {
            priority
        } else {
            0
        };
        let seq = self.new_seq(Sequence {
            request: index,
            sample_index: 0,
            tokens: prompt.to_vec(),
            num_computed: 0,
            kv: None,
            state: SeqState::Waiting,
            forks_pending: params.n - 1,
            num_cached_tokens: 0,
            admitted: false,
            grammar: None,
            seat: None,
        });
        self.requests[index as usize] = Some(Request {
            handle,
            priority,
            arrival,
            salt: salt.map(str::to_owned),
            prompt_len: prompt.len(),
            seqs: vec![seq],
            num_unfinished: params.n,
            scheduled: false,
            params,
        });
        self.by_handle.insert(handle, index);
        self.waiting.insert((priority, arrival, seq));
        Ok(handle)
    }

    fn validate_request(&self, prompt: &[u32], params: &mut RequestParams) -> KvResult<()> {
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        let c = &self.config;
        if prompt.is_empty() {
            return invalid("the prompt is empty: at least 1 token is required".into());
        }
        if prompt.len() >= c.max_model_len {
            return invalid(format!(
                "the prompt has {} tokens; max_model_len is {}, which leaves no room to generate",
                prompt.len(),
                c.max_model_len
            ));
        }
        if params.n == 0 || params.n as usize > c.max_num_seqs {
            return invalid(format!(
                "n must be in 1..={} (max_num_seqs), got {}",
                c.max_num_seqs, params.n
            ));
        }
        if params.max_tokens == 0 {
            return invalid("max_tokens must be >= 1, got 0".into());
        }
        if params.min_tokens > params.max_tokens {
            return invalid(format!(
                "min_tokens ({}) must be <= max_tokens ({})",
                params.min_tokens, params.max_tokens
            ));
        }
        let room = u32::try_from(c.max_model_len - prompt.len()).unwrap_or(u32::MAX);
        params.max_tokens = params.max_tokens.min(room);
        if params.min_tokens > params.max_tokens {
            return invalid(format!(
                "min_tokens={} cannot be reached: only {room} tokens fit after the {}-token \
                 prompt within max_model_len={}",
                params.min_tokens,
                prompt.len(),
                c.max_model_len
            ));
        }
        if c.policy == Policy::Static {
            self.check_static_reservation_fits(prompt.len(), params)?;
        }
        Ok(())
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

    /// Abort a request in any state; its blocks return at once. Returns
    /// false when the handle is unknown (already finished or never added).
    pub fn abort_request(&mut self, handle: u64) -> KvResult<bool> {
        self.finish_request(handle, FinishReason::Abort)
    }

    /// Finish every unfinished sequence of a request with `reason` (the
    /// engine uses it for stop strings and step failures).
    pub fn finish_request(&mut self, handle: u64, reason: FinishReason) -> KvResult<bool> {
        let Some(&index) = self.by_handle.get(&handle) else {
            return Ok(false);
        };
        let seqs = self.requests[index as usize]
            .as_ref()
            .expect("live")
            .seqs
            .clone();
        for seq in seqs {
            if !self.by_handle.contains_key(&handle) {
                break; // the last unfinished sample finished: records are gone
            }
            self.finish_seq(seq, reason)?;
        }
        if reason == FinishReason::Abort {
            self.stats.num_aborted_requests += 1;
        }
        self.end_static_batch_if_done()?;
        Ok(true)
    }

    /// Finish one sample of a request (e.g. it produced a stop string).
    pub fn finish_sample(
        &mut self,
        handle: u64,
        sample_index: u32,
        reason: FinishReason,
    ) -> KvResult<bool> {
        let Some(&index) = self.by_handle.get(&handle) else {
            return Ok(false);
        };
        let request = self.requests[index as usize].as_ref().expect("live");
        let Some(&seq) = request.seqs.get(sample_index as usize) else {
            return Err(KvError::InvalidArgument(format!(
                "request {handle} has no sample {sample_index} (it has {})",
                request.seqs.len()
            )));
        };
        self.finish_seq(seq, reason)?;
        self.end_static_batch_if_done()?;
        Ok(true)
    }

    fn finish_seq(&mut self, seq: u32, reason: FinishReason) -> KvResult<()> {
        let state = self.seq(seq).state;
        match state {
            SeqState::Finished(_) => return Ok(()),
            SeqState::Waiting => {
                let key = self.key(seq);
                self.waiting.remove(&key);
            }
            SeqState::Running => self.remove_running(seq),
        }
        self.release_seat(seq);
        // Samples never forked finish with their parent.
        let unforked = std::mem::take(&mut self.seq_mut(seq).forks_pending);
        self.seq_mut(seq).state = SeqState::Finished(reason);
        if self.keeps_seat_as_ghost(state, reason) {
            self.ghosts.push(seq);
        } else {
            self.release_kv(seq)?;
        }
        let request_index = self.seq(seq).request;
        let request = self.requests[request_index as usize]
            .as_mut()
            .expect("live");
        request.num_unfinished -= 1 + unforked;
        if request.num_unfinished == 0 {
            let handle = request.handle;
            self.by_handle.remove(&handle);
            self.stats.num_finished_requests += 1;
            self.maybe_release_request(request_index);
        }
        Ok(())
    }

    /// Give the sequence's seat back (it stops sampling: finished or
    /// preempted); the next plan lists it in `freed_seats`.
    fn release_seat(&mut self, seq: u32) {
        if let Some(seat) = self.seq_mut(seq).seat.take() {
            self.free_seats.push(seat);
            self.seats_freed.push(seat as i32);
        }
    }

    fn release_kv(&mut self, seq: u32) -> KvResult<()> {
        if let Some(kv) = self.seq_mut(seq).kv.take() {
            self.kv.free_sequence(kv)?;
        }
        self.seq_mut(seq).num_computed = 0;
        Ok(())
    }

    /// Drop a finished request's records once none of its sequences is
    /// still seated as a static ghost.
    fn maybe_release_request(&mut self, index: u32) {
        let request = self.requests[index as usize].as_ref().expect("live");
        if request.num_unfinished > 0 || request.seqs.iter().any(|&s| self.seq(s).kv.is_some()) {
            return;
        }
        let request = self.requests[index as usize].take().expect("live");
        for seq in request.seqs {
            self.seqs[seq as usize] = None;
            self.free_seqs.push(seq);
        }
        self.request_generation[index as usize] =
            self.request_generation[index as usize].wrapping_add(1);
        self.free_requests.push(index);
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
        let mut budget = self.config.max_num_batched_tokens;
        match self.config.policy {
            Policy::Static => self.schedule_static()?,
            policy => {
                if policy == Policy::Priority {
                    self.preempt_for_priority()?;
                }
                let preempted = self.schedule_running(&mut budget)?;
                if !preempted {
                    self.admit_waiting(&mut budget)?;
                }
            }
        }
        self.build_plan()?;
        self.awaiting_update = !self.plan.is_empty();
        Ok(&self.plan)
    }

    /// Tokens the next chunk of `seq` may take under the budget.
    fn chunk_len(&self, seq: u32, budget: usize) -> usize {
        let s = self.seq(seq);
        self.chunk_len_from(s.tokens.len() - s.num_computed, budget)
    }

    fn chunk_len_from(&self, remaining: usize, budget: usize) -> usize {
        let mut len = remaining.min(budget);
        let threshold = self.config.long_prefill_token_threshold;
        if remaining > 1 && threshold > 0 {
            len = len.min(threshold);
        }
        len
    }

    fn schedule_running(&mut self, budget: &mut usize) -> KvResult<bool> {
        let mut preempted_any = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let seq = self.running[i];
            let len = self.chunk_len(seq, *budget);
            if len == 0 {
                i += 1;
                continue;
            }
            let start = self.seq(seq).num_computed;
            loop {
                let kv = self.seq(seq).kv.expect("running sequences hold KV");
                match self.kv.allocate_slots(kv, len, &mut self.copies) {
                    Ok(()) => {
                        self.scheduled.push(Scheduled {
                            seq,
                            start,
                            len,
                            ghost: false,
                        });
                        *budget -= len;
                        i += 1;
                        break;
                    }
                    Err(KvError::OutOfBlocks { .. }) => {
                        let victim = *self.running.last().expect("seq is running");
                        self.preempt(victim)?;
                        preempted_any = true;
                        if victim == seq {
                            break;
                        }
                    }
                    Err(err) => return Err(err),
                }
            }
        }
        Ok(preempted_any)
    }

    /// Give a waiting sequence its page table and its prefix-cache hit.
    fn attach_kv(&mut self, seq: u32) -> KvResult<()> {
        if self.seq(seq).kv.is_some() {
            return Ok(());
        }
        let salt = self.request_of(seq).salt.clone();
        let kv = self.kv.create_sequence(salt.as_deref());
        let tokens = &self.seqs[seq as usize].as_ref().expect("live").tokens;
        let reusable = &tokens[..tokens.len() - 1];
        let matched = if self.config.enable_prefix_caching {
            self.kv.match_prefix(kv, reusable)?
        } else {
            0
        };
        let s = self.seq_mut(seq);
        s.kv = Some(kv);
        s.num_computed = matched;
        if !s.admitted {
            s.num_cached_tokens = matched;
        }
        Ok(())
    }

    /// Detach the KV of a candidate that was not admitted after all; it
    /// stays a first admission.
    fn detach_kv(&mut self, seq: u32) -> KvResult<()> {
        self.release_kv(seq)
    }

    /// Blocks admitting waiting `seq` would take from what is available
    /// now: its first chunk beyond the cached prefix, plus the evictable
    /// cached blocks that prefix would pin. Changes nothing.
    fn admission_blocks(&self, seq: u32) -> usize {
        let s = self.seq(seq);
        let salt = self.request_of(seq).salt.as_deref();
        let reusable = &s.tokens[..s.tokens.len() - 1];
        let (matched, pinned_evictable) = if self.config.enable_prefix_caching {
            self.kv.peek_prefix(salt, reusable)
        } else {
            (0, 0)
        };
        let len = self.chunk_len_from(s.tokens.len() - matched, self.config.max_num_batched_tokens);
        let bs = self.config.block_size;
        (matched + len).div_ceil(bs) - matched / bs + pinned_evictable
    }

    /// Seats a waiting sequence takes once running: itself plus the samples
    /// it forks when its prompt completes.
    fn seats(&self, seq: u32) -> usize {
        1 + self.seq(seq).forks_pending as usize
    }

    fn admit_waiting(&mut self, budget: &mut usize) -> KvResult<()> {
        while *budget > 0 {
            let Some(&key) = self.waiting.first() else {
                break;
            };
            let seq = key.2;
            if self.occupied_seats() + self.seats(seq) > self.config.max_num_seqs {
                break;
            }
            self.attach_kv(seq)?;
            let remaining = {
                let s = self.seq(seq);
                s.tokens.len() - s.num_computed
            };
            if !self.config.enable_chunked_prefill && remaining > *budget {
                self.detach_kv(seq)?;
                break;
            }
            let len = self.chunk_len(seq, *budget);
            let kv = self.seq(seq).kv.expect("attached");
            match self.kv.allocate_slots(kv, len, &mut self.copies) {
                Ok(()) => {
                    let start = self.seq(seq).num_computed;
                    self.waiting.remove(&key);
                    let s = self.seq_mut(seq);
                    s.state = SeqState::Running;
                    s.admitted = true;
                    self.insert_running(seq);
                    self.scheduled.push(Scheduled {
                        seq,
                        start,
                        len,
                        ghost: false,
                    });
                    *budget -= len;
                }
                Err(KvError::OutOfBlocks { .. }) => {
                    self.detach_kv(seq)?;
                    break;
                }
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }

    /// Priority policy: while the best waiting sequence outranks the worst
    /// running one and lacks a seat or memory, preempt the worst running.
    fn preempt_for_priority(&mut self) -> KvResult<()> {
        loop {
            let Some(&best) = self.waiting.first() else {
                return Ok(());
            };
            let Some(&worst) = self.running.last() else {
                return Ok(());
            };
            if self.key(worst) < best {
                return Ok(());
            }
            let seats_full = self.occupied_seats() + self.seats(best.2) > self.config.max_num_seqs;
            let memory_short = !seats_full && {
                let wanted = self.admission_blocks(best.2);
                let mut growth = 0;
                for &seq in &self.running {
                    let s = self.seq(seq);
                    let next = (s.tokens.len() - s.num_computed).min(1);
                    growth += self.kv.blocks_needed(s.kv.expect("running"), next)?;
                }
                wanted + growth > self.kv.num_available_blocks()
            };
            if !(seats_full || memory_short) {
                return Ok(());
            }
            self.preempt(worst)?;
        }
    }

    fn insert_running(&mut self, seq: u32) {
        let key = self.key(seq);
        let pos = self.running.partition_point(|&s| self.key(s) < key);
        self.running.insert(pos, seq);
        self.pending_fork_seats += self.seq(seq).forks_pending as usize;
    }

    fn remove_running(&mut self, seq: u32) {
        if let Some(pos) = self.running.iter().position(|&s| s == seq) {
            self.running.remove(pos);
            self.pending_fork_seats -= self.seq(seq).forks_pending as usize;
        }
    }

    fn occupied_seats(&self) -> usize {
        self.running.len() + self.pending_fork_seats
    }

    /// Preempt by recompute: free the sequence's blocks (full ones stay in
    /// the prefix cache) and put it back at its place in the waiting queue.
    fn preempt(&mut self, seq: u32) -> KvResult<()> {
        self.remove_running(seq);
        self.release_seat(seq);
        self.release_kv(seq)?;
        self.seq_mut(seq).state = SeqState::Waiting;
        let key = self.key(seq);
        self.waiting.insert(key);
        self.stats.num_preemptions += 1;
        let handle = self.request_of(seq).handle;
        self.plan.preempted.push(handle);
        self.plan
            .preempted_index
            .push(self.seq(seq).sample_index as i32);
        Ok(())
    }

    fn build_plan(&mut self) -> KvResult<()> {
        let scratch_block = self.config.num_blocks as i32;
        let scratch_slot = scratch_block * self.config.block_size as i32;
        let width = self
            .scheduled
            .iter()
            .map(|r| {
                self.kv
                    .block_table(self.seq(r.seq).kv.expect("scheduled"))
                    .map(|t| t.len())
            })
            .try_fold(0, |w, len| len.map(|l| w.max(l)))?;
        let scheduled = std::mem::take(&mut self.scheduled);
        self.plan.block_table_width = width;
        self.plan.cu_q_lens.push(0);
        self.sample_rows.clear();
        for copy in self.copies.drain(..) {
            self.plan.copy_src.push(copy.src as i32);
            self.plan.copy_dst.push(copy.dst as i32);
        }
        // Freed before any seat of this plan is bound (same order as freed).
        self.plan.freed_seats.append(&mut self.seats_freed);
        self.plan.decode_only = !scheduled.is_empty() && scheduled.iter().all(|r| r.len == 1);
        let bs = self.config.block_size;
        for row in &scheduled {
            self.push_row_arrays(row, width, scratch_block, scratch_slot)?;
            if row.ghost {
                self.stats.ghost_rows += 1;
                continue;
            }
            // Advance, cache newly full blocks, sample when the row reaches
            // the end of its known tokens, fork a completed n > 1 prompt.
            let seq = self.seqs[row.seq as usize].as_mut().expect("live");
            seq.num_computed = row.start + row.len;
            let done = seq.num_computed == seq.tokens.len();
            let kv = seq.kv.expect("scheduled");
            self.kv.record_written(kv, row.start, seq.num_computed)?;
            if self.config.enable_prefix_caching && row.start / bs != seq.num_computed / bs {
                self.kv.cache_blocks(kv, &seq.tokens[..seq.num_computed])?;
            }
            if !done {
                continue;
            }
            let logits_index = self.plan.token_ids.len() as i32 - 1;
            self.push_sample_row(row.seq, logits_index)?;
            let forks = std::mem::take(&mut self.seq_mut(row.seq).forks_pending);
            self.pending_fork_seats -= forks as usize;
            for _ in 0..forks {
                let child = self.fork_seq(row.seq)?;
                self.push_sample_row(child, logits_index)?;
            }
        }
        self.stats.num_steps += u64::from(!scheduled.is_empty());
        self.stats.last_step_tokens = self.plan.num_tokens();
        self.stats.last_step_seqs = scheduled.len();
        self.stats.seq_rows += scheduled.len() as u64;
        self.stats.prompt_tokens_scheduled += self.plan.num_prefill_tokens as u64;
        self.stats.decode_tokens_scheduled += self.plan.num_decode_tokens as u64;
        if !self.waiting.is_empty() {
            let seats = self.running.len() + self.ghosts.len();
            self.stats.idle_seats_while_waiting +=
                self.config.max_num_seqs.saturating_sub(seats) as u64;
        }
        self.scheduled = scheduled;
        Ok(())
    }

    /// Tokens, positions, slots, lengths and the block-table row of one
    /// scheduled row.
    fn push_row_arrays(
        &mut self,
        row: &Scheduled,
        width: usize,
        scratch_block: i32,
        scratch_slot: i32,
    ) -> KvResult<()> {
        let plan = &mut self.plan;
        let seq = self.seqs[row.seq as usize].as_ref().expect("live");
        let request = self.requests[seq.request as usize].as_mut().expect("live");
        if !request.scheduled {
            // The request's first row: its first sequence was just admitted.
            request.scheduled = true;
            let first = self.seqs[request.seqs[0] as usize].as_ref().expect("live");
            plan.first_scheduled.push(request.handle);
            plan.first_scheduled_cached
                .push(first.num_cached_tokens as i32);
        }
        let request = &*request;
        let kv = seq.kv.expect("scheduled");
        let end = row.start + row.len;
        plan.token_ids
            .extend(seq.tokens[row.start..end].iter().map(|&t| t as i32));
        plan.positions.extend((row.start..end).map(|p| p as i32));
        let slots_from = plan.slot_mapping.len();
        plan.slot_mapping.resize(slots_from + row.len, scratch_slot);
        if !row.ghost {
            self.kv
                .write_slots(kv, row.start, &mut plan.slot_mapping[slots_from..])?;
        }
        plan.cu_q_lens.push(plan.token_ids.len() as i32);
        plan.row_request.push(request.handle);
        plan.kv_lens.push(if row.ghost {
            row.start as i32 + 1
        } else {
            end as i32
        });
        let table = self.kv.block_table(kv)?;
        plan.block_tables.extend_from_slice(block_ids_as_i32(table));
        plan.block_tables
            .extend(std::iter::repeat_n(scratch_block, width - table.len()));
        if row.ghost {
            // A static ghost recomputes its last position: not a real token.
        } else if row.len == 1 && row.start >= request.prompt_len {
            plan.num_decode_tokens += 1;
        } else {
            plan.num_prefill_tokens += row.len;
        }
        Ok(())
    }

    fn fork_seq(&mut self, parent: u32) -> KvResult<u32> {
        let parent_kv = self.seq(parent).kv.expect("parent holds KV");
        let kv = self.kv.fork(parent_kv)?;
        let p = self.seq(parent);
        let request = p.request;
        let sample_index = self.requests[request as usize]
            .as_ref()
            .expect("live")
            .seqs
            .len() as u32;
        let child = Sequence {
            request,
            sample_index,
            tokens: p.tokens.clone(),
            num_computed: p.num_computed,
            kv: Some(kv),
            state: SeqState::Running,
            forks_pending: 0,
            num_cached_tokens: p.num_cached_tokens,
            admitted: true,
            // Each sample walks the grammar on its own.
            grammar: p.grammar.clone(),
            seat: None,
        };
        let child = self.new_seq(child);
        self.requests[request as usize]
            .as_mut()
            .expect("live")
            .seqs
            .push(child);
        self.insert_running(child);
        Ok(child)
    }

    fn push_sample_row(&mut self, seq: u32, logits_index: i32) -> KvResult<()> {
        let new_seat = self.seq(seq).seat.is_none();
        if new_seat {
            let seat = self.free_seats.pop().ok_or_else(|| {
                KvError::InvariantViolated(
                    "no free seat for a running sequence: more than max_num_seqs are running"
                        .into(),
                )
            })?;
            self.seq_mut(seq).seat = Some(seat);
        }
        let s = self.seqs[seq as usize].as_ref().expect("live");
        let request = self.requests[s.request as usize].as_ref().expect("live");
        let p = &request.params;
        let output_len = s.tokens.len() - request.prompt_len;
        let plan = &mut self.plan;
        plan.logits_indices.push(logits_index);
        plan.sample_request.push(request.handle);
        plan.sample_index.push(s.sample_index as i32);
        plan.sample_output_len.push(output_len as i32);
        plan.sample_suppress_stop
            .push((output_len as u32) < p.min_tokens);
        plan.sample_rows.push(s.seat.expect("bound above") as i32);
        plan.sample_new_seat.push(new_seat);
        self.sample_rows.push((request.handle, s.sample_index, seq));
        Ok(())
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
        for (row, (&(handle, sample_index, seq), &token)) in rows.iter().zip(sampled).enumerate() {
            // The sequence may have been aborted (and its slot reused) since
            // the plan was made: its request handle must still match.
            let live = match &self.seqs[seq as usize] {
                Some(s) if s.state == SeqState::Running => self.requests[s.request as usize]
                    .as_ref()
                    .is_some_and(|r| r.handle == handle),
                _ => false,
            };
            if !live {
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
            }
            events.push(TokenEvent {
                row: row as u32,
                request: handle,
                sample_index,
                token,
                finish,
                stop_token,
            });
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

    /// Every seat is free or held by exactly one running sequence.
    fn check_seat_invariants(&self) -> KvResult<()> {
        let fail = |msg: String| Err(KvError::InvariantViolated(msg));
        let mut holder = vec![None; self.config.max_num_seqs];
        for &seat in &self.free_seats {
            match holder.get_mut(seat as usize) {
                Some(h @ None) => *h = Some(u32::MAX),
                _ => return fail(format!("free seat {seat} is out of range or listed twice")),
            }
        }
        for (index, seq) in self.seqs.iter().enumerate() {
            let Some(seat) = seq.as_ref().and_then(|s| s.seat) else {
                continue;
            };
            if seq.as_ref().map(|s| s.state) != Some(SeqState::Running) {
                return fail(format!(
                    "sequence {index} holds seat {seat} but is not running"
                ));
            }
            match holder.get_mut(seat as usize) {
                Some(h @ None) => *h = Some(index as u32),
                _ => return fail(format!("seat {seat} is out of range, free, or held twice")),
            }
        }
        if let Some(seat) = holder.iter().position(Option::is_none) {
            return fail(format!("seat {seat} is neither free nor held"));
        }
        Ok(())
    }

    /// Full consistency check of the scheduler and the KV manager.
    pub fn check_invariants(&self) -> KvResult<()> {
        let fail = |msg: String| Err(KvError::InvariantViolated(msg));
        self.kv.check_invariants()?;
        if self.occupied_seats() > self.config.max_num_seqs {
            return fail(format!(
                "{} seats taken > max_num_seqs {}",
                self.occupied_seats(),
                self.config.max_num_seqs
            ));
        }
        let promised: usize = self
            .running
            .iter()
            .map(|&s| self.seq(s).forks_pending as usize)
            .sum();
        if promised != self.pending_fork_seats {
            return fail(format!(
                "{promised} fork seats promised but {} counted",
                self.pending_fork_seats
            ));
        }
        if self.config.policy != Policy::Static
            && !self
                .running
                .windows(2)
                .all(|w| self.key(w[0]) < self.key(w[1]))
        {
            return fail("running is not sorted by (priority, arrival)".into());
        }
        for (index, seq) in self.seqs.iter().enumerate() {
            let Some(seq) = seq else { continue };
            let index = index as u32;
            let in_waiting = self.waiting.contains(&self.key(index));
            let in_running = self.running.contains(&index);
            let in_ghosts = self.ghosts.contains(&index);
            match seq.state {
                SeqState::Waiting => {
                    if !in_waiting || in_running || in_ghosts {
                        return fail(format!("waiting sequence {index} is misplaced"));
                    }
                    if seq.kv.is_some() || seq.num_computed != 0 {
                        return fail(format!("waiting sequence {index} holds KV"));
                    }
                }
                SeqState::Running => {
                    if !in_running || in_waiting || in_ghosts {
                        return fail(format!("running sequence {index} is misplaced"));
                    }
                    let kv = seq.kv.ok_or_else(|| {
                        KvError::InvariantViolated(format!("running {index} has no KV"))
                    })?;
                    if self.kv.num_tokens(kv)? < seq.num_computed {
                        return fail(format!(
                            "running sequence {index} has fewer KV slots than computed tokens"
                        ));
                    }
                }
                SeqState::Finished(_) => {
                    if in_waiting || in_running || (seq.kv.is_some() && !in_ghosts) {
                        return fail(format!(
                            "finished sequence {index} still holds a place or KV"
                        ));
                    }
                }
            }
        }
        if self.waiting.len() + self.running.len() + self.ghosts.len()
            > self.seqs.iter().flatten().count()
        {
            return fail("queues hold sequences that do not exist".into());
        }
        self.check_grammar_invariants()?;
        self.check_seat_invariants()?;
        if self.by_handle.is_empty()
            && self.ghosts.is_empty()
            && self.kv.num_referenced_blocks() != 0
        {
            return fail(format!(
                "no live request, but {} blocks are referenced",
                self.kv.num_referenced_blocks()
            ));
        }
        Ok(())
    }
}
