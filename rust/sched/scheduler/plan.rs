//! Building the step plan (phase 4 of a step): the scheduled rows
//! flattened into the `StepPlan` arrays, seats bound to sampled rows,
//! n > 1 requests forked when their prompt completes, newly full blocks
//! cached.

use super::{SampleRow, Scheduled, Scheduler};
use crate::error::{KvError, KvResult};
use crate::kv::block_pool::block_ids_as_i32;
use crate::sched::request::{SeqState, Sequence};

impl Scheduler {
    pub(super) fn build_plan(&mut self) -> KvResult<()> {
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
            // Drafted tokens (`speculation.rs`) are computed but not yet the
            // sequence's: `update` advances past those it accepts.
            let seq = self.seqs[row.seq as usize].as_mut().expect("live");
            let drafts = seq.draft.len();
            seq.num_computed = row.start + row.len - drafts;
            let done = seq.num_computed == seq.tokens.len();
            let kv = seq.kv.expect("scheduled");
            self.kv.record_written(kv, row.start, seq.num_computed)?;
            // Sliding window: the next query is at `num_computed`; blocks
            // before its window go now (the plan above already holds this
            // step's table, and nothing is allocated until the next step).
            // Before caching, so a sequence that slides caches nothing more.
            if self.config.sliding_window.is_some() {
                self.kv.slide_window(kv, seq.num_computed)?;
            }
            if self.config.enable_prefix_caching && row.start / bs != seq.num_computed / bs {
                self.kv.cache_blocks(kv, &seq.tokens[..seq.num_computed])?;
            }
            if !done {
                continue;
            }
            let logits_index = self.plan.token_ids.len() as i32 - 1 - drafts as i32;
            for offset in 0..=drafts {
                self.push_sample_row(row.seq, logits_index + offset as i32, offset)?;
            }
            let forks = std::mem::take(&mut self.seq_mut(row.seq).forks_pending);
            self.pending_fork_seats -= forks as usize;
            for _ in 0..forks {
                let child = self.fork_seq(row.seq)?;
                self.push_sample_row(child, logits_index, 0)?;
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
        // A verification row: the last committed token, then the drafts.
        let committed = end - seq.draft.len();
        plan.token_ids
            .extend(seq.tokens[row.start..committed].iter().map(|&t| t as i32));
        plan.token_ids.extend(seq.draft.iter().map(|&t| t as i32));
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
        } else if row.len - seq.draft.len() == 1 && row.start >= request.prompt_len {
            plan.num_decode_tokens += row.len;
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
            draft: Vec::new(),
            spec_k: p.spec_k,
            spec_misses: 0,
            spec_cooldown: 0,
            stream: None,
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

    /// A sampled row of `seq` at `logits_index`, `offset` rows after its
    /// first in this plan (its drafts' rows, `speculation.rs`).
    fn push_sample_row(&mut self, seq: u32, logits_index: i32, offset: usize) -> KvResult<()> {
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
        let output_len = s.tokens.len() - request.prompt_len + offset;
        let plan = &mut self.plan;
        plan.logits_indices.push(logits_index);
        plan.sample_request.push(request.handle);
        plan.sample_index.push(s.sample_index as i32);
        plan.sample_output_len.push(output_len as i32);
        plan.sample_suppress_stop
            .push((output_len as u32) < p.min_tokens);
        plan.sample_rows.push(s.seat.expect("bound above") as i32);
        plan.sample_new_seat.push(new_seat);
        self.sample_rows.push(SampleRow {
            handle: request.handle,
            sample_index: s.sample_index,
            seq,
            offset: offset as u32,
        });
        Ok(())
    }
}
