//! The integer path with AVX-512 VNNI: one to [`VNNI_ROWS`] input rows, each
//! sub-block's 32 products in one `vpdpwssd`, sixteen sub-blocks' sums reduced
//! together.
//!
//! The AVX2 integer path ([`super::qmatmul`]) turns every sub-block's integer
//! sum into float on its own: a conversion, a scalar `scale · d_x`, a
//! broadcast and an FMA per sub-block and input row, about as many
//! instructions as the products themselves; a one-row product of Q4_0 and of
//! Q8_0 ran at the same ~23 G weights/s on a Zen 4 core, bound by instructions
//! per weight, not by bytes (`cargo bench --bench cpu_matmul --
//! quant_one_row`, benches/RESULTS.md, 2026-11-28). Here a group of sixteen
//! sub-blocks is unpacked once (each sub-block's 32 integers in one register,
//! the sixteen `f16` scales converted together); per input row, sixteen `vpdpwssd`
//! leave sixteen registers of partial sums, a transpose-and-add tree reduces
//! them to one register holding the sixteen sub-blocks' exact integer sums,
//! and one conversion, one product of the scales and one FMA per sixteen
//! sub-blocks take them to float. The offsets (`min · Σ x` per sub-block) add
//! in the same register.
//!
//! Each input row runs the same instructions in the same order whatever the
//! other rows of the call, so a row's result is the same alone or among
//! [`VNNI_ROWS`] (a speculative verification's rows equal the decode step's,
//! bit for bit). It reads Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K ([`reads`]);
//! calls of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 take `lanes_avx512.rs` instead where it is
//! on (`KVPAGE_CPU_LANES=0` turns it off; Q5_1 is read only there). int8 keeps the
//! AVX2 one-row path and the float panel. The
//! K-quants' integer sub-block scales are multiplied into the 16-bit weights
//! (`q · sc`), so their float factor is one per 256-weight super-block; Q6_K's
//! `-32` offset goes into the integers too, so its offset multiplies the
//! quantized inputs where the other formats add `min · Σ x` in float.
//!
//! Every function here needs AVX-512 F, BW and VNNI and AVX2, FMA and F16C:
//! [`available`] checks them.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::activations::Q16Rows;
use super::call::QuantShape;
#[cfg(doc)]
use super::formats::q4k_scale_min;
use super::formats::{QuantType, SUB};
use super::unpack_avx2::{Format, Q4K, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0};
use crate::kernels::cpu_matmul::OutPtr;

/// Calls of at most this many rows take this path where it is [`available`]
/// for the format (more rows: the float panel, which shares each expanded
/// sub-block across more rows). As many as `lanes_avx512.rs` takes, so that a
/// speculative verification of up to 31 drafts gives every row the sums it gets
/// alone on every format the two kernels read.
pub const VNNI_ROWS: usize = 32;

/// Input rows one pass over a tile's weight rows multiplies (their sixteen-lane
/// accumulators stay in registers); more rows take several passes, the tile's
/// weights then coming from cache.
const PASS_ROWS: usize = 8;

/// Sub-blocks reduced together: one 16-lane register of sums.
const GROUP: usize = 16;

/// Sub-blocks of a K-quant super-block (256 weights): a group holds two.
const SUPER: usize = 8;

/// Whether this CPU runs the path (and neither `KVPAGE_CPU_AVX512` nor
/// `KVPAGE_CPU_VNNI` is `0`: A/B measurements; read once per process).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && std::env::var("KVPAGE_CPU_AVX512").map_or(true, |v| v != "0")
            && std::env::var("KVPAGE_CPU_VNNI").map_or(true, |v| v != "0")
    })
}

