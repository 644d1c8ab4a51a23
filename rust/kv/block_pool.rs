//! The physical KV block pool: a fixed set of `num_blocks` blocks of
//! `block_size` token slots, a LIFO free list and a refcount per block.
//!
//! It owns only "who holds how many references to which block". Whether a
//! block that drops to refcount 0 goes back to the free list or stays cached
//! for reuse is decided one level up (`kv_cache`), so `release` reports the
//! new count and `push_free` returns a block to the list.
//!
//! Invariants (checked by `check_invariants`, the cheap ones by `debug_assert!`):
//! - every block id on the free list is `< num_blocks`, appears once, and has
//!   refcount 0 (`is_free[b]` mirrors membership);
//! - a block with refcount > 0 is never on the free list.
//!
//! Complexity: `allocate` of k blocks O(k), `retain`/`release`/`push_free` O(1).
//! The free list is allocated once at construction: nothing on the hot path
//! allocates memory.

use crate::error::{try_filled_vec, KvError, KvResult};

pub type BlockId = u32;

/// Block ids as the int32 the device arrays use. Lossless: a pool never
/// has more than `i32::MAX` blocks, so every id fits.
#[inline]
pub fn block_ids_as_i32(blocks: &[BlockId]) -> &[i32] {
    // SAFETY: u32 and i32 have the same size and alignment, and every id is
    // below i32::MAX (checked in `BlockPool::new`).
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<i32>(), blocks.len()) }
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refcount: Vec<u32>,
    is_free: Vec<bool>,
    free: Vec<BlockId>,
}

