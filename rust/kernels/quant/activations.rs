//! The input rows of a one-row quantized product, in 16 bits per block of 32.
//!
//! Owns [`Q16Rows`]: each block of 32 inputs becomes `q = round(x / d)` with
//! `d = max|x| / 32767` (ties to even), so the weights' integers multiply them
//! with integer multiply-adds, at a relative rounding error of ~1.5e-5 per
//! input (8-bit inputs, llama.cpp's choice, lose ~4e-3: enough to flip near-tied
//! greedy tokens). Beside them, the float sums of each half block and each
//! block, exact, for the weights' offsets. Quantized once per call, read by every weight row.
//!
//! Invariant: `q`, `d` (and `sums`) and `half_sums` have `rows * inner`,
//! `rows * inner / 32` and `rows * inner / 16` entries; a block of zeros has
//! `d = 0` and `q = 0`;
//! `|q| <= 32767`, so a sum of 32 products with weights `|w| <= 128` fits in i32;
//! a block holding a NaN or an infinity has `d = NaN`, so every product of its
//! row is NaN, as the float path's is (`f32::max` skips NaN and NaN casts to 0:
//! a NaN input would otherwise vanish from a one-row product).

use super::formats::SUB;

/// `rows` rows of `inner` inputs (a multiple of 32), quantized.
pub struct Q16Rows {
    pub rows: usize,
    pub inner: usize,
    pub q: Vec<i16>,
    /// Scale of each block of 32, row-major.
    pub d: Vec<f32>,
    /// The float sum of each half block of 16 inputs, row-major.
    pub half_sums: Vec<f32>,
    /// The float sum of each block of 32 inputs, `half_sums[2b] + half_sums[2b + 1]`.
    pub sums: Vec<f32>,
}

impl Q16Rows {
    /// Quantize `x [rows, inner]` (`inner` a multiple of 32, checked by the caller).
    pub fn quantize(x: &[f32], rows: usize, inner: usize) -> Q16Rows {
        debug_assert_eq!(x.len(), rows * inner);
        debug_assert_eq!(inner % SUB, 0);
        let blocks = rows * inner / SUB;
        let mut out = Q16Rows {
            rows,
            inner,
            q: vec![0; rows * inner],
            d: vec![0.0; blocks],
            half_sums: vec![0.0; 2 * blocks],
            sums: vec![0.0; blocks],
        };
        for (b, (xs, qs)) in x
            .chunks_exact(SUB)
            .zip(out.q.chunks_exact_mut(SUB))
            .enumerate()
        {
            // `f32::max` skips a NaN: a second, branch-free fold finds one.
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let nan = xs.iter().fold(false, |seen, v| seen | v.is_nan());
            let finite = amax.is_finite() && !nan;
            let d = if finite { amax / 32767.0 } else { f32::NAN };
            let inverse = if d == 0.0 || !finite { 0.0 } else { 1.0 / d };
            for (v, q) in xs.iter().zip(qs.iter_mut()) {
                *q = (round_ties_even_small(v * inverse) as i32).clamp(-32767, 32767) as i16;
            }
            out.d[b] = d;
            out.half_sums[2 * b] = xs[..16].iter().sum();
            out.half_sums[2 * b + 1] = xs[16..].iter().sum();
            out.sums[b] = out.half_sums[2 * b] + out.half_sums[2 * b + 1];
        }
        out
    }

    /// Row `r`'s quantized values.
    pub fn row(&self, r: usize) -> &[i16] {
        &self.q[r * self.inner..][..self.inner]
    }
}

/// `x.round_ties_even()` for `|x| < 2^22`, without a libm call: adding and removing
/// 1.5 * 2^23 leaves no fraction bits, so the sum rounds to an integer in the FPU's
/// round-to-nearest-even mode. Vectorizes where `round_ties_even` (a call to `rintf`
/// without SSE4.1) does not; quantizing the inputs took ~5 % of a decode layer.
#[inline(always)]
fn round_ties_even_small(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + SHIFT) - SHIFT
}

#[cfg(test)]
mod tests {
    use super::{round_ties_even_small, Q16Rows};

    #[test]
    fn a_block_scale_is_nan_exactly_when_the_block_holds_a_nan_or_an_infinity() {
        let block = |value: f32, at: usize| {
            let mut xs = [0.5f32; 32];
            xs[at] = value;
            Q16Rows::quantize(&xs, 1, 32).d[0]
        };
        for at in [0, 17, 31] {
            for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                assert!(block(bad, at).is_nan(), "{bad} at {at}");
            }
            assert!(block(-3.0, at).is_finite());
        }
        // Finite inputs whose half sums overflow (to +inf and -inf) keep a finite
        // scale, as their float products stay finite.
        let huge: Vec<f32> = (0..32).map(|i| if i < 16 { 3e38 } else { -3e38 }).collect();
        let rows = Q16Rows::quantize(&huge, 1, 32);
        assert_eq!(rows.d[0], 3e38 / 32767.0);
        assert_eq!(rows.q[0], 32767);
    }

    #[test]
    fn small_rounding_is_ties_to_even() {
        let halves = (-70_000..=70_000).map(|i| i as f32 * 0.5);
        let others = (0..100_000).map(|i| (i as f32 * 0.37) - 18_000.0);
        for x in halves
            .chain(others)
            .chain([0.49999997, -0.49999997, 32767.4, -32767.6])
        {
            assert_eq!(round_ties_even_small(x), x.round_ties_even(), "{x}");
        }
    }
}
