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
//!   cached. For sliding-window models it also drops the blocks that fall
//!   out of a sequence's window, and keeps the prefix tree from pinning
//!   them (the rule is at the top of `kv_cache.rs`).
//!
//! Invariants: each module lists its own, once, at its top (`block_pool`:
//! the free list and refcounts; `prefix_cache`: the tree and its LRU;
//! `kv_cache`: the block states and page tables across all three).
//! `KvCacheManager::check_invariants` checks them all.

pub mod block_pool;
pub mod kv_cache;
#[cfg(test)]
mod kv_cache_tests;
#[cfg(test)]
mod kv_cache_window_tests;
pub mod prefix_cache;
