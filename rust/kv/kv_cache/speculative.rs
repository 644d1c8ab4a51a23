//! Speculative decoding in the KV cache manager: `truncate` gives back the
//! slots of drafted tokens the model rejected.
//!
//! A verification step allocates slots for a sequence's next token and its
//! drafted ones (`allocate_slots`), and the model writes all their KV. After
//! verification only the accepted prefix is kept: `truncate(seq, n)` shortens
//! the table to `n` tokens. Blocks wholly past position `n` go back to the
//! pool; the last kept block keeps the rejected positions' KV, which the next
//! step overwrites in place (no copy). Drafted positions are never cached: the
//! scheduler caches only committed tokens, so every block past `n` is the
//! sequence's own, unpinned and outside the prefix tree.

use super::{KvCacheManager, SeqId};
use crate::error::{KvError, KvResult};
use crate::kv::block_pool::BlockId;

impl KvCacheManager {
    /// Shorten `seq` to its first `num_tokens` positions (at least those it
    /// has cached or dropped out of a window), releasing the blocks past them.
    pub fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> KvResult<()> {
        let block_size = self.block_size();
        let table = self.table(seq)?;
        let floor = (table.num_cached_blocks.max(table.num_dropped)) * block_size;
        if num_tokens > table.num_tokens || num_tokens < floor {
            return Err(KvError::InvalidArgument(format!(
                "cannot truncate sequence {seq} of {} tokens to {num_tokens}: \
                 it must keep its {floor} cached or dropped positions",
                table.num_tokens
            )));
        }
        let keep = num_tokens.div_ceil(block_size);
        let table = self.tables[(seq & 0xffff_ffff) as usize]
            .table
            .as_mut()
            .expect("checked above");
        let released: Vec<BlockId> = table.blocks.drain(keep..).collect();
        table.num_tokens = num_tokens;
        for block in released.into_iter().rev() {
            self.release_block(block)?;
        }
        Ok(())
    }
}
