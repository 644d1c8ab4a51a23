//! Decode lookahead (multi-step scheduling): how many decode steps the
//! plan just made may run on the device in one call, and the plans of the
//! steps after it, made without admitting anyone.
//!
//! A lookahead of `n` promises the runner that for the next `n - 1` steps
//! the same running sequences (less those that finish or are aborted) each
//! decode one token at the next position, into a block its table already
//! holds: no allocation, block copy, preemption, admission or fork happens
//! in between, and no row follows a grammar (its mask needs the host).
//! `schedule_continuation` makes those plans, and checks the promise before
//! it touches any state.
//!
//! Invariant: a continuation plan is exactly the plan `schedule()` would
//! make with an empty waiting queue and no drafts (the reference-model tests
//! replay both): speculation (`speculation.rs`) and lookahead take turns, a
//! plan with drafts runs alone (`lookahead_steps` is 1 when a plan samples
//! more rows than it schedules) and a continuation never drafts.

use super::{Policy, Scheduler};
use crate::error::{KvError, KvResult};
use crate::sched::step_plan::StepPlan;

impl Scheduler {
    /// Decode steps (1..=`max_steps`) the plan awaiting its update may run
    /// in one device call: every sampled row decodes one token per step
    /// within the blocks it holds. Capped so the last step still has a row
    /// short of `max_tokens`. 1 when anything needs the host between steps.
    pub fn lookahead_steps(&self, max_steps: usize) -> usize {
        let plain_decode = self.awaiting_update
            && self.config.policy != Policy::Static
            && self.plan.decode_only
            && self.waiting.is_empty()
            && self.pending_fork_seats == 0
            && self.plan.copy_src.is_empty()
            && self.sample_rows.len() == self.scheduled.len();
        if max_steps <= 1 || !plain_decode {
            return 1;
        }
        let bs = self.config.block_size;
        let mut steps = max_steps;
        let mut most_remaining = 0;
        for row in &self.scheduled {
            let s = self.seq(row.seq);
            let table_len = match s.kv.map(|kv| self.kv.block_table(kv)) {
                Some(Ok(table)) => table.len(),
                _ => return 1,
            };
            if s.grammar.is_some() {
                return 1;
            }
            let capacity = (table_len * bs).min(self.config.max_model_len);
            steps = steps.min(capacity.saturating_sub(row.start));
            let request = self.request_of(row.seq);
            let produced = s.tokens.len() - request.prompt_len;
            let remaining = (request.params.max_tokens as usize).saturating_sub(produced);
            most_remaining = most_remaining.max(remaining);
        }
        steps.min(most_remaining).max(1)
    }

    /// The plan of the next step of a lookahead (after the last step's
    /// `update`): the running sequences' next decode tokens, nothing
    /// admitted. An error, with no state changed, if any running sequence
    /// would need more than that (the caller asked for more steps than
    /// `lookahead_steps` gave).
    pub fn schedule_continuation(&mut self) -> KvResult<&StepPlan> {
        if self.awaiting_update {
            return Err(KvError::InvalidArgument(
                "schedule_continuation() called before update() of the last step".into(),
            ));
        }
        let bs = self.config.block_size;
        for &seq in &self.running {
            let s = self.seq(seq);
            let kv = s.kv.expect("running sequences hold KV");
            let capacity = self.kv.block_table(kv)?.len() * bs;
            let one_more_token = s.tokens.len() == s.num_computed + 1;
            if !one_more_token || s.num_computed >= capacity || s.grammar.is_some() {
                return Err(KvError::InvalidArgument(format!(
                    "sequence {seq} cannot continue a lookahead: it needs the host's \
                     scheduling (a new block, a prefill chunk or a grammar mask)"
                )));
            }
        }
        if self.pending_fork_seats > 0 {
            return Err(KvError::InvalidArgument(
                "a lookahead cannot continue while forks are pending".into(),
            ));
        }
        self.plan.clear();
        self.scheduled.clear();
        self.copies.clear();
        let mut budget = self.config.max_num_batched_tokens.max(self.running.len());
        // One token each, as promised: no drafts (`speculation.rs`).
        let preempted = self.schedule_running(&mut budget, false)?;
        if preempted || !self.copies.is_empty() {
            return Err(KvError::InvariantViolated(
                "a lookahead step allocated or copied a block".into(),
            ));
        }
        self.build_plan()?;
        self.awaiting_update = !self.plan.is_empty();
        Ok(&self.plan)
    }
}
