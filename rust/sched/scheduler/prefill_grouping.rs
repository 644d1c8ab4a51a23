//! Prefill grouping (part of admission, phase 3): a waiting sequence whose
//! prompt shares whole blocks with a prompt another sequence is prefilling
//! right now waits for those blocks instead of computing them a second time.
//!
//! The prefix cache only offers a block once its KV has been computed, so
//! without this, copies of one prompt admitted in the same step (GRPO's n
//! samples sent as separate requests, a burst of requests behind one long
//! system prompt) each prefill all of it. Here the first copy admitted is the
//! leader; a later one is held back while a running sequence still computing
//! its own prompt (more than one token left) shares a longer run of whole
//! blocks with it than the cache holds now. Each step the leader caches the
//! blocks of the chunk it computed (`plan.rs`); once its prompt is done the
//! follower is admitted, matches them in the cache and prefills only its own
//! tail.
//!
//! A follower waits at most as long as the leader's prefill (the leader runs
//! first every step, being running); if the leader is preempted or finishes,
//! the condition no longer holds and the follower is admitted as usual.
//! Holding back never reorders running sequences, and sequences behind a held
//! one in the queue may be admitted before it. Grouping needs the prefix
//! cache and is off with a sliding window (a sequence stops caching once it
//! slides, so a follower could wait for blocks that never arrive) and under
//! the `static` policy (no prefix cache).
//!
//! Cost: for each waiting sequence examined, a scan of the running ones that
//! are still prefilling, comparing the first block's tokens before any more.

use super::Scheduler;

impl Scheduler {
    /// Whether waiting `seq` should wait for a running sequence's prefill:
    /// some running sequence still prefilling shares more whole blocks of
    /// `seq`'s reusable prompt than the prefix cache holds now.
    pub(super) fn waits_for_shared_prefill(&self, seq: u32) -> bool {
        if !self.config.group_shared_prefills
            || !self.config.enable_prefix_caching
            || self.config.sliding_window.is_some()
        {
            return false;
        }
        let bs = self.config.block_size;
        let s = self.seq(seq);
        let request = self.request_of(seq);
        let reusable = &s.tokens[..(s.tokens.len() - 1).min(request.reuse_limit)];
        if reusable.len() < bs {
            return false;
        }
        let mut cached: Option<usize> = None;
        for &other in &self.running {
            let o = self.seq(other);
            let prefilling = o.tokens.len() - o.num_computed > 1;
            if !prefilling || o.tokens.len() < bs || o.tokens[..bs] != reusable[..bs] {
                continue;
            }
            if self.request_of(other).salt != request.salt {
                continue;
            }
            let shared = o
                .tokens
                .iter()
                .zip(reusable)
                .take_while(|(a, b)| a == b)
                .count()
                / bs
                * bs;
            let cached = *cached
                .get_or_insert_with(|| self.kv.peek_prefix(request.salt.as_deref(), reusable).0);
            if shared > cached {
                return true;
            }
        }
        false
    }
}
