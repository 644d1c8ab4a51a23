//! The integer path with AVX-512 VNNI, weight rows in lanes: one to
//! [`LANES_ROWS`] input rows against a tile of sixteen weight rows, lane `o`
//! of every register holding weight row `o`, so no sum is ever reduced across
//! lanes.
//!
//! The row-at-a-time kernel (`integer_avx512.rs`) puts one weight row's
//! sub-block in a register and reduces its sixteen lanes of partial sums with
//! a transpose-and-add tree for every input row: ~45 shuffles and adds per 512
//! weights per input row, as many instructions as the products. Here a
//! sub-block of the tile's sixteen rows is transposed once, as bytes: register
//! `j` holds weights `4j..4j + 4` of all sixteen rows, one a byte (nibbles
//! masked out of their bytes, Q5's fifth bits added), so one `vpdpbusd` with
//! four input bytes broadcast adds four products to each row's sum. The 16-bit
//! inputs go in as two bytes each (`q = 256 · high + low`, [`Q16Rows`]): each
//! input row costs sixteen `vpdpbusd`, a conversion and one or two fused
//! multiply-adds per 512 weights, and the integer sums are exactly those of
//! 16-bit products. Until 2026-11-29 the weights were widened to 16-bit pairs
//! for `vpdpwssd` (sixteen of them too): the widening's shuffles cost as much
//! as the products at one input row. With bytes, one-row products ran ~10-15
//! % faster and bench moe's expert FFN 13 % at 1-32 tokens, to the same bits
//! (benches/RESULTS.md, 2026-11-29).
//!
//! Per sub-block `s` and weight row `o` the kernel adds `factor[o, s] · d_x[s]
//! · Σ q · q_x + offset[o, s] · Σ x`, sub-block after sub-block, the same
//! instructions in the same order for an input row whatever the other rows of
//! the call: a row's result is the same alone or among [`LANES_ROWS`] (a
//! speculative verification's rows equal the decode step's, bit for bit, and
//! so does a decode batch of up to 32 sequences).
//!
//! It reads Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 ([`reads`]); the other formats keep the
//! row-at-a-time kernel. Measured on a Zen 4 core (benches/RESULTS.md,
//! 2026-11-28): against the row-at-a-time kernel up to 8 rows and the float
//! panel above, Q4_0 576x1536 products ran 1.4x faster at one row and 1.7-2.0x
//! at 2-32; SmolLM2's decode 1.05x at one request and 1.2x at four; bench moe's
//! 32 requests 1.2x. At one row with an inner size of whole groups of 512
//! (where the row-at-a-time kernel has no partial group) it is ~10 % slower:
//! Q4_0 1024x512, and bench moe at one request (0.92x); Q4_K was 0.8x at one
//! row, so it is not read here.
//!
//! A tile's sixteen rows are sixteen streams, more than the hardware
//! prefetcher follows; the kernel asks for its bytes itself ([`TileRows::prefetch`]).
//!
//! Every function here needs AVX-512 F, BW and VNNI: `integer_avx512::available`
//! checks them.

use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

use super::activations::Q16Rows;
use super::call::{QuantShape, OUTS_PER_TILE};
use super::formats::{QuantType, SUB};
use super::integer_avx512::{self, Unpack512};
use super::unpack_avx2::{Format, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::kernels::cpu_matmul::OutPtr;

/// Calls of at most this many rows take this path where it reads the format
/// (more rows: the float panel).
pub const LANES_ROWS: usize = 32;

/// Weight rows of a tile, one per lane.
const LANES: usize = 16;
const _: () = assert!(OUTS_PER_TILE == LANES);

/// Whether calls of `kind` on this CPU take this path: the instructions
/// (`integer_avx512::available`), a format it [`reads`], and
/// `KVPAGE_CPU_LANES` not `0` (A/B measurements; read once per process).
pub fn takes(kind: QuantType) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    reads(kind)
        && integer_avx512::available()
        && *ON.get_or_init(|| std::env::var("KVPAGE_CPU_LANES").map_or(true, |v| v != "0"))
}

