//! The input rows of a one-row quantized product, in 16 bits per block of 32.
//!
//! Owns [`Q16Rows`] and the process's [`cpu_input_bits`]: each block of 32 inputs
//! becomes `q = round(x / d)` with `d = max|x| / 32767` (ties to even), so the
//! weights' integers multiply them with integer multiply-adds, at a relative
//! rounding error of ~1.5e-5 per input. With [`set_cpu_input_bits`]`(8)` (opt-in:
//! llama.cpp's numerics for 4-bit weights) a block keeps 8 bits, `q8 =
//! round(x / d8)` with `d8 = max|x| / 127`, stored as `q = 256 · q8` and `d =
//! d8 / 256` (the same products; exact unless `d8 / 256` is subnormal): every
//! kernel reads it unchanged and the lanes kernels skip the zero low bytes,
//! half their multiply-adds, for a rounding error of ~4e-3 (enough to flip
//! near-tied greedy tokens, hence not the default). Beside them, the float
//! sums of each half block (added in a fixed tree order) and each block, for
//! the weights' offsets. Quantized once per call, read by every weight row;
//! with AVX2 eight lanes at a time, with AVX-512 sixteen, to the same bits
//! (quantizing a decode step's inputs one scalar at a time took ~4 % of a MoE
//! decode step with AVX-512, 2026-11-28, and ~9 % of a 32-token one with AVX2,
//! 2026-11-29).
//!
//! Invariant: `q` (and its bytes `high`, `low`), `d` (and `sums`,
//! `high_sums`) and `half_sums` have `rows * inner`, `rows * inner / 32` and
//! `rows * inner / 16` entries; `q == 256 * high + low` everywhere and
//! `high_sums` sums each block's `high`; with `bits == 8` every `low` is 0;
//! a block of zeros has `d = 0` and `q = 0`;
//! `|q| <= 32767`, so a sum of 32 products with weights `|w| <= 128` fits in i32;
//! a block holding a NaN or an infinity has `d = NaN`, so every product of its
//! row is NaN, as the float path's is (`f32::max` skips NaN and NaN casts to 0:
//! a NaN input would otherwise vanish from a one-row product).

use std::sync::atomic::{AtomicU32, Ordering};

use super::formats::SUB;

/// Bits each quantized input keeps: 16 (the default) or 8 ([`set_cpu_input_bits`]).
static INPUT_BITS: AtomicU32 = AtomicU32::new(16);

/// The input bits of the products this process runs from now on (module
/// docs): 16, or 8 for llama.cpp's numerics at half the lanes kernels'
/// multiply-adds. `Err` names any other value.
pub fn set_cpu_input_bits(bits: u32) -> Result<(), String> {
    if bits != 8 && bits != 16 {
        return Err(format!("input bits must be 8 or 16, got {bits}"));
    }
    INPUT_BITS.store(bits, Ordering::Relaxed);
    Ok(())
}

/// The input bits [`Q16Rows::quantize`] uses now ([`set_cpu_input_bits`]).
pub fn cpu_input_bits() -> u32 {
    INPUT_BITS.load(Ordering::Relaxed)
}

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
    /// Each `q` split into bytes, `q = 256 · high + low`: `high = q >> 8`
    /// (signed) and `low = q & 255` (unsigned), for the lanes kernel's 8-bit
    /// products (`vpdpbusd` multiplies unsigned by signed bytes).
    pub high: Vec<i8>,
    pub low: Vec<u8>,
    /// The sum of each block's 32 `high` bytes (for signed weights).
    pub high_sums: Vec<i32>,
    /// 16, or 8: every `low` is 0 and `q = 256 · high` (module docs).
    pub bits: u32,
}

impl Q16Rows {
    /// Quantize `x [rows, inner]` (`inner` a multiple of 32, checked by the
    /// caller) to the process's [`cpu_input_bits`].
    pub fn quantize(x: &[f32], rows: usize, inner: usize) -> Q16Rows {
        Self::quantize_to(x, rows, inner, cpu_input_bits())
    }