/// Whether this path reads `kind`: the 32-weight blocks led by an `f16`
/// scale (and Q4_1's `f16` offset), and the K-quants Q4_K and Q6_K, where it
/// beat the AVX2 and float paths at 1 to 8 rows on a Zen 4 core (30 products
/// of 576x1536, or 1536x576 for K-quants, ms; benches/RESULTS.md, 2026-11-28):
/// Q4_0 one row 1.10 -> 0.79, 2 rows 1.91 -> 1.26; Q4_1 1.01 -> 0.79, 1.85 ->
/// 1.33; Q5_0 1.63 -> 1.42; Q8_0 2 rows 2.40 -> 1.30; Q4_K 1.15 -> 0.69, 6
/// rows 3.49 -> 1.96; Q6_K 1.89 -> 0.93, 6 rows 3.93 -> 2.25.
pub fn reads(kind: QuantType) -> bool {
    matches!(
        kind,
        QuantType::Q8_0
            | QuantType::Q4_0
            | QuantType::Q5_0
            | QuantType::Q4_1
            | QuantType::Q4K
            | QuantType::Q6K
    )
}

/// Whether a call of `kind` on this CPU takes this path: [`available`] and
/// [`reads`], the one condition both the row count
/// ([`super::qmatmul::integer_rows`]) and the dispatch read.
pub fn takes(kind: QuantType) -> bool {
    available() && reads(kind)
}

/// A format's sub-block in one 32-lane register of 16-bit integers (lane `i`
/// weight `i`), read straight from its block where the format allows; the
/// values of [`super::formats::unpack`].
///
/// The formats read here start each 32-weight block with its `f16 d` (Q4_1:
/// then its `f16 m`); weight `i` is `d * q[i] + MIN_TIMES_D * d` (Q4_1:
/// `d * q[i] + m`). The sixteen scales of a group are converted at once.
pub(super) trait Unpack512: Format {
    const MIN_TIMES_D: f32;
    /// An `f16 m` follows `d` and is the offset (`MIN_TIMES_D` unused).
    const M_FIELD: bool = false;
    /// The integers of the block at `block`.
    unsafe fn ints(block: *const u8) -> __m512i;
}

/// 16 bytes of nibbles: lanes `0..16` the low nibbles, `16..32` the high ones.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles(at: *const u8) -> __m512i {
    let bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(at as *const __m128i));
    let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_cvtepu8_epi16(bytes), shifts),
        _mm512_set1_epi16(15),
    )
}

/// `q` with 16 added in the lanes whose bit is set in the little-endian `u32` at `at`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn with_fifth_bits(q: __m512i, at: *const u8) -> __m512i {
    let bits = std::ptr::read_unaligned(at as *const u32);
    _mm512_mask_add_epi16(q, bits, q, _mm512_set1_epi16(16))
}

impl Unpack512 for Q8_0 {
    const MIN_TIMES_D: f32 = 0.0;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn ints(block: *const u8) -> __m512i {
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(block.add(2) as *const __m256i))
    }
}

impl Unpack512 for Q4_0 {
    const MIN_TIMES_D: f32 = -8.0;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn ints(block: *const u8) -> __m512i {
        nibbles(block.add(2))
    }
}

impl Unpack512 for Q4_1 {
    const MIN_TIMES_D: f32 = 0.0;
    const M_FIELD: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn ints(block: *const u8) -> __m512i {
        nibbles(block.add(4))
    }
}

impl Unpack512 for Q5_0 {
    const MIN_TIMES_D: f32 = -16.0;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn ints(block: *const u8) -> __m512i {
        with_fifth_bits(nibbles(block.add(6)), block.add(2))
    }
}

impl Unpack512 for Q5_1 {
    const MIN_TIMES_D: f32 = 0.0;
    const M_FIELD: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn ints(block: *const u8) -> __m512i {
        with_fifth_bits(nibbles(block.add(8)), block.add(4))
    }
}

