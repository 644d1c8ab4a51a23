//! The AVX2 + FMA + F16C kernels of [`super::qmatmul`]: integer
//! multiply-adds over 32 weights at once for one row, float sub-blocks shared
//! by row groups or a panel for more (the paths are described in
//! [`super::qmatmul`]). Sub-blocks are unpacked by [`super::unpack_avx2`].
//!
//! Every function here needs AVX2, FMA and F16C: [`super::qmatmul::tile`]
//! checks [`super::call::vectorized`] first.

use std::arch::x86_64::*;

use super::activations::Q16Rows;
use super::call::{row_scale, QuantShape, OUTS_PER_TILE};
use super::formats::{QuantType, SUB};
use super::panel_avx512;
use super::panel_block::{Block, PANEL_INNER};
use super::unpack_avx2::{by_format, expand, Format, WideSub};
use crate::kernels::cpu_matmul::avx2::horizontal_sum;
use crate::kernels::cpu_matmul::OutPtr;

/// Input rows per unpacking of a weight sub-block on the integer path: one
/// accumulator per row, the two 16-bit weight vectors and a row's two inputs
/// and products within 16 registers.
const INTEGER_ROW_GROUP: usize = 4;
/// Calls of at most this many rows take the AVX2 integer path
/// ([`super::qmatmul::integer_rows`]), more the float path. Per extra row it
/// costs ~1.5 ns a sub-block against the float row groups' fixed ~10 ns of
/// FMA latency chains, and about what the panel costs at 16 rows
/// (`cargo bench --bench cpu_matmul -- quant_qmatmul`, Q4_0 576x1536 x 30 on a
/// 2-core Zen 3, float -> integer: 2 rows 8.7 -> 3.6-3.9 ms, 4 rows 9.7 ->
/// 5.7-6.2, 8 rows 9.3 -> 8.7-12.0, 16 rows 20.3 -> 17.2-21.4, 32 rows 29.8 ->
/// 37-50; 2026-11-29, `benches/RESULTS.md`), so a verification of up to 15
/// drafted tokens gets the decode step's bits.
pub(super) const INTEGER_ROWS: usize = 16;
/// Input rows per expansion of a weight row on the few-row float path: one
/// accumulator per row, four weight vectors and one input within 16
/// registers (measured against 5 rows with two chains each: 8 rows 21.8 ->
/// 17.0 ms, 16 rows 44 -> 35 ms for 30 layers of SmolLM2's matmuls).
const FLOAT_ROW_GROUP: usize = 10;
/// Calls of at least this many rows take the panel float path, fewer the
/// row groups. With AVX2 alone, expanding a span of the tile first, then its
/// FMAs, does not overlap the two, and costs more than the panel's blocking
/// saves below 16 rows (`cargo bench --bench cpu_matmul -- quant_qmatmul`,
/// Q4_1, 30 products: 4 rows 6.0 -> 10.9 ms, 16 rows 20.4 -> 19.9 ms, 32 rows
/// 37 -> 29 ms). With AVX-512 the panel's expansion takes two widenings per
/// sub-block instead of a dozen shuffles, and the panel wins from 2 rows on
/// the formats with one scale per sub-block, whose row groups ran at half
/// speed (30 products, 2 / 4 / 6 rows, 2026-11-27: Q4_0 6.6 / 7.6 / 6.1 ->
/// 3.3 / 4.1 / 5.5 ms, Q5_0 6.5 / 7.3 / 7.8 -> 4.1 / 5.0 / 5.9 ms, Q8_0
/// 5.9 / 6.7 / 5.0 -> 3.5 / 4.2 / 5.4 ms), at +0-10 % on Q4_1, Q4_K and
/// Q6_K (`benches/RESULTS.md`, "Few-row quantized products").
/// Whether the float panel takes calls from 2 rows (AVX-512), where the AVX2
/// integer path of [`INTEGER_ROWS`] is not used past one row.
pub(super) fn panel_from_two_rows() -> bool {
    panel_avx512::available()
}

