//! `check_invariants`: the full consistency check of the scheduler (the
//! invariants listed in `mod.rs`) and of the KV manager under it.

use super::{Policy, Scheduler};
use crate::error::{KvError, KvResult};
use crate::sched::request::SeqState;

impl Scheduler {
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
                    // Sliding window: it holds no block before its next query's window.
                    let table_len = self.kv.block_table(kv)?.len();
                    let dropped = self.kv.num_dropped_blocks(kv)?;
                    if dropped != self.kv.out_of_window(seq.num_computed).min(table_len) {
                        return fail(format!(
                            "running sequence {index} at {} computed tokens dropped {dropped} blocks",
                            seq.num_computed
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