    /// Quantize `x [rows, inner]` to `bits` (8 or 16) bits.
    pub fn quantize_to(x: &[f32], rows: usize, inner: usize, bits: u32) -> Q16Rows {
        debug_assert_eq!(x.len(), rows * inner);
        debug_assert_eq!(inner % SUB, 0);
        assert!(
            bits == 8 || bits == 16,
            "input bits must be 8 or 16, got {bits}"
        );
        let blocks = rows * inner / SUB;
        let mut out = Q16Rows {
            bits,
            rows,
            inner,
            q: vec![0; rows * inner],
            d: vec![0.0; blocks],
            half_sums: vec![0.0; 2 * blocks],
            sums: vec![0.0; blocks],
            high: vec![0; rows * inner],
            low: vec![0; rows * inner],
            high_sums: vec![0; blocks],
        };
        #[cfg(target_arch = "x86_64")]
        if avx512_available() {
            // SAFETY: the CPU has AVX-512 F and BW; `out` is sized for `x`.
            unsafe { out.fill_avx512(x) };
            return out;
        }
        #[cfg(target_arch = "x86_64")]
        if super::call::vectorized() {
            // SAFETY: `vectorized` found AVX2 and FMA; `out` is sized for `x`.
            unsafe { out.fill_avx2(x) };
            return out;
        }
        out.fill_portable(x);
        out
    }

    /// Every block of `x` into `self` (sized for it), one scalar at a time.
    fn fill_portable(&mut self, x: &[f32]) {
        for (b, xs) in x.chunks_exact(SUB).enumerate() {
            self.fill_block_portable(b, xs);
        }
    }

    /// Block `b`, whose inputs are `xs`, one scalar at a time.
    fn fill_block_portable(&mut self, b: usize, xs: &[f32]) {
        // `f32::max` skips a NaN: a second, branch-free fold finds one.
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let nan = xs.iter().fold(false, |seen, v| seen | v.is_nan());
        let Scale { d, inverse } = scale(amax, nan, self.bits);
        let (limit, shift) = limit_and_shift(self.bits);
        self.high_sums[b] = 0;
        for (i, v) in xs.iter().enumerate() {
            let q =
                ((round_ties_even_small(v * inverse) as i32).clamp(-limit, limit) << shift) as i16;
            self.q[b * SUB + i] = q;
            self.high[b * SUB + i] = (q >> 8) as i8;
            self.low[b * SUB + i] = q as u8;
            self.high_sums[b] += i32::from(q >> 8);
        }
        self.d[b] = d;
        self.half_sums[2 * b] = tree_sum16(&xs[..16]);
        self.half_sums[2 * b + 1] = tree_sum16(&xs[16..]);
        self.sums[b] = self.half_sums[2 * b] + self.half_sums[2 * b + 1];
    }