fn panel_min_rows() -> usize {
    if panel_avx512::available() {
        2
    } else {
        16
    }
}
/// Register blocking of the panel float path: input rows x weight rows per block,
/// one accumulator each (8 accumulators, 4 weight vectors and 2 input
/// vectors: 14 of the 16 registers).
const BLOCK_ROWS: usize = 2;
const BLOCK_OUTS: usize = 4;

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

/// The float path: the panel for [`panel_min_rows`] rows and more, row groups
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
    if shape.rows >= panel_min_rows() {
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
        prefetch_ahead(w, (out + 1) * row_bytes, row_bytes);
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
            let weights = expand::<F>(&sub);
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
    debug_assert!(
        end - start <= OUTS_PER_TILE && PANEL_INNER.is_multiple_of(F::KIND.block_elems())
    );
    PANEL_SCRATCH.with_borrow_mut(|scratch| {
        let (panel, acc) = scratch.for_call(shape.rows);
        panel_tile_in::<F>(shape, x, w, row_scales, y, start, end, panel, acc)
    })
}

/// Per worker thread, the panel and the accumulators of its panel tiles,
/// allocated once: a fresh 16 KiB panel and accumulator vector per tile cost
/// a memset and an allocation each (~9 % of a 2-row call, perf).
struct PanelScratch {
    panel: Box<Panel>,
    acc: Vec<__m256>,
}

thread_local! {
    static PANEL_SCRATCH: std::cell::RefCell<PanelScratch> = std::cell::RefCell::new(PanelScratch {
        panel: Box::new(Panel([0.0; OUTS_PER_TILE * PANEL_INNER])),
        acc: Vec::new(),
    });
}

