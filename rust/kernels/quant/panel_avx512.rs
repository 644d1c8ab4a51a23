//! The AVX-512 register block of the panel float path
//! ([`super::qmatmul_avx2`]): the same sums as its AVX2 block, two weight rows
//! at a time.
//!
//! The AVX2 block keeps one 8-lane accumulator per (input row, weight row) and
//! adds `x[k..k + 8] * w[k..k + 8]` to it for `k` front to back. Here two weight
//! rows' accumulators sit side by side in one 16-lane register, their weights
//! loaded into its two halves and the input's 8 lanes broadcast to both: each
//! lane runs the same fused multiply-adds in the same order, so every output is
//! bit-identical to the AVX2 block's (`tests.rs` checks the panel against the
//! row groups, which stay AVX2), with twice the lanes per instruction and
//! twice the registers for a larger block (4 input rows x 8 weight rows).
//!
//! Every function here needs AVX-512 F and DQ: [`available`] says whether the
//! CPU has them.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::call::OUTS_PER_TILE;
use super::formats::SUB;
use super::panel_block::{Block, PANEL_INNER};
use super::unpack_avx2::Format;

/// Input rows and weight-row pairs of a block (4 x 4 pairs: 16 accumulators,
/// 4 weight pairs and one input within the 32 registers).
pub(super) const BLOCK_ROWS: usize = 4;
pub(super) const BLOCK_PAIRS: usize = 4;

/// Whether this CPU runs the block, and `KVPAGE_CPU_AVX512` is not `0` (for
/// A/B measurements; read once per process).
pub(super) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && std::env::var("KVPAGE_CPU_AVX512").map_or(true, |v| v != "0")
    })
}

/// `R` input rows x `P` pairs of weight rows of `block`. Of the last pair only
/// the first `2 * P - 1` rows are written back when `odd` (its second row lies
/// past the tile's last: it reads the panel's unused, finite rows and its sums
/// are dropped).
///
/// # Safety
/// [`available`]; `block` as the AVX2 block needs it, with `2 * P` weight rows
/// inside the panel and accumulators inside the tile's.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
#[allow(clippy::needless_range_loop)] // index loops name the register blocking
pub(super) unsafe fn run<const R: usize, const P: usize>(block: &Block, odd: bool) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    for r in 0..R {
        for p in 0..P {
            let at = block.acc.add(r * OUTS_PER_TILE + 2 * p);
            acc[r][p] = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(*at), *at.add(1));
        }
    }
    for k in (0..block.len).step_by(8) {
        let mut weights = [_mm512_setzero_ps(); P];
        for p in 0..P {
            let low = _mm256_loadu_ps(block.panel.add(2 * p * PANEL_INNER + k));
            let high = _mm256_loadu_ps(block.panel.add((2 * p + 1) * PANEL_INNER + k));
            weights[p] = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(low), high);
        }
        for r in 0..R {
            let x = _mm512_broadcast_f32x8(_mm256_loadu_ps(block.x.add(r * block.x_stride + k)));
            for p in 0..P {
                acc[r][p] = _mm512_fmadd_ps(x, weights[p], acc[r][p]);
            }
        }
    }
    for r in 0..R {
        for p in 0..P {
            let at = block.acc.add(r * OUTS_PER_TILE + 2 * p);
            *at = _mm512_castps512_ps256(acc[r][p]);
            if !(odd && p == P - 1) {
                *at.add(1) = _mm512_extractf32x8_ps::<1>(acc[r][p]);
            }
        }
    }
}

/// Every block of one span of a tile: 4 input rows x 4 pairs of weight rows
/// at a time, the same sums as the AVX2 blocks.
///
/// # Safety
/// [`available`]; the panel, inputs and accumulators of a panel tile.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
pub(super) unsafe fn blocks(
    panel: *const f32,
    x: &[f32],
    inner: usize,
    span: usize,
    len: usize,
    rows: usize,
    outs: usize,
    acc: *mut __m256,
) {
    for r in (0..rows).step_by(BLOCK_ROWS) {
        for o in (0..outs).step_by(2 * BLOCK_PAIRS) {
            let block = Block::at(panel, x, inner, span, len, acc, r, o);
            let left = (outs - o).min(2 * BLOCK_PAIRS);
            let odd = left % 2 == 1;
            macro_rules! dispatch {
                ($(($r:literal, $p:literal)),*) => {
                    match ((rows - r).min(BLOCK_ROWS), left.div_ceil(2)) {
                        $(($r, $p) => run::<$r, $p>(&block, odd),)*
                        _ => unreachable!("blocks of 1..=4 rows x 1..=4 pairs"),
                    }
                };
            }
            #[rustfmt::skip]
            dispatch!(
                (1, 1), (1, 2), (1, 3), (1, 4),
                (2, 1), (2, 2), (2, 3), (2, 4),
                (3, 1), (3, 2), (3, 3), (3, 4),
                (4, 1), (4, 2), (4, 3), (4, 4)
            );
        }
    }
}

/// Weights `span..span + len` of one weight row as floats into `dst`: the
/// AVX2 expansion's values bit for bit (`scale * q + min` in one fused
/// multiply-add per weight), 16 lanes at a time. The AVX2 form spends about
/// a dozen shuffles per sub-block on port 5 (widening four quarters, the
/// scale broadcasts), which bound the panel path below 16 rows; here two
/// widenings cover the 32 weights.
///
/// # Safety
/// [`available`]; `row` a weight row of `F` holding `span + len` weights,
/// `dst` room for `len` floats.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn expand_span<F: Format>(
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
        let halves = [
            _mm256_castsi256_si128(sub.q),
            _mm256_extracti128_si256::<1>(sub.q),
        ];
        let (scale, min) = if F::HALVES_DIFFER {
            (
                [_mm512_set1_ps(sub.scale[0]), _mm512_set1_ps(sub.scale[1])],
                [_mm512_set1_ps(sub.min[0]), _mm512_set1_ps(sub.min[1])],
            )
        } else {
            let (scale, min) = (_mm512_set1_ps(sub.scale[0]), _mm512_set1_ps(sub.min[0]));
            ([scale; 2], [min; 2])
        };
        for (h, bytes) in halves.into_iter().enumerate() {
            let values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
            let weights = _mm512_fmadd_ps(values, scale[h], min[h]);
            _mm512_storeu_ps(dst.add(k - span + 16 * h), weights);
        }
    }
}
