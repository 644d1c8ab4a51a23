//! Host CPU kernels for the `xla` attention backend, and their XLA FFI export.
//!
//! - [`cpu_attention`]: paged decode attention on the host CPU: one query
//!   token per row, K/V read straight from the paged pool; its AVX2 kernel in
//!   `cpu_attention_avx2.rs`, its plan checks in `cpu_attention_checks.rs`; the pool element types and buffer limits both
//!   share in `kv_element.rs`, the per-head window / soft-cap / sink extras in
//!   `head_options.rs` (both depend on them, they on neither).
//! - [`cpu_matmul`]: linear layers of few rows (decode steps): `y = x · wᵀ`.
//! - [`expert_matmul`]: mixture-of-experts layers, `y[n] = x[n] · W[e_n]ᵀ`,
//!   float or quantized experts, reading only the routed experts' weights
//!   (each once per call) through the kernels of [`cpu_matmul`] and [`quant`].
//! - [`expert_ffn`]: a whole routed MoE feed-forward (router, top-k, gate,
//!   up, SwiGLU, down, weighted sum) in one call, on [`expert_matmul`]'s
//!   routing and [`quant`]'s tiles.
//! - [`quant`]: linear layers with quantized weights (GGUF blocks, int8),
//!   read as they are stored: `y = x · dequant(w)ᵀ`, and their dequantization;
//!   `quant/formats.rs` owns the table of formats every language reads.
//! - [`lazy_zeros`]: zero-filling the KV pools without writing their pages,
//!   so a pool costs memory only where blocks are used.
//! - [`parallel`]: where those kernels' parallel work runs (XLA's intra-op
//!   pool when XLA calls them, scoped threads in tests and benches); kernels
//!   never spawn threads themselves.
//! - [`xla_ffi`]: the `#[no_mangle]` C-ABI handlers that JAX registers as
//!   CPU custom-call targets, and the slice of XLA's FFI C API they need
//!   ([`xla_ffi_attention`]: paged decode attention, [`xla_ffi_quant`]: the quantized ones, [`xla_ffi_experts`]: the
//!   mixture-of-experts ones, [`xla_ffi_zeros`]: the pools' zero-fill).
//!
//! Invariants:
//! - every buffer is checked for its size (and at the FFI boundary, count,
//!   dtype and rank) before any element is read, so a bad plan is an error,
//!   never an out-of-bounds read;
//! - no load or store, whatever its width, reaches past a buffer's first or
//!   last byte: weights are read in place from a read-only mapping of the
//!   file, which may end where they do (`guard_page_tests.rs` places every
//!   buffer against an unmapped page; `scripts/sanitize.sh` runs the tests
//!   under AddressSanitizer and Miri);
//! - every unit of parallel work runs exactly once before `run` returns, and
//!   a panicking unit is reported as an error, never unwound through the
//!   caller; a handler never panics across the FFI boundary;
//! - results do not depend on the number of threads.

pub mod cpu_attention;
#[cfg(target_arch = "x86_64")]
mod cpu_attention_avx2;
mod cpu_attention_checks;
pub mod cpu_matmul;
pub mod expert_ffn;
#[cfg(test)]
mod expert_ffn_tests;
pub mod expert_matmul;
#[cfg(test)]
mod expert_matmul_tests;
#[cfg(test)]
mod guard_page;
#[cfg(test)]
mod guard_page_tests;
mod head_options;
mod kv_element;
pub mod lazy_zeros;
pub mod parallel;
pub mod quant;
pub mod xla_ffi;
pub mod xla_ffi_attention;
pub mod xla_ffi_experts;
pub mod xla_ffi_quant;
pub mod xla_ffi_zeros;
