//! `y = x · dequant(w)ᵀ` with quantized weights: the decode- and prefill-sized
//! linear layers of a quantized model on the host CPU.
//!
//! Owns [`qmatmul`] (one thread, for tests and benches), [`Inputs`], the
//! per-tile entry [`tile`] that the XLA FFI handler runs on XLA's thread pool,
//! and the portable loops; the AVX2 kernels are in `qmatmul_avx2.rs`, the
//! call's shape, checks and tiles in [`super::call`]. Each weight row's
//! sub-blocks are unpacked in registers and multiplied there. Two paths, by
//! the rows of the call:
//!
//! - **few rows** (a decode step; up to [`integer_rows`]: 16 with AVX2, each
//!   weight sub-block unpacked once per group of 4 rows, `qmatmul_avx2.rs`;
//!   32 with AVX-512 VNNI for Q4_0, Q4_1, Q5_0 and Q8_0, `lanes_avx512.rs`, and
//!   for Q4_K and Q6_K, `integer_avx512.rs`, and past 32 in blocks of 32; such
//!   a call is a speculative verification, a decode batch or the routed rows
//!   of one expert): each row is quantized to 16 bits per block ([`Q16Rows`]) and the products are
//!   integer multiply-adds (`pmaddwd`); per sub-block `s` of 32 weights the
//!   kernel adds
//!   `Σ_h scale[h] · d_x[s] · Σ_{i in half h} q[i] · q_x[i] + Σ_h min[h] · half_sum_x[s, h]`.
//!   A one-row product on these formats is bound by instructions more than by
//!   streaming the weights, so each format widens its integers straight to 16
//!   bits (`pmovzxbw`/`pmovsxbw` from memory, then a mask and a shift for
//!   nibbles), and the kernel reads one weight row at a time, front to back:
//!   four rows interleaved ran up to 2x slower from DRAM (`benches/RESULTS.md`,
//!   "Latest: one weight row at a time"), asking the cache for the bytes 2 KiB
//!   ahead as it goes: the hardware prefetcher alone left a row's loads
//!   waiting on memory (`quant_one_row`, 160 MB of Q4_1: 46.5 -> 17.7 ms one
//!   row, 73.5 -> 41.4 ms four rows; 2026-11-27, `benches/RESULTS.md`). 8-bit inputs with `pmaddubsw` (llama.cpp's
//!   choice for 4-bit weights) ran 1.1-1.3x faster still but flipped SmolLM2's
//!   greedy tokens: 43 % agreement with the float path over 8 prompts, against
//!   91 % with 16 bits (`tests/quant/test_quant.py`); they are opt-in
//!   ([`super::activations::set_cpu_input_bits`], `--cpu-input-bits 8`).
//! - **more rows**: each sub-block is expanded to float in registers once for
//!   a group of input rows (`scale · q + min`, one FMA per 8 weights) and
//!   multiplied against the float inputs, as the float kernel does
//!   ([`crate::kernels::cpu_matmul`]): the expansion is shared by every row, so
//!   the cost per row is the float kernel's and no input precision is lost.
//!
//! Weights packed into tiles ([`tile_packed`]) take a lanes kernel at every row
//! count, in blocks of [`packed_rows`]: `lanes_avx512.rs` with AVX-512 VNNI (the
//! same bits as the weights' rows), `lanes_avx2.rs` with AVX2 alone (the rows
//! keep the kernels above there, so the two agree to rounding).
//!
//! A row's result therefore depends on whether its call takes the integer path
//! (as XLA's own dot differs between shapes); within a path it does not depend
//! on the other rows. [`Inputs::float_path`] takes the float path for any row
//! count, so a row's result never depends on the call (batch-invariant mode).
//!
//! Layout (row-major): `x [rows, inner]` f32, `w [outs, row_bytes(inner)]`
//! bytes (each row its blocks, as GGUF stores a `[out, in]` weight),
//! `row_scales [outs]` f32 for per-channel types (else empty), `y [rows, outs]`.

