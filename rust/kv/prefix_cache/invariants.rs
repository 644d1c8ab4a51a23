//! `PrefixCache::check_invariants`: every invariant of the module docs of
//! `prefix_cache.rs`, checked in debug builds and tests.

use super::{NodeId, PrefixCache, NIL};
use crate::error::{KvError, KvResult};
use crate::kv::block_pool::BlockId;

impl PrefixCache {
    /// Check the tree, liveness and LRU invariants against the pool's
    /// refcounts, O(num_blocks + salts). Liveness is checked locally (each
    /// node's live-children count against its children), which by
    /// induction from the leaves proves it globally.
    pub fn check_invariants(&self, refcount: impl Fn(BlockId) -> u32) -> KvResult<()> {
        let fail = |msg: String| Err(KvError::InvariantViolated(msg));
        let mut children = vec![0u32; self.num_children.len()];
        let mut live_children = vec![0u32; self.num_blocks];
        let mut cached = 0;
        for b in 0..self.num_blocks {
            if !self.cached[b] {
                if self.in_lru[b]
                    || self.held[b]
                    || self.live_children[b] != 0
                    || self.first_child[b] != NIL
                {
                    return fail(format!("uncached block {b} has cache state"));
                }
                continue;
            }
            cached += 1;
            let parent = self.parent[b];
            if parent as usize >= self.num_children.len()
                || !(self.is_root(parent) || self.cached[parent as usize])
            {
                return fail(format!("cached block {b} has uncached parent {parent}"));
            }
            children[parent as usize] += 1;
            if self.edges.get(&self.edge_key[b]) != Some(&(b as BlockId)) {
                return fail(format!("cached block {b} is missing from the edge map"));
            }
            let count = refcount(b as BlockId);
            if (count > 0) != self.held[b] {
                return fail(format!(
                    "cached block {b}: refcount {count} but held flag {}",
                    self.held[b]
                ));
            }
            let live = self.is_live(b as BlockId);
            if live == self.in_lru[b] {
                return fail(format!(
                    "cached block {b}: live {live} but on LRU list: {}",
                    self.in_lru[b]
                ));
            }
            if live && !self.is_root(parent) {
                live_children[parent as usize] += 1;
                if self.in_lru[parent as usize] {
                    return fail(format!(
                        "block {b} is in use but its parent {parent} is evictable"
                    ));
                }
            }
        }
        if cached != self.num_cached || self.edges.len() != cached {
            return fail(format!(
                "cached count {} / edges {} disagree with {cached} cached blocks",
                self.num_cached,
                self.edges.len()
            ));
        }
        if children != self.num_children {
            return fail("child counts disagree with the tree".to_owned());
        }
        for node in 0..self.num_children.len() {
            let (mut child, mut listed, mut prev) = (self.first_child[node], 0u32, NIL);
            while child != NIL && listed <= self.num_children[node] {
                let c = child as usize;
                if !self.cached[c]
                    || self.parent[c] as usize != node
                    || self.prev_sibling[c] != prev
                {
                    return fail(format!(
                        "child list of node {node} holds stray block {child}"
                    ));
                }
                listed += 1;
                prev = child;
                child = self.next_sibling[c];
            }
            if listed != self.num_children[node] {
                return fail(format!(
                    "node {node} lists {listed} children but counts {}",
                    self.num_children[node]
                ));
            }
        }
        if live_children != self.live_children {
            return fail("live-child counts disagree with the tree".to_owned());
        }
        let order = self.lru_order();
        if order.len() != self.lru_len {
            return fail(format!(
                "LRU length {} but {} linked",
                self.lru_len,
                order.len()
            ));
        }
        let mut position = vec![usize::MAX; self.num_blocks];
        for (i, &block) in order.iter().enumerate() {
            position[block as usize] = i;
        }
        for b in (0..self.num_blocks).filter(|&b| self.in_lru[b]) {
            let parent = self.parent[b];
            if !self.is_root(parent) && position[parent as usize] < position[b] {
                return fail(format!("LRU lists parent {parent} before its child {b}"));
            }
        }
        if let Some(&front) = order.first() {
            if self.num_children[front as usize] != 0 {
                return fail(format!("LRU front {front} is not a leaf"));
            }
        }
        for (idx, salt) in self.root_salt.iter().enumerate() {
            let root = (self.num_blocks + idx) as NodeId;
            let mapped = salt.as_ref().and_then(|s| self.salted_roots.get(s));
            if salt.is_some() && mapped != Some(&root) {
                return fail(format!("salted root {root} is not mapped from its salt"));
            }
        }
        if self.salted_roots.len() != self.root_salt.iter().flatten().count() {
            return fail("salt map and root salts disagree".to_owned());
        }
        Ok(())
    }
}