impl PanelScratch {
    /// The panel and `rows` rows of zeroed accumulators. Rows of the panel a
    /// tile does not fill hold an earlier tile's weights: the odd row the
    /// AVX-512 block reads past a tile's last has its sums dropped.
    fn for_call(&mut self, rows: usize) -> (&mut [f32], &mut [__m256]) {
        self.acc.clear();
        // SAFETY: AVX is available wherever the panel path runs.
        self.acc
            .resize(rows * OUTS_PER_TILE, unsafe { _mm256_setzero_ps() });
        (&mut self.panel.0, &mut self.acc)
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_tile_in<F: Format>(
    shape: &QuantShape,
    x: &[f32],
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
    start: usize,
    end: usize,
    panel: &mut [f32],
    acc: &mut [__m256],
) {
    let (rows, inner, outs) = (shape.rows, shape.inner, end - start);
    let row_bytes = F::KIND.row_bytes(inner).expect("validated");
    let wide = panel_avx512::available();
    for span in (0..inner).step_by(PANEL_INNER) {
        let len = (inner - span).min(PANEL_INNER);
        for o in 0..outs {
            let row = w.as_ptr().add((start + o) * row_bytes);
            let scale = row_scale(shape, row_scales, start + o);
            let expand_span = if wide {
                panel_avx512::expand_span::<F>
            } else {
                expand_span::<F>
            };
            expand_span(
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
        if wide {
            panel_avx512::blocks(
                panel.as_ptr(),
                x,
                inner,
                span,
                len,
                rows,
                outs,
                acc.as_mut_ptr(),
            );
        } else {
            for r in (0..rows).step_by(BLOCK_ROWS) {
                for o in (0..outs).step_by(BLOCK_OUTS) {
                    let block =
                        Block::at(panel.as_ptr(), x, inner, span, len, acc.as_mut_ptr(), r, o);
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
    let rows = (start + OUTS_PER_TILE).min(w.len() / row_bytes);
    for o in start..rows {
        // Inside `w`: `first + bytes <= row_bytes` for a row `o < outs`.
        let row = w.as_ptr().add(o * row_bytes + first);
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(row.add(line).cast());
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
        for (c, weights) in expand::<F>(&sub).iter().enumerate() {
            _mm256_storeu_ps(dst.add(k - span + 8 * c), *weights);
        }
    }
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

/// The integer path: each weight row read once from memory and unpacked once
/// per group of up to [`INTEGER_ROW_GROUP`] input rows.
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
    if shape.rows == 1 && F::INTERLEAVES_OUTS {
        return one_row_tile_of::<F>(shape, xq, w, row_scales, y, start, end);
    }
    for out in start..end {
        prefetch_ahead(w, (out + 1) * row_bytes, row_bytes);
        let row = w.as_ptr().add(out * row_bytes);
        let scale = row_scale(shape, row_scales, out);
        for first in (0..shape.rows).step_by(INTEGER_ROW_GROUP) {
            macro_rules! dispatch {
                ($($r:literal),*) => {
                    match (shape.rows - first).min(INTEGER_ROW_GROUP) {
                        $($r => {
                            let sums = integer_row_dots::<F, $r>(row, scale, xq, first);
                            for (r, value) in sums.iter().enumerate() {
                                *y.at((first + r) * shape.outs + out) = *value;
                            }
                        })*
                        _ => unreachable!("integer row groups hold 1..={INTEGER_ROW_GROUP} rows"),
                    }
                };
            }
            dispatch!(1, 2, 3, 4);
        }
    }
}

/// The integer path for one input row of a format that
/// [`Format::INTERLEAVES_OUTS`]: [`ONE_ROW_OUTS`] weight rows at a time,
/// so their accumulation chains overlap (one row's chain of dependent FMAs
/// would wait on each sub-block's latency) and the input is loaded once for
/// them. Each output runs exactly the operations of [`integer_row_dots`] for
/// one row, so the result equals that of the same row in a call of more rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn one_row_tile_of<F: Format>(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    row_scales: &[f32],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    let row_bytes = F::KIND.row_bytes(shape.inner).expect("validated");
    let mut out = start;
    while out + ONE_ROW_OUTS <= end {
        prefetch_ahead(
            w,
            (out + ONE_ROW_OUTS) * row_bytes,
            ONE_ROW_OUTS * row_bytes,
        );
        let rows: [*const u8; ONE_ROW_OUTS] =
            std::array::from_fn(|o| w.as_ptr().add((out + o) * row_bytes));
        let scales = std::array::from_fn(|o| row_scale(shape, row_scales, out + o));
        let sums = integer_out_dots::<F, ONE_ROW_OUTS>(rows, scales, xq);
        for (o, value) in sums.iter().enumerate() {
            *y.at(out + o) = *value;
        }
        out += ONE_ROW_OUTS;
    }
    for out in out..end {
        prefetch_ahead(w, (out + 1) * row_bytes, row_bytes);
        let row = w.as_ptr().add(out * row_bytes);
        let [value] = integer_row_dots::<F, 1>(row, row_scale(shape, row_scales, out), xq, 0);
        *y.at(out) = value;
    }
}

/// Weight rows per pass of [`one_row_tile_of`]: one accumulator each, the
/// input's two vectors, and a weight row's unpacked sub-block within 16
/// registers.
const ONE_ROW_OUTS: usize = 4;

/// `x[0] · w_row[o]` for `O` weight rows: per 32 inputs loaded once, each
/// row's sub-block unpacked and multiplied as [`integer_row_dots`] does for
/// one input row (the same operations in the same order per output).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // index loops name the register blocking
unsafe fn integer_out_dots<F: Format, const O: usize>(
    rows: [*const u8; O],
    row_scales: [f32; O],
    xq: &Q16Rows,
) -> [f32; O] {
    let subs_per_block = F::KIND.block_elems() / SUB;
    let mut acc = [_mm256_setzero_ps(); O];
    let mut offset = [0.0f32; O];
    let x_q = xq.q.as_ptr();
    for b in 0..xq.inner / F::KIND.block_elems() {
        for j in 0..subs_per_block {
            let s = b * subs_per_block + j;
            let xr = x_q.add(s * SUB);
            let x0 = _mm256_loadu_si256(xr as *const __m256i);
            let x1 = _mm256_loadu_si256(xr.add(16) as *const __m256i);
            let dx = *xq.d.get_unchecked(s);
            for o in 0..O {
                let sub = F::wide_sub(rows[o].add(b * F::KIND.block_bytes()), j, row_scales[o]);
                accumulate_sub::<F>(&sub, [x0, x1], dx, xq, s, &mut acc[o], &mut offset[o]);
            }
        }
    }
    let mut sums = [0.0f32; O];
    for o in 0..O {
        sums[o] = horizontal_sum(acc[o]) + offset[o];
    }
    sums
}

/// One 32-weight sub-block of one output and one input row on the integer
/// path: `sub` against the row's 16-bit inputs `x` (scale `dx`; `index`, the
/// row's sub-block counted over all rows of `xq`, finds its sums), into the
/// output's accumulator and offset. Every integer-path caller sums through
/// here, so an output's bits do not depend on how a call groups its rows or
/// outputs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_sub<F: Format>(
    sub: &WideSub,
    x: [__m256i; 2],
    dx: f32,
    xq: &Q16Rows,
    index: usize,
    acc: &mut __m256,
    offset: &mut f32,
) {
    let low = _mm256_madd_epi16(sub.q[0], x[0]);
    let high = _mm256_madd_epi16(sub.q[1], x[1]);
    if F::HALVES_DIFFER {
        let h0 = *xq.half_sums.get_unchecked(2 * index);
        let h1 = *xq.half_sums.get_unchecked(2 * index + 1);
        let s0 = _mm256_set1_ps(sub.scale[0] * dx);
        let s1 = _mm256_set1_ps(sub.scale[1] * dx);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), s0, *acc);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), s1, *acc);
        *offset += sub.min[0] * h0 + sub.min[1] * h1;
    } else {
        let sum = _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
        *acc = _mm256_fmadd_ps(sum, _mm256_set1_ps(sub.scale[0] * dx), *acc);
        if !F::SIGNED {
            *offset += sub.min[0] * *xq.sums.get_unchecked(index);
        }
    }
}

/// Bytes ahead of the weight row being read that the one-row and row-group
/// paths ask the cache for (1, 2, 4 and 8 KiB tried: 2 KiB fastest from
/// DRAM, `cargo bench --bench cpu_matmul -- quant_one_row`).
const PREFETCH_AHEAD: usize = 2048;

/// Prefetch `w[from + PREFETCH_AHEAD ..][..len]`, the part inside `w`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prefetch_ahead(w: &[u8], from: usize, len: usize) {
    let first = from + PREFETCH_AHEAD;
    let last = (first + len).min(w.len());
    let mut at = first;
    while at < last {
        _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(at).cast());
        at += 64;
    }
}

