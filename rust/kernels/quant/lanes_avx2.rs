//! The integer path with AVX2 alone for weights packed into tiles: one to
//! [`LANES_ROWS`] input rows against a tile of sixteen weight rows of Q4_0 or
//! Q4_1, as two halves of eight, lane `o` of every register holding weight row
//! `o` of its half, so no sum is ever reduced across lanes.
//!
//! The row-at-a-time kernel (`qmatmul_avx2.rs`) widens a weight row's
//! sub-block to 16 bits, multiplies it with `pmaddwd`, and pays per weight row
//! and sub-block a scalar scale, a broadcast and its own chain of float adds:
//! ~3.3 ns a 32-weight sub-block on a Zen 3 core, compute-bound (bench moe's
//! one-token decode at 0.69x llama.cpp, 2026-11-29). Here a block of eight
//! rows' nibbles is four registers as packed by [`super::tiles::pack_tiles`]
//! (register `q`, lane `o`: row `o`'s bytes `4q..4q + 4`), masked into eight
//! registers of one weight a byte; `pmaddubsw` with four input bytes broadcast
//! adds, per lane, two products into each of its two 16-bit halves. The 16-bit
//! inputs go in as two bytes each (`q = 256 · high + low`, [`Q16Rows`]), so
//! the integer sums are exactly those of 16-bit products, as in the AVX-512
//! lanes kernel (`lanes_avx512.rs`, whose `vpdpbusd` AVX2 lacks: here
//! `pmaddubsw`, 16-bit adds and three `pmaddwd` per block and input row).
//! With 8-bit inputs (`set_cpu_input_bits(8)`: every `low` is 0) the `low`
//! half is left out: eight `pmaddubsw` and one `pmaddwd` per block and row.
//! Weights in GGUF's row order keep the row-at-a-time kernel: transposing
//! eight rows here for every block made one-row products 1.85x slower than it
//! (`cargo bench --bench cpu_matmul`, 2026-11-29), so a packed matrix and the
//! same matrix in rows agree to the integer path's rounding, not to the bit
//! (on AVX-512 VNNI they agree to the bit).
//!
//! No 16-bit sum saturates or wraps: a weight is `0..=15`, `high` is
//! `-128..=127` and `low` `0..=255`; a `pmaddubsw` pair is at most `2 · 15 ·
//! 128 = 3840` with `high` and `2 · 255 · 15 = 7650` with `low`, and the
//! kernel adds at most eight `high` pairs (30720) and four `low` pairs (30600)
//! before widening to 32 bits (`i16::MAX` is 32767).
//!
//! Per block `b` and weight row `o` the kernel adds `factor[o, b] · d_x[b] ·
//! Σ q · q_x + offset[o, b] · Σ x`, block after block, the same instructions
//! in the same order for an input row whatever the other rows of the call: a
//! row's result is the same alone or among any others (a speculative
//! verification's rows equal the decode step's; calls of more than
//! [`LANES_ROWS`] rows are cut into blocks by `qmatmul::Inputs::prepare_packed`).
//!
//! Every function here needs AVX2, FMA and F16C ([`takes`] checks them).

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::activations::Q16Rows;
use super::call::{vectorized, QuantShape, OUTS_PER_TILE};
use super::formats::{QuantType, SUB};
use crate::kernels::cpu_matmul::OutPtr;

/// Input rows of one call of the kernel (a call of more is cut into blocks of
/// this many by `qmatmul::Inputs::prepare_packed`).
pub const LANES_ROWS: usize = 16;

/// Weight rows in a register's lanes.
const LANES: usize = 8;
/// A tile's halves of [`LANES`] rows.
const HALVES: usize = OUTS_PER_TILE / LANES;
const _: () = assert!(OUTS_PER_TILE == 2 * LANES);

/// Whether calls of `kind` on this CPU take this path: a format it [`reads`],
/// AVX2 without the AVX-512 kernels (`KVPAGE_CPU_AVX512=0` hands an AVX-512
/// CPU to it), and `KVPAGE_CPU_LANES` not `0` (A/B runs; read once per
/// process).
pub fn takes(kind: QuantType) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    reads(kind)
        && vectorized()
        && !super::qmatmul_avx2::panel_from_two_rows()
        && *ON.get_or_init(|| std::env::var("KVPAGE_CPU_LANES").map_or(true, |v| v != "0"))
}

