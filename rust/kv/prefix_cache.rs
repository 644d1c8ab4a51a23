//! Radix prefix cache: a tree over token ids at block granularity that maps
//! prompt prefixes to the physical blocks holding their KV.
//!
//! ```text
//!   root(salt=None) ── [t0..t15]=b7 ── [t16..t31]=b2 ── [t32..t47]=b9
//!                                   └─ [u16..u31]=b4
//!   root(salt="A")  ── [t0..t15]=b5            (another tenant: never shared)
//! ```
//!
//! Every node but a root is one cached, *full* block, so nodes are addressed
//! by their block id and all per-node state lives in arrays indexed by it (an
//! arena with no pointers). Roots, one per `cache_salt`, get ids past
//! `num_blocks`. Edges live in one hash map keyed by (parent, hash of the
//! child's tokens); the child's tokens are stored and compared on every hit,
//! so a hash collision can only cost a cache miss, never a wrong match.
//!
//! This module does not own refcounts (the `BlockPool` does); the KV manager
//! tells it when a cached block gains its first holder (`on_held`) or loses
//! its last (`on_unheld`). A cached node is *live* while it has a holder or a
//! live child: a child keeps its parent alive structurally, whoever holds
//! it, so a parent can never be evicted (and its id recycled) under a child
//! that is still in use. Live children are counted per node and liveness
//! changes propagate up the path, stopping at the first ancestor whose
//! liveness does not change (O(1) in the usual root-first retain and
//! deepest-first release orders).
//!
//! Dead nodes (no holder, no live child) are the evictable ones. They sit in
//! an intrusive doubly linked LRU list in the order they died; a node dies
//! only after all its children are dead, so every node comes after its
//! children and the list's front is always the least recently used dead
//! *leaf*. Eviction pops it in O(1).
//!
//! Invariants (see `check_invariants`, run in release builds too):
//! - a node's parent is a root or a cached node; `num_children` counts the
//!   edges out of each node; the edge map holds exactly the cached nodes;
//! - `held` mirrors "refcount > 0" and `live_children` counts the live
//!   children of every cached node;
//! - the LRU list holds exactly the dead cached nodes, every node after all
//!   its children (so the front is a leaf); no live node has a dead parent;
//! - a root is kept while it has children or live sequences using it;
//! - each node's children form an intrusive doubly linked sibling list
//!   (`first_child`, `next_sibling`, `prev_sibling`) holding exactly the
//!   cached nodes whose parent it is, so a subtree is walked in O(its size).
//!
//! Sliding-window attention (`KvCacheManager` with a window) adds one
//! operation: `detach_live_children`. A cached block whose last holder
//! drops it while a child is still live would otherwise stay pinned
//! ("kept alive") by that child; instead the live children's subtrees are
//! removed from the tree (their held blocks stay with their holders as
//! plain, uncached blocks; their unheld blocks are handed back to be
//! freed), and the block itself dies normally (evictable, still
//! matchable). See the rule at the top of `kv_cache.rs`.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use rustc_hash::FxHashMap;

use crate::error::{try_filled_vec, KvError, KvResult};
use crate::kv::block_pool::BlockId;

pub mod events;
mod invariants;

use events::EventLog;

/// A tree node: a cached block id (< num_blocks) or a root id (>= num_blocks).
pub type NodeId = u32;

const NIL: u32 = u32::MAX;

/// What inserting a full block found at its place in the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    /// The block is now a node under the given parent.
    Inserted,
    /// Equal tokens are already cached under this parent as another block.
    AlreadyCached(BlockId),
    /// Different tokens with the same hash are cached there: not cacheable.
    HashCollision,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queries: u64,
    pub query_tokens: u64,
    pub hit_tokens: u64,
    pub hit_blocks: u64,
    pub inserted_blocks: u64,
    pub evicted_blocks: u64,
    /// Nodes removed by `detach_live_children` (sliding window).
    pub detached_blocks: u64,
}