use super::activations::Q16Rows;
use super::call::{row_scale, tiles, validate, vectorized, QuantShape, OUTS_PER_TILE};
use super::formats::{dequantize_row, unpack, QuantType, SubBlock, SUB};
#[cfg(target_arch = "x86_64")]
use super::integer_avx512::{self, VNNI_ROWS};
#[cfg(target_arch = "x86_64")]
use super::lanes_avx2;
#[cfg(target_arch = "x86_64")]
use super::lanes_avx512::{self, LANES_ROWS};
#[cfg(target_arch = "x86_64")]
use super::qmatmul_avx2 as avx2;
use crate::kernels::cpu_matmul::OutPtr;

/// Calls of at most this many rows take the integer path (module docs): one
/// with the portable loop (and for the formats AVX-512 CPUs have no VNNI
/// kernel for: their float panel takes 2 rows and more), 16 with AVX2 alone
/// (`qmatmul_avx2.rs`), 32 with AVX-512 VNNI ([`LANES_ROWS`], [`VNNI_ROWS`]).
pub fn integer_rows(kind: QuantType) -> usize {
    #[cfg(target_arch = "x86_64")]
    if vectorized() && lanes_avx512::takes(kind) {
        return LANES_ROWS;
    }
    #[cfg(target_arch = "x86_64")]
    if vectorized() && integer_avx512::takes(kind) {
        return VNNI_ROWS;
    }
    #[cfg(target_arch = "x86_64")]
    if vectorized() && !avx2::panel_from_two_rows() {
        return avx2::INTEGER_ROWS;
    }
    let _ = kind;
    1
}

/// Whether calls of more than [`integer_rows`] rows of `kind` take the integer
/// path too, in blocks of that many (where an AVX-512 VNNI kernel reads
/// `kind`: its products cost less per row than the float path's; with AVX2
/// alone they cost more from ~16 rows on, `qmatmul_avx2.rs`).
pub fn integer_blocks(kind: QuantType) -> bool {
    #[cfg(target_arch = "x86_64")]
    if vectorized() && (lanes_avx512::takes(kind) || integer_avx512::takes(kind)) {
        return true;
    }
    let _ = kind;
    false
}

/// Whether a call of `rows` rows of `kind` takes the integer path (in blocks of
/// [`integer_rows`] rows past them where [`integer_blocks`]; see [`Inputs::prepare`]).
pub fn takes_integer_path(kind: QuantType, rows: usize) -> bool {
    rows <= integer_rows(kind) || integer_blocks(kind)
}

/// The inputs of one call as the kernels read them: the float rows, and for
/// the integer path their 16-bit form, in blocks of at most
/// [`integer_rows`] rows (empty: the float path).
pub struct Inputs<'a> {
    pub x: &'a [f32],
    pub integer: Vec<Q16Rows>,
}

impl<'a> Inputs<'a> {
    /// Prepare `x` (validated for `shape`) for the path its row count takes: the
    /// integer path up to [`integer_rows`] rows, and past them, where a kernel
    /// reads several rows at once (AVX-512 VNNI), the same kernel on blocks of
    /// that many rows, so a row's result never depends on the call's other rows
    /// (a verification among a batch's rows equals the decode step's) and the
    /// float panel is left to kernels of one row.
    pub fn prepare(shape: &QuantShape, x: &'a [f32]) -> Self {
        let integer = if takes_integer_path(shape.kind, shape.rows) {
            quantized_blocks(x, shape.inner, integer_rows(shape.kind))
        } else {
            Vec::new()
        };
        Inputs { x, integer }
    }

    /// Prepare `x` (validated for `shape`) for weights packed into tiles
    /// ([`tile_packed`]): the lanes kernel that reads them takes every row
    /// count, in blocks of [`packed_rows`] rows.
    pub fn prepare_packed(shape: &QuantShape, x: &'a [f32]) -> Self {
        let integer = quantized_blocks(x, shape.inner, packed_rows(shape.kind));
        Inputs { x, integer }
    }

    /// `x` for the float path whatever its row count: each row's result is then
    /// the same whichever rows share the call (batch-invariant inference).
    pub fn float_path(x: &'a [f32]) -> Self {
        Inputs {
            x,
            integer: Vec::new(),
        }
    }
}

/// The rows of `x` (`inner` inputs each) quantized in blocks of `rows` rows.
fn quantized_blocks(x: &[f32], inner: usize, rows: usize) -> Vec<Q16Rows> {
    x.chunks(rows * inner)
        .map(|block| Q16Rows::quantize(block, block.len() / inner, inner))
        .collect()
}

