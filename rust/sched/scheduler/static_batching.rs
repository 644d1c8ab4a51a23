//! The `static` scheduling policy: the measurable baseline of padded static
//! batching with contiguous, max-length KV reservations.
//!
//! A batch is seated only when the previous one is completely done. Every
//! sample of a request is its own sequence from the start, with its own
//! reservation of `min(prompt + max_tokens, max_model_len)` slots and its
//! own copy of the prompt to prefill (as padded static batching repeats the
//! prompt n times); nothing is shared, so no two samples ever write one
//! slot. Finished sequences keep their seat and their reservation as
//! "ghost" rows that recompute their last position (writes discarded)
//! until the whole batch is done.
//!
//! Invariants (checked through `Scheduler::check_invariants`):
//! - a seated request is seated whole: all n samples run in one batch, and
//!   none has a fork pending;
//! - a ghost that never computed a token (finished before its prefill)
//!   schedules no row: there is no last position to recompute;
//! - when no seat of the batch is running, the ghosts' KV is released.

use super::{Policy, Scheduled, Scheduler};
use crate::error::{KvError, KvResult};
use crate::sched::request::{FinishReason, RequestParams, SeqState, Sequence};

impl Scheduler {
    /// KV slots one static sequence reserves up front.
    pub(super) fn static_reservation(&self, prompt_len: usize, params: &RequestParams) -> usize {
        (prompt_len + params.max_tokens as usize).min(self.config.max_model_len)
    }

    /// A static request whose `n` reservations could never fit in the pool
    /// would wait forever: refuse it up front.
    pub(super) fn check_static_reservation_fits(
        &self,
        prompt_len: usize,
        params: &RequestParams,
    ) -> KvResult<()> {
        let c = &self.config;
        let reserve = self.static_reservation(prompt_len, params);
        if reserve.div_ceil(c.block_size) * params.n as usize > c.num_blocks {
            return Err(KvError::InvalidArgument(format!(
                "static batching reserves {reserve} tokens per sequence up front; that does not fit \
                 in {} blocks of {} tokens",
                c.num_blocks, c.block_size
            )));
        }
        Ok(())
    }

    /// Under the static policy a running sequence that finishes (except by
    /// abort) keeps its seat and reservation as a ghost until its batch ends.
    pub(super) fn keeps_seat_as_ghost(&self, state: SeqState, reason: FinishReason) -> bool {
        self.config.policy == Policy::Static
            && state == SeqState::Running
            && reason != FinishReason::Abort
    }

    /// When the previous batch is done, seat a new one; then every seat
    /// runs (prefill chunks under the token budget, decodes), finished ones
    /// as ghosts.
    pub(super) fn schedule_static(&mut self) -> KvResult<()> {
        if self.running.is_empty() {
            self.seat_static_batch()?;
        }
        // The batch shares the step's token budget: long prompts prefill
        // over several steps (in chunks), as the continuous policy's do.
        let mut budget = self.config.max_num_batched_tokens;
        for &seq in &self.running {
            let s = self.seq(seq);
            let len = (s.tokens.len() - s.num_computed).min(budget);
            if len > 0 {
                budget -= len;
                self.scheduled.push(Scheduled {
                    seq,
                    start: s.num_computed,
                    len,
                    ghost: false,
                });
            }
        }
        for &seq in &self.ghosts {
            let computed = self.seq(seq).num_computed;
            if budget == 0 {
                break;
            }
            if computed == 0 {
                continue; // finished before its prefill: nothing to recompute
            }
            budget -= 1;
            self.scheduled.push(Scheduled {
                seq,
                start: computed - 1,
                len: 1,
                ghost: true,
            });
        }
        Ok(())
    }

    /// Seat waiting requests, whole (all n samples), in order, while seats
    /// and KV for every sample's full reservation last.
    fn seat_static_batch(&mut self) -> KvResult<()> {
        let bs = self.config.block_size;
        while let Some(&key) = self.waiting.first() {
            let seq = key.2;
            let samples = self.seats(seq);
            if self.occupied_seats() + samples > self.config.max_num_seqs {
                break;
            }
            let reserve = {
                let request = self.request_of(seq);
                self.static_reservation(request.prompt_len, &request.params)
            };
            if reserve.div_ceil(bs) * samples > self.kv.num_available_blocks() {
                break;
            }
            self.waiting.remove(&key);
            let forks = std::mem::take(&mut self.seq_mut(seq).forks_pending);
            self.seat_static(seq, reserve)?;
            for _ in 0..forks {
                let sample = self.new_static_sample(seq);
                self.seat_static(sample, reserve)?;
            }
        }
        Ok(())
    }

    /// Another sample of `first`'s request: its own sequence over the prompt.
    fn new_static_sample(&mut self, first: u32) -> u32 {
        let s = self.seq(first);
        let request = s.request;
        let tokens = s.tokens.clone();
        let grammar = s.grammar.clone();
        let seqs = &self.requests[request as usize].as_ref().expect("live").seqs;
        let sample_index = seqs.len() as u32;
        let sample = self.new_seq(Sequence {
            request,
            sample_index,
            tokens,
            num_computed: 0,
            kv: None,
            state: SeqState::Waiting,
            forks_pending: 0,
            num_cached_tokens: 0,
            admitted: false,
            grammar,
            seat: None,
            draft: Vec::new(),
            spec_k: self.config.speculative.num_speculative_tokens as u32,
            spec_misses: 0,
            spec_cooldown: 0,
            stream: None,
        });
        self.requests[request as usize]
            .as_mut()
            .expect("live")
            .seqs
            .push(sample);
        sample
    }

    /// Give one sequence its page table with the whole reservation.
    fn seat_static(&mut self, seq: u32, reserve: usize) -> KvResult<()> {
        let salt = self.request_of(seq).salt.clone();
        let kv = self.kv.create_sequence(salt.as_deref());
        if let Err(err) = self.kv.allocate_slots(kv, reserve, &mut self.copies) {
            self.kv.free_sequence(kv)?;
            return Err(match err {
                KvError::OutOfBlocks { .. } => KvError::InvariantViolated(format!(
                    "static reservation of {reserve} slots failed after it was counted: {err}"
                )),
                other => other,
            });
        }
        let s = self.seq_mut(seq);
        s.kv = Some(kv);
        s.num_computed = 0;
        s.state = SeqState::Running;
        s.admitted = true;
        self.running.push(seq);
        Ok(())
    }

    /// Once no seat of the batch is still generating, the ghosts' reserved
    /// KV goes back and their records are dropped.
    pub(super) fn end_static_batch_if_done(&mut self) -> KvResult<()> {
        if !self.running.is_empty() {
            return Ok(());
        }
        for seq in std::mem::take(&mut self.ghosts) {
            self.release_kv(seq)?;
            let request = self.seq(seq).request;
            self.maybe_release_request(request);
        }
        Ok(())
    }
}
