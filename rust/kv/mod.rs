//! The paged KV memory: which physical block holds which tokens, and who
//! holds each block.
//!
//! - [`block_pool`]: a fixed set of `num_blocks` blocks of `block_size` token
//!   slots, a LIFO free list and a refcount per block. It owns only "who
//!   holds how many references to which block".
//! - [`prefix_cache`]: a radix tree over token ids at block granularity that
//!   maps prompt prefixes to the physical blocks holding their KV (one root
//!   per `cache_salt`, an intrusive LRU of evictable leaves). It does not own
//!   refcounts.
//! - [`kv_cache`]: per-sequence page tables over one `BlockPool`, with
//!   copy-on-write sharing and the radix `PrefixCache`; it decides whether a
//!   block that drops to refcount 0 goes back to the free list or stays
//!   cached.
//!
//! Invariants (checked by each type's `check_invariants`):
//! - every block is free, referenced, kept alive or cached-unreferenced, and
//!   free + referenced + kept alive + cached-unreferenced = num_blocks;
//! - every block's refcount equals its holders, counted over all live
//!   sequences (table entries plus pins); a block with refcount > 0 is never
//!   on the free list;
//! - a block that will be written (the last block of a sequence while it is
//!   partially filled) has refcount 1, so no two sequences write one slot;
//! - a cached child keeps its parent alive: a cached node is never evicted
//!   while any descendant is held, by any sequence.

pub mod block_pool;
pub mod kv_cache;
#[cfg(test)]
mod kv_cache_tests;
pub mod prefix_cache;