/// Whether this path reads `kind`: 4-bit nibbles after `f16` fields.
pub fn reads(kind: QuantType) -> bool {
    matches!(kind, QuantType::Q4_0 | QuantType::Q4_1)
}

/// A format this path reads.
trait Nibbles {
    const KIND: QuantType;
    /// `w = d · q + m`, with an `f16 m` after `d`; else `w = d · (q − 8)`.
    const M_FIELD: bool;
    /// Bytes of `f16` fields before a block's sixteen bytes of nibbles.
    const HEADER: usize = if Self::M_FIELD { 4 } else { 2 };
}

struct Q4_0;
struct Q4_1;

impl Nibbles for Q4_0 {
    const KIND: QuantType = QuantType::Q4_0;
    const M_FIELD: bool = false;
}

impl Nibbles for Q4_1 {
    const KIND: QuantType = QuantType::Q4_1;
    const M_FIELD: bool = true;
}

/// Weight rows `start..end` (one tile) of `y`, every row of `xq`, from
/// weights packed by [`super::tiles::pack_tiles`].
///
/// # Safety
/// [`takes`]`(shape.kind)`; `xq` quantized from an `x` that passed validation
/// with `w` and `y` for `shape`, with at most [`LANES_ROWS`] rows; `w` packed;
/// `end - start == 16`; no other thread writes rows `start..end`.
pub(super) unsafe fn tile_packed(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    match shape.kind {
        QuantType::Q4_0 => tile_packed_of::<Q4_0>(shape, xq, w, y, start, end),
        QuantType::Q4_1 => tile_packed_of::<Q4_1>(shape, xq, w, y, start, end),
        kind => unreachable!("{} is not packed into tiles", kind.name()),
    }
}

/// Per lane, the float factor of a block's integer sums and its offset per
/// unit of `Σ x`, from the block's `d` (and `m`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn factors<F: Nibbles>(d: __m256, m: __m256) -> (__m256, __m256) {
    if F::M_FIELD {
        (d, m)
    } else {
        (d, _mm256_mul_ps(d, _mm256_set1_ps(-8.0)))
    }
}

/// The nibbles of a block of eight rows, `t` as packed (register `q`, lane
/// `o`: row `o`'s bytes `4q..4q + 4`), one weight a byte: register `j`, lane
/// `o` holds row `o`'s weights `4j..4j + 4` (the low nibbles of bytes `0..16`
/// are weights `0..16`, the high ones `16..32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_quads(t: &[__m256i; 4]) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(15);
    let mut quads = [_mm256_setzero_si256(); 8];
    for (q, t) in t.iter().enumerate() {
        quads[q] = _mm256_and_si256(*t, mask);
        // 16-bit shifts move the next byte's low nibble into this byte's
        // high one; the mask drops it.
        quads[q + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(*t), mask);
    }
    quads
}

