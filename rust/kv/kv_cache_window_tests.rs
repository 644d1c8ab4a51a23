//! Behaviour tests of `KvCacheManager` with a sliding window
//! (`kv_cache/sliding_window.rs`); the randomized windowed test is with the
//! others in `kv_cache_tests.rs`.

use crate::kv::kv_cache::{BlockCopy, KvCacheManager, SeqId};

fn append(kv: &mut KvCacheManager, seq: SeqId, n: usize) -> Vec<BlockCopy> {
    let mut copies = Vec::new();
    kv.allocate_slots(seq, n, &mut copies).unwrap();
    copies
}

/// Blocks `seq` still holds (its table less the dropped entries).
fn held(kv: &KvCacheManager, seq: SeqId) -> usize {
    kv.block_table(seq).unwrap().len() - kv.num_dropped_blocks(seq).unwrap()
}

#[test]
fn without_a_window_slide_changes_nothing() {
    let mut kv = KvCacheManager::new(8, 4, true).unwrap();
    assert_eq!(kv.sliding_window(), None);
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 30);
    assert_eq!(kv.slide_window(seq, 30).unwrap(), 0);
    assert_eq!(kv.num_dropped_blocks(seq).unwrap(), 0);
    assert_eq!(kv.out_of_window(1000), 0);
    assert!(KvCacheManager::new_with_window(8, 4, true, Some(0)).is_err());
}

#[test]
fn blocks_out_of_the_window_go_back_to_the_pool() {
    // W = 6, B = 4: at next query position N, blocks b with 4(b+1) <= N - 5 go.
    let mut kv = KvCacheManager::new_with_window(16, 4, false, Some(6)).unwrap();
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 12);
    let table = kv.block_table(seq).unwrap().to_vec();
    assert_eq!(kv.slide_window(seq, 8).unwrap(), 0, "query 8 reads 3..=8");
    assert_eq!(kv.slide_window(seq, 9).unwrap(), 1, "query 9 reads 4..=9");
    assert_eq!(kv.num_free_blocks(), 16 - 2);
    assert_eq!(kv.refcount(table[0]).unwrap(), 0);
    let dropped = kv.dropped_block();
    assert_eq!(dropped, 16, "the dropped entry is the scratch block id");
    assert_eq!(kv.block_table(seq).unwrap(), [dropped, table[1], table[2]]);
    assert!(kv.slot(seq, 3).is_err(), "a dropped position has no slot");
    assert_eq!(kv.slot(seq, 4).unwrap(), table[1] * 4);
    let mut slots = [0; 2];
    assert!(kv.write_slots(seq, 2, &mut slots).is_err());
    assert!(kv.record_written(seq, 0, 4).is_err());
    assert!(kv.slide_window(seq, 13).is_err(), "past the reserved slots");
    assert_eq!(
        kv.slide_window(seq, 12).unwrap(),
        0,
        "query 12 reads 7..=12"
    );
    assert_eq!(kv.slide_window(seq, 5).unwrap(), 0, "never backwards");
    kv.check_invariants().unwrap();
    // A long generation holds at most ceil((W - 1) / B) + 1 blocks.
    for n in 13..400 {
        append(&mut kv, seq, 1);
        kv.slide_window(seq, n).unwrap();
        assert!(held(&kv, seq) <= 3, "{} blocks held at {n}", held(&kv, seq));
    }
    kv.check_invariants().unwrap();
    kv.free_sequence(seq).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_free_blocks(), 16);
}

#[test]
fn a_window_of_one_may_drop_the_last_full_block() {
    let mut kv = KvCacheManager::new_with_window(4, 4, false, Some(1)).unwrap();
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 8);
    assert_eq!(kv.slide_window(seq, 8).unwrap(), 2);
    assert_eq!(held(&kv, seq), 0);
    append(&mut kv, seq, 1);
    assert_eq!(held(&kv, seq), 1);
    kv.check_invariants().unwrap();
    kv.free_sequence(seq).unwrap();
    assert_eq!(kv.num_free_blocks(), 4);
}

#[test]
fn forks_keep_their_own_references_to_blocks_out_of_the_window() {
    let mut kv = KvCacheManager::new_with_window(16, 4, false, Some(4)).unwrap();
    let parent = kv.create_sequence(None);
    append(&mut kv, parent, 10);
    let child = kv.fork(parent).unwrap();
    let first = kv.block_table(parent).unwrap()[0];
    assert_eq!(kv.slide_window(parent, 10).unwrap(), 1);
    assert_eq!(kv.refcount(first).unwrap(), 1, "the child still holds it");
    assert_eq!(kv.block_table(child).unwrap()[0], first);
    // A fork of a slid sequence shares its dropped entries, not its blocks.
    let grandchild = kv.fork(parent).unwrap();
    assert_eq!(kv.num_dropped_blocks(grandchild).unwrap(), 1);
    kv.check_invariants().unwrap();
    assert_eq!(kv.slide_window(child, 10).unwrap(), 1);
    assert_eq!(kv.refcount(first).unwrap(), 0);
    assert!(
        kv.num_free_blocks() == 16 - 2,
        "only the shared blocks 1 and 2 remain"
    );
    for seq in [parent, child, grandchild] {
        kv.free_sequence(seq).unwrap();
        kv.check_invariants().unwrap();
    }
    assert_eq!(kv.num_free_blocks(), 16);
}