/// Weight rows `start..end` of `y`, every row of `xq`.
///
/// # Safety
/// [`takes`]`(shape.kind)`; `xq` quantized from an `x` that passed validation
/// with `w` and `y` for `shape` (these formats have no row scales), with at
/// most [`VNNI_ROWS`] rows; no other thread writes rows `start..end`.
pub(super) unsafe fn tile(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    debug_assert!((1..=VNNI_ROWS).contains(&shape.rows));
    macro_rules! rows {
        ($format:ty) => {
            for base in (0..shape.rows).step_by(PASS_ROWS) {
                let pass = Pass { base, y };
                match (shape.rows - base).min(PASS_ROWS) {
                    1 => rows_tile::<$format, 1>(shape, xq, w, pass, start, end),
                    2 => rows_tile::<$format, 2>(shape, xq, w, pass, start, end),
                    3 => rows_tile::<$format, 3>(shape, xq, w, pass, start, end),
                    4 => rows_tile::<$format, 4>(shape, xq, w, pass, start, end),
                    5 => rows_tile::<$format, 5>(shape, xq, w, pass, start, end),
                    6 => rows_tile::<$format, 6>(shape, xq, w, pass, start, end),
                    7 => rows_tile::<$format, 7>(shape, xq, w, pass, start, end),
                    _ => rows_tile::<$format, PASS_ROWS>(shape, xq, w, pass, start, end),
                }
            }
        };
    }
    match shape.kind {
        QuantType::Q8_0 => rows!(Q8_0),
        QuantType::Q4_0 => rows!(Q4_0),
        QuantType::Q4_1 => rows!(Q4_1),
        QuantType::Q5_0 => rows!(Q5_0),
        QuantType::Q4K => rows!(Q4K),
        QuantType::Q6K => rows!(Q6K),
        kind => unreachable!("the VNNI path does not read {}", kind.name()),
    }
}

/// Input rows `base..base + R` of a call, and its output.
#[derive(Clone, Copy)]
struct Pass {
    base: usize,
    y: OutPtr,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_tile<F: Group512, const R: usize>(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    pass: Pass,
    start: usize,
    end: usize,
) {
    let row_bytes = shape.kind.row_bytes(shape.inner).expect("validated");
    for out in start..end {
        super::qmatmul_avx2::prefetch_ahead(w, (out + 1) * row_bytes, row_bytes);
        let row = w.as_ptr().add(out * row_bytes);
        let sums = row_dots::<F, R>(row, xq, pass.base);
        for (r, value) in sums.iter().enumerate() {
            *pass.y.at((pass.base + r) * shape.outs + out) = *value;
        }
    }
}

/// One weight row against rows `base..base + R` of `xq`: whole groups of
/// [`GROUP`] sub-blocks, then the partial last one (its missing sub-blocks add
/// zeros).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn row_dots<F: Group512, const R: usize>(
    row: *const u8,
    xq: &Q16Rows,
    base: usize,
) -> [f32; R] {
    let subs = xq.inner / SUB;
    let mut acc = [_mm512_setzero_ps(); R];
    let whole = subs / GROUP;
    for g in 0..whole {
        group::<F, R, true>(row, xq, base, g * GROUP, GROUP, &mut acc);
    }
    if !subs.is_multiple_of(GROUP) {
        group::<F, R, false>(row, xq, base, whole * GROUP, subs % GROUP, &mut acc);
    }
    let mut out = [0.0f32; R];
    for (value, acc) in out.iter_mut().zip(acc) {
        *value = _mm512_reduce_add_ps(acc);
    }
    out
}

/// A group of up to [`GROUP`] sub-blocks of one weight row, unpacked: each
/// sub-block's 32 integers (16 bits each), and per sub-block (lane) the float
/// factor of its integer sums and its offset per unit of `Σ x`.
struct Unpacked {
    ints: [__m512i; GROUP],
    scales: __m512,
    mins: __m512,
}

/// A format this path reads, a group of sub-blocks at a time.
trait Group512 {
    /// The offsets are zero.
    const SIGNED: bool;
    /// Sub-blocks `first..first + count` of the row at `row` (`WHOLE`: `count`
    /// is [`GROUP`]); lanes from `count` on are zeros.
    unsafe fn unpack_group<const WHOLE: bool>(
        row: *const u8,
        first: usize,
        count: usize,
    ) -> Unpacked;
}

macro_rules! group_of_blocks {
    ($($format:ty),*) => {$(
        impl Group512 for $format {
            const SIGNED: bool = <$format as Format>::SIGNED;
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
            unsafe fn unpack_group<const WHOLE: bool>(
                row: *const u8,
                first: usize,
                count: usize,
            ) -> Unpacked {
                unpack_blocks::<$format, WHOLE>(row, first, count)
            }
        }
    )*};
}