/// Ask the cache for `row[range]`, a line at a time (a hint: never faults).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch(row: *const u8, range: std::ops::Range<usize>) {
    let mut at = range.start;
    while at < range.end {
        _mm_prefetch::<_MM_HINT_T0>(row.add(at) as *const i8);
        at += 64;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_packed_of<F: Nibbles>(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    debug_assert!(end - start == OUTS_PER_TILE && xq.rows <= LANES_ROWS);
    debug_assert!(shape.outs.is_multiple_of(OUTS_PER_TILE));
    let bb = F::KIND.block_bytes();
    // A packed block: each `f16` field of the sixteen rows (32 bytes), then
    // four registers' worth of nibbles (64 bytes each, lane `o` at `4o`).
    let block_bytes = OUTS_PER_TILE * bb;
    let nibbles_at = OUTS_PER_TILE * F::HEADER;
    let row_bytes = shape.kind.row_bytes(shape.inner).expect("validated");
    let tile_bytes = OUTS_PER_TILE * row_bytes;
    let base = w.as_ptr().add(start * row_bytes);
    // One stream: blocks asked for `AHEAD` blocks before they are read.
    const AHEAD: usize = 4;
    prefetch(base, 0..(AHEAD * block_bytes).min(tile_bytes));
    let mut acc = [[_mm256_setzero_ps(); LANES_ROWS]; HALVES];
    for b in 0..shape.inner / SUB {
        let ahead = (b + AHEAD) * block_bytes;
        if ahead < tile_bytes {
            prefetch(base, ahead..ahead + block_bytes);
        }
        let at = base.add(b * block_bytes);
        for (h, acc) in acc.iter_mut().enumerate() {
            // Field `f` of the half's rows at `f · 32 + 16 h`.
            let d = _mm256_cvtph_ps(_mm_loadu_si128(at.add(2 * LANES * h) as *const __m128i));
            let m = if F::M_FIELD {
                _mm256_cvtph_ps(_mm_loadu_si128(
                    at.add(2 * OUTS_PER_TILE + 2 * LANES * h) as *const __m128i
                ))
            } else {
                d
            };
            let (factor, offset) = factors::<F>(d, m);
            let mut t = [_mm256_setzero_si256(); 4];
            for (q, t) in t.iter_mut().enumerate() {
                *t = _mm256_loadu_si256(at.add(nibbles_at + 64 * q + 32 * h) as *const __m256i);
            }
            let quads = nibble_quads(&t);
            if xq.bits == 8 {
                add_block::<false>(&quads, factor, offset, xq, b, acc);
            } else {
                add_block::<true>(&quads, factor, offset, xq, b, acc);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        for (r, acc) in acc.iter().enumerate().take(xq.rows) {
            _mm256_storeu_ps(y.at(r * shape.outs + start + h * LANES), *acc);
        }
    }
}

/// The four bytes at `p + at` in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn broadcast(p: *const u8, at: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p.add(at) as *const i32))
}

/// Block `b` of eight weight rows (`quads`, `factor` and `offset` per lane)
/// against every row of `xq`, into `acc`.
///
/// The integer sum of an input row and a weight row is `Σ w · q` over the
/// block, with `q = 256 · high + low` ([`Q16Rows`]): `256 · Σ w · high + Σ w ·
/// low`, in `pmaddubsw` (pairs of unsigned by signed bytes; the weight is the
/// unsigned operand for `high`, `low` for the other), 16-bit adds within the
/// module's bounds, and `pmaddwd` to 32 bits. The sums are exact, so any order
/// of the integer instructions gives the same result; the float steps after
/// them are a row's own, in a fixed order. Without `LOW` (8-bit inputs: every
/// `low` is 0) the `low` products are left out, half the multiply-adds, to the
/// same sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_block<const LOW: bool>(
    quads: &[__m256i; 8],
    factor: __m256,
    offset: __m256,
    xq: &Q16Rows,
    b: usize,
    acc: &mut [__m256; LANES_ROWS],
) {
    // (No closures here or in the callers: they would not inherit the
    // target features.)
    let subs = xq.inner / SUB;
    let ones = _mm256_set1_epi16(1);
    #[allow(clippy::needless_range_loop)] // index loops name the register blocking
    for r in 0..xq.rows {
        let first = r * xq.inner + b * SUB;
        let (high, low) = (xq.high.as_ptr() as *const u8, xq.low.as_ptr());
        // Weights 8p..8p + 8 (registers 2p, 2p + 1): one pair each of `high`
        // and `low` sums per lane half.
        let mut high_sum = _mm256_setzero_si256();
        let mut low_sums = [_mm256_setzero_si256(); 2];
        for p in 0..4 {
            let (j, at) = (2 * p, first + 8 * p);
            let h = _mm256_add_epi16(
                _mm256_maddubs_epi16(quads[j], broadcast(high, at)),
                _mm256_maddubs_epi16(quads[j + 1], broadcast(high, at + 4)),
            );
            high_sum = _mm256_add_epi16(high_sum, h);
            if LOW {
                let l = _mm256_add_epi16(
                    _mm256_maddubs_epi16(broadcast(low, at), quads[j]),
                    _mm256_maddubs_epi16(broadcast(low, at + 4), quads[j + 1]),
                );
                low_sums[p / 2] = _mm256_add_epi16(low_sums[p / 2], l);
            }
        }
        let mut sum = _mm256_madd_epi16(high_sum, _mm256_set1_epi16(256));
        if LOW {
            sum = _mm256_add_epi32(
                sum,
                _mm256_add_epi32(
                    _mm256_madd_epi16(low_sums[0], ones),
                    _mm256_madd_epi16(low_sums[1], ones),
                ),
            );
        }
        let at = r * subs + b;
        let scale = _mm256_mul_ps(factor, _mm256_set1_ps(xq.d[at]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xq.sums[at]), acc[r]);
    }
}