#[test]
fn sliding_past_a_cached_prefix_detaches_what_it_would_pin() {
    // W = 5, B = 4. `a` caches 3 blocks, then slides past the first: block 0
    // loses its last holder while its child (block 1, held by `a`) is live,
    // so the tree drops blocks 1 and 2 (a keeps them, uncached) and keeps
    // block 0 as an evictable, matchable one-block prefix.
    let mut kv = KvCacheManager::new_with_window(16, 4, true, Some(5)).unwrap();
    let tokens: Vec<u32> = (0..12).collect();
    let a = kv.create_sequence(None);
    append(&mut kv, a, 12);
    assert_eq!(kv.cache_blocks(a, &tokens).unwrap(), 3);
    let table = kv.block_table(a).unwrap().to_vec();
    assert_eq!(kv.slide_window(a, 8).unwrap(), 1);
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_cached_blocks(), 1);
    assert_eq!(
        kv.num_referenced_blocks(),
        2,
        "no block is pinned by the tree"
    );
    assert_eq!(kv.prefix_cache_stats().detached_blocks, 2);
    assert_eq!(
        kv.cache_blocks(a, &tokens).unwrap(),
        0,
        "a slid: it caches no more"
    );
    let b = kv.create_sequence(None);
    assert_eq!(
        kv.match_prefix(b, &tokens).unwrap(),
        4,
        "only the intact block 0"
    );
    assert_eq!(kv.block_table(b).unwrap(), [table[0]]);
    for seq in [a, b] {
        kv.free_sequence(seq).unwrap();
        kv.check_invariants().unwrap();
    }
    assert_eq!(kv.num_referenced_blocks(), 0);
}

#[test]
fn a_prefix_stays_matchable_while_another_sequence_holds_its_window() {
    let mut kv = KvCacheManager::new_with_window(32, 4, true, Some(6)).unwrap();
    let tokens: Vec<u32> = (0..16).collect();
    let a = kv.create_sequence(None);
    append(&mut kv, a, 16);
    kv.cache_blocks(a, &tokens).unwrap();
    let b = kv.create_sequence(None);
    assert_eq!(kv.match_prefix(b, &tokens[..15]).unwrap(), 12);
    // `a` slides past blocks 0..3; `b` (within its first window) still
    // holds them, so nothing is detached and all stay matchable.
    append(&mut kv, a, 4);
    assert_eq!(kv.slide_window(a, 20).unwrap(), 3);
    kv.check_invariants().unwrap();
    assert_eq!(kv.prefix_cache_stats().detached_blocks, 0);
    let c = kv.create_sequence(None);
    assert_eq!(kv.match_prefix(c, &tokens[..15]).unwrap(), 12);
    // The last holders of block 2 go while its child (block 3) is still
    // held by the slid `a`: block 3 leaves the tree rather than pin 0..3,
    // and blocks 0..3 stay cached, evictable and matchable.
    kv.free_sequence(b).unwrap();
    kv.free_sequence(c).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.prefix_cache_stats().detached_blocks, 1);
    assert_eq!(kv.num_referenced_blocks(), held(&kv, a));
    assert_eq!(kv.num_cached_blocks(), 3);
    let d = kv.create_sequence(None);
    assert_eq!(kv.match_prefix(d, &tokens[..15]).unwrap(), 12);
    for seq in [a, d] {
        kv.free_sequence(seq).unwrap();
        kv.check_invariants().unwrap();
    }
    assert_eq!(kv.num_referenced_blocks(), 0);
}

#[test]
fn sliding_releases_pins_at_dropped_indices() {
    // `a` caches block [0..4); `p` computes the same block itself and pins
    // a's when it caches; sliding past index 0 releases both.
    let mut kv = KvCacheManager::new_with_window(16, 4, true, Some(3)).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let a = kv.create_sequence(None);
    append(&mut kv, a, 4);
    kv.cache_blocks(a, &tokens[..4]).unwrap();
    let p = kv.create_sequence(None);
    append(&mut kv, p, 8);
    kv.cache_blocks(p, &tokens).unwrap();
    let a0 = kv.block_table(a).unwrap()[0];
    assert_eq!(kv.refcount(a0).unwrap(), 2, "a and p's pin");
    kv.free_sequence(a).unwrap();
    assert_eq!(kv.slide_window(p, 8).unwrap(), 1);
    assert_eq!(kv.refcount(a0).unwrap(), 0);
    kv.check_invariants().unwrap();
    kv.free_sequence(p).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_referenced_blocks(), 0);
}
