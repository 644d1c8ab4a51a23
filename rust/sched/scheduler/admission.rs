//! Admission (phase 3 of a step): while the token budget and
//! `max_num_seqs` allow, waiting sequences get a page table and their
//! prefix-cache hit; only the uncached suffix is prefilled. A sequence whose
//! prompt another is prefilling right now waits for it
//! (`prefill_grouping.rs`).

use std::ops::Bound::{Excluded, Unbounded};

use super::{Scheduled, Scheduler, WaitKey};
use crate::error::{KvError, KvResult};
use crate::sched::request::SeqState;

impl Scheduler {
    /// Give a waiting sequence its page table and its prefix-cache hit.
    fn attach_kv(&mut self, seq: u32) -> KvResult<()> {
        if self.seq(seq).kv.is_some() {
            return Ok(());
        }
        let salt = self.request_of(seq).salt.clone();
        let limit = self.request_of(seq).reuse_limit;
        let kv = self.kv.create_sequence(salt.as_deref());
        let tokens = &self.seqs[seq as usize].as_ref().expect("live").tokens;
        let reusable = &tokens[..(tokens.len() - 1).min(limit)];
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
    pub(super) fn admission_blocks(&self, seq: u32) -> usize {
        let s = self.seq(seq);
        let request = self.request_of(seq);
        let salt = request.salt.as_deref();
        let reusable = &s.tokens[..(s.tokens.len() - 1).min(request.reuse_limit)];
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
    pub(super) fn seats(&self, seq: u32) -> usize {
        1 + self.seq(seq).forks_pending as usize
    }

    /// Admit waiting sequences in queue order; one that waits for a shared
    /// prefill (`prefill_grouping.rs`) is passed over, at most
    /// `max_num_seqs` of them a step.
    pub(super) fn admit_waiting(&mut self, budget: &mut usize) -> KvResult<()> {
        let mut passed: Option<WaitKey> = None;
        let mut num_passed = 0;
        while *budget > 0 {
            let next = match passed {
                Some(after) => self.waiting.range((Excluded(after), Unbounded)).next(),
                None => self.waiting.first(),
            };
            let Some(&key) = next else {
                break;
            };
            let seq = key.2;
            if num_passed < self.config.max_num_seqs && self.waits_for_shared_prefill(seq) {
                passed = Some(key);
                num_passed += 1;
                self.stats.prefill_waits += 1;
                continue;
            }
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
}
