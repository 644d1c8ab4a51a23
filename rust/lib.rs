//! kvpage core: the memory and scheduling half of the kvpage inference engine.
//!
//! - [`block_pool`]: fixed pool of physical KV blocks, free list, refcounts.
//! - [`prefix_cache`]: radix tree over token blocks, LRU eviction, salts.
//! - [`kv_cache`]: per-sequence page tables with copy-on-write over both.
//! - [`cpu_attention`] + [`xla_ffi`]: paged decode attention on the host CPU,
//!   exported as an XLA FFI custom call for the `xla` attention backend.
//! - [`cpu_matmul`] + [`xla_ffi`]: linear layers of few rows (decode steps) on the host CPU.
//! - [`parallel`]: where those kernels' parallel work runs (XLA's pool or scoped threads).
//! - [`detokenizer`]: incremental detokenization and stop strings, all sequences per call.
//! - [`output_streams`]: what each sample hands out (tokens, text, finish), three bulk calls a step.
//!
//! Everything here is plain Rust: `cargo test` and `cargo bench` need no
//! Python. The PyO3 bindings (`kvpage._core`) live in [`python`] behind the
//! `python` feature and stay a thin layer.

pub mod block_pool;
pub mod cpu_attention;
pub mod cpu_matmul;
pub mod detokenizer;
pub mod error;
pub mod kv_cache;
pub mod output_streams;
pub mod parallel;
pub mod prefix_cache;
#[cfg(test)]
mod reference_model_tests;

#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_detokenizer;
#[cfg(feature = "python")]
mod python_output_streams;

pub use block_pool::{BlockId, BlockPool};
pub use error::{KvError, KvResult};
pub use kv_cache::{BlockCopy, KvCacheManager, SeqId};
pub use prefix_cache::{PrefixCache, PrefixCacheStats};

#[cfg(test)]
mod kv_cache_tests;
pub mod request;
pub mod scheduler;
#[cfg(test)]
mod scheduler_regression_tests;
#[cfg(test)]
mod scheduler_tests;
pub mod step_plan;
pub mod structured_output;
#[cfg(test)]
mod structured_output_tests;
#[cfg(any(test, feature = "bench-support"))]
pub mod test_rng;
pub mod xla_ffi;