impl BlockPool {
    /// A pool whose blocks are all free. Blocks are handed out lowest id first.
    pub fn new(num_blocks: usize, block_size: usize) -> KvResult<Self> {
        if num_blocks == 0 || num_blocks >= i32::MAX as usize {
            return Err(KvError::InvalidArgument(format!(
                "num_blocks must be in 1..{}, got {num_blocks}",
                i32::MAX
            )));
        }
        if block_size == 0 || block_size > 1 << 16 {
            return Err(KvError::InvalidArgument(format!(
                "block_size must be in 1..=65536, got {block_size}"
            )));
        }
        let mut free = try_filled_vec(num_blocks, 0 as BlockId, "the free list")?;
        for (slot, block) in free.iter_mut().zip((0..num_blocks as BlockId).rev()) {
            *slot = block;
        }
        Ok(Self {
            block_size,
            refcount: try_filled_vec(num_blocks, 0, "block refcounts")?,
            is_free: try_filled_vec(num_blocks, true, "block states")?,
            free,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn refcount(&self, block: BlockId) -> KvResult<u32> {
        self.check_range(block)?;
        Ok(self.refcount[block as usize])
    }

    pub fn is_free(&self, block: BlockId) -> bool {
        self.is_free.get(block as usize).copied().unwrap_or(false)
    }

    /// Take one free block with refcount 1, or `None` when the list is empty.
    #[inline]
    pub fn allocate_one(&mut self) -> Option<BlockId> {
        let block = self.free.pop()?;
        debug_assert!(self.is_free[block as usize] && self.refcount[block as usize] == 0);
        self.is_free[block as usize] = false;
        self.refcount[block as usize] = 1;
        Some(block)
    }

    /// All-or-nothing: append `count` fresh blocks (refcount 1) to `out`, or
    /// leave the pool and `out` untouched and report how many were available.
    pub fn allocate(&mut self, count: usize, out: &mut Vec<BlockId>) -> KvResult<()> {
        if count > self.free.len() {
            return Err(KvError::OutOfBlocks {
                requested: count,
                available: self.free.len(),
            });
        }
        out.reserve(count);
        for _ in 0..count {
            let block = self
                .allocate_one()
                .expect("count checked against the free list");
            out.push(block);
        }
        Ok(())
    }

    /// Add a holder to a block that is held or cached (never to a free one).
    #[inline]
    pub fn retain(&mut self, block: BlockId) -> KvResult<()> {
        self.check_range(block)?;
        if self.is_free[block as usize] {
            return Err(KvError::IncrefFreeBlock { block });
        }
        self.refcount[block as usize] += 1;
        Ok(())
    }

    /// Drop one holder; returns the new refcount. The block is NOT put back on
    /// the free list here: at 0 the caller either caches it or `push_free`s it.
    #[inline]
    pub fn release(&mut self, block: BlockId) -> KvResult<u32> {
        self.check_range(block)?;
        let count = &mut self.refcount[block as usize];
        if *count == 0 {
            return Err(KvError::DoubleFree { block });
        }
        *count -= 1;
        Ok(*count)
    }

    /// Return an unreferenced block to the free list.
    #[inline]
    pub fn push_free(&mut self, block: BlockId) -> KvResult<()> {
        self.check_range(block)?;
        if self.is_free[block as usize] || self.refcount[block as usize] != 0 {
            return Err(KvError::DoubleFree { block });
        }
        self.is_free[block as usize] = true;
        self.free.push(block);
        Ok(())
    }

    /// Drop one holder and, at refcount 0, return the block to the free list.
    /// The plain "free" for users of the pool without a prefix cache.
    pub fn free(&mut self, block: BlockId) -> KvResult<()> {
        if self.release(block)? == 0 {
            self.push_free(block)?;
        }
        Ok(())
    }

    fn check_range(&self, block: BlockId) -> KvResult<()> {
        if (block as usize) < self.refcount.len() {
            Ok(())
        } else {
            Err(KvError::BlockOutOfRange {
                block,
                num_blocks: self.refcount.len() as u32,
            })
        }
    }

    /// Full check of the free-list invariants, O(num_blocks).
    pub fn check_invariants(&self) -> KvResult<()> {
        let mut seen = vec![false; self.refcount.len()];
        for &block in &self.free {
            let b = block as usize;
            if b >= seen.len() {
                return Err(KvError::InvariantViolated(format!(
                    "free list holds out-of-range block {block}"
                )));
            }
            if seen[b] {
                return Err(KvError::InvariantViolated(format!(
                    "block {block} is twice on the free list"
                )));
            }
            seen[b] = true;
            if self.refcount[b] != 0 {
                return Err(KvError::InvariantViolated(format!(
                    "free block {block} has refcount {}",
                    self.refcount[b]
                )));
            }
        }
        for (b, (&listed, &flag)) in seen.iter().zip(&self.is_free).enumerate() {
            if listed != flag {
                return Err(KvError::InvariantViolated(format!(
                    "block {b}: free flag {flag} but on free list: {listed}"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut pool = BlockPool::new(4, 16).unwrap();
        let mut out = Vec::new();
        pool.allocate(3, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        let err = pool.allocate(2, &mut out).unwrap_err();
        assert_eq!(
            err,
            KvError::OutOfBlocks {
                requested: 2,
                available: 1
            }
        );
        assert_eq!(
            out.len(),
            3,
            "a failed allocation must not touch the output"
        );
        assert_eq!(pool.num_free(), 1);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn free_returns_block_only_at_refcount_zero() {
        let mut pool = BlockPool::new(2, 16).unwrap();
        let b = pool.allocate_one().unwrap();
        pool.retain(b).unwrap();
        pool.free(b).unwrap();
        assert_eq!(pool.num_free(), 1);
        pool.free(b).unwrap();
        assert_eq!(pool.num_free(), 2);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn double_free_and_out_of_range_are_errors() {
        let mut pool = BlockPool::new(2, 16).unwrap();
        let b = pool.allocate_one().unwrap();
        pool.free(b).unwrap();
        assert_eq!(pool.free(b), Err(KvError::DoubleFree { block: b }));
        assert_eq!(
            pool.free(7),
            Err(KvError::BlockOutOfRange {
                block: 7,
                num_blocks: 2
            })
        );
        assert_eq!(pool.retain(b), Err(KvError::IncrefFreeBlock { block: b }));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn rejects_empty_pool_and_zero_block_size() {
        assert!(BlockPool::new(0, 16).is_err());
        assert!(BlockPool::new(8, 0).is_err());
    }
}
