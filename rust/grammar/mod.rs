//! Structured outputs: token masks that keep a sequence inside a JSON
//! schema, a regular expression, a choice list or a Lark grammar, computed
//! by llguidance's Earley parser over a token trie.
//!
//! - [`structured_output`]: the model's `GrammarVocab` (once per model), the
//!   compiled `Grammar`s, one `GrammarMatcher` per constrained sequence, and
//!   `fill_bitmasks` for a step's sampled rows.
//!
//! The scheduler carries the matchers (`sched::scheduler`: `set_grammar`,
//! `fill_token_bitmask`, and `update` advancing them); nothing here depends
//! on the scheduler.
//!
//! Invariants:
//! - a matcher has consumed exactly the tokens its sequence generated, in
//!   order; no rollback exists or is needed;
//! - mask layout: one `u32` word per 32 token ids; token `t` is allowed iff
//!   bit `t % 32` of word `t / 32` is set; ids past the tokenizer are never
//!   allowed;
//! - a matcher whose grammar is complete, or in an error state, allows only
//!   the EOS tokens, so a row is never fully masked.

pub mod structured_output;
#[cfg(test)]
mod structured_output_tests;
