//! The six formats' blocks unpacked in AVX2 registers: [`super::formats::unpack`]'s
//! values (the layouts of [`super::formats`]), one type per format so every call
//! inlines. Read by the product's kernels (`qmatmul_avx2.rs`) and the
//! dequantization ([`super::dequantize`]); depends on [`super::formats`] only.
//!
//! Invariant: every load of a block lies inside that block (a 2-byte field is
//! read with 2 bytes, [`one_f16`]), so the last block of a buffer is read to
//! its last byte and no further.
//!
//! Every function here needs AVX2, FMA and F16C: callers check
//! [`super::call::vectorized`] first.

use std::arch::x86_64::*;

use super::formats::{q4k_scale_min, QuantType};

/// One sub-block in registers: 32 integers as `i8` (unsigned formats' values
/// are below 64), the scale and offset of each half.
#[derive(Clone, Copy)]
pub(super) struct Sub {
    pub q: __m256i,
    pub scale: [f32; 2],
    pub min: [f32; 2],
}

/// One sub-block as the integer path reads it: weights `0..16` and `16..32`
/// as 16-bit integers, the scale and offset of each half.
#[derive(Clone, Copy)]
pub(super) struct WideSub {
    pub q: [__m256i; 2],
    pub scale: [f32; 2],
    pub min: [f32; 2],
}

/// A weight format's unpacking in registers (the layouts of
/// [`super::formats`]); a type per format so every call inlines.
pub(super) trait Format {
    const KIND: QuantType;
    /// [`Format::wide_sub`]'s offsets are zero (its integers carry the sign;
    /// [`Format::sub`]'s may still have one).
    const SIGNED: bool;
    /// The two halves have their own scale and offset (Q6_K's 16-weight groups).
    const HALVES_DIFFER: bool = false;
    /// One input row takes several weight rows at a time
    /// (`qmatmul_avx2::one_row_tile_of`): only where the unpacking is short
    /// enough for their registers (Q4_0, 1.2x from DRAM; Q4_1 no faster, Q8_0
    /// and the K-quants 1.2-2x slower, 2026-11-29 on a Zen 3).
    const INTERLEAVES_OUTS: bool = false;
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

/// `$function::<F>$args` with `F` the [`Format`] of `$kind` (a runtime
/// [`QuantType`]): one monomorphized kernel per format.
macro_rules! by_format {
    ($kind:expr, $function:ident, $args:tt) => {
        match $kind {
            $crate::kernels::quant::formats::QuantType::Q8_0 => {
                $function::<$crate::kernels::quant::unpack_avx2::Q8_0> $args
            }
            $crate::kernels::quant::formats::QuantType::Int8 => {
                $function::<$crate::kernels::quant::unpack_avx2::Int8> $args
            }
            $crate::kernels::quant::formats::QuantType::Q4_0 => {
                $function::<$crate::kernels::quant::unpack_avx2::Q4_0> $args
            }
            $crate::kernels::quant::formats::QuantType::Q4_1 => {
                $function::<$crate::kernels::quant::unpack_avx2::Q4_1> $args
            }
            $crate::kernels::quant::formats::QuantType::Q4K => {
                $function::<$crate::kernels::quant::unpack_avx2::Q4K> $args
            }
            $crate::kernels::quant::formats::QuantType::Q5_0 => {
                $function::<$crate::kernels::quant::unpack_avx2::Q5_0> $args
            }
            $crate::kernels::quant::formats::QuantType::Q5_1 => {
                $function::<$crate::kernels::quant::unpack_avx2::Q5_1> $args
            }
            $crate::kernels::quant::formats::QuantType::Q6K => {
                $function::<$crate::kernels::quant::unpack_avx2::Q6K> $args
            }
        }
    };
}
pub(super) use by_format;

/// A sub-block as 32 floats in four registers: `scale[h] * q + min[h]`
/// (formats whose halves share one scale and offset broadcast them once).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn expand<F: Format>(sub: &Sub) -> [__m256; 4] {
    let halves = [
        _mm256_castsi256_si128(sub.q),
        _mm256_extracti128_si256::<1>(sub.q),
    ];
    let (scale, min) = if F::HALVES_DIFFER {
        (
            [_mm256_set1_ps(sub.scale[0]), _mm256_set1_ps(sub.scale[1])],
            [_mm256_set1_ps(sub.min[0]), _mm256_set1_ps(sub.min[1])],
        )
    } else {
        let (scale, min) = (_mm256_set1_ps(sub.scale[0]), _mm256_set1_ps(sub.min[0]));
        ([scale; 2], [min; 2])
    };
    let mut weights = [_mm256_setzero_ps(); 4];
    for (c, weight) in weights.iter_mut().enumerate() {
        let bytes = if c % 2 == 0 {
            halves[c / 2]
        } else {
            _mm_srli_si128::<8>(halves[c / 2])
        };
        let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        *weight = _mm256_fmadd_ps(values, scale[c / 2], min[c / 2]);
    }
    weights
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

pub(super) struct Q8_0;
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

pub(super) struct Int8;
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

pub(super) struct Q4_0;
impl Format for Q4_0 {
    const KIND: QuantType = QuantType::Q4_0;
    const SIGNED: bool = true;
    const INTERLEAVES_OUTS: bool = true;
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
        let [low, high] = nibbles_wide(block.add(2));
        let eight = _mm256_set1_epi16(8);
        WideSub {
            q: [_mm256_sub_epi16(low, eight), _mm256_sub_epi16(high, eight)],
            scale: [one_f16(block); 2],
            min: [0.0; 2],
        }
    }
}

pub(super) struct Q4_1;
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

/// Q5_0 / Q5_1's fifth bits: byte `i` of the result is `16` where bit `i` of
/// the little-endian `u32` at `at` is set, else 0 (weights 0..16 in the low
/// lane, 16..32 in the high one, as [`nibbles_16`] orders them).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fifth_bits(at: *const u8) -> __m256i {
    let qh = _mm256_set1_epi32(std::ptr::read_unaligned(at as *const i32));
    // Byte i of each lane takes qh byte i / 8 (low lane) or 2 + i / 8 (high).
    let spread = _mm256_shuffle_epi8(
        qh,
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

pub(super) struct Q5_0;
impl Format for Q5_0 {
    const KIND: QuantType = QuantType::Q5_0;
    const SIGNED: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, _j: usize, _row_scale: f32) -> Sub {
        let d = one_f16(block);
        Sub {
            q: _mm256_or_si256(nibbles_16(block.add(6)), fifth_bits(block.add(2))),
            scale: [d; 2],
            min: [-16.0 * d; 2],
        }
    }
}

pub(super) struct Q5_1;
impl Format for Q5_1 {
    const KIND: QuantType = QuantType::Q5_1;
    const SIGNED: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, _j: usize, _row_scale: f32) -> Sub {
        let dm = two_f16(block);
        Sub {
            q: _mm256_or_si256(nibbles_16(block.add(8)), fifth_bits(block.add(4))),
            scale: [_mm_cvtss_f32(dm); 2],
            min: [lane1(dm); 2],
        }
    }
}

pub(super) struct Q4K;
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

pub(super) struct Q6K;
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
