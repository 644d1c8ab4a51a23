//! Behaviour tests of `KvCacheManager`, plus a seeded randomized test that
//! runs random public-API operations against a simulated device whose slots
//! store context hashes, and checks every invariant after each one
//! (`KVPAGE_SEED` replays a seed, `KVPAGE_SOAK=1` runs far longer).

use crate::error::KvError;
use crate::kv::kv_cache::{BlockCopy, KvCacheManager, SeqId};
use crate::kv::prefix_cache::events::EventReplay;
use crate::test_rng::SplitMix64;

fn append(kv: &mut KvCacheManager, seq: SeqId, n: usize) -> Vec<BlockCopy> {
    let mut copies = Vec::new();
    kv.allocate_slots(seq, n, &mut copies).unwrap();
    copies
}

#[test]
fn position_maps_to_block_and_offset() {
    let mut kv = KvCacheManager::new(64, 16, false).unwrap();
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 40);
    let table = kv.block_table(seq).unwrap().to_vec();
    assert_eq!(table.len(), 3);
    assert_eq!(kv.slot(seq, 37).unwrap(), table[2] * 16 + 5);
    let mut slots = vec![0; 40];
    kv.write_slots(seq, 0, &mut slots).unwrap();
    assert_eq!(slots[37], (table[2] * 16 + 5) as i32);
    assert!(
        kv.slot(seq, 40).is_err(),
        "positions past the table have no slot"
    );
}

#[test]
fn append_allocates_only_when_last_block_is_full() {
    let mut kv = KvCacheManager::new(8, 4, false).unwrap();
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 3);
    assert_eq!(kv.num_free_blocks(), 7);
    append(&mut kv, seq, 1);
    assert_eq!(kv.num_free_blocks(), 7, "the 4th token fills block 0");
    append(&mut kv, seq, 1);
    assert_eq!(kv.num_free_blocks(), 6);
    kv.check_invariants().unwrap();
}

#[test]
fn failed_allocation_changes_nothing() {
    let mut kv = KvCacheManager::new(8, 4, false).unwrap();
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 6);
    let other = kv.create_sequence(None);
    append(&mut kv, other, 16);
    let mut copies = Vec::new();
    let err = kv.allocate_slots(seq, 20, &mut copies).unwrap_err();
    assert_eq!(
        err,
        KvError::OutOfBlocks {
            requested: 5,
            available: 2
        }
    );
    assert_eq!(kv.num_tokens(seq).unwrap(), 6);
    assert_eq!(kv.num_free_blocks(), 2);
    // A length that would wrap around is refused, not wrapped.
    let err = kv
        .allocate_slots(seq, usize::MAX - 3, &mut copies)
        .unwrap_err();
    assert!(matches!(
        err,
        KvError::OutOfBlocks {
            requested: usize::MAX,
            ..
        }
    ));
    assert_eq!(kv.num_tokens(seq).unwrap(), 6);
    assert!(copies.is_empty());
    kv.check_invariants().unwrap();
}

#[test]
fn fork_shares_blocks_and_copies_partial_block_on_first_write() {
    let mut kv = KvCacheManager::new(16, 4, false).unwrap();
    let parent = kv.create_sequence(None);
    append(&mut kv, parent, 6); // block 0 full, block 1 holds 2 of 4
    let child = kv.fork(parent).unwrap();
    assert_eq!(kv.num_free_blocks(), 14, "fork allocates nothing");
    let shared = kv.block_table(parent).unwrap().to_vec();
    assert_eq!(kv.block_table(child).unwrap(), &shared[..]);
    assert_eq!(kv.refcount(shared[0]).unwrap(), 2);
    kv.check_invariants().unwrap();

    let copies = append(&mut kv, child, 1);
    let new_last = kv.block_table(child).unwrap()[1];
    assert_eq!(
        copies,
        vec![BlockCopy {
            src: shared[1],
            dst: new_last
        }]
    );
    assert_eq!(
        kv.block_table(child).unwrap()[0],
        shared[0],
        "full blocks are never copied"
    );
    // The parent now owns its partial block alone: no copy on its write.
    assert!(append(&mut kv, parent, 1).is_empty());
    kv.check_invariants().unwrap();
}

