//! Weight-only quantized linear layers on the host CPU: `y = x · dequant(w)ᵀ`
//! read straight from the weights' quantized blocks (GGUF's Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q4_K, Q6_K, and per-channel int8), never expanded to float in
//! memory.
//!
//! A decode step of a small model streams every weight once per step, so the
//! bytes per weight bound its speed: SmolLM2's Q4_1 file holds 0.625 bytes per
//! weight where float32 holds 4. Each 32-weight sub-block is unpacked in
//! registers to small integers with its scale and offset ([`formats`]); then
//! ([`qmatmul`]) a one-row call multiplies them with the row quantized to 16
//! bits ([`activations`]) in integer multiply-adds, and a call of more rows
//! expands each sub-block to float once and shares it across the rows.
//!
//! Files, each depending only on those above it (no cycles):
//! - [`formats`]: the table of formats (name, block bytes, weights per block,
//!   FFI code: the one place they are written; Python reads it through
//!   `kvpage._core.quant_formats()`), and the reference unpacking every kernel
//!   agrees with.
//! - [`activations`]: the 16-bit rows of `x` (and their bytes), with per-block scales and sums.
//! - [`call`]: a call's shape, its validation, its tiles, the kernel choice.
//! - `unpack_avx2.rs`: the formats' blocks unpacked in AVX2 registers.
//! - [`qmatmul`]: the product and its portable loops; `qmatmul_avx2.rs` its
//!   AVX2 kernels, [`lanes_avx512`] the integer path of up to 32 rows with
//!   AVX-512 VNNI for Q4_0, Q4_1, Q5_0 and Q8_0 (sixteen weight rows in the lanes
//!   of a register), [`integer_avx512`] the one of up to 32 rows (passes of 8) for
//!   Q4_K and Q6_K (sixteen sub-blocks' sums reduced together), `panel_avx512.rs` the AVX-512 register blocks of its panel
//!   path (the same sums, bit for bit), `panel_block.rs` the block both read.
//! - [`dequantize`]: the float weights, for products of many rows.
//! - [`tiles`]: Q4_0 and Q4_1 weights packed into tiles of sixteen rows, the
//!   order [`lanes_avx512`]'s registers hold them in (read by its
//!   `tile_packed`; with AVX2 alone by [`lanes_avx2`], eight rows a register),
//!   and back.
//!
//! Invariants:
//! - a weight buffer has exactly `outs * row_bytes(inner)` bytes and `inner` is a
//!   multiple of the type's block (checked before any read);
//! - every load of a block lies inside that block, so the last block of a
//!   buffer is read to its last byte and no further (a 2-byte field is read
//!   with 2 bytes: the AVX2 Q6_K kernel once read its trailing `f16 d` with 4);
//! - every weight of a sub-block is `scale[i / 16] * q[i] + min[i / 16]` with the
//!   values [`formats::unpack`] gives; the vectorized kernels read the same
//!   values;
//! - each element of `y` is computed by one worker, in an order that depends only
//!   on the shapes and the instruction set, never on the thread count or on the
//!   other rows of a multi-row call.

pub mod activations;
pub mod call;
pub mod dequantize;
pub mod formats;
#[cfg(target_arch = "x86_64")]
pub mod integer_avx512;
#[cfg(target_arch = "x86_64")]
pub mod lanes_avx2;
#[cfg(target_arch = "x86_64")]
pub mod lanes_avx512;
#[cfg(target_arch = "x86_64")]
mod panel_avx512;
#[cfg(target_arch = "x86_64")]
mod panel_block;
pub mod qmatmul;
#[cfg(target_arch = "x86_64")]
mod qmatmul_avx2;
pub mod tiles;
#[cfg(target_arch = "x86_64")]
mod unpack_avx2;

#[cfg(test)]
pub(crate) mod tests;