/// Whether this path reads `kind`.
pub fn reads(kind: QuantType) -> bool {
    matches!(
        kind,
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1
    )
}

/// The tile's weight rows: row `o` at `base + offsets[o]`; rows past the
/// tile's last repeat it (their lanes are computed and dropped), so every
/// read lies inside the tile.
struct TileRows {
    base: *const u8,
    offsets: [usize; LANES],
}

impl TileRows {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn new(base: *const u8, row_bytes: usize, count: usize) -> TileRows {
        let offsets: [usize; LANES] = std::array::from_fn(|o| o.min(count - 1) * row_bytes);
        TileRows { base, offsets }
    }

    /// Ask the cache for the bytes of `blocks` (`block_bytes` each) of row
    /// `o`, clipped to the row's `row_bytes`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn prefetch<const HINT: i32>(
        &self,
        o: usize,
        blocks: Range<usize>,
        block_bytes: usize,
        row_bytes: usize,
    ) {
        let from = blocks.start * block_bytes;
        let to = (blocks.end * block_bytes).min(row_bytes);
        if from >= to {
            return;
        }
        let row = self.base.add(self.offsets[o]);
        let mut at = from;
        while at < to {
            _mm_prefetch::<HINT>(row.add(at) as *const i8);
            at += 64;
        }
        _mm_prefetch::<HINT>(row.add(to - 1) as *const i8);
    }

    /// The four bytes at `at` of every row, lane `o` row `o`'s.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dwords(&self, at: usize) -> __m512i {
        let z: [__m512i; 4] = std::array::from_fn(|_| _mm512_setzero_si512());
        let mut z = z;
        for (a, z) in z.iter_mut().enumerate() {
            let row = |l: usize| self.base.add(self.offsets[4 * l + a] + at) as *const i32;
            let mut v = _mm512_castsi128_si512(_mm_cvtsi32_si128(std::ptr::read_unaligned(row(0))));
            v = _mm512_mask_set1_epi32(v, 0x0010, std::ptr::read_unaligned(row(1)));
            v = _mm512_mask_set1_epi32(v, 0x0100, std::ptr::read_unaligned(row(2)));
            *z = _mm512_mask_set1_epi32(v, 0x1000, std::ptr::read_unaligned(row(3)));
        }
        _mm512_unpacklo_epi64(
            _mm512_unpacklo_epi32(z[0], z[1]),
            _mm512_unpacklo_epi32(z[2], z[3]),
        )
    }

    /// The sixteen bytes at `at` of every row, transposed: register `q`, lane
    /// `o` holds row `o`'s bytes `4q..4q + 4`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn bytes16(&self, at: usize) -> [__m512i; 4] {
        // (No closures: they would not inherit this function's target features.)
        let mut z = [_mm512_setzero_si512(); 4];
        for (a, z) in z.iter_mut().enumerate() {
            let row = |l: usize| self.base.add(self.offsets[4 * l + a] + at) as *const __m128i;
            let mut v = _mm512_castsi128_si512(_mm_loadu_si128(row(0)));
            v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(row(1)));
            v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(row(2)));
            *z = _mm512_inserti32x4::<3>(v, _mm_loadu_si128(row(3)));
        }
        let (a0, a1) = (
            _mm512_unpacklo_epi32(z[0], z[1]),
            _mm512_unpackhi_epi32(z[0], z[1]),
        );
        let (a2, a3) = (
            _mm512_unpacklo_epi32(z[2], z[3]),
            _mm512_unpackhi_epi32(z[2], z[3]),
        );
        [
            _mm512_unpacklo_epi64(a0, a2),
            _mm512_unpackhi_epi64(a0, a2),
            _mm512_unpacklo_epi64(a1, a3),
            _mm512_unpackhi_epi64(a1, a3),
        ]
    }
}

/// A format this path reads: blocks of 32 weights, led by the `f16` scale
/// (and Q4_1's `f16` offset) whose meaning [`Unpack512`] states.
trait Lanes: Unpack512 {
    /// Block `b` of every row, one weight a byte: register `j`, lane `o` holds
    /// row `o`'s weights `4j..4j + 4`. Unsigned weights (`0..32`) unless
    /// [`Unpack512::SIGNED`].
    unsafe fn quads(rows: &TileRows, b: usize) -> [__m512i; 8];
}

