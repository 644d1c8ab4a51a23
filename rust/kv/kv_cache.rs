//! The KV cache manager: per-sequence page tables over one `BlockPool`, with
//! copy-on-write sharing and the radix `PrefixCache`.
//!
//! A sequence's page table maps logical block `i` (positions
//! `i * block_size .. (i + 1) * block_size`) to a physical block; position
//! `p` lives at slot `table[p / block_size] * block_size + p % block_size`.
//!
//! ```text
//!   tokens   | cached prefix (shared, full) | own blocks ...  | last (partial) |
//!   table    |  b7   b2                     |  b5   b1        |  b8  (3/16)    |
//! ```
//!
//! Sharing: `fork` gives a child every block of its parent (refcount + 1).
//! The first write into a shared, partially filled last block copies it: the
//! writer gets a fresh block and a (src, dst) copy order for the model runner
//! to execute on device before the step. Full blocks are never written again,
//! so they are never copied.
//!
//! Every block is in exactly one state:
//! - free: on the pool's free list, refcount 0;
//! - referenced: refcount = number of page-table entries + prefix pins holding it;
//! - kept alive: in the prefix tree with refcount 0, but an ancestor of a
//!   referenced cached block (a child keeps its parent), so not evictable;
//! - cached-unreferenced: in the prefix tree with refcount 0 and no
//!   referenced descendant, evictable (LRU).
//!
//! Invariants (checked by `check_invariants`):
//! - free + referenced + kept alive + cached-unreferenced = num_blocks;
//! - every block's refcount equals its holders, counted over all live
//!   sequences (table entries plus pins);
//! - a sequence's table has exactly ceil(num_tokens / block_size) entries;
//! - a block that will be written (the last block of a sequence while it is
//!   partially filled) has refcount 1, so no two sequences write one slot;
//! - the prefix tree's own invariants (`PrefixCache::check_invariants`),
//!   among them "a cached child keeps its parent alive": a cached node is
//!   never evicted while any descendant is held, by any sequence;
//! - `written[b]` (leading slots of block `b` holding computed KV, as told
//!   by `record_written`) is 0 for free blocks, and `num_written_slots` is
//!   its sum over referenced blocks, so usage stats are O(1);
//! - with a sliding window: a table's DROPPED entries (below) are exactly
//!   its leading `num_dropped`, it pins nothing at those indices, and no
//!   block is kept alive (so the third state above is empty).
//!
//! A sequence's cached blocks form a path from its salt's root. When the tree
//! already holds equal tokens under another block (two sequences computed the
//! same block at once), the sequence keeps its own block in its table and
//! pins the tree's block, so the path stays whole and later blocks can still
//! be cached under it.
//!
//! Sliding-window attention: `sliding_window.rs` (the rule for dropping
//! blocks that leave the window, and the prefix cache under a window).
//! Speculative decoding: `speculative.rs` (`truncate`, giving back the
//! slots of rejected draft tokens).

use crate::error::{KvError, KvResult};
use crate::kv::block_pool::{BlockId, BlockPool};
use crate::kv::prefix_cache::events::CacheEvent;
use crate::kv::prefix_cache::{InsertOutcome, NodeId, PrefixCache, PrefixCacheStats};

mod invariants;
mod sliding_window;
mod speculative;

/// Handle of a live sequence: slab index in the low 32 bits, generation in
/// the high 32 bits, so a stale handle is an error rather than an alias.
pub type SeqId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

#[derive(Debug, Clone, Default)]
struct PageTable {
    blocks: Vec<BlockId>,
    num_tokens: usize,
    /// Salt root of the sequence's prefix path.
    root: NodeId,
    /// Deepest tree node on this sequence's cached path (`root` when none).
    path_tail: NodeId,
    /// Leading logical blocks already registered in the tree.
    num_cached_blocks: usize,
    /// False after a hash collision or a cache reset: stop caching this one.
    caching: bool,
    cache_epoch: u64,
    /// Tree blocks pinned in place of own duplicate blocks, by logical index.
    pins: Vec<(usize, BlockId)>,
    /// The last block is known to be held by this table alone (set when it
    /// was allocated or copied here, cleared by a fork), so a decode that
    /// fits in it needs no refcount lookup. False only means "check".
    owns_last: bool,
    /// Leading entries dropped out of the sliding window (each holds
    /// `dropped_block()`).
    num_dropped: usize,
}

