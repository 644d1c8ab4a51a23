//! Requests coming and going: `add_request` (the one place request limits
//! are checked), aborting and finishing requests or single samples, and
//! giving back what a finished sequence held (seat, KV, records).

use super::{Policy, Scheduler};
use crate::error::{KvError, KvResult};
use crate::sched::request::{FinishReason, Request, RequestParams, SeqState, Sequence};

impl Scheduler {
    /// Queue a request; returns its handle. Rejects, with a message naming
    /// the value, prompts that are empty or longer than `max_model_len`,
    /// requests that could not fit in the whole KV pool, and stop conditions
    /// that cannot be met. `max_tokens` is clamped to the room the prompt
    /// leaves (`u32::MAX` = until `max_model_len`; a prompt of exactly
    /// `max_model_len` tokens gets one): this is the one place these limits
    /// are checked.
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
            draft: Vec::new(),
            spec_k: self.config.speculative.num_speculative_tokens as u32,
            spec_misses: 0,
            spec_cooldown: 0,
            stream: None,
        });
        self.requests[index as usize] = Some(Request {
            handle,
            priority,
            arrival,
            salt: salt.map(str::to_owned),
            reuse_limit: usize::MAX,
            prompt_len: prompt.len(),
            seqs: vec![seq],
            num_unfinished: params.n,
            scheduled: false,
            speculate: true,
            params,
        });
        self.by_handle.insert(handle, index);
        self.waiting.insert((priority, arrival, seq));
        Ok(handle)
    }

    /// Let the prefix cache supply at most the first `tokens` tokens of
    /// request `handle` (its later positions are computed even when cached).
    /// Only before the request is first scheduled: an admitted sequence keeps
    /// the hit it got.
    pub fn limit_prefix_reuse(&mut self, handle: u64, tokens: usize) -> KvResult<()> {
        let Some(&index) = self.by_handle.get(&handle) else {
            return Err(KvError::InvalidArgument(format!(
                "request {handle} is not live"
            )));
        };
        let request = self.requests[index as usize]
            .as_mut()
            .expect("live request");
        if request.scheduled {
            return Err(KvError::InvalidArgument(format!(
                "request {handle} is already scheduled; limit its prefix reuse when adding it"
            )));
        }
        request.reuse_limit = tokens;
        Ok(())
    }

    /// Never draft tokens for request `handle` (`speculation.rs`): the engine
    /// calls it for requests whose sampling needs every earlier token on the
    /// device (penalties).
    pub fn disable_speculation(&mut self, handle: u64) -> KvResult<()> {
        let Some(&index) = self.by_handle.get(&handle) else {
            return Err(KvError::InvalidArgument(format!(
                "request {handle} is not live"
            )));
        };
        self.requests[index as usize]
            .as_mut()
            .expect("live request")
            .speculate = false;
        Ok(())
    }

    fn validate_request(&self, prompt: &[u32], params: &mut RequestParams) -> KvResult<()> {
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        let c = &self.config;
        if prompt.is_empty() {
            return invalid("the prompt is empty: at least 1 token is required".into());
        }
        if prompt.len() > c.max_model_len {
            return invalid(format!(
                "the prompt has {} tokens; max_model_len is {}",
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
        // A prompt of max_model_len tokens still gets its one sampled token (vLLM's rule):
        // that token's KV is never written, so only the prompt needs the table's room.
        // Scoring (a teacher-forced prompt with max_tokens = 1) thus needs no room at all.
        let room = u32::try_from((c.max_model_len - prompt.len()).max(1)).unwrap_or(u32::MAX);
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

    pub(super) fn finish_seq(&mut self, seq: u32, reason: FinishReason) -> KvResult<()> {
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
    pub(super) fn release_seat(&mut self, seq: u32) {
        if let Some(seat) = self.seq_mut(seq).seat.take() {
            self.free_seats.push(seat);
            self.seats_freed.push(seat as i32);
        }
    }

    pub(super) fn release_kv(&mut self, seq: u32) -> KvResult<()> {
        if let Some(kv) = self.seq_mut(seq).kv.take() {
            self.kv.free_sequence(kv)?;
        }
        self.seq_mut(seq).num_computed = 0;
        Ok(())
    }

    /// Drop a finished request's records once none of its sequences is
    /// still seated as a static ghost.
    pub(super) fn maybe_release_request(&mut self, index: u32) {
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
}