/// The 4-bit weights in sixteen bytes of every row, `t` as
/// [`TileRows::bytes16`] gives them, one a byte in [`Lanes::quads`]' order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn nibble_quads(t: &[__m512i; 4]) -> [__m512i; 8] {
    let mask = _mm512_set1_epi8(15);
    std::array::from_fn(|j| {
        if j < 4 {
            _mm512_and_si512(t[j], mask)
        } else {
            // 16-bit shifts move the next byte's low nibble into this byte's
            // high one; the mask drops it.
            _mm512_and_si512(_mm512_srli_epi16::<4>(t[j - 4]), mask)
        }
    })
}

/// Per lane `o`, block `b` of row `o`: the float factor of its integer sums
/// and its offset per unit of `Σ x`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn factors<F: Lanes>(rows: &TileRows, b: usize) -> (__m512, __m512) {
    let (d, m) = halves(rows, b * F::KIND.block_bytes());
    if F::M_FIELD {
        (d, m)
    } else {
        (d, _mm512_mul_ps(d, _mm512_set1_ps(F::MIN_TIMES_D)))
    }
}

/// The `f16` scale of the 32-weight block at `at` of every row (and the `f16`
/// after it).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn halves(rows: &TileRows, at: usize) -> (__m512, __m512) {
    let head = rows.dwords(at);
    (
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(head))),
    )
}

impl Lanes for Q4_0 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn quads(rows: &TileRows, b: usize) -> [__m512i; 8] {
        nibble_quads(&rows.bytes16(b * Self::KIND.block_bytes() + 2))
    }
}

impl Lanes for Q4_1 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn quads(rows: &TileRows, b: usize) -> [__m512i; 8] {
        nibble_quads(&rows.bytes16(b * Self::KIND.block_bytes() + 4))
    }
}

/// Q5_0: `d`, then the 32 fifth bits (`u32 qh`, bit `i` weight `i`), then
/// Q4_0's nibbles; `w = d · (q − 16)`.
impl Lanes for Q5_0 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn quads(rows: &TileRows, b: usize) -> [__m512i; 8] {
        let at = b * Self::KIND.block_bytes();
        with_fifth_bits(rows, at + 2, nibble_quads(&rows.bytes16(at + 6)))
    }
}

/// Q5_1: `d`, `m`, then `qh` and the nibbles as Q5_0's; `w = d · q + m`.
impl Lanes for Q5_1 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn quads(rows: &TileRows, b: usize) -> [__m512i; 8] {
        let at = b * Self::KIND.block_bytes();
        with_fifth_bits(rows, at + 4, nibble_quads(&rows.bytes16(at + 8)))
    }
}

/// `quads` with 16 added to each weight whose bit is set in its row's `u32`
/// at `qh_at` (bit `i` weight `i`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn with_fifth_bits(rows: &TileRows, qh_at: usize, mut quads: [__m512i; 8]) -> [__m512i; 8] {
    // Byte `c` of `qh` (weights `8c..8c + 8`) copied into the four bytes of
    // its dword: register `j = 2c + half` tests bits `4j..4j + 4`, byte `k` of
    // a dword bit `4 half + k` of the copy.
    let qh = rows.dwords(qh_at);
    let sixteen = _mm512_set1_epi8(16);
    let bits = [
        _mm512_set1_epi32(0x0804_0201),
        _mm512_set1_epi32(0x8040_2010u32 as i32),
    ];
    for (c, index) in COPY_BYTE.iter().enumerate() {
        let copies = _mm512_shuffle_epi8(qh, _mm512_loadu_si512(index.as_ptr() as *const _));
        for (half, &bits) in bits.iter().enumerate() {
            let j = 2 * c + half;
            let set = _mm512_test_epi8_mask(copies, bits);
            quads[j] = _mm512_mask_add_epi8(quads[j], set, quads[j], sixteen);
        }
    }
    quads
}