/// `x[r] · w_row` for the `R` 16-bit input rows from `first`: per 32 weights
/// unpacked once, two `pmaddwd` per row. Each row runs exactly the operations
/// of a call of that row alone (its own accumulator and offset, in the same
/// order), so its result does not depend on `R` or on the call's other rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // index loops name the register blocking
unsafe fn integer_row_dots<F: Format, const R: usize>(
    row: *const u8,
    row_scale: f32,
    xq: &Q16Rows,
    first: usize,
) -> [f32; R] {
    let subs_per_block = F::KIND.block_elems() / SUB;
    let subs = xq.inner / SUB;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut offset = [0.0f32; R];
    let x_q = xq.q.as_ptr().add(first * xq.inner);
    for b in 0..xq.inner / F::KIND.block_elems() {
        for j in 0..subs_per_block {
            let s = b * subs_per_block + j;
            let sub = F::wide_sub(row.add(b * F::KIND.block_bytes()), j, row_scale);
            for r in 0..R {
                let xr = x_q.add(r * xq.inner + s * SUB);
                let x0 = _mm256_loadu_si256(xr as *const __m256i);
                let x1 = _mm256_loadu_si256(xr.add(16) as *const __m256i);
                let index = (first + r) * subs + s;
                let dx = *xq.d.get_unchecked(index);
                accumulate_sub::<F>(&sub, [x0, x1], dx, xq, index, &mut acc[r], &mut offset[r]);
            }
        }
    }
    let mut sums = [0.0f32; R];
    for r in 0..R {
        sums[r] = horizontal_sum(acc[r]) + offset[r];
    }
    sums
}
