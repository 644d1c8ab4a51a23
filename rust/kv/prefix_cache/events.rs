//! What the prefix cache stores and drops, told to the world outside: the
//! events a cache-aware router reads to learn which blocks an engine holds
//! (the shape of vLLM's KV-cache events: block stored, blocks removed, all
//! cleared).
//!
//! Owns [`CacheEvent`], [`EventLog`] and the content hash of a cached block,
//! [`chain_hash`]: the hash of its tokens chained from its parent's, so it
//! names the whole prefix the block ends, the same in every engine that
//! caches the same tokens under the same salt (a router can compare two
//! engines' blocks by hash alone). Node ids are engine-local and never
//! leave the engine.
//!
//! Invariant (checked by `prefix_cache_tests.rs`): replaying the log from the
//! start (or from the last `Cleared`) gives exactly the set of cached blocks'
//! hashes: every insertion is one `Stored`, every removal (eviction, a
//! subtree detached by a sliding window) one `Removed`, a full reset one
//! `Cleared`. Nothing is recorded while the log is off, so a server without
//! events pays one branch per insertion or removal.

use super::{hash_block_tokens, NodeId, PrefixCache, NIL};
use crate::kv::block_pool::BlockId;

/// One change of what the prefix cache holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block was cached: its chained hash, its parent's (None for a
    /// first block), its tokens, and the salt of its tree.
    Stored {
        hash: u64,
        parent: Option<u64>,
        tokens: Vec<u32>,
        salt: Option<String>,
    },
    /// A cached block left the cache (evicted or detached).
    Removed { hash: u64 },
    /// Every cached block was forgotten at once (`reset_prefix_cache`).
    Cleared,
}

/// The events recorded since the last drain, when recording is on.
#[derive(Debug, Clone, Default)]
pub struct EventLog {
    enabled: bool,
    events: Vec<CacheEvent>,
}

impl EventLog {
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
        if !enabled {
            self.events.clear();
        }
    }

    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    #[inline]
    pub fn record(&mut self, event: impl FnOnce() -> CacheEvent) {
        if self.enabled {
            self.events.push(event());
        }
    }

    /// The events since the last call, oldest first.
    pub fn drain(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }
}

/// The hash of the first block under a root: the salt's, so that equal
/// tokens under different salts never share a hash.
pub fn root_hash(salt: Option<&str>) -> u64 {
    match salt {
        None => 0x6b76_7061_6765_0000, // "kvpage"
        Some(salt) => {
            let units: Vec<u32> = salt.bytes().map(u32::from).collect();
            hash_block_tokens(&units) ^ 0x7361_6c74 // "salt"
        }
    }
}

/// The chained hashes of the full blocks of `tokens` under `salt`'s root:
/// what [`PrefixCache::cached_block_hashes`] holds for blocks caching that
/// prefix (a router's side of the comparison).
pub fn prefix_block_hashes(tokens: &[u32], block_size: usize, salt: Option<&str>) -> Vec<u64> {
    let mut hash = root_hash(salt);
    (tokens.chunks_exact(block_size.max(1)))
        .map(|block| {
            hash = chain_hash(hash, block);
            hash
        })
        .collect()
}

/// The hash of a block holding `tokens` whose parent's hash is `parent`.
#[inline]
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut z = parent.rotate_left(23) ^ hash_block_tokens(tokens);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The log's side of the cache: hashes kept and events recorded as blocks come and go.
impl PrefixCache {
    /// Turn the event log on or off. Blocks cached while it was off have no
    /// hash: a removal of one is not recorded (the router never heard of it).
    pub fn set_events_enabled(&mut self, enabled: bool) {
        if enabled && self.block_hash.is_empty() {
            self.block_hash = vec![0; self.num_blocks];
        }
        self.events.set_enabled(enabled);
    }

    /// The chained hash of every cached block, from a walk of the tree down
    /// from its roots (the event log need not be on): the summary of what
    /// this engine holds that a router polls. O(cached blocks), no state.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.num_cached);
        let unsalted = std::iter::once((self.unsalted_root(), None));
        let salted = (self.salted_roots.iter()).map(|(salt, &root)| (root, Some(salt.as_str())));
        let mut stack: Vec<(NodeId, u64)> = Vec::new();
        for (root, salt) in unsalted.chain(salted) {
            stack.push((root, root_hash(salt)));
            while let Some((node, hash)) = stack.pop() {
                let mut child = self.first_child[node as usize];
                while child != NIL {
                    let child_hash = chain_hash(hash, self.block_tokens(child));
                    out.push(child_hash);
                    stack.push((child, child_hash));
                    child = self.next_sibling[child as usize];
                }
            }
        }
        out
    }

    /// The chained hashes of the cached blocks as the event log kept them,
    /// in block order (log on).
    #[cfg(test)]
    pub(crate) fn logged_block_hashes(&self) -> Vec<u64> {
        (0..self.num_blocks)
            .filter(|&b| self.cached[b])
            .map(|b| self.block_hash[b])
            .collect()
    }

    /// `Stored` for `block`, just inserted under `parent` (log on).
    pub(super) fn record_stored(&mut self, parent: NodeId, block: BlockId) {
        if !self.events.enabled() {
            return;
        }
        let (parent_hash, salt) = if self.is_root(parent) {
            let salt = self.root_salt[parent as usize - self.num_blocks].clone();
            (None, salt)
        } else {
            (Some(self.block_hash[parent as usize]), None)
        };
        let base = match parent_hash {
            Some(hash) => hash,
            None => root_hash(salt.as_deref()),
        };
        let hash = chain_hash(base, self.block_tokens(block));
        self.block_hash[block as usize] = hash;
        let tokens = self.block_tokens(block).to_vec();
        self.events.record(|| CacheEvent::Stored {
            hash,
            parent: parent_hash,
            tokens,
            salt,
        });
    }

    /// `Cleared`, as the tree forgets every block.
    pub(super) fn record_cleared(&mut self) {
        self.events.record(|| CacheEvent::Cleared);
        self.block_hash.iter_mut().for_each(|h| *h = 0);
    }

    /// `Removed` for a cached `block` about to leave the tree.
    #[inline]
    pub(super) fn record_removed(&mut self, block: BlockId) {
        if let Some(&hash) = self.block_hash.get(block as usize) {
            if hash != 0 {
                self.events.record(|| CacheEvent::Removed { hash });
                self.block_hash[block as usize] = 0;
            }
        }
    }
}

/// A router's view of one engine's cache, rebuilt from its events (tests): the
/// module's invariant is that it equals the cached blocks' hashes.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct EventReplay {
    held: std::collections::HashSet<u64>,
    pub(crate) cleared: usize,
}

#[cfg(test)]
impl EventReplay {
    pub(crate) fn apply(&mut self, events: Vec<CacheEvent>) {
        for event in events {
            match event {
                CacheEvent::Stored { hash, parent, .. } => {
                    if let Some(parent) = parent {
                        assert!(self.held.contains(&parent), "parent of {hash} unknown");
                    }
                    assert!(self.held.insert(hash), "block {hash} stored twice");
                }
                CacheEvent::Removed { hash } => {
                    assert!(self.held.remove(&hash), "removed {hash} never stored");
                }
                CacheEvent::Cleared => {
                    self.held.clear();
                    self.cleared += 1;
                }
            }
        }
    }

    pub(crate) fn assert_holds(&self, mut cached: Vec<u64>) {
        cached.sort_unstable();
        let mut held: Vec<u64> = self.held.iter().copied().collect();
        held.sort_unstable();
        assert_eq!(held, cached, "replayed events != cached blocks");
    }
}
