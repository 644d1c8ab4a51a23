//! `y = x · dequant(w)ᵀ` with quantized weights: the decode- and prefill-sized
//! linear layers of a quantized model on the host CPU.
//!
//! Owns [`qmatmul`] (one thread, for tests and benches), [`validate`],
//! [`Inputs`] and the per-tile entry [`tile`] that the XLA FFI handler runs on
//! XLA's thread pool. Each weight row's sub-blocks are unpacked in registers
//! and multiplied there. Two paths, by the rows of the call:
//!
//! - **one row** (a decode step of one sequence; up to [`INTEGER_ROWS`]): the
//!   row is quantized to 16 bits per block ([`Q16Rows`]) and the products are
//!   integer multiply-adds (`pmaddwd`); per sub-block `s` of 32 weights the
//!   kernel adds
//!   `Σ_h scale[h] · d_x[s] · Σ_{i in half h} q[i] · q_x[i] + Σ_h min[h] · half_sum_x[s, h]`.
//!   A one-row product on these formats is bound by instructions more than by
//!   streaming the weights, so each format widens its integers straight to 16
//!   bits (`pmovzxbw`/`pmovsxbw` from memory, then a mask and a shift for
//!   nibbles), and the kernel reads one weight row at a time, front to back:
//!   four rows interleaved ran up to 2x slower from DRAM (`benches/RESULTS.md`,
//!   "Latest: one weight row at a time"). 8-bit inputs with `pmaddubsw` (llama.cpp's
//!   choice for 4-bit weights) ran 1.1-1.3x faster still but flipped SmolLM2's
//!   greedy tokens: 43 % agreement with the float path over 8 prompts, against
//!   91 % with 16 bits (`tests/quant/test_quant.py`).
//! - **more rows**: each sub-block is expanded to float in registers once for
//!   a group of input rows (`scale · q + min`, one FMA per 8 weights) and
//!   multiplied against the float inputs, as the float kernel does
//!   ([`crate::kernels::cpu_matmul`]): the expansion is shared by every row, so
//!   the cost per row is the float kernel's and no input precision is lost.
//!
//! A row's result therefore depends on whether it is alone in its call (as
//! XLA's own dot differs between shapes); within a path it does not depend on
//! the other rows.
//!
//! Layout (row-major): `x [rows, inner]` f32, `w [outs, row_bytes(inner)]`
//! bytes (each row its blocks, as GGUF stores a `[out, in]` weight),
//! `row_scales [outs]` f32 for per-channel types (else empty), `y [rows, outs]`.

use std::sync::OnceLock;

use super::activations::Q16Rows;
use super::formats::{dequantize_row, unpack, QuantType, SubBlock, SUB};
use crate::kernels::cpu_matmul::OutPtr;

/// Shapes and weight format of one call (layout in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantShape {
    pub kind: QuantType,
    pub rows: usize,
    pub inner: usize,
    pub outs: usize,
}

/// Weight rows per unit of parallel work.
pub const OUTS_PER_TILE: usize = 16;

/// Calls of at most this many rows take the integer path (module docs).
pub const INTEGER_ROWS: usize = 1;

/// The inputs of one call as the kernels read them: the float rows, and for
/// the integer path their 16-bit form.
pub struct Inputs<'a> {
    pub x: &'a [f32],
    pub integer: Option<Q16Rows>,
}

impl<'a> Inputs<'a> {
    /// Prepare `x` (validated for `shape`) for the path its row count takes.
    pub fn prepare(shape: &QuantShape, x: &'a [f32]) -> Self {
        let integer =
            (shape.rows <= INTEGER_ROWS).then(|| Q16Rows::quantize(x, shape.rows, shape.inner));
        Inputs { x, integer }
    }
}

/// Check the invariants of [`super`]; `Err` names the first violation.
pub fn validate(
    shape: &QuantShape,
    x: &[f32],
    w: &[u8],
    row_scales: &[f32],
    y: &[f32],
) -> Result<(), String> {
    let s = shape;
    let Some(row_bytes) = s.kind.row_bytes(s.inner) else {
        return Err(format!(
            "{} weights need an inner size that is a positive multiple of {}, got {}",
            s.kind.name(),
            s.kind.block_elems(),
            s.inner
        ));
    };
    let scales = if s.kind.row_scaled() { s.outs } else { 0 };
    let sizes = [
        ("x", x.len(), s.rows * s.inner),
        ("w", w.len(), s.outs * row_bytes),
        ("row_scales", row_scales.len(), scales),
        ("y", y.len(), s.rows * s.outs),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(format!("{name} has {got} elements, its shape says {want}"));
        }
    }
    Ok(())
}