#[test]
fn blocks_return_to_pool_only_when_last_holder_frees() {
    let mut kv = KvCacheManager::new(8, 4, false).unwrap();
    let parent = kv.create_sequence(None);
    append(&mut kv, parent, 8);
    let child = kv.fork(parent).unwrap();
    kv.free_sequence(parent).unwrap();
    assert_eq!(kv.num_free_blocks(), 6);
    kv.free_sequence(child).unwrap();
    assert_eq!(kv.num_free_blocks(), 8);
    assert!(matches!(
        kv.free_sequence(child),
        Err(KvError::UnknownSequence { .. })
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn seeds_example_sixteen_conversations_share_thirteen_blocks() {
    // 16 conversations with a 200-token system prompt at block 16: forking
    // one prefilled prompt shares ceil(200 / 16) = 13 blocks instead of 208.
    let mut kv = KvCacheManager::new(256, 16, false).unwrap();
    let prompt = kv.create_sequence(None);
    append(&mut kv, prompt, 200);
    let children: Vec<SeqId> = (0..15).map(|_| kv.fork(prompt).unwrap()).collect();
    assert_eq!(kv.num_referenced_blocks(), 13);
    assert_eq!(children.len() + 1, 16);
    kv.check_invariants().unwrap();
}

#[test]
fn prefix_cache_shares_full_blocks_between_requests() {
    let mut kv = KvCacheManager::new(64, 16, true).unwrap();
    let system: Vec<u32> = (0..200).collect();
    let first = kv.create_sequence(None);
    append(&mut kv, first, 200);
    assert_eq!(
        kv.cache_blocks(first, &system).unwrap(),
        12,
        "only full blocks are cached"
    );
    for _ in 0..15 {
        let seq = kv.create_sequence(None);
        assert_eq!(kv.match_prefix(seq, &system[..199]).unwrap(), 192);
        append(&mut kv, seq, 8);
    }
    // 12 shared full blocks + 16 private partial blocks.
    assert_eq!(kv.num_referenced_blocks(), 12 + 16);
    kv.check_invariants().unwrap();
}

#[test]
fn different_salts_never_share_blocks() {
    let mut kv = KvCacheManager::new(32, 4, true).unwrap();
    let tokens: Vec<u32> = (0..12).collect();
    let a = kv.create_sequence(Some("tenant-a"));
    append(&mut kv, a, 12);
    kv.cache_blocks(a, &tokens).unwrap();
    let b = kv.create_sequence(Some("tenant-b"));
    assert_eq!(kv.match_prefix(b, &tokens).unwrap(), 0);
    let a2 = kv.create_sequence(Some("tenant-a"));
    assert_eq!(kv.match_prefix(a2, &tokens).unwrap(), 12);
    kv.check_invariants().unwrap();
}

#[test]
fn unreferenced_cached_blocks_are_reused_then_evicted_lru_first() {
    let mut kv = KvCacheManager::new(6, 4, true).unwrap();
    let old: Vec<u32> = (100..108).collect();
    let recent: Vec<u32> = (200..208).collect();
    for tokens in [&old, &recent] {
        let seq = kv.create_sequence(None);
        append(&mut kv, seq, 8);
        kv.cache_blocks(seq, tokens).unwrap();
        kv.free_sequence(seq).unwrap();
    }
    assert_eq!(kv.num_free_blocks(), 2);
    assert_eq!(kv.num_available_blocks(), 6);
    // Needing 3 blocks evicts one: the leaf of the least recently used prompt.
    let seq = kv.create_sequence(None);
    append(&mut kv, seq, 12);
    assert_eq!(kv.prefix_cache_stats().evicted_blocks, 1);
    let probe = kv.create_sequence(None);
    assert_eq!(
        kv.match_prefix(probe, &recent).unwrap(),
        8,
        "recent prompt survives"
    );
    let probe2 = kv.create_sequence(None);
    assert_eq!(
        kv.match_prefix(probe2, &old).unwrap(),
        4,
        "old prompt lost its leaf"
    );
    kv.check_invariants().unwrap();
}

#[test]
fn duplicate_block_is_pinned_and_path_continues() {
    let mut kv = KvCacheManager::new(16, 4, true).unwrap();
    let tokens: Vec<u32> = (0..12).collect();
    let a = kv.create_sequence(None);
    let b = kv.create_sequence(None);
    append(&mut kv, a, 4);
    append(&mut kv, b, 4);
    kv.cache_blocks(a, &tokens[..4]).unwrap();
    assert_eq!(
        kv.cache_blocks(b, &tokens[..4]).unwrap(),
        0,
        "b's block duplicates a's"
    );
    append(&mut kv, b, 8);
    assert_eq!(
        kv.cache_blocks(b, &tokens).unwrap(),
        2,
        "b's later blocks extend a's path"
    );
    kv.free_sequence(a).unwrap();
    kv.check_invariants().unwrap();
    let c = kv.create_sequence(None);
    assert_eq!(kv.match_prefix(c, &tokens).unwrap(), 12);
    kv.free_sequence(b).unwrap();
    kv.free_sequence(c).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_referenced_blocks(), 0);
}

#[test]
fn reset_prefix_cache_frees_unreferenced_and_stops_caching_live() {
    let mut kv = KvCacheManager::new(8, 4, true).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let a = kv.create_sequence(None);
    append(&mut kv, a, 8);
    kv.cache_blocks(a, &tokens).unwrap();
    let b = kv.create_sequence(None);
    append(&mut kv, b, 4);
    kv.cache_blocks(b, &[9, 9, 9, 9]).unwrap();
    kv.free_sequence(b).unwrap();
    kv.reset_prefix_cache().unwrap();
    assert_eq!(kv.num_cached_blocks(), 0);
    assert_eq!(kv.num_free_blocks(), 6);
    kv.check_invariants().unwrap();
    let c = kv.create_sequence(None);
    assert_eq!(kv.match_prefix(c, &tokens).unwrap(), 0);
    kv.free_sequence(a).unwrap();
    assert_eq!(kv.num_free_blocks(), 8);
    kv.check_invariants().unwrap();
}

/// One live sequence of the randomized test: its salt and tokens. What the
/// simulated device must read back at position `p` is the hash of the salt
/// and of tokens `0..=p` (its whole context, not just its token), so a slot
/// computed under another prefix is caught even when the tokens agree.
struct SimSeq {
    id: SeqId,
    salt: usize,
    tokens: Vec<u32>,
}

const GARBAGE: u64 = u64::MAX;
const SALTS: [Option<&str>; 3] = [None, Some("a"), Some("b")];

/// Context hash of a position, chained from the previous one.
fn context_hash(previous: u64, token: u32) -> u64 {
    crate::kv::prefix_cache::hash_block_tokens(&[previous as u32, (previous >> 32) as u32, token])
}

fn context_hashes(salt: usize, tokens: &[u32]) -> Vec<u64> {
    let mut h = salt as u64;
    tokens
        .iter()
        .map(|&t| {
            h = context_hash(h, t);
            h
        })
        .collect()
}

struct Sim {
    kv: KvCacheManager,
    window: Option<usize>,
    slid: usize,
    device: Vec<u64>,
    seqs: Vec<SimSeq>,
    rng: SplitMix64,
    block_size: usize,
    copies: usize,
    failed_allocations: usize,
    /// The cached blocks as a router replaying the KV events sees them.
    replayed: EventReplay,
}

impl Sim {
    fn new(seed: u64, num_blocks: usize, block_size: usize) -> Self {
        Self::new_with_window(seed, num_blocks, block_size, None)
    }

    fn new_with_window(
        seed: u64,
        num_blocks: usize,
        block_size: usize,
        window: Option<u32>,
    ) -> Self {
        let mut kv = KvCacheManager::new_with_window(num_blocks, block_size, true, window).unwrap();
        kv.set_kv_events_enabled(true);
        Self {
            kv,
            window: window.map(|w| w as usize),
            slid: 0,
            device: vec![GARBAGE; num_blocks * block_size],
            seqs: Vec::new(),
            rng: SplitMix64::new(seed),
            block_size,
            copies: 0,
            failed_allocations: 0,
            replayed: EventReplay::default(),
        }
    }

    /// Replay the events since the last call against the cached blocks.
    fn check_events(&mut self) {
        let events = self.kv.take_kv_events();
        self.replayed.apply(events);
        let logged = self.kv.logged_block_hashes();
        let mut walked = self.kv.cached_block_hashes();
        walked.sort_unstable();
        let mut sorted = logged.clone();
        sorted.sort_unstable();
        assert_eq!(walked, sorted, "the tree walk's hashes != the event log's");
        self.replayed.assert_holds(logged);
    }

    /// Tokens from a tiny alphabet, so prompts often share prefixes.
    fn random_tokens(&mut self, n: usize) -> Vec<u32> {
        let base = self.rng.below(3) as u32;
        (0..n)
            .map(|i| {
                if self.rng.chance(9, 10) {
                    base + (i as u32 % 5)
                } else {
                    7
                }
            })
            .collect()
    }

    /// Grow `seq` by `new` tokens as the runner would: run copies, write
    /// K/V (context hashes); sometimes cache the full blocks at once,
    /// sometimes leave that to a later `cache` operation (after forks).
    fn grow(&mut self, index: usize, new: &[u32]) -> bool {
        let id = self.seqs[index].id;
        let start = self.kv.num_tokens(id).unwrap();
        let mut copies = Vec::new();
        if self.kv.allocate_slots(id, new.len(), &mut copies).is_err() {
            self.failed_allocations += 1;
            return false;
        }
        self.copies += copies.len();
        let bs = self.block_size;
        for copy in copies {
            let (src, dst) = (copy.src as usize * bs, copy.dst as usize * bs);
            self.device.copy_within(src..src + bs, dst);
        }
        self.seqs[index].tokens.extend_from_slice(new);
        let hashes = context_hashes(self.seqs[index].salt, &self.seqs[index].tokens);
        for (pos, &hash) in hashes.iter().enumerate().skip(start) {
            let slot = self.kv.slot(id, pos).unwrap() as usize;
            self.device[slot] = hash;
        }
        self.kv.record_written(id, start, hashes.len()).unwrap();
        // With a window, usually slide to the new length as the scheduler
        // does, before or after caching (caching first, then sliding past
        // what was just cached, exercises the detach rule).
        let slide = self.window.is_some() && self.rng.chance(3, 4);
        let slide_first = self.rng.chance(1, 2);
        if slide && slide_first {
            self.slide(index, hashes.len());
        }
        if self.rng.chance(1, 2) {
            self.cache(index);
        }
        if slide && !slide_first {
            self.slide(index, hashes.len());
        }
        true
    }

    fn slide(&mut self, index: usize, next_pos: usize) {
        let id = self.seqs[index].id;
        let before = self.kv.num_dropped_blocks(id).unwrap();
        let dropped = self.kv.slide_window(id, next_pos).unwrap();
        let after = self.kv.num_dropped_blocks(id).unwrap();
        assert_eq!(after, before + dropped);
        assert_eq!(after, before.max(self.kv.out_of_window(next_pos)));
        self.slid += dropped;
    }

    fn cache(&mut self, index: usize) {
        let tokens = self.seqs[index].tokens.clone();
        self.kv.cache_blocks(self.seqs[index].id, &tokens).unwrap();
    }

    fn step(&mut self) {
        let ops = if self.window.is_some() { 116 } else { 110 };
        match self.rng.below(ops) {
            0..=19 => {
                let salt = self.rng.below(SALTS.len());
                let id = self.kv.create_sequence(SALTS[salt]);
                let len = 1 + self.rng.below(4 * self.block_size);
                let prompt = self.random_tokens(len);
                let matched = self.kv.match_prefix(id, &prompt[..len - 1]).unwrap();
                assert_eq!(matched % self.block_size, 0);
                self.seqs.push(SimSeq {
                    id,
                    salt,
                    tokens: prompt[..matched].to_vec(),
                });
                let last = self.seqs.len() - 1;
                // What a prefix hit attaches must be KV of this very prefix.
                self.verify_seq(last);
                if !self.grow(last, &prompt[matched..]) {
                    let seq = self.seqs.pop().unwrap();
                    self.kv.free_sequence(seq.id).unwrap();
                }
            }
            20..=59 if !self.seqs.is_empty() => {
                let index = self.rng.below(self.seqs.len());
                let n = 1 + self.rng.below(self.block_size + 2);
                let new = self.random_tokens(n);
                self.grow(index, &new);
            }
            60..=69 if !self.seqs.is_empty() => {
                let index = self.rng.below(self.seqs.len());
                let child = self.kv.fork(self.seqs[index].id).unwrap();
                let (salt, tokens) = (self.seqs[index].salt, self.seqs[index].tokens.clone());
                self.seqs.push(SimSeq {
                    id: child,
                    salt,
                    tokens,
                });
            }
            70..=94 if !self.seqs.is_empty() => {
                let index = self.rng.below(self.seqs.len());
                let seq = self.seqs.swap_remove(index);
                self.kv.free_sequence(seq.id).unwrap();
            }
            95..=98 => {
                let n = self.rng.below(4);
                self.kv.evict(n).unwrap();
            }
            99 if self.rng.chance(1, 10) => self.kv.reset_prefix_cache().unwrap(),
            100..=109 if !self.seqs.is_empty() => {
                let index = self.rng.below(self.seqs.len());
                self.cache(index);
            }
            110..=115 if !self.seqs.is_empty() => {
                // A slide to any position up to the length (e.g. a prefill
                // chunk computed short of the reserved slots).
                let index = self.rng.below(self.seqs.len());
                let len = self.seqs[index].tokens.len();
                let next_pos = self.rng.below(len + 1);
                self.slide(index, next_pos);
            }
            _ => {}
        }
    }

    fn verify_seq(&self, index: usize) {
        let seq = &self.seqs[index];
        assert_eq!(self.kv.num_tokens(seq.id).unwrap(), seq.tokens.len());
        // Positions in dropped blocks have no slot; every other one must
        // still read its own context's KV.
        let kept_from = self.kv.num_dropped_blocks(seq.id).unwrap() * self.block_size;
        if kept_from > 0 {
            assert!(self.kv.slot(seq.id, kept_from - 1).is_err());
        }
        for (pos, hash) in context_hashes(seq.salt, &seq.tokens)
            .into_iter()
            .enumerate()
            .skip(kept_from)
        {
            let slot = self.kv.slot(seq.id, pos).unwrap() as usize;
            assert_eq!(
                self.device[slot], hash,
                "seq {} position {pos} reads KV of another context",
                seq.id
            );
        }
    }

    fn verify(&self) {
        self.kv.check_invariants().unwrap();
        for index in 0..self.seqs.len() {
            self.verify_seq(index);
        }
    }
}

/// Ops per round: a few seconds in CI, far longer with `KVPAGE_SOAK=1`.
fn random_ops() -> usize {
    if std::env::var_os("KVPAGE_SOAK").is_some() {
        2_000_000
    } else {
        60_000
    }
}

#[test]
fn randomized_operations_keep_every_invariant() {
    let seed = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    for (round, num_blocks) in [(0u64, 24usize), (1, 64), (2, 12)] {
        let seed = seed + round;
        let mut sim = Sim::new(seed, num_blocks, 4);
        for op in 0..random_ops() {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                sim.step();
                sim.verify();
                sim.check_events();
            }));
            if let Err(panic) = result {
                eprintln!("randomized test failed at op {op}; replay with KVPAGE_SEED={seed}");
                std::panic::resume_unwind(panic);
            }
        }
        // The run must have exercised sharing, copies, pressure and eviction.
        let stats = sim.kv.prefix_cache_stats().clone();
        eprintln!(
            "round {round}: hits {} blocks, evictions {}, copies {}, failed allocations {}",
            stats.hit_blocks, stats.evicted_blocks, sim.copies, sim.failed_allocations
        );
        assert!(stats.hit_blocks > 1000 && stats.evicted_blocks > 1000);
        assert!(sim.copies > 1000 && sim.failed_allocations > 100);
        assert!(
            sim.replayed.cleared > 0,
            "the run must reset the prefix cache"
        );
        for seq in std::mem::take(&mut sim.seqs) {
            sim.kv.free_sequence(seq.id).unwrap();
        }
        sim.kv.check_invariants().unwrap();
        assert_eq!(sim.kv.num_referenced_blocks(), 0, "every block comes back");
        assert_eq!(sim.kv.num_written_slots(), 0);
    }
}

