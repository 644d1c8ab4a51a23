//! The token budget and chunked prefill (phase 2 of a step): how many
//! tokens the next chunk of a sequence may take, and the running
//! sequences' rows, one token per decode or the next chunk of an
//! unfinished prefill, preempting from the back when the pool runs dry.

use super::{Scheduled, Scheduler};
use crate::error::{KvError, KvResult};

impl Scheduler {
    /// Tokens the next chunk of `seq` may take under the budget.
    pub(super) fn chunk_len(&self, seq: u32, budget: usize) -> usize {
        let s = self.seq(seq);
        self.chunk_len_from(s.tokens.len() - s.num_computed, budget)
    }

    pub(super) fn chunk_len_from(&self, remaining: usize, budget: usize) -> usize {
        let mut len = remaining.min(budget);
        let threshold = self.config.long_prefill_token_threshold;
        if remaining > 1 && threshold > 0 {
            len = len.min(threshold);
        }
        len
    }

    /// The running sequences' rows; with `drafts`, decoding ones may carry
    /// drafted tokens (`speculation.rs`). True when it preempted any.
    pub(super) fn schedule_running(&mut self, budget: &mut usize, drafts: bool) -> KvResult<bool> {
        let mut preempted_any = false;
        // Sampled rows drafts may still add.
        let mut draft_room = if drafts { self.draft_room() } else { 0 };
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let seq = self.running[i];
            let mut len = self.chunk_len(seq, *budget);
            if len == 0 {
                i += 1;
                continue;
            }
            let decoding = self.seq(seq).tokens.len() - self.seq(seq).num_computed == 1;
            if decoding && draft_room > 0 {
                let drafted = self.draft(seq, *budget - 1, draft_room);
                draft_room -= drafted;
                len += drafted;
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
                    Err(KvError::OutOfBlocks { .. }) if !self.seq(seq).draft.is_empty() => {
                        // Drafts never cost anyone their memory: decode without them.
                        let drafted = std::mem::take(&mut self.seq_mut(seq).draft).len();
                        draft_room += drafted;
                        len -= drafted;
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
}
