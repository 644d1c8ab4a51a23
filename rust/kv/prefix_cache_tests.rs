//! Unit tests of the radix prefix cache.

use super::*;

fn chunk(start: u32, bs: usize) -> Vec<u32> {
    (start..start + bs as u32).collect()
}

#[test]
fn longest_prefix_stops_at_first_mismatch() {
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    assert_eq!(cache.insert(root, &chunk(0, 4), 3), InsertOutcome::Inserted);
    assert_eq!(cache.insert(3, &chunk(4, 4), 5), InsertOutcome::Inserted);
    let mut out = Vec::new();
    let tokens: Vec<u32> = (0..8).chain([99, 98, 97, 96]).collect();
    assert_eq!(cache.longest_prefix(root, &tokens, &mut out), 2);
    assert_eq!(out, vec![3, 5]);
    out.clear();
    assert_eq!(
        cache.longest_prefix(root, &[0, 1, 2], &mut out),
        0,
        "partial blocks never match"
    );
}

#[test]
fn salts_do_not_share() {
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let a = cache.acquire_root(Some("tenant-a"));
    let b = cache.acquire_root(Some("tenant-b"));
    assert_ne!(a, b);
    cache.insert(a, &chunk(0, 4), 1);
    let mut out = Vec::new();
    assert_eq!(cache.longest_prefix(b, &chunk(0, 4), &mut out), 0);
    assert_eq!(cache.longest_prefix(a, &chunk(0, 4), &mut out), 1);
    assert_eq!(
        cache.acquire_root(Some("tenant-a")),
        a,
        "equal salts share a root"
    );
}

#[test]
fn duplicate_insert_reports_the_cached_block() {
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    cache.insert(root, &chunk(0, 4), 1);
    assert_eq!(
        cache.insert(root, &chunk(0, 4), 2),
        InsertOutcome::AlreadyCached(1)
    );
}

#[test]
fn eviction_takes_lru_leaf_and_then_its_parent() {
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    cache.insert(root, &chunk(0, 4), 1);
    cache.insert(1, &chunk(4, 4), 2);
    cache.insert(root, &chunk(100, 4), 3);
    // Released deepest first: 2, 1, then an unrelated 3.
    cache.on_unheld(2);
    cache.on_unheld(1);
    cache.on_unheld(3);
    cache.check_invariants(|_| 0).unwrap();
    assert_eq!(cache.evict_one(), Ok(Some(2)));
    assert_eq!(cache.evict_one(), Ok(Some(1)));
    assert_eq!(cache.evict_one(), Ok(Some(3)));
    assert_eq!(cache.evict_one(), Ok(None));
    assert_eq!(cache.num_cached(), 0);
}

#[test]
fn unused_salted_root_is_recycled() {
    let mut cache = PrefixCache::new(4, 2).unwrap();
    let a = cache.acquire_root(Some("a"));
    cache.release_root(a);
    let b = cache.acquire_root(Some("b"));
    assert_eq!(a, b, "root id of an unused salt is reused");
    assert_ne!(
        cache.acquire_root(Some("a")),
        b,
        "but never shared by two live salts"
    );
}

#[test]
fn a_held_child_keeps_its_unheld_parent_alive() {
    // Regression (issue 13): a parent whose holders are gone but whose
    // child is still held must not be evictable, or its id could be
    // recycled under the child and serve a wrong prefix.
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    cache.insert(root, &chunk(0, 4), 0);
    cache.insert(0, &chunk(4, 4), 2);
    let mut refcount = [0u32; 8];
    refcount[2] = 1;
    cache.on_unheld(0);
    cache.check_invariants(|b| refcount[b as usize]).unwrap();
    assert_eq!(
        cache.num_evictable(),
        0,
        "the parent lives through its child"
    );
    assert_eq!(cache.evict_one(), Ok(None));
    refcount[2] = 0;
    cache.on_unheld(2);
    cache.check_invariants(|b| refcount[b as usize]).unwrap();
    assert_eq!(
        cache.lru_order(),
        vec![2, 0],
        "child dies first, then its parent"
    );
    cache.on_held(2);
    refcount[2] = 1;
    cache.check_invariants(|b| refcount[b as usize]).unwrap();
    assert_eq!(
        cache.num_evictable(),
        0,
        "holding the child revives the parent"
    );
}