#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_size: usize,
    num_blocks: usize,
    cached: Vec<bool>,
    parent: Vec<NodeId>,
    edge_key: Vec<u64>,
    tokens: Vec<u32>,
    /// Indexed by node id; roots are appended past `num_blocks`.
    num_children: Vec<u32>,
    /// Cached block has a holder (its pool refcount is > 0).
    held: Vec<bool>,
    /// Children that are live (held, or with a live child themselves).
    live_children: Vec<u32>,
    /// Head of each node's child list (roots included), NIL when none.
    first_child: Vec<u32>,
    next_sibling: Vec<u32>,
    prev_sibling: Vec<u32>,
    /// Reused by subtree walks (no allocation once grown).
    walk_stack: Vec<BlockId>,
    /// Edge key (parent and child-token hash mixed) -> child block.
    edges: EdgeMap,
    lru_prev: Vec<u32>,
    lru_next: Vec<u32>,
    in_lru: Vec<bool>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    num_cached: usize,
    /// Salt -> root id. The unsalted root is `num_blocks` and always exists.
    salted_roots: FxHashMap<String, NodeId>,
    /// Salt of each salted root, by root index (None for the unsalted root
    /// and for recycled root ids), so dropping a root is O(1).
    root_salt: Vec<Option<String>>,
    root_users: Vec<u32>,
    free_root_ids: Vec<NodeId>,
    pub stats: PrefixCacheStats,
    /// Each cached block's [`events::chain_hash`] while the event log is on, else empty.
    block_hash: Vec<u64>,
    pub events: EventLog,
}

/// Hash of one block's tokens. Two independent multiply-rotate lanes over
/// 64-bit words keep the dependency chain short (this runs once per block on
/// every prefix lookup); collisions are caught by comparing tokens.
#[inline]
pub fn hash_block_tokens(tokens: &[u32]) -> u64 {
    const K1: u64 = 0x9e37_79b9_7f4a_7c15;
    const K2: u64 = 0xc2b2_ae3d_27d4_eb4f;
    let (mut a, mut b) = (0x243f_6a88_85a3_08d3u64, 0x1319_8a2e_0370_7344u64);
    let mut pairs = tokens.chunks_exact(4);
    for quad in &mut pairs {
        let w0 = quad[0] as u64 | (quad[1] as u64) << 32;
        let w1 = quad[2] as u64 | (quad[3] as u64) << 32;
        a = (a ^ w0).wrapping_mul(K1).rotate_left(29);
        b = (b ^ w1).wrapping_mul(K2).rotate_left(31);
    }
    for &t in pairs.remainder() {
        a = (a ^ t as u64).wrapping_mul(K1).rotate_left(29);
    }
    mix64(a ^ b.rotate_left(17) ^ tokens.len() as u64)
}

/// SplitMix64's finalizer: every output bit depends on every input bit.
#[inline]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The edge-map key of a child of `parent` whose tokens hash to `hash`.
#[inline]
fn edge_key(parent: NodeId, hash: u64) -> u64 {
    mix64(hash ^ (parent as u64).wrapping_mul(0xd6e8_feb8_6659_fd93))
}

/// The edge keys are already well mixed: hash them as they are.
#[derive(Default, Clone, Copy)]
struct PassThroughHasher(u64);

impl std::hash::Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 << 8) | byte as u64;
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