/// The `vpshufb` index that copies byte `c` of every dword into its four
/// bytes (`vpshufb` indexes within 128-bit lanes: dword `d` of a lane starts
/// at byte `4d`).
const fn copy_byte_index(c: i8) -> [i8; 64] {
    let mut index = [0i8; 64];
    let mut at = 0;
    while at < 64 {
        index[at] = 4 * ((at as i8 / 4) % 4) + c;
        at += 1;
    }
    index
}

const COPY_BYTE: [[i8; 64]; 4] = [
    copy_byte_index(0),
    copy_byte_index(1),
    copy_byte_index(2),
    copy_byte_index(3),
];

/// Q8_0: `d`, then 32 signed bytes; `w = d · q`.
impl Lanes for Q8_0 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn quads(rows: &TileRows, b: usize) -> [__m512i; 8] {
        let at = b * Self::KIND.block_bytes() + 2;
        let (first, second) = (rows.bytes16(at), rows.bytes16(at + 16));
        std::array::from_fn(|j| if j < 4 { first[j] } else { second[j - 4] })
    }
}

/// Weight rows `start..end` (at most one tile) of `y`, every row of `xq`.
///
/// # Safety
/// `integer_avx512::available()` and [`reads`]`(shape.kind)`; `xq` quantized
/// from an `x` that passed validation with `w` and `y` for `shape` (these
/// formats have no row scales), with at most [`LANES_ROWS`] rows; `end - start`
/// in `1..=16`; no other thread writes rows `start..end`.
pub(super) unsafe fn tile(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    match shape.kind {
        QuantType::Q8_0 => tile_of::<Q8_0>(shape, xq, w, y, start, end),
        QuantType::Q4_0 => tile_of::<Q4_0>(shape, xq, w, y, start, end),
        QuantType::Q4_1 => tile_of::<Q4_1>(shape, xq, w, y, start, end),
        QuantType::Q5_0 => tile_of::<Q5_0>(shape, xq, w, y, start, end),
        QuantType::Q5_1 => tile_of::<Q5_1>(shape, xq, w, y, start, end),
        kind => unreachable!("the lanes path does not read {}", kind.name()),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_of<F: Lanes>(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    debug_assert!(xq.rows <= LANES_ROWS && start < end && end - start <= LANES);
    let row_bytes = shape.kind.row_bytes(shape.inner).expect("validated");
    let count = end - start;
    let rows = TileRows::new(w.as_ptr().add(start * row_bytes), row_bytes, count);
    let mut acc = [_mm512_setzero_ps(); LANES_ROWS];
    let blocks = shape.inner / F::KIND.block_elems();
    // Sixteen rows read side by side are sixteen streams, more than the
    // hardware prefetcher follows (a product from DRAM ran at half the
    // row-at-a-time kernel's speed). So the kernel asks for its bytes itself:
    // the first `2 * LANES` blocks of every row at the start (already cached
    // when the tile before ran on this thread: it asked for them, spread over
    // its blocks), then at block `b` row `b % 16`'s blocks of the group of
    // sixteen after next, 17 to 32 blocks before they are read.
    let bb = F::KIND.block_bytes();
    let first = 0..2 * LANES;
    for o in 0..count {
        rows.prefetch::<_MM_HINT_T0>(o, first.clone(), bb, row_bytes);
    }
    let after_next = end + LANES;
    let next_count = shape.outs.saturating_sub(after_next).min(LANES);
    let next = TileRows::new(
        w.as_ptr().add(after_next.min(shape.outs - 1) * row_bytes),
        row_bytes,
        next_count.max(1),
    );
    for b in 0..blocks {
        let o = b % LANES;
        let ahead = b - o + 2 * LANES;
        rows.prefetch::<_MM_HINT_T0>(o, ahead..ahead + LANES, bb, row_bytes);
        for o in b * next_count / blocks..(b + 1) * next_count / blocks {
            next.prefetch::<_MM_HINT_T1>(o, first.clone(), bb, row_bytes);
        }
        let (factor, offset) = factors::<F>(&rows, b);
        let quads = F::quads(&rows, b);
        if xq.bits == 8 {
            add_block::<F, false>(&quads, factor, offset, xq, b, &mut acc);
        } else {
            add_block::<F, true>(&quads, factor, offset, xq, b, &mut acc);
        }
    }
    let lanes: __mmask16 = if count == LANES {
        0xffff
    } else {
        (1u16 << count) - 1
    };
    for (r, acc) in acc.iter().enumerate().take(xq.rows) {
        _mm512_mask_storeu_ps(y.at(r * shape.outs + start), lanes, *acc);
    }
}

/// Weight rows `start..end` (one whole tile of sixteen) of `y`, every row of
/// `xq`, from weights packed by [`super::tiles::pack_tiles`]: the same instructions on the
/// same values as [`tile`] on the rows, so the same bits.
///
/// # Safety
/// As [`tile`], with [`super::tiles::packs`]`(shape.kind)`, `w` packed, `end - start == 16`.
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

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_packed_of<F: Lanes>(
    shape: &QuantShape,
    xq: &Q16Rows,
    w: &[u8],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    debug_assert!(end - start == LANES && xq.rows <= LANES_ROWS);
    debug_assert!(shape.outs.is_multiple_of(LANES));
    let bb = F::KIND.block_bytes();
    let block_bytes = LANES * bb;
    let header = LANES * (bb - 16);
    let row_bytes = shape.kind.row_bytes(shape.inner).expect("validated");
    let tile_bytes = LANES * row_bytes;
    let base = w.as_ptr().add(start * row_bytes);
    let blocks = shape.inner / SUB;
    // One stream: the next blocks are asked for `AHEAD` blocks before they
    // are read, and the tile after next (L2) spread over the blocks.
    const AHEAD: usize = 8;
    for at in (0..(AHEAD * block_bytes).min(tile_bytes)).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(base.add(at) as *const i8);
    }
    let after_next = end + LANES;
    let next = (after_next < shape.outs).then(|| w.as_ptr().add(after_next * row_bytes));
    let lines = tile_bytes.div_ceil(64);
    let mut acc = [_mm512_setzero_ps(); LANES_ROWS];
    for b in 0..blocks {
        let ahead = (b + AHEAD) * block_bytes;
        if ahead < tile_bytes {
            for at in (ahead..ahead + block_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(base.add(at) as *const i8);
            }
        }
        if let Some(next) = next {
            for line in b * lines / blocks..(b + 1) * lines / blocks {
                _mm_prefetch::<_MM_HINT_T1>(next.add(64 * line) as *const i8);
            }
        }
        let at = base.add(b * block_bytes);
        let factor = _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i));
        let offset = if F::M_FIELD {
            _mm512_cvtph_ps(_mm256_loadu_si256(at.add(2 * LANES) as *const __m256i))
        } else {
            _mm512_mul_ps(factor, _mm512_set1_ps(F::MIN_TIMES_D))
        };
        let nibbles: [__m512i; 4] =
            std::array::from_fn(|q| _mm512_loadu_si512(at.add(header + 64 * q) as *const _));
        let quads = nibble_quads(&nibbles);
        if xq.bits == 8 {
            add_block::<F, false>(&quads, factor, offset, xq, b, &mut acc);
        } else {
            add_block::<F, true>(&quads, factor, offset, xq, b, &mut acc);
        }
    }
    for (r, acc) in acc.iter().enumerate().take(xq.rows) {
        _mm512_storeu_ps(y.at(r * shape.outs + start), *acc);
    }
}