#[test]
fn dropping_a_salted_root_forgets_only_its_salt() {
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let roots: Vec<NodeId> = (0..100)
        .map(|i| cache.acquire_root(Some(&format!("t{i}"))))
        .collect();
    cache.insert(roots[7], &chunk(0, 4), 1);
    cache.release_root(roots[7]);
    cache.check_invariants(|_| 1).unwrap();
    cache.on_unheld(1);
    assert_eq!(cache.evict_one(), Ok(Some(1)));
    cache.check_invariants(|_| 0).unwrap();
    assert_eq!(
        cache.acquire_root(Some("t8")),
        roots[8],
        "other salts keep their roots"
    );
    let reused = cache.acquire_root(Some("new"));
    assert_eq!(reused, roots[7], "the dropped root id is recycled");
    cache.check_invariants(|_| 0).unwrap();
}

#[test]
fn detach_live_children_removes_only_the_live_subtrees() {
    // root - 0 - 1 - 2      (1 and 2 held: a slid sequence's blocks)
    //          \ 3 - 4      (3 dead, 4 dead: a finished branch)
    //          \ 5          (held)
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    let mut refcount = [0u32; 8];
    for (parent, start, block) in [
        (root, 0, 0),
        (0, 4, 1),
        (1, 8, 2),
        (0, 40, 3),
        (3, 44, 4),
        (0, 80, 5),
    ] {
        assert_eq!(
            cache.insert(parent, &chunk(start, 4), block),
            InsertOutcome::Inserted
        );
        refcount[block as usize] = 1;
    }
    for block in [4, 3] {
        refcount[block] = 0;
        cache.on_unheld(block as BlockId);
    }
    cache.check_invariants(|b| refcount[b as usize]).unwrap();
    assert!(cache.has_live_children(0));
    // Block 0 is losing its last holder: its live children 1 and 5 go.
    let mut freed = Vec::new();
    cache.detach_live_children(0, &mut freed);
    assert!(
        freed.is_empty(),
        "1, 2 and 5 are held: they stay with their holders"
    );
    assert!(!cache.has_live_children(0));
    refcount[0] = 0;
    cache.on_unheld(0);
    cache.check_invariants(|b| refcount[b as usize]).unwrap();
    assert_eq!(cache.num_cached(), 3, "0 and its dead branch 3 - 4 stay");
    assert!(!cache.is_cached(1) && !cache.is_cached(2) && !cache.is_cached(5));
    assert_eq!(cache.num_evictable(), 3);
    assert_eq!(cache.stats.detached_blocks, 3);
    let mut out = Vec::new();
    let tokens: Vec<u32> = (0..12).collect();
    assert_eq!(cache.longest_prefix(root, &tokens, &mut out), 1);
    // A subtree's unheld nodes come back to be freed.
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    cache.insert(root, &chunk(0, 4), 0);
    cache.insert(0, &chunk(4, 4), 1);
    cache.insert(1, &chunk(8, 4), 2);
    cache.insert(1, &chunk(50, 4), 6);
    cache.on_unheld(6);
    cache.on_unheld(1);
    let mut freed = Vec::new();
    cache.detach_live_children(0, &mut freed);
    freed.sort_unstable();
    assert_eq!(freed, vec![1, 6], "the unheld nodes under the live child 1");
    cache.on_unheld(0);
    cache.check_invariants(|b| u32::from(b == 2)).unwrap();
    assert_eq!(cache.num_cached(), 1);
}

#[test]
fn a_router_hashes_a_prompt_as_the_tree_does() {
    use super::events::prefix_block_hashes;
    let mut cache = PrefixCache::new(8, 4).unwrap();
    let root = cache.acquire_root(None);
    cache.insert(root, &chunk(0, 4), 1);
    cache.insert(1, &chunk(4, 4), 2);
    let salted = cache.acquire_root(Some("s"));
    cache.insert(salted, &chunk(0, 4), 3);
    let mut held = cache.cached_block_hashes();
    held.sort_unstable();
    let prompt: Vec<u32> = (0..10).collect(); // two full blocks and a partial one
    let mut want = prefix_block_hashes(&prompt, 4, None);
    assert_eq!(want.len(), 2);
    want.extend(prefix_block_hashes(&prompt[..4], 4, Some("s")));
    want.sort_unstable();
    assert_eq!(held, want);
    // A different first block changes every hash after it.
    let other: Vec<u32> = (100..104).chain(4..8).collect();
    let other = prefix_block_hashes(&other, 4, None);
    assert!(!held.contains(&other[1]));
}