type EdgeMap = HashMap<u64, BlockId, BuildHasherDefault<PassThroughHasher>>;

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> KvResult<Self> {
        let token_slots = num_blocks.checked_mul(block_size).ok_or_else(|| {
            KvError::InvalidArgument(format!(
                "{num_blocks} blocks of {block_size} tokens overflow"
            ))
        })?;
        Ok(Self {
            block_size,
            num_blocks,
            cached: try_filled_vec(num_blocks, false, "the prefix cache")?,
            parent: try_filled_vec(num_blocks, NIL, "the prefix cache")?,
            edge_key: try_filled_vec(num_blocks, 0, "the prefix cache")?,
            tokens: try_filled_vec(token_slots, 0, "the prefix cache's tokens")?,
            num_children: try_filled_vec(num_blocks + 1, 0, "the prefix cache")?,
            held: try_filled_vec(num_blocks, false, "the prefix cache")?,
            live_children: try_filled_vec(num_blocks, 0, "the prefix cache")?,
            first_child: try_filled_vec(num_blocks + 1, NIL, "the prefix cache")?,
            next_sibling: try_filled_vec(num_blocks, NIL, "the prefix cache")?,
            prev_sibling: try_filled_vec(num_blocks, NIL, "the prefix cache")?,
            walk_stack: Vec::new(),
            edges: {
                let mut edges = EdgeMap::default();
                edges.try_reserve(num_blocks).map_err(|_| {
                    KvError::InvalidArgument(format!(
                        "cannot allocate the prefix cache for {num_blocks} blocks: out of memory"
                    ))
                })?;
                edges
            },
            lru_prev: try_filled_vec(num_blocks, NIL, "the LRU list")?,
            lru_next: try_filled_vec(num_blocks, NIL, "the LRU list")?,
            in_lru: try_filled_vec(num_blocks, false, "the LRU list")?,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            num_cached: 0,
            salted_roots: FxHashMap::default(),
            root_salt: vec![None],
            root_users: vec![0],
            free_root_ids: Vec::new(),
            stats: PrefixCacheStats::default(),
            block_hash: Vec::new(),
            events: EventLog::default(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of cached blocks (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Number of dead cached blocks (no holder, no live descendant): all of
    /// them can be evicted, leaves first.
    pub fn num_evictable(&self) -> usize {
        self.lru_len
    }

    #[inline]
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.cached.get(block as usize).copied().unwrap_or(false)
    }

    /// A cached block that is dead (on the LRU list), i.e. evictable.
    #[inline]
    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.in_lru.get(block as usize).copied().unwrap_or(false)
    }

    pub fn is_root(&self, node: NodeId) -> bool {
        node as usize >= self.num_blocks
    }

    pub fn unsalted_root(&self) -> NodeId {
        self.num_blocks as NodeId
    }

    /// The root for a salt, created on first use; the caller becomes one of
    /// its users and must `release_root` it.
    pub fn acquire_root(&mut self, salt: Option<&str>) -> NodeId {
        let root = match salt {
            None => self.unsalted_root(),
            Some(salt) => match self.salted_roots.get(salt) {
                Some(&root) => root,
                None => {
                    let root = match self.free_root_ids.pop() {
                        Some(id) => id,
                        None => {
                            self.num_children.push(0);
                            self.first_child.push(NIL);
                            self.root_users.push(0);
                            self.root_salt.push(None);
                            (self.num_children.len() - 1) as NodeId
                        }
                    };
                    self.salted_roots.insert(salt.to_owned(), root);
                    self.root_salt[root as usize - self.num_blocks] = Some(salt.to_owned());
                    root
                }
            },
        };
        self.root_users[root as usize - self.num_blocks] += 1;
        root
    }

    pub fn retain_root(&mut self, root: NodeId) {
        self.root_users[root as usize - self.num_blocks] += 1;
    }

    pub fn release_root(&mut self, root: NodeId) {
        let users = &mut self.root_users[root as usize - self.num_blocks];
        debug_assert!(*users > 0, "root {root} released more often than acquired");
        *users -= 1;
        self.maybe_drop_root(root);
    }

    fn maybe_drop_root(&mut self, root: NodeId) {
        let idx = root as usize - self.num_blocks;
        if root == self.unsalted_root()
            || self.root_users[idx] > 0
            || self.num_children[root as usize] > 0
        {
            return;
        }
        if let Some(salt) = self.root_salt[idx].take() {
            self.salted_roots.remove(&salt);
            self.free_root_ids.push(root);
        }
    }

    /// The cached child of `parent` holding exactly `chunk`, if any.
    #[inline]
    fn child(&self, parent: NodeId, chunk: &[u32]) -> Option<BlockId> {
        let child = *self
            .edges
            .get(&edge_key(parent, hash_block_tokens(chunk)))?;
        (self.parent[child as usize] == parent && self.block_tokens(child) == chunk)
            .then_some(child)
    }

    #[inline]
    fn block_tokens(&self, block: BlockId) -> &[u32] {
        let start = block as usize * self.block_size;
        &self.tokens[start..start + self.block_size]
    }

    /// The root of a salt if it exists (no sequence becomes its user).
    pub fn find_root(&self, salt: Option<&str>) -> Option<NodeId> {
        match salt {
            None => Some(self.unsalted_root()),
            Some(salt) => self.salted_roots.get(salt).copied(),
        }
    }

    /// Cached blocks of the longest cached prefix of `tokens` under `root`,
    /// without counting a query: the read-only walk of `longest_prefix`.
    pub fn walk<'a>(
        &'a self,
        root: NodeId,
        tokens: &'a [u32],
    ) -> impl Iterator<Item = BlockId> + 'a {
        let mut parent = root;
        tokens
            .chunks_exact(self.block_size)
            .map_while(move |chunk| {
                let block = self.child(parent, chunk)?;
                parent = block;
                Some(block)
            })
    }

    /// Longest cached prefix of `tokens` (whole blocks only) under `root`:
    /// pushes the blocks to `out`, returns how many. Never changes the tree;
    /// the caller pins the blocks (see `KvCacheManager::match_prefix`).
    pub fn longest_prefix(
        &mut self,
        root: NodeId,
        tokens: &[u32],
        out: &mut Vec<BlockId>,
    ) -> usize {
        let mut parent = root;
        let mut found = 0;
        for chunk in tokens.chunks_exact(self.block_size) {
            match self.child(parent, chunk) {
                Some(block) => {
                    out.push(block);
                    parent = block;
                    found += 1;
                }
                None => break,
            }
        }
        self.stats.queries += 1;
        self.stats.query_tokens += tokens.len() as u64;
        self.stats.hit_blocks += found as u64;
        self.stats.hit_tokens += (found * self.block_size) as u64;
        found
    }

    /// Cache a full, held block (refcount > 0) as the child of `parent`.
    /// The new node is live, so it keeps `parent` (and its path) alive.
    pub fn insert(&mut self, parent: NodeId, chunk: &[u32], block: BlockId) -> InsertOutcome {
        debug_assert_eq!(chunk.len(), self.block_size);
        debug_assert!(!self.cached[block as usize], "block {block} inserted twice");
        let key = edge_key(parent, hash_block_tokens(chunk));
        if let Some(&existing) = self.edges.get(&key) {
            return if self.parent[existing as usize] == parent
                && self.block_tokens(existing) == chunk
            {
                InsertOutcome::AlreadyCached(existing)
            } else {
                InsertOutcome::HashCollision
            };
        }
        let b = block as usize;
        self.edges.insert(key, block);
        self.cached[b] = true;
        self.held[b] = true;
        self.live_children[b] = 0;
        self.parent[b] = parent;
        self.edge_key[b] = key;
        self.tokens[b * self.block_size..(b + 1) * self.block_size].copy_from_slice(chunk);
        self.num_children[parent as usize] += 1;
        self.link_child(parent, block);
        self.num_cached += 1;
        self.stats.inserted_blocks += 1;
        self.add_live_child(parent);
        self.record_stored(parent, block);
        InsertOutcome::Inserted
    }

    #[inline]
    fn is_live(&self, block: BlockId) -> bool {
        self.held[block as usize] || self.live_children[block as usize] > 0
    }

    /// A cached block gained its first holder (refcount 0 -> 1). If it was
    /// dead it leaves the LRU list and revives its dead ancestors.
    pub fn on_held(&mut self, block: BlockId) {
        if !self.is_cached(block) || self.held[block as usize] {
            return;
        }
        let was_live = self.is_live(block);
        self.held[block as usize] = true;
        if !was_live {
            self.unlink_lru(block);
            self.add_live_child(self.parent[block as usize]);
        }
    }

    /// A cached block lost its last holder (refcount -> 0). Without live
    /// children it dies (enters the LRU list as the most recently used) and
    /// may take dead-to-be ancestors with it.
    pub fn on_unheld(&mut self, block: BlockId) {
        if !self.is_cached(block) || !self.held[block as usize] {
            return;
        }
        self.held[block as usize] = false;
        if !self.is_live(block) {
            self.push_lru(block);
            self.remove_live_child(self.parent[block as usize]);
        }
    }

    /// `node` has one more live child; revive it (and up the path) if it was dead.
    fn add_live_child(&mut self, mut node: NodeId) {
        while !self.is_root(node) {
            let was_live = self.is_live(node);
            self.live_children[node as usize] += 1;
            if was_live {
                return;
            }
            self.unlink_lru(node);
            node = self.parent[node as usize];
        }
    }

    /// `node` has one live child less; it dies (and up the path) if that
    /// was its last reason to live.
    fn remove_live_child(&mut self, mut node: NodeId) {
        while !self.is_root(node) {
            self.live_children[node as usize] -= 1;
            if self.is_live(node) {
                return;
            }
            self.push_lru(node);
            node = self.parent[node as usize];
        }
    }

    fn push_lru(&mut self, block: BlockId) {
        let b = block as usize;
        debug_assert!(self.cached[b] && !self.in_lru[b]);
        self.in_lru[b] = true;
        self.lru_prev[b] = self.lru_tail;
        self.lru_next[b] = NIL;
        if self.lru_tail != NIL {
            self.lru_next[self.lru_tail as usize] = block;
        } else {
            self.lru_head = block;
        }
        self.lru_tail = block;
        self.lru_len += 1;
    }

    fn unlink_lru(&mut self, block: BlockId) {
        let b = block as usize;
        if !self.in_lru[b] {
            return;
        }
        let (prev, next) = (self.lru_prev[b], self.lru_next[b]);
        if prev != NIL {
            self.lru_next[prev as usize] = next;
        } else {
            self.lru_head = next;
        }
        if next != NIL {
            self.lru_prev[next as usize] = prev;
        } else {
            self.lru_tail = prev;
        }
        self.in_lru[b] = false;
        self.lru_prev[b] = NIL;
        self.lru_next[b] = NIL;
        self.lru_len -= 1;
    }

    /// Remove the least recently used dead leaf from the tree and return its
    /// block (refcount 0 and now uncached: the caller frees it). The front is
    /// a leaf by construction; should that ever not hold, this is an
    /// invariant error, never a silent removal of a node with children.
    pub fn evict_one(&mut self) -> KvResult<Option<BlockId>> {
        let block = self.lru_head;
        if block == NIL {
            return Ok(None);
        }
        if self.num_children[block as usize] != 0 || self.is_live(block) {
            return Err(KvError::InvariantViolated(format!(
                "LRU front {block} is not a dead leaf"
            )));
        }
        self.unlink_lru(block);
        self.remove_node(block);
        self.stats.evicted_blocks += 1;
        Ok(Some(block))
    }

    /// Unlink a dead leaf. Its parent's live-children count is unchanged
    /// (the leaf was dead), and a parent is never removed before its children.
    fn remove_node(&mut self, block: BlockId) {
        let b = block as usize;
        self.record_removed(block);
        let parent = self.parent[b];
        self.edges.remove(&self.edge_key[b]);
        self.num_children[parent as usize] -= 1;
        self.unlink_child(parent, block);
        self.cached[b] = false;
        self.held[b] = false;
        self.live_children[b] = 0;
        self.parent[b] = NIL;
        self.num_cached -= 1;
        if self.is_root(parent) {
            self.maybe_drop_root(parent);
        }
    }

    /// Forget every cached block. Unheld ones (evictable, or kept alive by a
    /// held child) are pushed to `freed` (the caller returns them to the
    /// pool); held ones stay with their holders as plain, uncached blocks.
    pub fn clear(&mut self, freed: &mut Vec<BlockId>) {
        self.record_cleared();
        while let Some(block) = self.lru_head_block() {
            self.unlink_lru(block);
        }
        for b in 0..self.num_blocks {
            if self.cached[b] {
                if !self.held[b] {
                    freed.push(b as BlockId);
                }
                self.cached[b] = false;
                self.held[b] = false;
                self.live_children[b] = 0;
                self.parent[b] = NIL;
            }
        }
        self.edges.clear();
        self.num_children.iter_mut().for_each(|c| *c = 0);
        self.first_child.iter_mut().for_each(|c| *c = NIL);
        self.next_sibling.iter_mut().for_each(|c| *c = NIL);
        self.prev_sibling.iter_mut().for_each(|c| *c = NIL);
        self.num_cached = 0;
        let roots: Vec<NodeId> = self.salted_roots.values().copied().collect();
        for root in roots {
            self.maybe_drop_root(root);
        }
    }

    /// Put `child` at the head of `parent`'s child list.
    fn link_child(&mut self, parent: NodeId, child: BlockId) {
        let head = self.first_child[parent as usize];
        self.next_sibling[child as usize] = head;
        self.prev_sibling[child as usize] = NIL;
        if head != NIL {
            self.prev_sibling[head as usize] = child;
        }
        self.first_child[parent as usize] = child;
    }

    fn unlink_child(&mut self, parent: NodeId, child: BlockId) {
        let c = child as usize;
        let (prev, next) = (self.prev_sibling[c], self.next_sibling[c]);
        if prev != NIL {
            self.next_sibling[prev as usize] = next;
        } else {
            self.first_child[parent as usize] = next;
        }
        if next != NIL {
            self.prev_sibling[next as usize] = prev;
        }
        self.prev_sibling[c] = NIL;
        self.next_sibling[c] = NIL;
    }

    /// A cached block has a live child (so, unheld, it would be kept alive).
    #[inline]
    pub fn has_live_children(&self, block: BlockId) -> bool {
        self.is_cached(block) && self.live_children[block as usize] > 0
    }

    /// Remove the subtree of every live child of cached `block` from the
    /// tree (sliding window: `block` is losing its last holder and must not
    /// be kept alive by them). Held nodes of those subtrees stay with their
    /// holders as plain, uncached blocks; unheld ones (refcount 0, their KV
    /// unreachable once their ancestor is gone) are pushed to `freed` for
    /// the caller to return to the pool. `block` itself stays cached with
    /// its dead children; its liveness is unchanged (it is still held while
    /// this runs). O(size of the removed subtrees).
    pub fn detach_live_children(&mut self, block: BlockId, freed: &mut Vec<BlockId>) {
        debug_assert!(self.is_cached(block) && self.held[block as usize]);
        let mut child = self.first_child[block as usize];
        while child != NIL {
            let next = self.next_sibling[child as usize];
            if self.is_live(child) {
                self.live_children[block as usize] -= 1;
                self.num_children[block as usize] -= 1;
                self.unlink_child(block, child);
                self.remove_subtree(child, freed);
            }
            child = next;
        }
    }

    /// Forget `top` (already unlinked from its parent's list and counts)
    /// and every node below it.
    fn remove_subtree(&mut self, top: BlockId, freed: &mut Vec<BlockId>) {
        let mut stack = std::mem::take(&mut self.walk_stack);
        stack.clear();
        stack.push(top);
        while let Some(node) = stack.pop() {
            let n = node as usize;
            let mut child = self.first_child[n];
            while child != NIL {
                stack.push(child);
                child = self.next_sibling[child as usize];
            }
            self.record_removed(node);
            self.edges.remove(&self.edge_key[n]);
            self.unlink_lru(node);
            if !self.held[n] {
                freed.push(node);
            }
            self.cached[n] = false;
            self.held[n] = false;
            self.live_children[n] = 0;
            self.num_children[n] = 0;
            self.parent[n] = NIL;
            self.first_child[n] = NIL;
            self.next_sibling[n] = NIL;
            self.prev_sibling[n] = NIL;
            self.num_cached -= 1;
            self.stats.detached_blocks += 1;
        }
        self.walk_stack = stack;
    }

    fn lru_head_block(&self) -> Option<BlockId> {
        (self.lru_head != NIL).then_some(self.lru_head)
    }

    /// Blocks in LRU order, front (next to evict) first. For tests and checks.
    pub fn lru_order(&self) -> Vec<BlockId> {
        let mut order = Vec::with_capacity(self.lru_len);
        let mut cur = self.lru_head;
        while cur != NIL && order.len() <= self.lru_len {
            order.push(cur);
            cur = self.lru_next[cur as usize];
        }
        order
    }
}

#[cfg(test)]
#[path = "prefix_cache_tests.rs"]
mod tests;
