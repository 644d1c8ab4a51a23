//! Suffix drafting across requests: guess a sequence's next tokens from what
//! any recent sequence wrote after the same tokens.
//!
//! The n-gram drafter ([`super::ngram_drafter`]) looks only at the sequence's
//! own text. Many workloads repeat text across requests instead: the `n`
//! samples of one GRPO prompt, an agent loop that sees the same tool output
//! again, a batch of extractions over one document. [`SuffixIndex`] keeps the
//! token streams of recent sequences (each a prompt followed by its output,
//! appended as it grows) up to `capacity` tokens, the oldest streams dropped
//! first, and a hash map from every `n`-gram (`min_n <= n <= max_n`) that has
//! a continuation to its latest occurrence. [`SuffixIndex::propose`] looks up
//! the sequence's last `n` tokens, longest first, and copies up to `k` tokens
//! that followed them in whichever stream wrote them last.
//!
//! Invariants: a proposal is a contiguous run of one held stream that starts
//! right after an occurrence of the query's last `n >= min_n` tokens in that
//! stream, and has at most `k` tokens (hash collisions are checked against the
//! stream); an `n`-gram is indexed only once the token after it exists, so a
//! sequence's own latest suffix never proposes itself; the held streams hold
//! at most `capacity` tokens, or one stream when a single stream is longer.

use std::collections::VecDeque;
use std::hash::Hasher;

use rustc_hash::{FxHashMap, FxHasher};

/// The token streams of recent sequences and their `n`-grams (module docs).
#[derive(Debug, Clone)]
pub struct SuffixIndex {
    min_n: usize,
    max_n: usize,
    capacity: usize,
    streams: VecDeque<Vec<u32>>,
    /// Id of `streams[0]`; ids grow by one per opened stream.
    first_id: u64,
    held: usize,
    /// `n`-gram hash -> (stream id, position of the token that followed it).
    latest: FxHashMap<u64, (u64, u32)>,
}

fn gram_hash(gram: &[u32]) -> u64 {
    let mut h = FxHasher::default();
    h.write_usize(gram.len());
    for &t in gram {
        h.write_u32(t);
    }
    h.finish()
}

impl SuffixIndex {
    pub fn new(min_n: usize, max_n: usize, capacity: usize) -> Self {
        Self {
            min_n: min_n.max(1),
            max_n: max_n.max(min_n.max(1)),
            capacity,
            streams: VecDeque::new(),
            first_id: 0,
            held: 0,
            latest: FxHashMap::default(),
        }
    }

    /// A new, empty stream; its id.
    pub fn open(&mut self) -> u64 {
        self.streams.push_back(Vec::new());
        let id = self.first_id + self.streams.len() as u64 - 1;
        self.evict(); // a lone stream past the capacity goes once it has company
        id
    }

    /// Tokens stream `id` holds, or None once it was dropped.
    pub fn stream_len(&self, id: u64) -> Option<usize> {
        self.stream(id).map(<[u32]>::len)
    }

    fn stream(&self, id: u64) -> Option<&[u32]> {
        let at = id.checked_sub(self.first_id)?;
        self.streams.get(at as usize).map(Vec::as_slice)
    }