#[test]
fn randomized_operations_with_a_sliding_window_keep_every_invariant() {
    let seed = std::env::var("KVPAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x51de);
    for (round, num_blocks, window) in [(0u64, 24usize, 6u32), (1, 64, 9), (2, 12, 2)] {
        let seed = seed + round;
        let mut sim = Sim::new_with_window(seed, num_blocks, 4, Some(window));
        for op in 0..random_ops() / 2 {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                sim.step();
                sim.verify();
                sim.check_events();
            }));
            if let Err(panic) = result {
                eprintln!(
                    "sliding-window randomized test failed at op {op}; replay with KVPAGE_SEED={seed}"
                );
                std::panic::resume_unwind(panic);
            }
        }
        let stats = sim.kv.prefix_cache_stats().clone();
        eprintln!(
            "window round {round}: slid {} blocks, detached {}, hits {}, evictions {}, copies {}",
            sim.slid, stats.detached_blocks, stats.hit_blocks, stats.evicted_blocks, sim.copies
        );
        assert!(sim.slid > 1000 && stats.detached_blocks > 100);
        assert!(stats.hit_blocks > 100 && stats.evicted_blocks > 100 && sim.copies > 100);
        for seq in std::mem::take(&mut sim.seqs) {
            sim.kv.free_sequence(seq.id).unwrap();
        }
        sim.kv.check_invariants().unwrap();
        assert_eq!(sim.kv.num_referenced_blocks(), 0, "every block comes back");
        assert_eq!(sim.kv.num_written_slots(), 0);
    }
}

