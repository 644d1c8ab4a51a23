//! Sliding-window attention in the KV cache manager (`new_with_window`,
//! window `W`; `None` changes nothing in `kv_cache.rs`). A query at position `p` reads only keys at `j` with
//! `p - W < j <= p`, so once the next query of a sequence is at position
//! `N` (it has computed `N` tokens), logical block `b` (positions
//! `b * B .. (b + 1) * B`) with `(b + 1) * B <= N - W + 1` is out of the
//! window for good. `slide_window(seq, N)` drops the sequence's references
//! to those blocks (and to the tree blocks it pins at those indices),
//! deepest first:
//!
//! ```text
//!   table    | DROPPED DROPPED | b5  b1  b8 ... | last |     N - W + 1
//!   (index)      0       1        2   3   4               ^ falls in block 2
//! ```
//!
//! - the table keeps positional indexing: it still has `ceil(num_tokens / B)`
//!   entries, the leading `num_dropped` of them are DROPPED, stored as
//!   `dropped_block()` = `num_blocks`, the step plan's scratch block id, so
//!   block tables export them as they are;
//!   those positions have no slot (`slot`, `write_slots` and
//!   `record_written` reject them) and `fork`/`free_sequence` skip them;
//! - a block dropped this way goes back to the pool when no one else holds
//!   it; forks, parallel samples and prefix-cache matches hold their own
//!   references and keep it until they drop it too;
//! - a sequence that has dropped a block stops caching: the blocks it
//!   would add hang under a path it no longer holds.
//!
//! The prefix cache under a window (the rule): **a cached block is never
//! kept alive by a child**. When a cached block loses its last holder (a
//! slide, a finish, a preemption) while a child of it is still live, the
//! live children's subtrees leave the tree (`PrefixCache::
//! detach_live_children`): their held blocks stay with their holders as
//! plain blocks, their unheld ones return to the pool, and the block itself
//! becomes cached-unreferenced (evictable, still matchable) like any other.
//! So out-of-window blocks never pin memory through the tree: every
//! non-free block is referenced or evictable, and a sequence's live blocks
//! stay within `ceil((W - 1) / B) + 1` plus those of its next chunk. Every
//! tree node still holds its block's KV, so a match of `P` tokens always
//! has the window of the first new query (positions `max(0, P - W + 1)..P`)
//! intact; the price is that a prefix is matchable only up to where its
//! holders had not yet slid past its start (deeper blocks become
//! unmatched when that happens).

use super::KvCacheManager;
use crate::error::{KvError, KvResult};
use crate::kv::block_pool::BlockId;
use crate::kv::kv_cache::SeqId;

impl KvCacheManager {
    /// The sliding window in tokens, `None` for full attention.
    pub fn sliding_window(&self) -> Option<usize> {
        self.sliding_window
    }

    /// The table entry of a block dropped out of the window: the pool's
    /// `num_blocks`, which is the step plan's scratch block id.
    #[inline]
    pub fn dropped_block(&self) -> BlockId {
        self.pool.num_blocks() as BlockId
    }

    /// Leading logical blocks of `seq` dropped out of the window.
    pub fn num_dropped_blocks(&self, seq: SeqId) -> KvResult<usize> {
        Ok(self.table(seq)?.num_dropped)
    }

    /// Logical blocks entirely before the window of a query at `next_pos`
    /// (blocks `0..that`); 0 without a window.
    #[inline]
    pub fn out_of_window(&self, next_pos: usize) -> usize {
        match self.sliding_window {
            Some(window) => (next_pos + 1).saturating_sub(window) / self.block_size(),
            None => 0,
        }
    }

    /// The next query of `seq` is at position `next_pos` (it has computed
    /// `next_pos` tokens): drop its references to the blocks that lie
    /// entirely before that query's window, which no later query of it can
    /// read (see the module docs). Returns how many entries were dropped;
    /// always 0 without a window. `next_pos` may not exceed the sequence's
    /// reserved tokens.
    pub fn slide_window(&mut self, seq: SeqId, next_pos: usize) -> KvResult<usize> {
        let Some(window) = self.sliding_window else {
            return Ok(0);
        };
        let table = self.table(seq)?;
        if next_pos > table.num_tokens {
            return Err(KvError::InvalidArgument(format!(
                "next position {next_pos} is past the {} tokens of sequence {seq}",
                table.num_tokens
            )));
        }
        // The common case (no block leaves yet), without a division: the
        // next block leaves once next_pos + 1 - W reaches its end.
        if next_pos + 1 < (table.num_dropped + 1) * self.block_size() + window {
            return Ok(0);
        }
        let drop_to = self.out_of_window(next_pos).min(table.blocks.len());
        if drop_to <= table.num_dropped {
            return Ok(0);
        }
        let dropped = self.dropped_block();
        let mut table = self.take_table(seq)?;
        let from = table.num_dropped;
        table.caching = false;
        // Deepest first, each pin before the own block at its index (as
        // `free_sequence`), so a cached chain dies from its leaf up.
        let first_kept_pin = table.pins.partition_point(|&(at, _)| at < drop_to);
        let mut pins = table.pins[..first_kept_pin].iter().rev().peekable();
        let mut result = Ok(());
        for logical in (from..drop_to).rev() {
            while let Some(&(_, pinned)) = pins.next_if(|(at, _)| *at >= logical) {
                result = result.and(self.release_block(pinned));
            }
            let block = std::mem::replace(&mut table.blocks[logical], dropped);
            result = result.and(self.release_block(block));
        }
        table.pins.drain(..first_kept_pin);
        table.num_dropped = drop_to;
        self.put_table(seq, table);
        result.map(|()| drop_to - from)
    }
}
