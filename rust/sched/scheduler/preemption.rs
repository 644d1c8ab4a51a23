//! Priority order and preemption: the running queue kept sorted by
//! (priority, arrival, seq) with the seats it occupies, the priority
//! policy's preemption (phase 1 of a step) and preemption by recompute.

use super::Scheduler;
use crate::error::KvResult;
use crate::sched::request::SeqState;

impl Scheduler {
    /// Priority policy: while the best waiting sequence outranks the worst
    /// running one and lacks a seat or memory, preempt the worst running.
    pub(super) fn preempt_for_priority(&mut self) -> KvResult<()> {
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

    pub(super) fn insert_running(&mut self, seq: u32) {
        let key = self.key(seq);
        let pos = self.running.partition_point(|&s| self.key(s) < key);
        self.running.insert(pos, seq);
        self.pending_fork_seats += self.seq(seq).forks_pending as usize;
    }

    pub(super) fn remove_running(&mut self, seq: u32) {
        if let Some(pos) = self.running.iter().position(|&s| s == seq) {
            self.running.remove(pos);
            self.pending_fork_seats -= self.seq(seq).forks_pending as usize;
        }
    }

    pub(super) fn occupied_seats(&self) -> usize {
        self.running.len() + self.pending_fork_seats
    }

    /// Preempt by recompute: free the sequence's blocks (full ones stay in
    /// the prefix cache) and put it back at its place in the waiting queue.
    pub(super) fn preempt(&mut self, seq: u32) -> KvResult<()> {
        self.seq_mut(seq).draft.clear();
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
}