group_of_blocks!(Q8_0, Q4_0, Q4_1, Q5_0);

/// [`Group512::unpack_group`] of the formats whose 32-weight blocks start with
/// their `f16` scale (and offset).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_blocks<F: Unpack512, const WHOLE: bool>(
    row: *const u8,
    first: usize,
    count: usize,
) -> Unpacked {
    let mut ints = [_mm512_setzero_si512(); GROUP];
    // The block's first four bytes as one little-endian u32: `d`, then `m` for
    // `M_FIELD` formats (else the next field's bytes, unused; every block these
    // formats have is longer than four bytes). Read as u32s and split in
    // registers: sixteen 2-byte stores read back as one register stalled
    // store forwarding (Q4_1 one row 0.79 ms this way, 1.30 ms that way).
    let mut head = [0u32; GROUP];
    for j in 0..GROUP {
        if WHOLE || j < count {
            let block = row.add((first + j) * F::KIND.block_bytes());
            ints[j] = F::ints(block);
            head[j] = std::ptr::read_unaligned(block as *const u32);
        }
    }
    let head = _mm512_loadu_si512(head.as_ptr() as *const _);
    let scales = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    let mins = if F::M_FIELD {
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(head)))
    } else {
        _mm512_mul_ps(scales, _mm512_set1_ps(F::MIN_TIMES_D))
    };
    Unpacked { ints, scales, mins }
}

/// Q4_K: 256-weight super-blocks of eight sub-blocks, `w = d · sc_j · q −
/// dmin · m_j` with 6-bit `sc_j`, `m_j`. Each sub-block's integers are `q ·
/// sc_j` (at most 15 · 63, so a sub-block's 32 products with 16-bit inputs
/// stay far inside i32), which leaves one float factor `d` per super-block:
/// a group is two super-blocks, a partial one the row's last.
impl Group512 for Q4K {
    const SIGNED: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack_group<const WHOLE: bool>(
        row: *const u8,
        first: usize,
        count: usize,
    ) -> Unpacked {
        let mut ints = [_mm512_setzero_si512(); GROUP];
        // Per super-block: `d` and `dmin`, and the eight 6-bit `m` as bytes.
        let (mut d, mut dmin, mut m) = ([0.0f32; 2], [0.0f32; 2], [0u64; 2]);
        let mask = _mm512_set1_epi16(15);
        for s in 0..GROUP / SUPER {
            if !(WHOLE || s * SUPER < count) {
                break;
            }
            let block = row.add((first / SUPER + s) * QuantType::Q4K.block_bytes());
            let halves = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                block as *const i32,
            )));
            d[s] = _mm_cvtss_f32(halves);
            dmin[s] = _mm_cvtss_f32(_mm_movehdup_ps(halves));
            let (sc, mins) = q4k_scales_and_mins(block.add(4));
            m[s] = mins;
            for pair in 0..SUPER / 2 {
                let at = block.add(16 + 32 * pair) as *const __m256i;
                let bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(at));
                let (low, high) = (_mm512_and_si512(bytes, mask), _mm512_srli_epi16::<4>(bytes));
                let factor = |j: usize| _mm512_set1_epi16((sc >> (8 * j) & 0xff) as i16);
                let j = s * SUPER + 2 * pair;
                ints[j] = _mm512_mullo_epi16(low, factor(2 * pair));
                ints[j + 1] = _mm512_mullo_epi16(high, factor(2 * pair + 1));
            }
        }
        // Lanes 0..8 the first super-block's sub-blocks, 8..16 the second's.
        let per_super =
            |v: [f32; 2]| _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(v[0]), _mm512_set1_ps(v[1]));
        let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(
            m[1] as i64,
            m[0] as i64,
        )));
        Unpacked {
            ints,
            scales: per_super(d),
            mins: _mm512_mul_ps(m, _mm512_sub_ps(_mm512_setzero_ps(), per_super(dmin))),
        }
    }
}