/// Issue 13's scenario: a caches [0..4); p allocates 8 tokens; c forks p; p
/// caches [0..8) (pinning a's block 0 and inserting its second block under
/// it); a and p go. Returns the manager and c, which still holds the child.
fn parent_kept_alive_by_a_forked_child() -> (KvCacheManager, SeqId) {
    let mut kv = KvCacheManager::new(8, 4, true).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let a = kv.create_sequence(None);
    append(&mut kv, a, 4);
    kv.cache_blocks(a, &tokens[..4]).unwrap();
    let p = kv.create_sequence(None);
    append(&mut kv, p, 8);
    let c = kv.fork(p).unwrap();
    kv.cache_blocks(p, &tokens).unwrap();
    kv.free_sequence(a).unwrap();
    kv.free_sequence(p).unwrap();
    (kv, c)
}

#[test]
fn a_fork_keeps_the_parent_its_sibling_cached_under_alive() {
    // Regression (issue 13): block 0 must stay: c still holds the child, so
    // block 0's id must not be recycled under another prefix.
    let (mut kv, c) = parent_kept_alive_by_a_forked_child();
    kv.check_invariants().unwrap();
    assert_eq!(
        kv.num_available_blocks(),
        8 - 3,
        "c's two blocks and the cached parent they keep alive"
    );
    assert_eq!(
        kv.evict(1).unwrap(),
        0,
        "block 0 lives through its held child"
    );
    kv.check_invariants().unwrap();
    let q = kv.create_sequence(None);
    append(&mut kv, q, 4);
    kv.cache_blocks(q, &[90, 91, 92, 93]).unwrap();
    let r = kv.create_sequence(None);
    let probe = [90, 91, 92, 93, 4, 5, 6, 7, 99];
    assert_eq!(
        kv.match_prefix(r, &probe).unwrap(),
        4,
        "KV computed after [0..4) must never follow [90..94)"
    );
    kv.check_invariants().unwrap();
    for seq in [c, q, r] {
        kv.free_sequence(seq).unwrap();
    }
    kv.check_invariants().unwrap();
}

