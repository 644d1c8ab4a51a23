//! Output streams: what the engine's caller sees of each sample.
//!
//! The scheduler owns the sequence being generated; this module owns what is
//! handed out.
//!
//! - [`detokenizer`]: incremental detokenization with stop strings, for many
//!   sequences at once; the Rust twin of `python/kvpage/outputs/detokenizer.py`,
//!   producing the same text, character for character.
//! - [`output_streams`]: every request's generated tokens (cut at a stop
//!   string), their text, the cumulative logprob, the finish and stop
//!   reasons and how much was already handed out, driven by three bulk calls
//!   per step (`push`, `detokenize`, `take_outputs`).
//!
//! Invariants (checked by each type's `check_invariants`, in debug builds
//! after every mutation or bulk call):
//! - per sample, `sent_tokens <= fed <= tokens.len()`; a finished sample
//!   takes no more tokens;
//! - a detokenizer's `prefix <= read <= ids.len()`, and once its
//!   `stop_reason` is set its text never changes again.

pub mod detokenizer;
pub mod output_streams;