/// An entry of the manager's page-table registry: the table of the live
/// sequence at this index, and the generation its `SeqId` must carry.
#[derive(Debug, Clone, Default)]
struct TableEntry {
    generation: u32,
    table: Option<PageTable>,
}

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    cache: PrefixCache,
    enable_prefix_caching: bool,
    cache_epoch: u64,
    tables: Vec<TableEntry>,
    free_tables: Vec<u32>,
    num_live: usize,
    scratch: Vec<BlockId>,
    /// Per block: leading slots holding computed KV (0 when free).
    written: Vec<u32>,
    /// Sum of `written` over referenced blocks.
    num_written_slots: usize,
    /// Sliding-window size in tokens (`None`: full attention).
    sliding_window: Option<usize>,
    /// Unheld blocks handed back by `detach_live_children` (reused).
    detached: Vec<BlockId>,
}

impl KvCacheManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
    ) -> KvResult<Self> {
        Self::new_with_window(num_blocks, block_size, enable_prefix_caching, None)
    }

    /// A manager for a model whose every attention layer slides with window
    /// `sliding_window` (tokens, >= 1); `None` is `new`. See the module docs.
    pub fn new_with_window(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        sliding_window: Option<u32>,
    ) -> KvResult<Self> {
        if sliding_window == Some(0) {
            return Err(KvError::InvalidArgument(
                "sliding_window must be >= 1 (or None for full attention)".into(),
            ));
        }
        let pool = BlockPool::new(num_blocks, block_size)?;
        // Slot ids (and the scratch block's, one past the pool) are int32.
        if (num_blocks + 1).saturating_mul(block_size) > i32::MAX as usize {
            return Err(KvError::InvalidArgument(format!(
                "{num_blocks} blocks of {block_size} tokens give slot ids past the int32 range"
            )));
        }
        Ok(Self {
            cache: PrefixCache::new(num_blocks, block_size)?,
            pool,
            enable_prefix_caching,
            cache_epoch: 0,
            tables: Vec::new(),
            free_tables: Vec::new(),
            num_live: 0,
            scratch: Vec::new(),
            written: crate::error::try_filled_vec(num_blocks, 0, "written-slot counts")?,
            num_written_slots: 0,
            sliding_window: sliding_window.map(|w| w as usize),
            detached: Vec::new(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks an allocation can get right now: free plus evictable.
    pub fn num_available_blocks(&self) -> usize {
        self.pool.num_free() + self.cache.num_evictable()
    }

    /// Blocks held by live sequences, with the cached ancestors their
    /// cached blocks keep alive (what vLLM calls KV cache usage).
    pub fn num_referenced_blocks(&self) -> usize {
        self.num_blocks() - self.num_available_blocks()
    }

    pub fn num_cached_blocks(&self) -> usize {
        self.cache.num_cached()
    }

    /// Slots of referenced blocks that hold computed KV (see
    /// `record_written`); a block shared by several sequences counts once.
    pub fn num_written_slots(&self) -> usize {
        self.num_written_slots
    }

    pub fn usage(&self) -> f64 {
        self.num_referenced_blocks() as f64 / self.num_blocks() as f64
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.enable_prefix_caching
    }

    pub fn prefix_cache_stats(&self) -> &PrefixCacheStats {
        &self.cache.stats
    }

    pub fn num_sequences(&self) -> usize {
        self.num_live
    }

    pub fn refcount(&self, block: BlockId) -> KvResult<u32> {
        self.pool.refcount(block)
    }

    /// A new, empty sequence whose prefix blocks are shared only with
    /// sequences of the same `salt`.
    pub fn create_sequence(&mut self, salt: Option<&str>) -> SeqId {
        let root = self.cache.acquire_root(salt);
        let table = PageTable {
            root,
            path_tail: root,
            caching: self.enable_prefix_caching,
            cache_epoch: self.cache_epoch,
            ..PageTable::default()
        };
        self.insert_table(table)
    }

    fn insert_table(&mut self, table: PageTable) -> SeqId {
        self.num_live += 1;
        let index = match self.free_tables.pop() {
            Some(index) => index,
            None => {
                self.tables.push(TableEntry::default());
                (self.tables.len() - 1) as u32
            }
        };
        let entry = &mut self.tables[index as usize];
        entry.table = Some(table);
        ((entry.generation as u64) << 32) | index as u64
    }

    fn table(&self, seq: SeqId) -> KvResult<&PageTable> {
        let entry = self.tables.get((seq & 0xffff_ffff) as usize);
        match entry {
            Some(entry) if entry.generation as u64 == seq >> 32 => {
                entry.table.as_ref().ok_or(KvError::UnknownSequence { seq })
            }
            _ => Err(KvError::UnknownSequence { seq }),
        }
    }

    fn table_mut(&mut self, seq: SeqId) -> KvResult<&mut PageTable> {
        let entry = self.tables.get_mut((seq & 0xffff_ffff) as usize);
        match entry {
            Some(entry) if entry.generation as u64 == seq >> 32 => {
                entry.table.as_mut().ok_or(KvError::UnknownSequence { seq })
            }
            _ => Err(KvError::UnknownSequence { seq }),
        }
    }

    pub fn num_tokens(&self, seq: SeqId) -> KvResult<usize> {
        Ok(self.table(seq)?.num_tokens)
    }

    pub fn block_table(&self, seq: SeqId) -> KvResult<&[BlockId]> {
        Ok(&self.table(seq)?.blocks)
    }

    /// Attach the longest cached prefix of `tokens` (whole blocks) to an empty
    /// sequence, pinning those blocks; returns the number of tokens matched.
    /// Pass the tokens whose KV may be reused (a scheduler leaves out the
    /// last prompt token so that its logits are computed).
    pub fn match_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> KvResult<usize> {
        let table = self.table(seq)?;
        if table.num_tokens != 0 {
            return Err(KvError::SequenceNotEmpty {
                seq,
                num_tokens: table.num_tokens,
            });
        }
        if !table.caching || table.cache_epoch != self.cache_epoch {
            return Ok(0);
        }
        let root = table.root;
        let mut found = std::mem::take(&mut self.scratch);
        found.clear();
        let num_found = self.cache.longest_prefix(root, tokens, &mut found);
        for &block in &found {
            self.retain_block(block)?;
        }
        let block_size = self.block_size();
        let table = self.table_mut(seq)?;
        table.blocks.extend_from_slice(&found);
        table.num_tokens = num_found * block_size;
        table.num_cached_blocks = num_found;
        table.path_tail = found.last().copied().unwrap_or(root);
        self.scratch = found;
        Ok(num_found * block_size)
    }

    /// What `match_prefix` would find for `tokens` in a new sequence of
    /// `salt`, without changing anything: (tokens matched, evictable blocks
    /// among them, which matching would take from the available ones).
    pub fn peek_prefix(&self, salt: Option<&str>, tokens: &[u32]) -> (usize, usize) {
        if !self.enable_prefix_caching {
            return (0, 0);
        }
        let Some(root) = self.cache.find_root(salt) else {
            return (0, 0);
        };
        let (mut matched, mut evictable) = (0, 0);
        for block in self.cache.walk(root, tokens) {
            matched += 1;
            evictable += usize::from(self.cache.is_evictable(block));
        }
        (matched * self.block_size(), evictable)
    }

    /// Blocks `allocate_slots(seq, num_new_tokens)` would take from the pool
    /// (new blocks plus a copy-on-write copy), without changing anything.
    pub fn blocks_needed(&self, seq: SeqId, num_new_tokens: usize) -> KvResult<usize> {
        let table = self.table(seq)?;
        Ok(self.blocks_needed_for(table, num_new_tokens))
    }

    /// Blocks to take from the pool; `usize::MAX` when the grown length
    /// would not even fit in a usize (so it can never be granted).
    fn blocks_needed_for(&self, table: &PageTable, num_new_tokens: usize) -> usize {
        if num_new_tokens == 0 {
            return 0;
        }
        let block_size = self.block_size();
        let Some(total_tokens) = table.num_tokens.checked_add(num_new_tokens) else {
            return usize::MAX;
        };
        let copy = match table.blocks.last() {
            Some(&last) if !table.num_tokens.is_multiple_of(block_size) => {
                usize::from(self.pool.refcount(last).unwrap_or(0) > 1)
            }
            _ => 0,
        };
        (total_tokens.div_ceil(block_size) - table.blocks.len()).saturating_add(copy)
    }

    /// Reserve KV slots for the next `num_new_tokens` positions of `seq`,
    /// all or nothing: on `OutOfBlocks` nothing changed. A copy-on-write of a
    /// shared, partially filled last block is appended to `copies`.
    pub fn allocate_slots(
        &mut self,
        seq: SeqId,
        num_new_tokens: usize,
        copies: &mut Vec<BlockCopy>,
    ) -> KvResult<()> {
        let block_size = self.block_size();
        let table = self.table_mut(seq)?;
        let filled = table.num_tokens % block_size;
        let fits = filled
            .checked_add(num_new_tokens)
            .is_some_and(|end| end <= block_size);
        if table.owns_last && filled != 0 && fits {
            table.num_tokens += num_new_tokens; // the common decode: room in an owned block
            return Ok(());
        }
        let needed = self.blocks_needed_for(self.table(seq)?, num_new_tokens);
        self.ensure_free(needed)?;
        // Split borrows: the table lives in `tables`, blocks come from `pool`.
        let pool = &mut self.pool;
        let table = self.tables[(seq & 0xffff_ffff) as usize]
            .table
            .as_mut()
            .expect("checked above");
        if num_new_tokens > 0 && !table.num_tokens.is_multiple_of(block_size) {
            let last = table.blocks.last_mut().expect("a partial block exists");
            if pool.refcount(*last)? > 1 {
                let dst = pool.allocate_one().expect("ensured free blocks");
                pool.release(*last)?;
                copies.push(BlockCopy { src: *last, dst });
                let copied = self.written[*last as usize];
                self.written[dst as usize] = copied;
                self.num_written_slots += copied as usize;
                *last = dst;
            }
            table.owns_last = pool.refcount(*table.blocks.last().expect("exists"))? == 1;
        }
        let total_blocks = (table.num_tokens + num_new_tokens).div_ceil(block_size);
        let extra = total_blocks - table.blocks.len();
        if extra > 0 {
            pool.allocate(extra, &mut table.blocks)?;
            table.owns_last = true;
        }
        table.num_tokens += num_new_tokens;
        debug_assert!(
            num_new_tokens == 0
                || table.num_tokens.is_multiple_of(block_size)
                || pool.refcount(*table.blocks.last().unwrap()).unwrap() == 1,
            "the block being written must be owned by the writer alone"
        );
        Ok(())
    }

    /// Make `count` blocks free, evicting cached-unreferenced ones LRU first.
    fn ensure_free(&mut self, count: usize) -> KvResult<()> {
        let available = self.num_available_blocks();
        if count > available {
            return Err(KvError::OutOfBlocks {
                requested: count,
                available,
            });
        }
        while self.pool.num_free() < count {
            let block = self.cache.evict_one()?.ok_or_else(|| {
                KvError::InvariantViolated("an evictable block could not be evicted".into())
            })?;
            self.push_free(block)?;
        }
        Ok(())
    }

    /// Return an unreferenced block to the pool; its KV is gone.
    fn push_free(&mut self, block: BlockId) -> KvResult<()> {
        self.pool.push_free(block)?;
        self.written[block as usize] = 0;
        Ok(())
    }

    /// Add a holder to a held or cached block.
    fn retain_block(&mut self, block: BlockId) -> KvResult<()> {
        if self.pool.refcount(block)? == 0 {
            self.cache.on_held(block);
            self.num_written_slots += self.written[block as usize] as usize;
        }
        self.pool.retain(block)
    }

    /// Positions `start..end` of `seq` now hold computed KV (the scheduler
    /// tells this when it issues the step that writes them). Only feeds
    /// `num_written_slots`; O(blocks touched).
    pub fn record_written(&mut self, seq: SeqId, start: usize, end: usize) -> KvResult<()> {
        let table = self.table(seq)?;
        if start >= end {
            return Ok(());
        }
        if end > table.num_tokens {
            return Err(KvError::InvalidArgument(format!(
                "positions {start}..{end} exceed the {} tokens of sequence {seq}",
                table.num_tokens
            )));
        }
        let block_size = self.block_size();
        if start < table.num_dropped * block_size {
            return Err(dropped_position(seq, start));
        }
        let table = &self.tables[(seq & 0xffff_ffff) as usize]
            .table
            .as_ref()
            .expect("checked above");
        for index in start / block_size..end.div_ceil(block_size) {
            let block = table.blocks[index] as usize;
            let fill = (end - index * block_size).min(block_size) as u32;
            if self.written[block] < fill {
                self.num_written_slots += (fill - self.written[block]) as usize;
                self.written[block] = fill;
            }
        }
        Ok(())
    }

    fn take_table(&mut self, seq: SeqId) -> KvResult<PageTable> {
        self.table(seq)?;
        Ok(self.tables[(seq & 0xffff_ffff) as usize]
            .table
            .take()
            .expect("checked"))
    }

    fn put_table(&mut self, seq: SeqId, table: PageTable) {
        self.tables[(seq & 0xffff_ffff) as usize].table = Some(table);
    }

    /// The slot id of position `pos` of `seq`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> KvResult<u32> {
        let table = self.table(seq)?;
        if pos >= table.num_tokens {
            return Err(KvError::InvalidArgument(format!(
                "position {pos} has no KV slot in sequence {seq} of {} tokens",
                table.num_tokens
            )));
        }
        let block_size = self.block_size();
        if pos < table.num_dropped * block_size {
            return Err(dropped_position(seq, pos));
        }
        Ok(table.blocks[pos / block_size] * block_size as u32 + (pos % block_size) as u32)
    }

    /// Slot ids of positions `start..start + out.len()` of `seq`, into `out`.
    pub fn write_slots(&self, seq: SeqId, start: usize, out: &mut [i32]) -> KvResult<()> {
        let table = self.table(seq)?;
        if start
            .checked_add(out.len())
            .is_none_or(|end| end > table.num_tokens)
        {
            return Err(KvError::InvalidArgument(format!(
                "positions {start}..{start}+{} exceed the {} tokens of sequence {seq}",
                out.len(),
                table.num_tokens
            )));
        }
        let block_size = self.block_size();
        if start < table.num_dropped * block_size && !out.is_empty() {
            return Err(dropped_position(seq, start));
        }
        for (i, slot) in out.iter_mut().enumerate() {
            let pos = start + i;
            *slot =
                (table.blocks[pos / block_size] as usize * block_size + pos % block_size) as i32;
        }
        Ok(())
    }

    /// Register the full blocks among the first `tokens.len()` positions of
    /// `seq` in the prefix tree. `tokens` are the sequence's token ids from
    /// position 0; only positions that already have KV slots count. Returns
    /// how many blocks were newly cached.
    pub fn cache_blocks(&mut self, seq: SeqId, tokens: &[u32]) -> KvResult<usize> {
        let table = self.table(seq)?;
        if !table.caching || table.cache_epoch != self.cache_epoch {
            return Ok(0);
        }
        let block_size = self.block_size();
        let full = tokens.len().min(table.num_tokens) / block_size;
        if full <= table.num_cached_blocks {
            return Ok(0);
        }
        let mut table = self.take_table(seq)?;
        let mut newly = 0;
        for index in table.num_cached_blocks..full {
            let chunk = &tokens[index * block_size..(index + 1) * block_size];
            let block = table.blocks[index];
            if self.cache.is_cached(block) {
                // Shared with a fork that cached it first: already on the path.
                table.path_tail = block;
                table.num_cached_blocks = index + 1;
                continue;
            }
            match self.cache.insert(table.path_tail, chunk, block) {
                InsertOutcome::Inserted => {
                    table.path_tail = block;
                    newly += 1;
                }
                InsertOutcome::AlreadyCached(existing) => {
                    self.retain_block(existing)?;
                    table.pins.push((index, existing));
                    table.path_tail = existing;
                }
                InsertOutcome::HashCollision => {
                    table.caching = false;
                    break;
                }
            }
            table.num_cached_blocks = index + 1;
        }
        self.put_table(seq, table);
        Ok(newly)
    }

    /// A new sequence sharing every block of `seq` (refcount + 1 each).
    pub fn fork(&mut self, seq: SeqId) -> KvResult<SeqId> {
        self.table_mut(seq)?.owns_last = false;
        let child = self.table(seq)?.clone();
        for &block in &child.blocks[child.num_dropped..] {
            self.pool.retain(block)?;
        }
        for &(_, block) in &child.pins {
            self.pool.retain(block)?;
        }
        self.cache.retain_root(child.root);
        Ok(self.insert_table(child))
    }

    /// Drop a sequence: every block loses one holder, deepest first; cached
    /// blocks at refcount 0 become evictable, the others go back to the pool.
    pub fn free_sequence(&mut self, seq: SeqId) -> KvResult<()> {
        let table = self.take_table(seq)?;
        let index = (seq & 0xffff_ffff) as u32;
        let entry = &mut self.tables[index as usize];
        entry.generation = entry.generation.wrapping_add(1);
        self.free_tables.push(index);
        self.num_live -= 1;
        let mut pins = table.pins.iter().rev().peekable();
        for (logical, &block) in table.blocks.iter().enumerate().rev() {
            if logical < table.num_dropped {
                break; // out of the window: already released
            }
            while let Some(&(_, pinned)) = pins.next_if(|(at, _)| *at >= logical) {
                self.release_block(pinned)?;
            }
            self.release_block(block)?;
        }
        self.cache.release_root(table.root);
        Ok(())
    }

    fn release_block(&mut self, block: BlockId) -> KvResult<()> {
        if self.pool.release(block)? == 0 {
            self.num_written_slots -= self.written[block as usize] as usize;
            if self.cache.is_cached(block) {
                if self.sliding_window.is_some() && self.cache.has_live_children(block) {
                    // The window rule: never kept alive by a child (module docs).
                    let mut detached = std::mem::take(&mut self.detached);
                    self.cache.detach_live_children(block, &mut detached);
                    let freed = detached.drain(..).try_for_each(|b| self.push_free(b));
                    self.detached = detached;
                    freed?;
                }
                self.cache.on_unheld(block);
            } else {
                self.push_free(block)?;
            }
        }
        Ok(())
    }

    /// Forget the whole prefix cache (e.g. after new weights): evictable
    /// blocks return to the pool; live sequences keep their blocks but stop
    /// caching them.
    pub fn reset_prefix_cache(&mut self) -> KvResult<()> {
        let mut freed = Vec::new();
        self.cache.clear(&mut freed);
        for block in freed {
            self.push_free(block)?;
        }
        self.cache_epoch += 1;
        Ok(())
    }

    /// Record what the prefix cache stores and drops ([`CacheEvent`]s for
    /// cache-aware routers), from now on.
    pub fn set_kv_events_enabled(&mut self, enabled: bool) {
        self.cache.set_events_enabled(enabled);
    }

    /// The chained hash of every cached block (a router's summary of what
    /// this engine holds; [`PrefixCache::cached_block_hashes`]).
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.cache.cached_block_hashes()
    }

    /// The cached blocks' hashes as the event log kept them (tests replay the
    /// events against them).
    #[cfg(test)]
    pub(crate) fn logged_block_hashes(&self) -> Vec<u64> {
        self.cache.logged_block_hashes()
    }

    /// The prefix cache's events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<CacheEvent> {
        self.cache.events.drain()
    }

    /// Evict up to `count` cached-unreferenced blocks (LRU first); returns
    /// how many were evicted.
    pub fn evict(&mut self, count: usize) -> KvResult<usize> {
        let mut evicted = 0;
        while evicted < count {
            let Some(block) = self.cache.evict_one()? else {
                break;
            };
            self.push_free(block)?;
            evicted += 1;
        }
        Ok(evicted)
    }
}

fn dropped_position(seq: SeqId, pos: usize) -> KvError {
    KvError::InvalidArgument(format!(
        "position {pos} of sequence {seq} lies in a block dropped out of its sliding window"
    ))
}