#[test]
fn reset_prefix_cache_frees_a_parent_kept_alive_by_a_child() {
    // Found by the soak run: a cached block with no holder but a held child
    // is neither free nor evictable; a reset must still return it.
    let (mut kv, c) = parent_kept_alive_by_a_forked_child();
    kv.reset_prefix_cache().unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_free_blocks(), 8 - 2, "only c's two blocks are held");
    kv.free_sequence(c).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_free_blocks(), 8);
}

#[test]
fn zero_token_growth_of_a_fork_is_a_no_op() {
    let mut kv = KvCacheManager::new(8, 4, false).unwrap();
    let parent = kv.create_sequence(None);
    append(&mut kv, parent, 5);
    let child = kv.fork(parent).unwrap();
    assert!(
        append(&mut kv, child, 0).is_empty(),
        "no copy for a write of nothing"
    );
    assert_eq!(
        kv.block_table(child).unwrap(),
        kv.block_table(parent).unwrap()
    );
    kv.check_invariants().unwrap();
}

#[test]
fn forks_caching_a_shared_block_do_not_pin_it_twice() {
    let mut kv = KvCacheManager::new(8, 4, true).unwrap();
    let tokens: Vec<u32> = (0..4).collect();
    let parent = kv.create_sequence(None);
    append(&mut kv, parent, 4);
    let child = kv.fork(parent).unwrap();
    assert_eq!(kv.cache_blocks(parent, &tokens).unwrap(), 1);
    assert_eq!(kv.cache_blocks(child, &tokens).unwrap(), 0);
    let block = kv.block_table(parent).unwrap()[0];
    assert_eq!(kv.refcount(block).unwrap(), 2, "two holders, no extra pin");
    kv.check_invariants().unwrap();
}
