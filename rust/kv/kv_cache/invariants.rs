//! `KvCacheManager::check_invariants`: every invariant of the module docs of
//! `kv_cache.rs`, checked in debug builds and tests.

use super::KvCacheManager;
use crate::error::{KvError, KvResult};
use crate::kv::block_pool::BlockId;

impl KvCacheManager {
    /// Full consistency check, O(num_blocks + total table length).
    pub fn check_invariants(&self) -> KvResult<()> {
        let fail = |msg: String| Err(KvError::InvariantViolated(msg));
        self.pool.check_invariants()?;
        let pool = &self.pool;
        self.cache
            .check_invariants(|b| pool.refcount(b).unwrap_or(0))?;
        let block_size = self.block_size();
        let mut holders = vec![0u32; self.num_blocks()];
        let mut live = 0;
        for (index, entry) in self.tables.iter().enumerate() {
            let Some(table) = &entry.table else { continue };
            live += 1;
            if table.blocks.len() != table.num_tokens.div_ceil(block_size) {
                return fail(format!(
                    "page-table entry {index}: {} blocks for {} tokens",
                    table.blocks.len(),
                    table.num_tokens
                ));
            }
            let dropped = self.dropped_block();
            if table.num_dropped > table.blocks.len()
                || (table.num_dropped > 0 && self.sliding_window.is_none())
                || table.blocks[..table.num_dropped]
                    .iter()
                    .any(|&b| b != dropped)
                || table.blocks[table.num_dropped..].contains(&dropped)
                || table
                    .pins
                    .first()
                    .is_some_and(|&(at, _)| at < table.num_dropped)
            {
                return fail(format!(
                    "page-table entry {index}: dropped entries are not exactly its leading {}",
                    table.num_dropped
                ));
            }
            for &block in table.blocks[table.num_dropped..]
                .iter()
                .chain(table.pins.iter().map(|(_, b)| b))
            {
                holders[block as usize] += 1;
            }
            if table.num_tokens % block_size != 0 {
                let last = *table.blocks.last().expect("partial block exists");
                if pool.refcount(last)? > 1 && !self.last_block_shared_by_fork(last) {
                    return fail(format!("partial block {last} is shared outside a fork"));
                }
            }
        }
        if live != self.num_live {
            return fail(format!("{live} live tables but {} counted", self.num_live));
        }
        let mut referenced = 0;
        let mut kept_alive = 0;
        let mut written = 0;
        for (b, &count) in holders.iter().enumerate() {
            let refcount = pool.refcount(b as BlockId)?;
            if refcount != count {
                return fail(format!(
                    "block {b} has refcount {refcount} but {count} holders"
                ));
            }
            if self.written[b] as usize > block_size
                || (pool.is_free(b as BlockId) && self.written[b] != 0)
            {
                return fail(format!("block {b} has {} written slots", self.written[b]));
            }
            if refcount > 0 {
                referenced += 1;
                written += self.written[b] as usize;
            } else if self.cache.is_cached(b as BlockId) && !self.cache.is_evictable(b as BlockId) {
                kept_alive += 1;
            }
        }
        if written != self.num_written_slots {
            return fail(format!(
                "{written} written slots in referenced blocks but {} counted",
                self.num_written_slots
            ));
        }
        if self.sliding_window.is_some() && kept_alive != 0 {
            return fail(format!(
                "{kept_alive} cached blocks are kept alive under a sliding window"
            ));
        }
        let unreferenced_cached = self.cache.num_evictable();
        if pool.num_free() + referenced + kept_alive + unreferenced_cached != self.num_blocks() {
            return fail(format!(
                "free {} + referenced {referenced} + kept alive {kept_alive} \
                 + cached-unreferenced {unreferenced_cached} != {}",
                pool.num_free(),
                self.num_blocks()
            ));
        }
        Ok(())
    }

    /// A shared partial last block is legal only between forks that have not
    /// written into it yet: every holder then has it as its last block.
    fn last_block_shared_by_fork(&self, block: BlockId) -> bool {
        let block_size = self.block_size();
        self.tables
            .iter()
            .filter_map(|e| e.table.as_ref())
            .all(|t| match t.blocks.iter().position(|&b| b == block) {
                None => true,
                Some(i) => i + 1 == t.blocks.len() && t.num_tokens % block_size != 0,
            })
    }
}