/// `y = x · dequant(w)ᵀ` on the calling thread.
pub fn qmatmul(
    shape: &QuantShape,
    x: &[f32],
    w: &[u8],
    row_scales: &[f32],
    y: &mut [f32],
) -> Result<(), String> {
    validate(shape, x, w, row_scales, y)?;
    let inputs = Inputs::prepare(shape, x);
    let out = OutPtr::new(y);
    for index in 0..tiles(shape) {
        // SAFETY: validated above; one thread writes every tile.
        unsafe { tile(shape, &inputs, w, row_scales, out, index) };
    }
    Ok(())
}

/// Columns `index * OUTS_PER_TILE ..` (one tile) of `y`, every row.
///
/// # Safety
/// `inputs` were prepared from an `x` that passed [`validate`] with `w`,
/// `row_scales` and the buffer behind `y` for `shape`; no other thread writes the
/// same tile.
pub unsafe fn tile(
    shape: &QuantShape,
    inputs: &Inputs,
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
    index: usize,
) {
    let start = index * OUTS_PER_TILE;
    let end = (start + OUTS_PER_TILE).min(shape.outs);
    if start >= end {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if vectorized() {
        if inputs.integer.is_empty() {
            return avx2::float_tile(shape, inputs.x, w, row_scales, y, start, end);
        }
        for (block, xq, y) in row_blocks(shape, inputs, y) {
            if lanes_avx512::takes(shape.kind) {
                lanes_avx512::tile(&block, xq, w, y, start, end);
            } else if integer_avx512::takes(shape.kind) {
                integer_avx512::tile(&block, xq, w, y, start, end);
            } else {
                avx2::integer_tile(&block, xq, w, row_scales, y, start, end);
            }
        }
        return;
    }
    portable_tile(shape, inputs, w, row_scales, y, start, end)
}

/// Whether weights of `kind` may be packed into tiles for [`tile_packed`]
/// here (Q4_0 and Q4_1 where the lanes kernel reads them:
/// `tiles::pack_tiles`), in matrices of `outs` rows.
pub fn packs(kind: QuantType, outs: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if super::tiles::packs(kind) && outs.is_multiple_of(OUTS_PER_TILE) {
        return vectorized() && (lanes_avx512::takes(kind) || lanes_avx2::takes(kind));
    }
    let _ = (kind, outs);
    false
}

/// Whether `kind`'s weights packed into tiles give the bits of the same
/// weights in rows (AVX-512 VNNI: one lanes kernel reads both; with AVX2 the
/// rows keep the row-at-a-time kernel, `lanes_avx2.rs`).
pub fn packed_matches_rows(kind: QuantType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return lanes_avx512::takes(kind);
    #[cfg(not(target_arch = "x86_64"))]
    return {
        let _ = kind;
        false
    };
}

/// Input rows per block of a call on weights packed into tiles: the rows of
/// the lanes kernel that reads them (AVX-512 VNNI: 32; AVX2: 16).
pub fn packed_rows(kind: QuantType) -> usize {
    #[cfg(target_arch = "x86_64")]
    if lanes_avx512::takes(kind) {
        return LANES_ROWS;
    }
    let _ = kind;
    #[cfg(target_arch = "x86_64")]
    return lanes_avx2::LANES_ROWS;
    #[cfg(not(target_arch = "x86_64"))]
    return 1;
}

/// [`tile`] for weights packed into tiles (`tiles::pack_tiles`).
///
/// # Safety
/// As [`tile`], with [`packs`]`(shape.kind, shape.outs)`, `w` packed, and
/// `inputs` from [`Inputs::prepare_packed`].
pub unsafe fn tile_packed(shape: &QuantShape, inputs: &Inputs, w: &[u8], y: OutPtr, index: usize) {
    debug_assert!(packs(shape.kind, shape.outs) && !inputs.integer.is_empty());
    #[cfg(target_arch = "x86_64")]
    {
        let start = index * OUTS_PER_TILE;
        for (block, xq, y) in row_blocks(shape, inputs, y) {
            if lanes_avx512::takes(shape.kind) {
                lanes_avx512::tile_packed(&block, xq, w, y, start, start + OUTS_PER_TILE);
            } else {
                lanes_avx2::tile_packed(&block, xq, w, y, start, start + OUTS_PER_TILE);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (shape, inputs, w, y, index);
}

/// The integer path's blocks of rows: each block's shape, 16-bit rows and
/// place in `y`.
///
/// # Safety
/// `y` holds `shape.rows * shape.outs` elements.
unsafe fn row_blocks<'i>(
    shape: &QuantShape,
    inputs: &'i Inputs,
    y: OutPtr,
) -> impl Iterator<Item = (QuantShape, &'i Q16Rows, OutPtr)> {
    let outs = shape.outs;
    let shape = *shape;
    inputs.integer.iter().scan(0, move |first, xq| {
        // SAFETY: the blocks' rows add up to `shape.rows`.
        let at = unsafe { y.from(*first * outs) };
        *first += xq.rows;
        Some((
            QuantShape {
                rows: xq.rows,
                ..shape
            },
            xq,
            at,
        ))
    })
}

/// Rows `start..end` of the weights through the portable loops.
///
/// # Safety
/// As [`tile`].
unsafe fn portable_tile(
    shape: &QuantShape,
    inputs: &Inputs,
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    if inputs.integer.is_empty() {
        return portable_float_tile(shape, inputs.x, w, row_scales, y, start, end);
    }
    for (block, xq, y) in row_blocks(shape, inputs, y) {
        portable_integer_tile(&block, xq, w, row_scales, y, start, end);
    }
}

/// Every tile through the portable loop, whatever the CPU has (tests).
///
/// # Safety
/// As [`tile`], for every tile.
#[cfg(test)]
pub(crate) unsafe fn portable_for_tests(
    shape: &QuantShape,
    inputs: &Inputs,
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
) {
    portable_tile(shape, inputs, w, row_scales, y, 0, shape.outs)
}

/// Any CPU, several rows: each weight row expanded to float once, float sums.
unsafe fn portable_float_tile(
    shape: &QuantShape,
    x: &[f32],
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    let row_bytes = shape.kind.row_bytes(shape.inner).expect("validated");
    for out in start..end {
        let row = &w[out * row_bytes..][..row_bytes];
        let scale = row_scale(shape, row_scales, out);
        let weights = dequantize_row(shape.kind, row, shape.inner, scale);
        for r in 0..shape.rows {
            let x_row = &x[r * shape.inner..][..shape.inner];
            let mut lanes = [0.0f32; 8];
            for (xc, wc) in x_row.chunks_exact(8).zip(weights.chunks_exact(8)) {
                for lane in 0..8 {
                    lanes[lane] += xc[lane] * wc[lane];
                }
            }
            *y.at(r * shape.outs + out) = lanes.iter().sum();
        }
    }
}

/// Any CPU, one row: [`unpack`] each sub-block once per weight row, integer sums.
unsafe fn portable_integer_tile(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    let kind = shape.kind;
    let row_bytes = kind.row_bytes(shape.inner).expect("validated");
    let per_block = kind.block_elems() / SUB;
    let subs = shape.inner / SUB;
    let mut unpacked = vec![SubBlock::default(); subs];
    for out in start..end {
        let row = &w[out * row_bytes..][..row_bytes];
        let scale = row_scale(shape, row_scales, out);
        for (s, sub) in unpacked.iter_mut().enumerate() {
            let block = &row[(s / per_block) * kind.block_bytes()..];
            *sub = unpack(kind, block, s % per_block, scale);
        }
        for r in 0..shape.rows {
            let x_row = xq.row(r);
            let mut sum = 0.0f32;
            for (s, sub) in unpacked.iter().enumerate() {
                let xs = &x_row[s * SUB..][..SUB];
                let mut halves = [0i32; 2];
                for i in 0..SUB {
                    halves[i / 16] += i32::from(sub.q[i]) * i32::from(xs[i]);
                }
                let b = r * subs + s;
                let d = xq.d[b];
                for (h, half) in halves.iter().enumerate() {
                    sum += sub.scale[h] * d * *half as f32;
                    sum += sub.min[h] * xq.half_sums[2 * b + h];
                }
            }
            *y.at(r * shape.outs + out) = sum;
        }
    }
}