/// A Q4_K super-block's eight 6-bit sub-block scales and eight 6-bit mins,
/// each as the bytes of a `u64` (sub-block `j` in byte `j`), from the 12
/// packed bytes at `at`: sub-blocks 0..4 keep the low six bits of bytes 0..4
/// (scales) and 4..8 (mins); sub-blocks 4..8 take four bits from bytes 8..12
/// (low nibble: scale, high nibble: min) and their top two bits from the top
/// two bits of bytes 0..4 (scale) and 4..8 (min) ([`q4k_scale_min`]'s layout,
/// read as three little-endian words).
#[inline]
unsafe fn q4k_scales_and_mins(at: *const u8) -> (u64, u64) {
    let word = |k: usize| std::ptr::read_unaligned(at.add(4 * k) as *const u32);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let (low6, low4, top2) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
    let scales_high = (w2 & low4) | (((w0 >> 6) & top2) << 4);
    let mins_high = ((w2 >> 4) & low4) | (((w1 >> 6) & top2) << 4);
    (
        u64::from(w0 & low6) | u64::from(scales_high) << 32,
        u64::from(w1 & low6) | u64::from(mins_high) << 32,
    )
}

/// Q6_K: 256-weight super-blocks of eight sub-blocks, `w = d · sc_h · (q −
/// 32)` with a signed 8-bit `sc_h` per 16 weights and 6-bit `q` (low four bits
/// in `ql`, high two in `qh`). Each sub-block's integers are `(q − 32) · sc_h`
/// (at most 32 · 128 in magnitude: a sub-block's 32 products with 16-bit
/// inputs stay inside i32), leaving one float factor `d` per super-block.
impl Group512 for Q6K {
    const SIGNED: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack_group<const WHOLE: bool>(
        row: *const u8,
        first: usize,
        count: usize,
    ) -> Unpacked {
        let mut ints = [_mm512_setzero_si512(); GROUP];
        let mut scales = [0.0f32; GROUP];
        let (mask, offset) = (_mm512_set1_epi16(15), _mm512_set1_epi16(32));
        for s in 0..GROUP / SUPER {
            if !(WHOLE || s * SUPER < count) {
                break;
            }
            let block = row.add((first / SUPER + s) * QuantType::Q6K.block_bytes());
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
                std::ptr::read_unaligned(block.add(208) as *const u16),
            ))));
            let sc = block.add(192) as *const i8;
            for half in 0..2 {
                let high_bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    block.add(128 + 32 * half) as *const __m256i,
                ));
                for chunk in 0..4 {
                    let low = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        block.add(64 * half + 32 * (chunk & 1)) as *const __m256i,
                    ));
                    let low = if chunk >= 2 {
                        _mm512_srli_epi16::<4>(low)
                    } else {
                        _mm512_and_si512(low, mask)
                    };
                    let high = _mm512_and_si512(
                        _mm512_srl_epi16(high_bits, _mm_cvtsi32_si128(2 * chunk as i32)),
                        _mm512_set1_epi16(3),
                    );
                    let q = _mm512_sub_epi16(
                        _mm512_or_si512(low, _mm512_slli_epi16::<4>(high)),
                        offset,
                    );
                    let at = 8 * half + 2 * chunk;
                    let factor = _mm512_inserti64x4::<1>(
                        _mm512_set1_epi16(i16::from(*sc.add(at))),
                        _mm256_set1_epi16(i16::from(*sc.add(at + 1))),
                    );
                    let j = s * SUPER + 4 * half + chunk;
                    ints[j] = _mm512_mullo_epi16(q, factor);
                    scales[j] = d;
                }
            }
        }
        Unpacked {
            ints,
            scales: _mm512_loadu_ps(scales.as_ptr()),
            mins: _mm512_setzero_ps(),
        }
    }
}