    /// [`Self::fill_portable`] sixteen lanes at a time: the same values, bit for
    /// bit (`cvtps2dq` rounds ties to even as [`round_ties_even_small`] does, and
    /// the half sums add in [`tree_sum16`]'s order).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW; `self` is sized for `x`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn fill_avx512(&mut self, x: &[f32]) {
        use std::arch::x86_64::*;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2")]
        unsafe fn tree_sum(v: __m512) -> f32 {
            let low = _mm512_castps512_ps256(v);
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            tree_sum_of_eight(_mm256_add_ps(low, high))
        }
        let (limit, shift) = limit_and_shift(self.bits);
        let (low_limit, high_limit) = (_mm512_set1_epi32(-limit), _mm512_set1_epi32(limit));
        let shift = _mm_cvtsi32_si128(shift);
        for b in 0..self.d.len() {
            let at = x.as_ptr().add(b * SUB);
            let (lo, hi) = (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)));
            let nan = (_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(lo, lo)
                | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(hi, hi))
                != 0;
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            let Scale { d, inverse } = scale(amax, nan, self.bits);
            if inverse.is_infinite() {
                // A subnormal scale: `cvtps2dq` would turn an infinite product
                // into i32::MIN, where the scalar cast saturates by sign.
                self.fill_block_portable(b, &x[b * SUB..][..SUB]);
                continue;
            }
            let q = self.q.as_mut_ptr().add(b * SUB) as *mut __m256i;
            let high = self.high.as_mut_ptr().add(b * SUB) as *mut __m128i;
            let low = self.low.as_mut_ptr().add(b * SUB) as *mut __m128i;
            // Zeros, NaN or infinity: every `q` is 0 (a NaN times 0 would
            // convert to i32::MIN); the vectors were made zero.
            if inverse != 0.0 {
                let inverse = _mm512_set1_ps(inverse);
                let mut high_sum = _mm512_setzero_si512();
                for (half, v) in [lo, hi].into_iter().enumerate() {
                    let ints = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
                    let ints = _mm512_min_epi32(_mm512_max_epi32(ints, low_limit), high_limit);
                    let ints = _mm512_sll_epi32(ints, shift);
                    let high_bytes = _mm512_srai_epi32::<8>(ints);
                    _mm256_storeu_si256(q.add(half), _mm512_cvtepi32_epi16(ints));
                    _mm_storeu_si128(high.add(half), _mm512_cvtepi32_epi8(high_bytes));
                    _mm_storeu_si128(low.add(half), _mm512_cvtepi32_epi8(ints));
                    high_sum = _mm512_add_epi32(high_sum, high_bytes);
                }
                self.high_sums[b] = _mm512_reduce_add_epi32(high_sum);
            }
            self.d[b] = d;
            let (first, second) = (tree_sum(lo), tree_sum(hi));
            self.half_sums[2 * b] = first;
            self.half_sums[2 * b + 1] = second;
            self.sums[b] = first + second;
        }
    }

    /// [`Self::fill_portable`] eight lanes at a time, to the same bits (as
    /// [`Self::fill_avx512`]: `cvtps2dq` rounds ties to even, the half sums add
    /// in [`tree_sum16`]'s order). Quantizing a 32-token MoE step's inputs one
    /// scalar at a time took ~9 % of its time on a Zen 3 (2026-11-29).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `self` is sized for `x`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fill_avx2(&mut self, x: &[f32]) {
        use std::arch::x86_64::*;
        /// `packs`/`packus` interleave the 128-bit halves: put them back.
        const IN_ORDER: i32 = 0b11_01_10_00;
        let sign = _mm256_set1_ps(-0.0);
        let (limit, shift) = limit_and_shift(self.bits);
        let (low_limit, high_limit) = (_mm256_set1_epi32(-limit), _mm256_set1_epi32(limit));
        let shift = _mm_cvtsi32_si128(shift);
        let low_byte = _mm256_set1_epi16(255);
        for b in 0..self.d.len() {
            let at = x.as_ptr().add(b * SUB);
            let v = [
                _mm256_loadu_ps(at),
                _mm256_loadu_ps(at.add(8)),
                _mm256_loadu_ps(at.add(16)),
                _mm256_loadu_ps(at.add(24)),
            ];
            let unordered = _mm256_or_ps(
                _mm256_or_ps(
                    _mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[0]),
                    _mm256_cmp_ps::<_CMP_UNORD_Q>(v[1], v[1]),
                ),
                _mm256_or_ps(
                    _mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[2]),
                    _mm256_cmp_ps::<_CMP_UNORD_Q>(v[3], v[3]),
                ),
            );
            let nan = _mm256_movemask_ps(unordered) != 0;
            // (No closures: they would not inherit the target features.)
            let max8 = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let max4 = _mm_max_ps(
                _mm256_castps256_ps128(max8),
                _mm256_extractf128_ps::<1>(max8),
            );
            let max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
            let amax = _mm_cvtss_f32(_mm_max_ss(max2, _mm_shuffle_ps::<1>(max2, max2)));
            let Scale { d, inverse } = scale(amax, nan, self.bits);
            if inverse.is_infinite() {
                // A subnormal scale: `cvtps2dq` would turn an infinite product
                // into i32::MIN, where the scalar cast saturates by sign.
                self.fill_block_portable(b, &x[b * SUB..][..SUB]);
                continue;
            }
            // Zeros, NaN or infinity: every `q` is 0 (a NaN times 0 would
            // convert to i32::MIN); the vectors were made zero.
            if inverse != 0.0 {
                let inverse = _mm256_set1_ps(inverse);
                let mut ints = [_mm256_setzero_si256(); 4];
                for (ints, v) in ints.iter_mut().zip(v) {
                    let rounded = _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse));
                    let clamped =
                        _mm256_min_epi32(_mm256_max_epi32(rounded, low_limit), high_limit);
                    *ints = _mm256_sll_epi32(clamped, shift);
                }
                // Within ±32767, so the saturating packs are exact.
                let q = [
                    _mm256_permute4x64_epi64::<IN_ORDER>(_mm256_packs_epi32(ints[0], ints[1])),
                    _mm256_permute4x64_epi64::<IN_ORDER>(_mm256_packs_epi32(ints[2], ints[3])),
                ];
                let high =
                    _mm256_packs_epi16(_mm256_srai_epi16::<8>(q[0]), _mm256_srai_epi16::<8>(q[1]));
                let low = _mm256_packus_epi16(
                    _mm256_and_si256(q[0], low_byte),
                    _mm256_and_si256(q[1], low_byte),
                );
                let (high, low) = (
                    _mm256_permute4x64_epi64::<IN_ORDER>(high),
                    _mm256_permute4x64_epi64::<IN_ORDER>(low),
                );
                let out = self.q.as_mut_ptr().add(b * SUB) as *mut __m256i;
                _mm256_storeu_si256(out, q[0]);
                _mm256_storeu_si256(out.add(1), q[1]);
                _mm256_storeu_si256(self.high.as_mut_ptr().add(b * SUB) as *mut __m256i, high);
                _mm256_storeu_si256(self.low.as_mut_ptr().add(b * SUB) as *mut __m256i, low);
                // Σ high: each `high` as 16 bits, the halves added, pairs to 32 bits.
                let pairs = _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_srai_epi16::<8>(q[0]), _mm256_srai_epi16::<8>(q[1])),
                    _mm256_set1_epi16(1),
                );
                let four = _mm_add_epi32(
                    _mm256_castsi256_si128(pairs),
                    _mm256_extracti128_si256::<1>(pairs),
                );
                let two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
                self.high_sums[b] =
                    _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32::<1>(two)));
            }
            self.d[b] = d;
            let (first, second) = (
                tree_sum_of_eight(_mm256_add_ps(v[0], v[1])),
                tree_sum_of_eight(_mm256_add_ps(v[2], v[3])),
            );
            self.half_sums[2 * b] = first;
            self.half_sums[2 * b + 1] = second;
            self.sums[b] = first + second;
        }
    }

    /// Row `r`'s quantized values.
    pub fn row(&self, r: usize) -> &[i16] {
        &self.q[r * self.inner..][..self.inner]
    }
}