    /// Append `tokens` to stream `id` (nothing once it was dropped), index
    /// the `n`-grams that now have a continuation, then drop the oldest
    /// streams past the capacity.
    pub fn extend(&mut self, id: u64, tokens: &[u32]) {
        let Some(at) = id.checked_sub(self.first_id) else {
            return;
        };
        let Some(stream) = self.streams.get_mut(at as usize) else {
            return;
        };
        let old = stream.len();
        stream.extend_from_slice(tokens);
        self.held += tokens.len();
        let stream = &self.streams[at as usize];
        // The n-gram ending at p - 1 gains its continuation when token p exists.
        for p in old.max(1)..stream.len() {
            for n in self.min_n..=self.max_n.min(p) {
                self.latest
                    .insert(gram_hash(&stream[p - n..p]), (id, p as u32));
            }
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.held > self.capacity && self.streams.len() > 1 {
            let dropped = self.streams.pop_front().expect("more than one stream");
            self.held -= dropped.len();
            self.first_id += 1;
        }
        let grams = self.max_n - self.min_n + 1;
        if self.latest.len() > 2 * grams * self.held + 1024 {
            let first = self.first_id;
            self.latest.retain(|_, &mut (id, _)| id >= first);
        }
    }

    /// Fill `out` with up to `k` tokens that followed the latest occurrence,
    /// in any held stream, of the longest suffix of `tokens` of length in
    /// `min_n..=max_n`; empty when there is none.
    pub fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        out.clear();
        if k == 0 {
            return;
        }
        let len = tokens.len();
        for n in (self.min_n..=self.max_n.min(len)).rev() {
            let gram = &tokens[len - n..];
            let Some(&(id, p)) = self.latest.get(&gram_hash(gram)) else {
                continue;
            };
            let Some(stream) = self.stream(id) else {
                continue;
            };
            let p = p as usize;
            if p < n || stream[p - n..p] != *gram {
                continue; // a hash collision
            }
            out.extend_from_slice(&stream[p..(p + k).min(stream.len())]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::SplitMix64;

    fn propose(index: &SuffixIndex, tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = vec![99];
        index.propose(tokens, k, &mut out);
        out
    }

    #[test]
    fn another_streams_continuation_is_proposed() {
        let mut index = SuffixIndex::new(2, 3, 1000);
        let a = index.open();
        index.extend(a, &[1, 2, 3, 4, 5, 6]);
        // A new sample of the same prompt: after "1 2 3", propose "4 5".
        let b = index.open();
        index.extend(b, &[1, 2, 3]);
        assert_eq!(propose(&index, &[1, 2, 3], 2), vec![4, 5]);
        // Its own latest suffix is never its own proposal.
        assert_eq!(propose(&index, &[7, 8], 3), Vec::<u32>::new());
        index.extend(b, &[9]);
        // "2 3" last continued with 9 (stream b), "1 2 3" too: the latest wins.
        assert_eq!(propose(&index, &[0, 2, 3], 2), vec![9]);
    }

    #[test]
    fn the_oldest_streams_go_past_the_capacity() {
        let mut index = SuffixIndex::new(1, 2, 8);
        let a = index.open();
        index.extend(a, &[1, 2, 3, 4, 5]);
        let b = index.open();
        index.extend(b, &[6, 7, 8, 9, 10]);
        assert_eq!(
            index.stream_len(a),
            None,
            "10 tokens exceed 8: the oldest went"
        );
        assert_eq!(index.stream_len(b), Some(5));
        assert!(propose(&index, &[1, 2], 3).is_empty());
        index.extend(a, &[1, 2]); // a dropped stream takes nothing
        assert_eq!(propose(&index, &[7], 2), vec![8, 9]);
        // One stream longer than the capacity stays.
        let mut one = SuffixIndex::new(1, 1, 2);
        let s = one.open();
        one.extend(s, &[1, 2, 3, 4]);
        assert_eq!(one.stream_len(s), Some(4));
    }

    #[test]
    fn random_streams_keep_the_invariants() {
        let mut rng = SplitMix64::new(5);
        for _ in 0..200 {
            let (min_n, max_n) = (1 + rng.below(2), 1 + rng.below(4));
            let mut index = SuffixIndex::new(min_n, max_n, 10 + rng.below(60));
            let mut ids = Vec::new();
            let mut out = Vec::new();
            for _ in 0..30 {
                if ids.is_empty() || rng.chance(1, 4) {
                    ids.push(index.open());
                }
                let id = ids[rng.below(ids.len())];
                let tokens: Vec<u32> = (0..rng.below(6)).map(|_| rng.below(3) as u32).collect();
                index.extend(id, &tokens);
                assert!(index.held <= index.capacity || index.streams.len() == 1);
                let query: Vec<u32> = (0..1 + rng.below(5)).map(|_| rng.below(3) as u32).collect();
                let k = rng.below(5);
                index.propose(&query, k, &mut out);
                assert!(out.len() <= k);
                if out.is_empty() {
                    continue;
                }
                let (lo, hi) = (index.min_n, index.max_n.min(query.len()));
                let found = index.streams.iter().any(|s| {
                    (lo..=hi).any(|n| {
                        (n..s.len()).any(|p| {
                            s[p - n..p] == query[query.len() - n..]
                                && s[p..].starts_with(&out)
                                && (out.len() == k || p + out.len() == s.len())
                        })
                    })
                });
                assert!(found, "{query:?} -> {out:?}");
            }
        }
    }
}
