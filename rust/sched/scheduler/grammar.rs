//! Structured outputs in the scheduler: each constrained sequence carries
//! its grammar matcher (`Sequence::grammar`), and the scheduler keeps it in
//! step with the sequence's tokens.
//!
//! - `set_grammar` gives a queued request's samples a fresh matcher; n > 1
//!   samples forked later clone their parent's (`fork_seq`), so each walks
//!   the grammar on its own.
//! - `fill_token_bitmask` writes the masks of the last plan's sampled rows
//!   (unconstrained rows allow everything) for the device sampler.
//! - `update` advances the matcher by every token it appends
//!   (`advance_grammar`); a grammar that is complete finishes the sequence
//!   with `Stop`, a token the grammar rejects finishes it with `Error`.
//! - Preemption keeps a sequence's tokens and its matcher: the recompute
//!   rebuilds KV, never the parse state, so nothing is replayed.
//!
//! Invariant (checked by `check_invariants`): a live sequence's matcher has
//! consumed exactly its generated tokens.

use rustc_hash::FxHashMap;

use super::Scheduler;
use crate::error::{KvError, KvResult};
use crate::grammar::structured_output::{fill_bitmasks, Grammar, GrammarMatcher};
use crate::sched::request::{FinishReason, SeqState};

impl Scheduler {
    /// Constrain every sample of a queued request to `grammar`. The request
    /// must not have been scheduled yet.
    pub fn set_grammar(&mut self, handle: u64, grammar: &Grammar) -> KvResult<()> {
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        let Some(&index) = self.by_handle.get(&handle) else {
            return invalid(format!("request {handle} is not live"));
        };
        let seqs = self.requests[index as usize]
            .as_ref()
            .expect("live")
            .seqs
            .clone();
        if seqs
            .iter()
            .any(|&s| self.seq(s).admitted || self.seq(s).state != SeqState::Waiting)
        {
            return invalid(format!(
                "request {handle} was already scheduled: set its grammar right after add_request"
            ));
        }
        for seq in seqs {
            self.seq_mut(seq).grammar = Some(grammar.matcher());
        }
        Ok(())
    }

    /// Sampled rows of the last plan whose sequence is constrained.
    pub fn num_constrained_rows(&self) -> usize {
        self.sample_rows
            .iter()
            .filter(|r| self.seq(r.seq).grammar.is_some())
            .count()
    }

    /// Write the token masks of the last plan's sampled rows into `out`
    /// (`num_sampled` rows of `words` u32 words; see `structured_output`).
    /// Returns the number of constrained rows. Call between `schedule()`
    /// and `update()`.
    pub fn fill_token_bitmask(&mut self, out: &mut [u32], words: usize) -> KvResult<usize> {
        if !self.awaiting_update {
            return Err(KvError::InvalidArgument(
                "fill_token_bitmask() needs a scheduled step awaiting its update()".into(),
            ));
        }
        let rows = self.sample_rows.len();
        if out.len() != rows * words {
            return Err(KvError::InvalidArgument(format!(
                "the mask buffer holds {} words; {rows} rows of {words} words need {}",
                out.len(),
                rows * words
            )));
        }
        let row_of: FxHashMap<u32, usize> = self
            .sample_rows
            .iter()
            .enumerate()
            .map(|(row, r)| (r.seq, row))
            .collect();
        let mut matchers: Vec<Option<&mut GrammarMatcher>> = (0..rows).map(|_| None).collect();
        for (index, entry) in self.seqs.iter_mut().enumerate() {
            if let (Some(&row), Some(seq)) = (row_of.get(&(index as u32)), entry.as_mut()) {
                matchers[row] = seq.grammar.as_mut();
            }
        }
        Ok(fill_bitmasks(matchers, out, words))
    }

    /// Advance `seq`'s matcher by the token just appended; the finish
    /// reason the grammar imposes, if any.
    pub(super) fn advance_grammar(&mut self, seq: u32, token: u32) -> Option<FinishReason> {
        let matcher = self.seq_mut(seq).grammar.as_mut()?;
        match matcher.consume(token) {
            Err(_) => Some(FinishReason::Error),
            Ok(()) if matcher.is_stopped() => Some(FinishReason::Stop),
            Ok(()) => None,
        }
    }

    pub(super) fn check_grammar_invariants(&self) -> KvResult<()> {
        for (index, seq) in self.seqs.iter().enumerate() {
            let Some(seq) = seq else { continue };
            let Some(matcher) = &seq.grammar else {
                continue;
            };
            let request = self.requests[seq.request as usize].as_ref().expect("live");
            let generated = seq.num_output_tokens(request.prompt_len);
            if matches!(seq.state, SeqState::Finished(_)) {
                continue; // a finished sample may have stopped mid-token
            }
            if matcher.num_consumed() != generated {
                return Err(KvError::InvariantViolated(format!(
                    "sequence {index}: its grammar consumed {} tokens, it generated {generated}",
                    matcher.num_consumed()
                )));
            }
        }
        Ok(())
    }
}