/// Block `b` of a tile (its weight `quads`, `factor` and `offset` per lane)
/// against every row of `xq`, into `acc`.
///
/// The integer sum of a row and weight row is `Σ w · q` over the block, with
/// `q = 256 · high + low` ([`Q16Rows`]): `256 · Σ w · high + Σ w · low`, each
/// in `vpdpbusd`s (four products of unsigned and signed bytes a lane). The
/// unsigned operand is the weight for `high` and `low` for the other; signed
/// weights (Q8_0) go in as `w + 128` against `high`, and `128 · Σ high` comes
/// off. The sums are exact, so any order of the instructions gives the same
/// result; the float steps after them are a row's own, in a fixed order.
/// Without `LOW` (8-bit inputs: every `low` is 0) the `low` products are
/// left out, to the same sums.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn add_block<F: Lanes, const LOW: bool>(
    quads: &[__m512i; 8],
    factor: __m512,
    offset: __m512,
    xq: &Q16Rows,
    b: usize,
    acc: &mut [__m512; LANES_ROWS],
) {
    let flip = _mm512_set1_epi8(-128);
    let subs = xq.inner / SUB;
    // Index loops, chains in named registers, the weights re-read from
    // `quads` and flipped per use: written with an iterator over `acc`, a
    // copied array of flipped weights and indexed chains, the same
    // instructions ran 1.25x slower at 32 rows (2026-11-29).
    #[allow(clippy::needless_range_loop)]
    for r in 0..xq.rows {
        let first = r * xq.inner + b * SUB;
        let (mut h0, mut h1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        let (mut l0, mut l1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for j in (0..8).step_by(2) {
            for (k, (h, l)) in [(&mut h0, &mut l0), (&mut h1, &mut l1)]
                .into_iter()
                .enumerate()
            {
                let at = first + 4 * (j + k);
                let high = _mm512_set1_epi32(std::ptr::read_unaligned(
                    xq.high.as_ptr().add(at) as *const i32
                ));
                let w = quads[j + k];
                let unsigned = if F::SIGNED {
                    _mm512_xor_si512(w, flip)
                } else {
                    w
                };
                *h = dpbusd(*h, unsigned, high);
                if LOW {
                    let low = _mm512_set1_epi32(std::ptr::read_unaligned(
                        xq.low.as_ptr().add(at) as *const i32
                    ));
                    *l = dpbusd(*l, low, w);
                }
            }
        }
        let at = r * subs + b;
        let mut high_sum = _mm512_add_epi32(h0, h1);
        if F::SIGNED {
            high_sum = _mm512_sub_epi32(high_sum, _mm512_set1_epi32(128 * xq.high_sums[at]));
        }
        let sum = _mm512_add_epi32(_mm512_slli_epi32::<8>(high_sum), _mm512_add_epi32(l0, l1));
        let scale = _mm512_mul_ps(factor, _mm512_set1_ps(xq.d[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
        if !F::SIGNED {
            acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xq.sums[at]), acc[r]);
        }
    }
}

/// `acc + Σ` of the four products of unsigned bytes of `a` and signed bytes
/// of `b` per 32-bit lane, as one `vpdpbusd`. Written in assembly: LLVM's
/// generic x86-64 tuning split the 16-bit `vpdpwssd` intrinsic into two
/// instructions where the CPU has one; this keeps the one instruction
/// whatever the tuning.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    std::arch::asm!(
        "vpdpbusd {acc}, {a}, {b}",
        acc = inout(zmm_reg) acc,
        a = in(zmm_reg) a,
        b = in(zmm_reg) b,
        options(pure, nomem, nostack, preserves_flags),
    );
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_rows_bytes_transpose_into_lanes() {
        if !super::super::integer_avx512::available() {
            return;
        }
        let row_bytes = 40;
        for count in [16, 11, 1] {
            let w: Vec<u8> = (0..count * row_bytes)
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            // SAFETY: `available` checked the instructions; reads stay in `w`.
            let got: [[u32; 16]; 4] = unsafe {
                let rows = TileRows::new(w.as_ptr(), row_bytes, count);
                std::mem::transmute(rows.bytes16(3))
            };
            for (q, lanes) in got.iter().enumerate() {
                for (o, value) in lanes.iter().enumerate() {
                    let at = o.min(count - 1) * row_bytes + 3 + 4 * q;
                    let want = u32::from_le_bytes(w[at..at + 4].try_into().unwrap());
                    assert_eq!(*value, want, "count {count} register {q} lane {o}");
                }
            }
        }
    }
}
