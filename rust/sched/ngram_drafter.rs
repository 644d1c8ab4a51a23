//! Prompt-lookup (n-gram) drafting: guess a sequence's next tokens from its
//! own text, with no model.
//!
//! Where an output repeats its input (code edits, extraction, rewriting), the
//! last few tokens usually occurred before, and what followed them then is
//! likely to follow now. [`propose`] finds the most recent earlier occurrence
//! of the sequence's last `n` tokens, for `n` from `max_n` down to `min_n`
//! (the longest match first), and proposes up to `k` tokens that followed it.
//! A guess costs one extra query token per drafted token in the next step;
//! the model verifies them all in that one pass (`scheduler/speculation.rs`).
//!
//! Invariants: the proposal is a contiguous run of `tokens` that starts right
//! after an earlier occurrence of its last `n >= min_n` tokens, and has at
//! most `k` tokens; no match gives an empty proposal. The search is linear in
//! `tokens.len() * max_n`, and never allocates beyond `out`.

/// Fill `out` with up to `k` tokens that followed the latest earlier
/// occurrence of the longest suffix of `tokens` of length in
/// `min_n..=max_n`; empty when there is none.
pub fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return;
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Latest start `i < len - n` with tokens[i..i + n] == suffix.
        if let Some(i) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
            let from = i + n;
            out.extend_from_slice(&tokens[from..(from + k).min(len)]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::SplitMix64 as TestRng;

    fn draft(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let mut out = vec![99];
        propose(tokens, min_n, max_n, k, &mut out);
        out
    }

    #[test]
    fn the_tokens_after_the_latest_match_are_proposed() {
        // "1 2 3 4 | 1 2 5 | 1 2": the latest "1 2" is followed by 5, 1, 2.
        let tokens = [1, 2, 3, 4, 1, 2, 5, 1, 2];
        assert_eq!(draft(&tokens, 1, 2, 3), vec![5, 1, 2]);
        assert_eq!(draft(&tokens, 1, 2, 1), vec![5]);
    }

    #[test]
    fn the_longest_suffix_wins_over_a_later_shorter_match() {
        // Suffix "7 8 9": matched at 0 (followed by 1); "8 9" alone also
        // matches later (followed by 2), but the longer match is preferred.
        let tokens = [7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9];
        assert_eq!(draft(&tokens, 1, 3, 1), vec![1]);
        assert_eq!(draft(&tokens, 1, 2, 1), vec![2]);
    }

    #[test]
    fn no_match_or_no_room_proposes_nothing() {
        assert!(draft(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(draft(&[5], 1, 3, 4).is_empty());
        assert!(draft(&[], 1, 3, 4).is_empty());
        assert!(draft(&[5, 5, 5], 1, 3, 0).is_empty());
        assert!(draft(&[5, 5, 5], 0, 3, 2).is_empty());
        // A match needs n >= min_n.
        assert!(draft(&[1, 2, 9, 2], 2, 3, 2).is_empty());
    }

    #[test]
    fn proposals_stop_at_the_end_of_the_text() {
        // "3 3": latest earlier match at 1, followed by the last token only.
        assert_eq!(draft(&[3, 3, 3], 1, 2, 5), vec![3]);
    }

    #[test]
    fn random_texts_keep_the_invariants() {
        let mut rng = TestRng::new(11);
        let mut out = Vec::new();
        for _ in 0..2000 {
            let len = rng.below(40);
            let vocab = 1 + rng.below(4) as u32;
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(vocab as usize) as u32).collect();
            let (min_n, max_n, k) = (1 + rng.below(3), 1 + rng.below(4), rng.below(6));
            propose(&tokens, min_n, max_n, k, &mut out);
            assert!(out.len() <= k);
            if out.is_empty() {
                continue;
            }
            // Some n in min_n..=max_n has an earlier occurrence followed by `out`.
            let found = (min_n..=max_n.min(len - 1)).any(|n| {
                (0..len - n).any(|i| {
                    tokens[i..i + n] == tokens[len - n..]
                        && tokens[i + n..].starts_with(&out)
                        && (out.len() == k || i + n + out.len() == len)
                })
            });
            assert!(found, "{tokens:?} {min_n} {max_n} {k} -> {out:?}");
        }
    }
}
