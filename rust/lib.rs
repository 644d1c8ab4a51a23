//! kvpage core: the memory and scheduling half of the kvpage inference engine.
//!
//! One module per concern; each module's `mod.rs` states what it owns and
//! its invariants.
//!
//! - [`kv`]: the paged KV memory: the block pool (free list, refcounts), the
//!   radix prefix cache (LRU eviction, salts) and per-sequence page tables
//!   with copy-on-write over both.
//! - [`sched`]: the continuous-batching scheduler and its `static` baseline,
//!   requests and their id spaces, and the step plan handed to the runner.
//! - [`output`]: incremental detokenization with stop strings, and the output
//!   streams: what each sample hands out (tokens, text, finish), three bulk
//!   calls a step.
//! - [`grammar`]: structured outputs: grammars compiled by llguidance and the
//!   token masks that constrain sampling.
//! - [`kernels`]: paged decode attention and few-row linear layers on the
//!   host CPU, where their parallel work runs, and their export as XLA FFI
//!   custom calls for the `xla` attention backend.
//! - [`error`]: the core's typed errors.
//! - `py` (feature `python`): the PyO3 bindings, `kvpage._core`.
//!
//! Dependencies point one way: `kernels` depends on nothing else here;
//! `grammar` and `kv` on `error`; `sched` on `kv`, `grammar` and `error`;
//! `output` on `sched::request` (finish reasons); nothing depends on `py`.
//!
//! Everything here is plain Rust: `cargo test` and `cargo bench` need no
//! Python. The PyO3 bindings live in `py` behind the `python` feature and
//! stay a thin layer.

pub mod error;
pub mod grammar;
pub mod kernels;
pub mod kv;
pub mod output;
pub mod sched;
#[cfg(any(test, feature = "bench-support"))]
pub mod test_rng;

#[cfg(feature = "python")]
mod py;

pub use error::{KvError, KvResult};
pub use kv::block_pool::{BlockId, BlockPool};
pub use kv::kv_cache::{BlockCopy, KvCacheManager, SeqId};
pub use kv::prefix_cache::{PrefixCache, PrefixCacheStats};