/// Sub-blocks `first..first + count` of one weight row into the accumulators
/// of input rows `base..base + R` (`WHOLE`: `count` is [`GROUP`], known when compiling, so the
/// sixteen registers of each step stay registers).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // index loops name the register blocking
unsafe fn group<F: Group512, const R: usize, const WHOLE: bool>(
    row: *const u8,
    xq: &Q16Rows,
    base: usize,
    first: usize,
    count: usize,
    acc: &mut [__m512; R],
) {
    let subs = xq.inner / SUB;
    let lanes: __mmask16 = if WHOLE { 0xffff } else { (1u16 << count) - 1 };
    let Unpacked { ints, scales, mins } = F::unpack_group::<WHOLE>(row, first, count);
    for r in 0..R {
        let x = xq.q.as_ptr().add((base + r) * xq.inner + first * SUB);
        let mut partial = [_mm512_setzero_si512(); GROUP];
        for j in 0..GROUP {
            if WHOLE || j < count {
                let xs = _mm512_loadu_si512(x.add(j * SUB) as *const _);
                partial[j] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), ints[j], xs);
            }
        }
        let sums = _mm512_cvtepi32_ps(reduce_sixteen(&partial));
        let at = (base + r) * subs + first;
        let d_x = _mm512_maskz_loadu_ps(lanes, xq.d.as_ptr().add(at));
        acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(scales, d_x), acc[r]);
        if !F::SIGNED {
            let x_sums = _mm512_maskz_loadu_ps(lanes, xq.sums.as_ptr().add(at));
            acc[r] = _mm512_fmadd_ps(mins, x_sums, acc[r]);
        }
    }
}

/// Lane `j` of the result is the sum of the sixteen lanes of `v[j]`: pairs of
/// registers interleaved and added, four times (exact: integer adds).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn reduce_sixteen(v: &[__m512i; GROUP]) -> __m512i {
    // Lanes (within each 128-bit quarter) hold, per step, the sums of ever
    // larger sets of the input registers' lanes.
    let mut eight = [_mm512_setzero_si512(); 8];
    for p in 0..8 {
        let (a, b) = (v[2 * p], v[2 * p + 1]);
        eight[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    }
    let mut four = [_mm512_setzero_si512(); 4];
    for p in 0..4 {
        let (a, b) = (eight[2 * p], eight[2 * p + 1]);
        four[p] = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    }
    let mut two = [_mm512_setzero_si512(); 2];
    for p in 0..2 {
        let (a, b) = (four[2 * p], four[2 * p + 1]);
        two[p] = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b),
        );
    }
    let (a, b) = (two[0], two[1]);
    _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::formats::q4k_scale_min;
    use crate::test_rng::SplitMix64 as TestRng;

    #[test]
    fn q4k_scales_and_mins_unpack_as_the_reference_does() {
        let mut rng = TestRng::new(77);
        for _ in 0..2000 {
            let packed: Vec<u8> = (0..12).map(|_| rng.below(256) as u8).collect();
            // SAFETY: 12 readable bytes.
            let (scales, mins) = unsafe { q4k_scales_and_mins(packed.as_ptr()) };
            for j in 0..8 {
                let (scale, min) = q4k_scale_min(&packed, j);
                assert_eq!((scales >> (8 * j)) as u8, scale, "{packed:?} scale {j}");
                assert_eq!((mins >> (8 * j)) as u8, min, "{packed:?} min {j}");
            }
        }
    }

    #[test]
    fn the_reduction_puts_each_registers_sum_in_its_own_lane() {
        if !available() {
            return;
        }
        let values: Vec<[i32; 16]> = (0..16i32)
            .map(|j| std::array::from_fn(|lane| (j + 1) * 1000 + lane as i32 * (j - 7)))
            .collect();
        // SAFETY: `available` checked the instructions.
        let sums: [i32; 16] = unsafe {
            let v: [__m512i; GROUP] =
                std::array::from_fn(|j| _mm512_loadu_si512(values[j].as_ptr() as *const _));
            std::mem::transmute(reduce_sixteen(&v))
        };
        for (j, lanes) in values.iter().enumerate() {
            assert_eq!(sums[j], lanes.iter().sum::<i32>(), "register {j}");
        }
    }
}