/// Number of tiles of [`OUTS_PER_TILE`] weight rows a call splits into.
pub fn tiles(shape: &QuantShape) -> usize {
    shape.outs.div_ceil(OUTS_PER_TILE)
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

/// Validate a dequantization of `outs` rows of `inner` weights into `out`.
pub fn validate_dequantize(
    kind: QuantType,
    inner: usize,
    w: &[u8],
    row_scales: &[f32],
    out: &[f32],
) -> Result<(), String> {
    let outs = out.len().checked_div(inner).unwrap_or(0);
    let shape = QuantShape {
        kind,
        rows: 0,
        inner,
        outs,
    };
    validate(&shape, &[], w, row_scales, &[])?;
    if out.len() != outs * inner {
        return Err(format!(
            "out has {} elements, not a multiple of {inner}",
            out.len()
        ));
    }
    Ok(())
}

/// Rows `index * OUTS_PER_TILE ..` (one tile) of the float weights `out [outs,
/// inner]` (`scale * q + min`, one FMA each on AVX2): for products of many rows,
/// which XLA's GEMM then runs faster than [`tile`] does.
///
/// # Safety
/// [`validate_dequantize`] passed for these buffers; no other thread writes the
/// same tile.
pub unsafe fn dequantize_tile(
    kind: QuantType,
    inner: usize,
    w: &[u8],
    row_scales: &[f32],
    out: OutPtr,
    outs: usize,
    index: usize,
) {
    let start = index * OUTS_PER_TILE;
    let end = (start + OUTS_PER_TILE).min(outs);
    #[cfg(target_arch = "x86_64")]
    if vectorized() {
        return avx2::dequantize_rows(kind, inner, w, row_scales, out, start, end);
    }
    portable_dequantize_rows(kind, inner, w, row_scales, out, start, end)
}

/// Weight rows `start..end` of [`dequantize_tile`] through the portable loop.
///
/// # Safety
/// As [`dequantize_tile`], for rows `start..end`.
pub(crate) unsafe fn portable_dequantize_rows(
    kind: QuantType,
    inner: usize,
    w: &[u8],
    row_scales: &[f32],
    out: OutPtr,
    start: usize,
    end: usize,
) {
    let row_bytes = kind.row_bytes(inner).expect("validated");
    for o in start..end {
        let scale = if kind.row_scaled() {
            row_scales[o]
        } else {
            1.0
        };
        let values = dequantize_row(kind, &w[o * row_bytes..][..row_bytes], inner, scale);
        for (i, v) in values.into_iter().enumerate() {
            *out.at(o * inner + i) = v;
        }
    }
}

/// Whether calls run the AVX2 kernel (else the portable loop); chosen once per
/// process. `KVPAGE_CPU_MATMUL_PORTABLE=1` forces the portable loop.
pub fn vectorized() -> bool {
    static CHOSEN: OnceLock<bool> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if std::env::var("KVPAGE_CPU_MATMUL_PORTABLE").as_deref() == Ok("1") {
            return false;
        }
        detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> bool {
    false
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
        return match &inputs.integer {
            Some(xq) => avx2::integer_tile(shape, xq, w, row_scales, y, start, end),
            None => avx2::float_tile(shape, inputs.x, w, row_scales, y, start, end),
        };
    }
    portable_tile(shape, inputs, w, row_scales, y, start, end)
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
    match &inputs.integer {
        Some(xq) => portable_integer_tile(shape, xq, w, row_scales, y, start, end),
        None => portable_float_tile(shape, inputs.x, w, row_scales, y, start, end),
    }
}

/// The row scale of weight row `out` (1 for types without one).
fn row_scale(shape: &QuantShape, row_scales: &[f32], out: usize) -> f32 {
    if shape.kind.row_scaled() {
        row_scales[out]
    } else {
        1.0
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

/// x86-64 with AVX2 + FMA + F16C: integer multiply-adds over 32 weights at once.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{row_scale, QuantShape, OUTS_PER_TILE};

    /// Inner elements of a tile's weight rows expanded to float at once (a
    /// multiple of every format's block, so a span never splits one): the
    /// tile's span, 16 x 256 floats, stays in L1 while every input row reads it.
    const PANEL_INNER: usize = 256;
    /// Input rows per expansion of a weight row on the few-row float path: one
    /// accumulator per row, four weight vectors and one input within 16
    /// registers (measured against 5 rows with two chains each: 8 rows 21.8 ->
    /// 17.0 ms, 16 rows 44 -> 35 ms for 30 layers of SmolLM2's matmuls).
    const FLOAT_ROW_GROUP: usize = 10;
    /// Calls of at least this many rows take the panel float path, fewer the
    /// row groups: expanding a span of the tile first, then its FMAs, does not
    /// overlap the two, and costs more than the panel's blocking saves below
    /// 16 rows (`cargo bench --bench cpu_matmul -- quant_qmatmul`, Q4_1, 30
    /// products: 4 rows 6.0 -> 10.9 ms, 16 rows 20.4 -> 19.9 ms, 32 rows 37 ->
    /// 29 ms).
    const PANEL_MIN_ROWS: usize = 16;
    /// Register blocking of the panel float path: input rows x weight rows per block,
    /// one accumulator each (8 accumulators, 4 weight vectors and 2 input
    /// vectors: 14 of the 16 registers).
    const BLOCK_ROWS: usize = 2;
    const BLOCK_OUTS: usize = 4;
    use crate::kernels::cpu_matmul::avx2::horizontal_sum;
    use crate::kernels::cpu_matmul::OutPtr;
    use crate::kernels::quant::activations::Q16Rows;
    use crate::kernels::quant::formats::{q4k_scale_min, QuantType, SUB};
    use std::arch::x86_64::*;

    /// One sub-block in registers: 32 integers as `i8` (unsigned formats' values
    /// are below 64), the scale and offset of each half.
    #[derive(Clone, Copy)]
    struct Sub {
        q: __m256i,
        scale: [f32; 2],
        min: [f32; 2],
    }

    /// One sub-block as the integer path reads it: weights `0..16` and `16..32`
    /// as 16-bit integers, the scale and offset of each half.
    #[derive(Clone, Copy)]
    struct WideSub {
        q: [__m256i; 2],
        scale: [f32; 2],
        min: [f32; 2],
    }

    /// A weight format's unpacking in registers (the layouts of
    /// [`crate::kernels::quant::formats`]); a type per format so every call inlines.
    trait Format {
        const KIND: QuantType;
        /// The offsets are zero.
        const SIGNED: bool;
        /// The two halves have their own scale and offset (Q6_K's 16-weight groups).
        const HALVES_DIFFER: bool = false;
        /// Sub-block `j` of the block at `block`.
        unsafe fn sub(block: *const u8, j: usize, row_scale: f32) -> Sub;

        /// [`Format::sub`] with 16-bit integers; formats whose bytes widen
        /// straight to 16 bits override it (fewer instructions than widening `q`).
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide_sub(block: *const u8, j: usize, row_scale: f32) -> WideSub {
            let sub = Self::sub(block, j, row_scale);
            WideSub {
                q: [
                    _mm256_cvtepi8_epi16(_mm256_castsi256_si128(sub.q)),
                    _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(sub.q)),
                ],
                scale: sub.scale,
                min: sub.min,
            }
        }
    }

    macro_rules! by_format {
        ($kind:expr, $function:ident, $args:tt) => {
            match $kind {
                QuantType::Q8_0 => $function::<Q8_0> $args,
                QuantType::Int8 => $function::<Int8> $args,
                QuantType::Q4_0 => $function::<Q4_0> $args,
                QuantType::Q4_1 => $function::<Q4_1> $args,
                QuantType::Q4K => $function::<Q4K> $args,
                QuantType::Q6K => $function::<Q6K> $args,
            }
        };
    }

    pub(super) unsafe fn integer_tile(
        shape: &QuantShape,
        xq: &Q16Rows,
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        by_format!(
            shape.kind,
            integer_tile_of,
            (shape, xq, w, row_scales, y, start, end)
        )
    }

    pub(super) unsafe fn float_tile(
        shape: &QuantShape,
        x: &[f32],
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        by_format!(
            shape.kind,
            float_tile_of,
            (shape, x, w, row_scales, y, start, end)
        )
    }

    /// The float path: the panel for [`PANEL_MIN_ROWS`] rows and more, row groups
    /// below. Both sum each output in the same order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_tile_of<F: Format>(
        shape: &QuantShape,
        x: &[f32],
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        if shape.rows >= PANEL_MIN_ROWS {
            panel_tile_of::<F>(shape, x, w, row_scales, y, start, end)
        } else {
            row_group_tile_of::<F>(shape, x, w, row_scales, y, start, end)
        }
    }

    /// The float path for few rows: each sub-block of a weight row expanded in
    /// registers and used at once by up to [`FLOAT_ROW_GROUP`] input rows, so
    /// the expansion overlaps the FMAs.
    unsafe fn row_group_tile_of<F: Format>(
        shape: &QuantShape,
        x: &[f32],
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        for first_row in (0..shape.rows).step_by(FLOAT_ROW_GROUP) {
            let rows = (shape.rows - first_row).min(FLOAT_ROW_GROUP);
            macro_rules! dispatch {
                ($($r:literal),*) => {
                    match rows {
                        $($r => float_group::<F, $r>(shape, x, w, row_scales, y, first_row, start, end),)*
                        _ => unreachable!("float row groups hold 1..={} rows", FLOAT_ROW_GROUP),
                    }
                };
            }
            dispatch!(1, 2, 3, 4, 5, 6, 7, 8, 9, 10);
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_group<F: Format, const R: usize>(
        shape: &QuantShape,
        x: &[f32],
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        first_row: usize,
        start: usize,
        end: usize,
    ) {
        let row_bytes = F::KIND.row_bytes(shape.inner).expect("validated");
        let x = x.as_ptr().add(first_row * shape.inner);
        for out in start..end {
            let row = w.as_ptr().add(out * row_bytes);
            let scale = row_scale(shape, row_scales, out);
            let sums = float_row_dots::<F, R>(row, scale, x, shape.inner);
            for (r, value) in sums.iter().enumerate() {
                *y.at((first_row + r) * shape.outs + out) = *value;
            }
        }
    }

    /// `x[r] · w_row` for `R` float input rows (stride `inner`), each sub-block
    /// expanded to float once; one accumulator chain per row, so a row's sum
    /// does not depend on `R`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // index loops name the register blocking
    unsafe fn float_row_dots<F: Format, const R: usize>(
        row: *const u8,
        row_scale: f32,
        x: *const f32,
        inner: usize,
    ) -> [f32; R] {
        let subs_per_block = F::KIND.block_elems() / SUB;
        let blocks = inner / F::KIND.block_elems();
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            for j in 0..subs_per_block {
                let sub = F::sub(row.add(b * F::KIND.block_bytes()), j, row_scale);
                let weights = expand(&sub);
                let base = (b * subs_per_block + j) * SUB;
                for r in 0..R {
                    let xr = x.add(r * inner + base);
                    for c in 0..4 {
                        let xv = _mm256_loadu_ps(xr.add(8 * c));
                        acc[r] = _mm256_fmadd_ps(xv, weights[c], acc[r]);
                    }
                }
            }
        }
        let mut sums = [0.0f32; R];
        for r in 0..R {
            sums[r] = horizontal_sum(acc[r]);
        }
        sums
    }

    /// The panel float path: the tile's weight rows are expanded to float a span of
    /// [`PANEL_INNER`] at a time, then every block of input rows x weight rows
    /// sums its span. Each output keeps one 8-lane accumulator that runs over
    /// `inner` front to back, as the float kernel's does, so a sum does not
    /// depend on the row count or the blocking.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn panel_tile_of<F: Format>(
        shape: &QuantShape,
        x: &[f32],
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        let (rows, inner, outs) = (shape.rows, shape.inner, end - start);
        debug_assert!(outs <= OUTS_PER_TILE && PANEL_INNER.is_multiple_of(F::KIND.block_elems()));
        let row_bytes = F::KIND.row_bytes(inner).expect("validated");
        let mut panel = Panel([0.0f32; OUTS_PER_TILE * PANEL_INNER]);
        let panel = &mut panel.0;
        let mut acc = vec![_mm256_setzero_ps(); rows * OUTS_PER_TILE];
        for span in (0..inner).step_by(PANEL_INNER) {
            let len = (inner - span).min(PANEL_INNER);
            for o in 0..outs {
                let row = w.as_ptr().add((start + o) * row_bytes);
                let scale = row_scale(shape, row_scales, start + o);
                expand_span::<F>(
                    row,
                    scale,
                    span,
                    len,
                    panel.as_mut_ptr().add(o * PANEL_INNER),
                );
            }
            // While the blocks below compute, fetch the weights the next span
            // expands (the next tile's first when this is the last): expanding
            // is a burst of loads that would otherwise wait on L3 or DRAM.
            prefetch_next_span(w, row_bytes, start, outs, span + len, inner, F::KIND);
            for r in (0..rows).step_by(BLOCK_ROWS) {
                let x_span = x.as_ptr().add(r * inner + span);
                for o in (0..outs).step_by(BLOCK_OUTS) {
                    let block = Block {
                        panel: panel.as_ptr().add(o * PANEL_INNER),
                        x: x_span,
                        x_stride: inner,
                        len,
                        acc: acc.as_mut_ptr().add(r * OUTS_PER_TILE + o),
                    };
                    macro_rules! dispatch {
                        ($(($r:literal, $o:literal)),*) => {
                            match ((rows - r).min(BLOCK_ROWS), (outs - o).min(BLOCK_OUTS)) {
                                $(($r, $o) => block.run::<$r, $o>(),)*
                                _ => unreachable!("blocks of 1..=2 rows x 1..=4 outs"),
                            }
                        };
                    }
                    dispatch!(
                        (1, 1),
                        (1, 2),
                        (1, 3),
                        (1, 4),
                        (2, 1),
                        (2, 2),
                        (2, 3),
                        (2, 4)
                    );
                }
            }
        }
        for r in 0..rows {
            for o in 0..outs {
                *y.at(r * shape.outs + start + o) = horizontal_sum(acc[r * OUTS_PER_TILE + o]);
            }
        }
    }

    /// Prefetch the bytes of weight rows `start..start + outs` that hold inner
    /// elements `next..next + PANEL_INNER` (`next == inner`: the following
    /// tile's first span).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prefetch_next_span(
        w: &[u8],
        row_bytes: usize,
        start: usize,
        outs: usize,
        next: usize,
        inner: usize,
        kind: QuantType,
    ) {
        let (start, next) = if next < inner {
            (start, next)
        } else {
            (start + outs, 0)
        };
        let per_elem = kind.block_bytes() as f32 / kind.block_elems() as f32;
        let first = (next as f32 * per_elem) as usize;
        let bytes = (PANEL_INNER.min(inner - next) as f32 * per_elem) as usize;
        for o in start..(start + OUTS_PER_TILE).min(w.len() / row_bytes) {
            let row = o * row_bytes + first;
            for line in (0..bytes).step_by(64) {
                if let Some(at) = w.get(row + line) {
                    _mm_prefetch::<_MM_HINT_T0>((at as *const u8).cast());
                }
            }
        }
    }

    /// The expanded span of a tile's weight rows, cache-line aligned so no
    /// vector load straddles two lines.
    #[repr(align(64))]
    struct Panel([f32; OUTS_PER_TILE * PANEL_INNER]);

    /// Weights `span..span + len` of one weight row as floats into `dst`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn expand_span<F: Format>(
        row: *const u8,
        row_scale: f32,
        span: usize,
        len: usize,
        dst: *mut f32,
    ) {
        let block_elems = F::KIND.block_elems();
        for k in (span..span + len).step_by(SUB) {
            let block = row.add(k / block_elems * F::KIND.block_bytes());
            let sub = F::sub(block, k % block_elems / SUB, row_scale);
            for (c, weights) in expand(&sub).iter().enumerate() {
                _mm256_storeu_ps(dst.add(k - span + 8 * c), *weights);
            }
        }
    }

    /// One block of input rows x weight rows over one span: `acc[r][o] += x[r] *
    /// panel[o]`, eight lanes at a time.
    struct Block {
        /// The first weight row's span, rows `PANEL_INNER` apart.
        panel: *const f32,
        /// The first input row's span, rows `x_stride` apart.
        x: *const f32,
        x_stride: usize,
        len: usize,
        /// The first row's first accumulator, rows `OUTS_PER_TILE` apart.
        acc: *mut __m256,
    }

    impl Block {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::needless_range_loop)] // index loops name the register blocking
        unsafe fn run<const R: usize, const O: usize>(&self) {
            let mut acc = [[_mm256_setzero_ps(); O]; R];
            for r in 0..R {
                for o in 0..O {
                    acc[r][o] = *self.acc.add(r * OUTS_PER_TILE + o);
                }
            }
            for k in (0..self.len).step_by(8) {
                let mut weights = [_mm256_setzero_ps(); O];
                for o in 0..O {
                    weights[o] = _mm256_loadu_ps(self.panel.add(o * PANEL_INNER + k));
                }
                for r in 0..R {
                    let xv = _mm256_loadu_ps(self.x.add(r * self.x_stride + k));
                    for o in 0..O {
                        acc[r][o] = _mm256_fmadd_ps(xv, weights[o], acc[r][o]);
                    }
                }
            }
            for r in 0..R {
                for o in 0..O {
                    *self.acc.add(r * OUTS_PER_TILE + o) = acc[r][o];
                }
            }
        }
    }

    /// A sub-block as 32 floats in four registers: `scale[h] * q + min[h]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn expand(sub: &Sub) -> [__m256; 4] {
        let halves = [
            _mm256_castsi256_si128(sub.q),
            _mm256_extracti128_si256::<1>(sub.q),
        ];
        let mut weights = [_mm256_setzero_ps(); 4];
        for (c, weight) in weights.iter_mut().enumerate() {
            let bytes = if c % 2 == 0 {
                halves[c / 2]
            } else {
                _mm_srli_si128::<8>(halves[c / 2])
            };
            let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            *weight = _mm256_fmadd_ps(
                values,
                _mm256_set1_ps(sub.scale[c / 2]),
                _mm256_set1_ps(sub.min[c / 2]),
            );
        }
        weights
    }

    pub(super) unsafe fn dequantize_rows(
        kind: QuantType,
        inner: usize,
        w: &[u8],
        row_scales: &[f32],
        out: OutPtr,
        start: usize,
        end: usize,
    ) {
        by_format!(
            kind,
            dequantize_rows_of,
            (inner, w, row_scales, out, start, end)
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // `o` indexes the rows, the scales and the output
    unsafe fn dequantize_rows_of<F: Format>(
        inner: usize,
        w: &[u8],
        row_scales: &[f32],
        out: OutPtr,
        start: usize,
        end: usize,
    ) {
        let row_bytes = F::KIND.row_bytes(inner).expect("validated");
        let subs_per_block = F::KIND.block_elems() / SUB;
        for o in start..end {
            let row = w.as_ptr().add(o * row_bytes);
            let scale = if F::KIND.row_scaled() {
                row_scales[o]
            } else {
                1.0
            };
            for b in 0..inner / F::KIND.block_elems() {
                for j in 0..subs_per_block {
                    let sub = F::sub(row.add(b * F::KIND.block_bytes()), j, scale);
                    let base = o * inner + (b * subs_per_block + j) * SUB;
                    for (c, weight) in expand(&sub).iter().enumerate() {
                        _mm256_storeu_ps(out.at(base + 8 * c), *weight);
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn integer_tile_of<F: Format>(
        shape: &QuantShape,
        xq: &Q16Rows,
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        let row_bytes = F::KIND.row_bytes(shape.inner).expect("validated");
        for r in 0..shape.rows {
            for out in start..end {
                let row = w.as_ptr().add(out * row_bytes);
                let scale = row_scale(shape, row_scales, out);
                *y.at(r * shape.outs + out) = integer_row_dot::<F>(row, scale, xq, r);
            }
        }
    }

    /// `x[r] · w_row` with 16-bit inputs: two `pmaddwd` per 32 weights.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn integer_row_dot<F: Format>(
        row: *const u8,
        row_scale: f32,
        xq: &Q16Rows,
        r: usize,
    ) -> f32 {
        let subs_per_block = F::KIND.block_elems() / SUB;
        let subs = xq.inner / SUB;
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0.0f32;
        let x_q = xq.q.as_ptr().add(r * xq.inner);
        let (x_d, x_half) = (
            xq.d.as_ptr().add(r * subs),
            xq.half_sums.as_ptr().add(2 * r * subs),
        );
        for b in 0..xq.inner / F::KIND.block_elems() {
            for j in 0..subs_per_block {
                let s = b * subs_per_block + j;
                let sub = F::wide_sub(row.add(b * F::KIND.block_bytes()), j, row_scale);
                let [low, high] = sub.q;
                let x0 = _mm256_loadu_si256(x_q.add(s * SUB) as *const __m256i);
                let x1 = _mm256_loadu_si256(x_q.add(s * SUB + 16) as *const __m256i);
                let low = _mm256_madd_epi16(low, x0);
                let high = _mm256_madd_epi16(high, x1);
                let dx = *x_d.add(s);
                let (h0, h1) = (*x_half.add(2 * s), *x_half.add(2 * s + 1));
                if F::HALVES_DIFFER {
                    let s0 = _mm256_set1_ps(sub.scale[0] * dx);
                    let s1 = _mm256_set1_ps(sub.scale[1] * dx);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), s0, acc);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), s1, acc);
                    offset += sub.min[0] * h0 + sub.min[1] * h1;
                } else {
                    let sum = _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
                    acc = _mm256_fmadd_ps(sum, _mm256_set1_ps(sub.scale[0] * dx), acc);
                    if !F::SIGNED {
                        offset += sub.min[0] * (h0 + h1);
                    }
                }
            }
        }
        horizontal_sum(acc) + offset
    }

    /// The halves at `at` and `at + 2` as floats (lanes 0 and 1), for the two
    /// adjacent f16 fields of Q4_1 and Q4_K (`d`, then `m` or `dmin`). Reads 4
    /// bytes: a lone half is read with [`one_f16`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn two_f16(at: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
            at as *const i32,
        )))
    }

    /// The half at `at` as a float, reading its 2 bytes only (a Q6_K block ends
    /// with its scale: a 4-byte read there ran past the end of the weights).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_f16(at: *const u8) -> f32 {
        let half = std::ptr::read_unaligned(at as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(half))))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lane1(v: __m128) -> f32 {
        _mm_cvtss_f32(_mm_movehdup_ps(v))
    }

    /// 16 bytes of nibbles: weights 0..16 the low nibbles, 16..32 the high ones.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles_16(at: *const u8) -> __m256i {
        let packed = _mm_loadu_si128(at as *const __m128i);
        let mask = _mm_set1_epi8(15);
        let low = _mm_and_si128(packed, mask);
        let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), mask);
        _mm256_set_m128i(high, low)
    }

    /// 16 bytes of signed integers at `at`, widened to 16 bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn signed_16(at: *const u8) -> __m256i {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(at as *const __m128i))
    }

    /// 16 bytes of nibbles at `at` widened to 16 bits: `[low nibbles, high
    /// nibbles]` (weights 0..16 and 16..32 of Q4_0 and Q4_1).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles_wide(at: *const u8) -> [__m256i; 2] {
        let bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(at as *const __m128i));
        [
            _mm256_and_si256(bytes, _mm256_set1_epi16(15)),
            _mm256_srli_epi16::<4>(bytes),
        ]
    }

    struct Q8_0;
    impl Format for Q8_0 {
        const KIND: QuantType = QuantType::Q8_0;
        const SIGNED: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(block: *const u8, _j: usize, _row_scale: f32) -> Sub {
            Sub {
                q: _mm256_loadu_si256(block.add(2) as *const __m256i),
                scale: [one_f16(block); 2],
                min: [0.0; 2],
            }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide_sub(block: *const u8, _j: usize, _row_scale: f32) -> WideSub {
            WideSub {
                q: [signed_16(block.add(2)), signed_16(block.add(18))],
                scale: [one_f16(block); 2],
                min: [0.0; 2],
            }
        }
    }

    struct Int8;
    impl Format for Int8 {
        const KIND: QuantType = QuantType::Int8;
        const SIGNED: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(block: *const u8, _j: usize, row_scale: f32) -> Sub {
            Sub {
                q: _mm256_loadu_si256(block as *const __m256i),
                scale: [row_scale; 2],
                min: [0.0; 2],
            }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide_sub(block: *const u8, _j: usize, row_scale: f32) -> WideSub {
            WideSub {
                q: [signed_16(block), signed_16(block.add(16))],
                scale: [row_scale; 2],
                min: [0.0; 2],
            }
        }
    }

    struct Q4_0;
    impl Format for Q4_0 {
        const KIND: QuantType = QuantType::Q4_0;
        const SIGNED: bool = false;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(block: *const u8, _j: usize, _row_scale: f32) -> Sub {
            let d = one_f16(block);
            Sub {
                q: nibbles_16(block.add(2)),
                scale: [d; 2],
                min: [-8.0 * d; 2],
            }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide_sub(block: *const u8, _j: usize, _row_scale: f32) -> WideSub {
            let d = one_f16(block);
            WideSub {
                q: nibbles_wide(block.add(2)),
                scale: [d; 2],
                min: [-8.0 * d; 2],
            }
        }
    }

    struct Q4_1;
    impl Format for Q4_1 {
        const KIND: QuantType = QuantType::Q4_1;
        const SIGNED: bool = false;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(block: *const u8, _j: usize, _row_scale: f32) -> Sub {
            let dm = two_f16(block);
            let m = lane1(dm);
            Sub {
                q: nibbles_16(block.add(4)),
                scale: [_mm_cvtss_f32(dm); 2],
                min: [m; 2],
            }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide_sub(block: *const u8, _j: usize, _row_scale: f32) -> WideSub {
            let dm = two_f16(block);
            WideSub {
                q: nibbles_wide(block.add(4)),
                scale: [_mm_cvtss_f32(dm); 2],
                min: [lane1(dm); 2],
            }
        }
    }

    struct Q4K;
    impl Format for Q4K {
        const KIND: QuantType = QuantType::Q4K;
        const SIGNED: bool = false;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(block: *const u8, j: usize, _row_scale: f32) -> Sub {
            let (scale, min) = Q4K::scale_min(block, j);
            let packed = _mm256_loadu_si256(block.add(16 + 32 * (j / 2)) as *const __m256i);
            let packed = if j % 2 == 1 {
                _mm256_srli_epi16::<4>(packed)
            } else {
                packed
            };
            Sub {
                q: _mm256_and_si256(packed, _mm256_set1_epi8(15)),
                scale: [scale; 2],
                min: [min; 2],
            }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide_sub(block: *const u8, j: usize, _row_scale: f32) -> WideSub {
            let (scale, min) = Q4K::scale_min(block, j);
            let at = block.add(16 + 32 * (j / 2));
            let mut low = _mm256_cvtepu8_epi16(_mm_loadu_si128(at as *const __m128i));
            let mut high = _mm256_cvtepu8_epi16(_mm_loadu_si128(at.add(16) as *const __m128i));
            if j % 2 == 1 {
                low = _mm256_srli_epi16::<4>(low);
                high = _mm256_srli_epi16::<4>(high);
            }
            let mask = _mm256_set1_epi16(15);
            WideSub {
                q: [_mm256_and_si256(low, mask), _mm256_and_si256(high, mask)],
                scale: [scale; 2],
                min: [min; 2],
            }
        }
    }

    impl Q4K {
        /// Sub-block `j`'s float scale and offset.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn scale_min(block: *const u8, j: usize) -> (f32, f32) {
            let dm = two_f16(block);
            let scales = std::slice::from_raw_parts(block.add(4), 12);
            let (sc, m) = q4k_scale_min(scales, j);
            (
                _mm_cvtss_f32(dm) * f32::from(sc),
                -(lane1(dm) * f32::from(m)),
            )
        }
    }

    struct Q6K;
    impl Format for Q6K {
        const KIND: QuantType = QuantType::Q6K;
        const SIGNED: bool = false;
        const HALVES_DIFFER: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn sub(block: *const u8, j: usize, _row_scale: f32) -> Sub {
            let (half, chunk) = (j / 4, j % 4);
            let d = one_f16(block.add(208));
            let low = _mm256_loadu_si256(block.add(64 * half + 32 * (chunk & 1)) as *const __m256i);
            let high = _mm256_loadu_si256(block.add(128 + 32 * half) as *const __m256i);
            let low = if chunk >= 2 {
                _mm256_srli_epi16::<4>(low)
            } else {
                low
            };
            let high = match chunk {
                0 => high,
                1 => _mm256_srli_epi16::<2>(high),
                2 => _mm256_srli_epi16::<4>(high),
                _ => _mm256_srli_epi16::<6>(high),
            };
            let low = _mm256_and_si256(low, _mm256_set1_epi8(15));
            let high = _mm256_and_si256(high, _mm256_set1_epi8(3));
            let q = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
            let scales = block.add(192 + 8 * half + 2 * chunk) as *const i8;
            let s0 = d * f32::from(*scales);
            let s1 = d * f32::from(*scales.add(1));
            Sub {
                q,
                scale: [s0, s1],
                min: [-32.0 * s0, -32.0 * s1],
            }
        }
    }
}
