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
//! Sliding-window attention (`new_with_window`, window `W`; `None` changes
//! nothing above). A query at position `p` reads only keys at `j` with
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

use crate::error::{KvError, KvResult};
use crate::kv::block_pool::{BlockId, BlockPool};
use crate::kv::prefix_cache::{InsertOutcome, NodeId, PrefixCache, PrefixCacheStats};

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

fn dropped_position(seq: SeqId, pos: usize) -> KvError {
    KvError::InvalidArgument(format!(
        "position {pos} of sequence {seq} lies in a block dropped out of its sliding window"
    ))
}
