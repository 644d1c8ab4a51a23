//! The K/V pool element types and the stack-buffer limits that both decode
//! attention kernels share: the generic loop ([`super::cpu_attention`]) and the
//! AVX2 kernel (`cpu_attention_avx2.rs`). A leaf: both depend on it, it depends
//! on neither.
//!
//! Owns [`KvElement`] (f32, [`F16`], [`Bf16`], widened to f32 one at a time or
//! eight at a time in registers) and [`MAX_GROUP`], [`MAX_HEAD_DIM`],
//! [`MAX_BLOCK`]; a call whose shape exceeds a limit takes a path without stack
//! buffers (`cpu_attention.rs` dispatches).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Most query heads sharing one KV head that the stack buffers hold.
pub(super) const MAX_GROUP: usize = 16;
/// Largest head_dim the stack buffers hold.
pub(super) const MAX_HEAD_DIM: usize = 256;
/// Largest block the per-block score buffer holds.
pub(super) const MAX_BLOCK: usize = 256;

/// A K/V pool element: f32, or f16 / bf16 kept as their bit patterns.
pub trait KvElement: Copy + Send + Sync {
    fn to_f32(self) -> f32;

    /// Eight consecutive elements as f32 lanes.
    ///
    /// # Safety
    /// `p` points at eight readable elements; the CPU has AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

/// bfloat16 as stored: the high 16 bits of an f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl KvElement for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const Bf16) -> __m256 {
        let halves = _mm_loadu_si128(p.cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
    }
}

/// IEEE binary16 as stored (the pool dtype llama.cpp keeps by default: half the
/// bytes of f32, 11 significant bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl F16 {
    /// `x` rounded to the nearest f16, ties to even (as F16C's `vcvtps2ph`): past
    /// the largest finite f16 gives inf, below half the smallest subnormal 0, NaN a
    /// quiet NaN.
    pub fn from_f32(x: f32) -> F16 {
        let bits = x.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let abs = bits & 0x7fff_ffff;
        let round = |value: u32, dropped: u32, half: u32| -> u16 {
            let up = dropped > half || (dropped == half && value & 1 == 1);
            (value + u32::from(up)) as u16
        };
        let magnitude = if abs > 0x7f80_0000 {
            0x7e00 | ((abs >> 13) & 0x3ff) as u16 // NaN, quieted
        } else if abs >= 0x477f_f000 {
            0x7c00 // 65520 and up round past 65504: inf
        } else if abs >= 0x3880_0000 {
            // Normal: rebias the exponent (127 -> 15), round the 13 dropped bits; a
            // carry out of the mantissa steps the exponent, as it should.
            round((abs >> 13) - (112 << 10), abs & 0x1fff, 0x1000)
        } else if abs > 0x3300_0000 {
            // Subnormal: the significand (implicit bit included) in units of 2^-24.
            let significand = (abs & 0x7f_ffff) | 0x80_0000;
            let shift = 126 - (abs >> 23);
            let dropped = significand & ((1 << shift) - 1);
            round(significand >> shift, dropped, 1 << (shift - 1))
        } else {
            0 // at most 2^-25: ties to the even 0
        };
        F16(sign | magnitude)
    }
}

impl KvElement for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let sign = u32::from(self.0 & 0x8000) << 16;
        let exponent = u32::from(self.0 >> 10) & 0x1f;
        let mantissa = u32::from(self.0 & 0x3ff);
        let magnitude = match (exponent, mantissa) {
            (0, 0) => 0,
            // Subnormal: mantissa * 2^-24, exact in f32.
            (0, m) => (m as f32 * f32::from_bits(0x3380_0000)).to_bits(),
            (0x1f, 0) => 0x7f80_0000,             // inf
            (0x1f, m) => 0x7fc0_0000 | (m << 13), // NaN, quieted as F16C does
            (e, m) => ((e + 112) << 23) | (m << 13),
        };
        f32::from_bits(sign | magnitude)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const F16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}