/// A block's stored scale and the factor that rounds its inputs.
struct Scale {
    /// `q · d` is an input's value.
    d: f32,
    /// `round(x · inverse)` is `q` with 16 bits, `q / 256` with 8.
    inverse: f32,
}

/// A block's [`Scale`] from its largest magnitude (`nan`: it holds a NaN) for
/// `bits`: `d = NaN, inverse = 0` for a NaN or an infinity, both 0 for zeros.
/// With 8 bits `inverse` is `1 / d8` and `d` is `d8 / 256` (module docs).
#[inline(always)]
fn scale(amax: f32, nan: bool, bits: u32) -> Scale {
    let finite = amax.is_finite() && !nan;
    let levels = if bits == 8 { 127.0 } else { 32767.0 };
    let rounding = if finite { amax / levels } else { f32::NAN };
    let inverse = if rounding == 0.0 || !finite {
        0.0
    } else {
        1.0 / rounding
    };
    let d = if bits == 8 {
        rounding * (1.0 / 256.0)
    } else {
        rounding
    };
    Scale { d, inverse }
}

/// The largest rounded magnitude and the left shift that makes it `q`.
#[inline(always)]
fn limit_and_shift(bits: u32) -> (i32, i32) {
    if bits == 8 {
        (127, 8)
    } else {
        (32767, 0)
    }
}

/// The sum of 16 values in a fixed tree: `x[i] + x[i + 8]`, then `+ 4`, `+ 2`,
/// `+ 1` apart (the order of [`Q16Rows::fill_avx512`]'s register halving).
#[inline(always)]
fn tree_sum16(x: &[f32]) -> f32 {
    let mut v = [0.0f32; 16];
    v.copy_from_slice(&x[..16]);
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            v[i] += v[i + width];
        }
    }
    v[0]
}

/// The last three levels of [`tree_sum16`] (`+ 4`, `+ 2`, `+ 1` apart) of
/// `eight`, its first level (`x[i] + x[i + 8]`) already added.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn tree_sum_of_eight(eight: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let four = _mm_add_ps(
        _mm256_castps256_ps128(eight),
        _mm256_extractf128_ps::<1>(eight),
    );
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
}

/// Whether [`Q16Rows::quantize`] runs its AVX-512 loop: the CPU has AVX-512 F
/// and BW, the kernels are vectorized and `KVPAGE_CPU_AVX512` is not `0`.
#[cfg(target_arch = "x86_64")]
fn avx512_available() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx2")
            && super::call::vectorized()
            && std::env::var("KVPAGE_CPU_AVX512").map_or(true, |v| v != "0")
    })
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
    use crate::test_rng::SplitMix64 as TestRng;

    /// The portable loop over `x` to `bits`, and each vector loop this CPU
    /// runs (none without AVX2).
    fn every_loop(x: &[f32], bits: u32) -> (Q16Rows, Vec<(&'static str, Q16Rows)>) {
        let inner = x.len();
        let empty = || Q16Rows::quantize_to(&vec![0.0; inner], 1, inner, bits);
        let mut portable = empty();
        portable.fill_portable(x);
        #[allow(unused_mut)]
        let mut vector = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if super::super::call::vectorized() {
                let mut rows = empty();
                // SAFETY: `vectorized` found AVX2 and FMA; sized for `x`.
                unsafe { rows.fill_avx2(x) };
                vector.push(("avx2", rows));
            }
            if super::avx512_available() {
                let mut rows = empty();
                // SAFETY: the CPU has AVX-512 F and BW; sized for `x`.
                unsafe { rows.fill_avx512(x) };
                vector.push(("avx512", rows));
            }
        }
        (portable, vector)
    }

    #[test]
    fn every_vector_loop_gives_the_portable_loops_bits() {
        let mut rng = TestRng::new(41);
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1e-40,
            -3e-44,
            3e38,
            0.5,
        ];
        for case in 0..400 {
            let magnitude = [1e-3f32, 1.0, 1e3, 1e30, 1e-38][case % 5];
            let mut x: Vec<f32> = (0..32 * 12)
                .map(|_| (rng.below(20001) as f32 / 10000.0 - 1.0) * magnitude)
                .collect();
            for _ in 0..case % 4 {
                let at = rng.below(x.len());
                x[at] = specials[rng.below(specials.len())];
            }
            if case % 7 == 0 {
                let block = rng.below(12);
                x[block * 32..][..32].fill(if case % 2 == 0 { 0.0 } else { 1e-41 });
            }
            let bits = [16, 8][case % 2];
            let (want, vector) = every_loop(&x, bits);
            for (name, got) in vector {
                let case = format!("{name}, {bits} bits, case {case}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(got.q, want.q, "{case}");
                assert_eq!(bits(&got.d), bits(&want.d), "{case}");
                assert_eq!(bits(&got.half_sums), bits(&want.half_sums), "{case}");
                assert_eq!(bits(&got.sums), bits(&want.sums), "{case}");
                assert_eq!((&got.high, &got.low), (&want.high, &want.low), "{case}");
                assert_eq!(got.high_sums, want.high_sums, "{case}");
            }
            for (at, &q) in want.q.iter().enumerate() {
                let split = 256 * i32::from(want.high[at]) + i32::from(want.low[at]);
                assert_eq!(split, i32::from(q), "case {case}, input {at}");
            }
            for (b, block) in want.high.chunks(32).enumerate() {
                let sum: i32 = block.iter().map(|&h| i32::from(h)).sum();
                assert_eq!(want.high_sums[b], sum, "case {case}, block {b}");
            }
            if bits == 8 {
                assert!(want.low.iter().all(|&l| l == 0), "case {case}");
            }
        }
    }

    #[test]
    fn eight_bit_inputs_are_the_nearest_of_255_levels_per_block() {
        let mut rng = TestRng::new(7);
        for case in 0..200 {
            let magnitude = [1e-3f32, 1.0, 1e3, 1e20][case % 4];
            let x: Vec<f32> = (0..64)
                .map(|_| (rng.below(20001) as f32 / 10000.0 - 1.0) * magnitude)
                .collect();
            let rows = Q16Rows::quantize_to(&x, 1, 64, 8);
            for (b, xs) in x.chunks(32).enumerate() {
                let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d8 = amax / 127.0;
                assert_eq!(rows.d[b], d8 / 256.0, "case {case}");
                for (i, &v) in xs.iter().enumerate() {
                    let q = rows.q[b * 32 + i];
                    assert_eq!(q % 256, 0, "case {case}");
                    assert!((q / 256).abs() <= 127, "case {case}");
                    // The product with the stored scale is the 8-bit value's.
                    let value = f32::from(q) * rows.d[b];
                    assert_eq!(value, f32::from(q / 256) * d8, "case {case}");
                    assert!(
                        (value - v).abs() <= 0.5001 * d8,
                        "case {case}: {v} -> {value}"
                    );
                }
            }
        }
        assert!(super::set_cpu_input_bits(12)
            .unwrap_err()
            .contains("8 or 16, got 12"));
    }

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
