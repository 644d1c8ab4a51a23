//! Linear layers of small batches on the host CPU: `y = x · wᵀ` for a few rows.
//!
//! Owns [`matmul_nt`], the math behind the decode-sized linear layers of a CPU
//! step (XLA calls it through [`crate::kernels::xla_ffi`]). A decode step of a small model
//! is a chain of `[T, in] x [out, in]ᵀ` products with T = 1..16 rows: pure weight
//! streaming. XLA:CPU's dot runs T = 2..8 at about half the bandwidth of its
//! one-row GEMV (60 products `[T, 576] x [1536, 576]ᵀ`: 7.8 ms at T = 1, 15.5 ms at
//! T = 2..8 on the 2-core EPYC of benches/RESULTS.md), so a 4-row step cost twice
//! a 1-row step. Here each weight row is loaded once and multiplied against every
//! input row while it is in registers, so T rows cost one pass over the weights
//! until the FMAs, not the memory, are the limit.
//!
//! Layout (row-major, f32): `x [rows, inner]`, `w [outs, inner]` (a Hugging Face
//! `[out_features, in_features]` weight, not transposed), `y [rows, outs]`.
//!
//! Invariants:
//! - every buffer has the size its shape says (checked before any read);
//! - each element of `y` is computed by exactly one worker, with a summation
//!   order that depends only on `inner` and the instruction set, so the result
//!   does not depend on the number of threads or on the other rows.

use std::sync::OnceLock;

/// Shapes of one call (see the module docs for the layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub rows: usize,
    pub inner: usize,
    pub outs: usize,
}

/// Input rows multiplied against one pass over a tile of weights (the register
/// budget of the AVX-512 kernel: 2 x 8 accumulators).
const ROW_GROUP: usize = 8;

/// Weight rows per unit of parallel work: ~150 KB of weights at 576 inputs, so a
/// unit's weights stay in L2 while every row group of a larger call passes over them.
pub const OUTS_PER_TILE: usize = 64;

/// Check the invariants in the module docs; `Err` names the first violation.
pub fn validate(shape: &MatmulShape, x: &[f32], w: &[f32], y: &[f32]) -> Result<(), String> {
    let s = shape;
    let sizes = [
        ("x", x.len(), s.rows * s.inner),
        ("w", w.len(), s.outs * s.inner),
        ("y", y.len(), s.rows * s.outs),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(format!("{name} has {got} elements, its shape says {want}"));
        }
    }
    Ok(())
}

/// A raw pointer to `y` that workers writing disjoint columns may share.
#[derive(Clone, Copy)]
pub struct OutPtr(*mut f32);

// SAFETY: workers write disjoint elements (disjoint column ranges) of one buffer
// that outlives them; see `matmul_nt_tile`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub fn new(y: &mut [f32]) -> Self {
        OutPtr(y.as_mut_ptr())
    }

    /// Element `index` of the buffer.
    ///
    /// # Safety
    /// `index` is within the buffer, and no other thread writes that element.
    pub unsafe fn at(self, index: usize) -> *mut f32 {
        self.0.add(index)
    }

    /// The buffer from element `index` on (a block of rows of `y`).
    ///
    /// # Safety
    /// `index` is within the buffer (or its end).
    pub unsafe fn from(self, index: usize) -> OutPtr {
        OutPtr(self.0.add(index))
    }
}

/// Number of tiles of [`OUTS_PER_TILE`] weight rows a call splits into.
pub fn tiles(shape: &MatmulShape) -> usize {
    shape.outs.div_ceil(OUTS_PER_TILE)
}

/// `y = x · wᵀ` on the calling thread.
pub fn matmul_nt(shape: &MatmulShape, x: &[f32], w: &[f32], y: &mut [f32]) -> Result<(), String> {
    validate(shape, x, w, y)?;
    let out = OutPtr::new(y);
    for tile in 0..tiles(shape) {
        // SAFETY: sizes validated above; one thread writes every tile.
        unsafe { matmul_nt_tile(shape, x, w, out, tile) };
    }
    Ok(())
}

/// Columns `tile * OUTS_PER_TILE ..` (one tile) of `y = x · wᵀ`.
///
/// # Safety
/// `x`, `w` and the buffer behind `y` passed [`validate`] for `shape`; no other
/// thread writes the same tile concurrently.
pub unsafe fn matmul_nt_tile(shape: &MatmulShape, x: &[f32], w: &[f32], y: OutPtr, tile: usize) {
    tile_with(instruction_set(), shape, x, w, y, tile)
}

/// [`matmul_nt_tile`] with the kernel of `set`, whatever [`instruction_set`]
/// chose (tests run every kernel the CPU has).
///
/// # Safety
/// As [`matmul_nt_tile`], and the CPU has `set`'s instructions.
pub(crate) unsafe fn tile_with(
    set: InstructionSet,
    shape: &MatmulShape,
    x: &[f32],
    w: &[f32],
    y: OutPtr,
    tile: usize,
) {
    let start = tile * OUTS_PER_TILE;
    let end = (start + OUTS_PER_TILE).min(shape.outs);
    if start >= end {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    match set {
        InstructionSet::Avx512 => {
            return vectorized_tile::<avx512::Avx512>(shape, x, w, y, start, end)
        }
        InstructionSet::Avx2Fma => {
            return vectorized_tile::<avx2::Avx2Fma>(shape, x, w, y, start, end)
        }
        InstructionSet::Portable => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = set;
    portable::tile(shape, x, w, y, start, end);
}

/// The kernel variant calls run on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstructionSet {
    /// AVX-512F: 16-lane FMAs, 32 vector registers.
    Avx512,
    /// AVX2 + FMA: 8-lane FMAs, 16 vector registers.
    Avx2Fma,
    /// The loop the compiler vectorizes for the build's baseline target.
    Portable,
}

/// f32 lanes of one vector register of the kernel this CPU runs: 16 (AVX-512), 8
/// (AVX2 + FMA), 0 (the portable loop, correct but slower than XLA's dot: callers
/// should not route to it). Callers size the row range they route here by it
/// (`python/kvpage/kernels/host/cpu_matmul.py`).
pub fn lanes() -> usize {
    match instruction_set() {
        InstructionSet::Avx512 => 16,
        InstructionSet::Avx2Fma => 8,
        InstructionSet::Portable => 0,
    }
}

/// Chosen once per process; `KVPAGE_CPU_MATMUL_PORTABLE=1` forces the portable loop.
pub fn instruction_set() -> InstructionSet {
    static CHOSEN: OnceLock<InstructionSet> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if std::env::var("KVPAGE_CPU_MATMUL_PORTABLE").as_deref() == Ok("1") {
            return InstructionSet::Portable;
        }
        detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> InstructionSet {
    if is_x86_feature_detected!("avx512f") {
        InstructionSet::Avx512
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        InstructionSet::Avx2Fma
    } else {
        InstructionSet::Portable
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> InstructionSet {
    InstructionSet::Portable
}

/// Every kernel this CPU can run, the portable loop first (tests).
#[cfg(test)]
pub(crate) fn available_instruction_sets() -> Vec<InstructionSet> {
    let mut sets = vec![InstructionSet::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            sets.push(InstructionSet::Avx2Fma);
        }
        if is_x86_feature_detected!("avx512f") {
            sets.push(InstructionSet::Avx512);
        }
    }
    sets
}

/// A vectorized kernel's inner product and its register blocking.
#[cfg(target_arch = "x86_64")]
trait DotRows {
    /// `sums[j][r] = x[r] . w[j]` for `R` rows of `x` and the `W` consecutive weight
    /// rows at `w` (both stride `k`); each sum accumulates in the same order whatever
    /// `R` and `W` are.
    ///
    /// # Safety
    /// The CPU has the kernel's instruction set; `x` holds `R` rows and `w` holds
    /// `W` rows of `k` floats.
    unsafe fn dot_rows<const R: usize, const W: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
    ) -> [[f32; R]; W];

    /// Rows `first_row .. first_row + rows` (1..=ROW_GROUP) of `y`, columns
    /// `start..end`, with the weight rows per pass suited to `rows`
    /// (each kernel's `row_group_table!`).
    ///
    /// # Safety
    /// As [`matmul_nt_tile`], and the CPU has the kernel's instruction set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_group(
        shape: &MatmulShape,
        x: &[f32],
        w: &[f32],
        y: OutPtr,
        first_row: usize,
        rows: usize,
        start: usize,
        end: usize,
    );
}

/// `match rows { R => group::<K, R, W>(..), .. }` for a table of (input rows R,
/// weight rows per pass W).
#[cfg(target_arch = "x86_64")]
macro_rules! row_group_table {
    ($kernel:ty, $rows:expr, $args:tt; $($r:literal $w:literal),*) => {
        match $rows {
            $($r => super::group::<$kernel, $r, $w> $args,)*
            _ => unreachable!("row groups hold 1..={} rows", super::ROW_GROUP),
        }
    };
}

/// Every row group of `y[.., start..end]` with kernel `K`.
#[cfg(target_arch = "x86_64")]
unsafe fn vectorized_tile<K: DotRows>(
    shape: &MatmulShape,
    x: &[f32],
    w: &[f32],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    for first_row in (0..shape.rows).step_by(ROW_GROUP) {
        let rows = (shape.rows - first_row).min(ROW_GROUP);
        K::row_group(shape, x, w, y, first_row, rows, start, end);
    }
}

/// Rows `first_row .. first_row + R` of `y`, columns `start..end`, `W` weight rows
/// per pass (then one at a time), with kernel `K`'s inner product.
#[cfg(target_arch = "x86_64")]
unsafe fn group<K: DotRows, const R: usize, const W: usize>(
    shape: &MatmulShape,
    x: &[f32],
    w: &[f32],
    y: OutPtr,
    first_row: usize,
    start: usize,
    end: usize,
) {
    let k = shape.inner;
    let x = x.as_ptr().add(first_row * k);
    let w = w.as_ptr();
    let store = |out: usize, sums: &[f32; R]| {
        for (r, value) in sums.iter().enumerate() {
            *y.0.add((first_row + r) * shape.outs + out) = *value;
        }
    };
    let mut out = start;
    while out + W <= end {
        let sums = K::dot_rows::<R, W>(x, w.add(out * k), k);
        for (j, row_sums) in sums.iter().enumerate() {
            store(out + j, row_sums);
        }
        out += W;
    }
    while out < end {
        let [sums] = K::dot_rows::<R, 1>(x, w.add(out * k), k);
        store(out, &sums);
        out += 1;
    }
}

/// Any CPU: 8-lane partial sums the compiler vectorizes.
mod portable {
    use super::{MatmulShape, OutPtr};

    const LANES: usize = 8;

    pub(super) unsafe fn tile(
        shape: &MatmulShape,
        x: &[f32],
        w: &[f32],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        let k = shape.inner;
        for row in 0..shape.rows {
            let x_row = &x[row * k..][..k];
            for out in start..end {
                let w_row = &w[out * k..][..k];
                let mut lanes = [0.0f32; LANES];
                let mut x_chunks = x_row.chunks_exact(LANES);
                let mut w_chunks = w_row.chunks_exact(LANES);
                for (xc, wc) in (&mut x_chunks).zip(&mut w_chunks) {
                    for lane in 0..LANES {
                        // Not `mul_add`: without FMA in the target it is a libm call.
                        lanes[lane] += xc[lane] * wc[lane];
                    }
                }
                let tail: f32 = x_chunks
                    .remainder()
                    .iter()
                    .zip(w_chunks.remainder())
                    .map(|(a, b)| a * b)
                    .sum();
                *y.0.add(row * shape.outs + out) = lanes.iter().sum::<f32>() + tail;
            }
        }
    }
}

/// x86-64 with AVX-512F: 2-4 weight rows x up to eight input rows per pass.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{DotRows, MatmulShape, OutPtr};
    use std::arch::x86_64::*;

    /// Prefetch distance in weight rows (4 rows of 576 floats: ~9 KB ahead).
    const PREFETCH_ROWS: usize = 4;

    pub(super) struct Avx512;

    impl DotRows for Avx512 {
        unsafe fn dot_rows<const R: usize, const W: usize>(
            x: *const f32,
            w: *const f32,
            k: usize,
        ) -> [[f32; R]; W] {
            dot_rows::<R, W>(x, w, k)
        }

        unsafe fn row_group(
            shape: &MatmulShape,
            x: &[f32],
            w: &[f32],
            y: OutPtr,
            first_row: usize,
            rows: usize,
            start: usize,
            end: usize,
        ) {
            // 4 weight rows for few input rows, where more independent streams and
            // sums keep the loads in flight; 2 for many, within the 32 registers.
            row_group_table!(Avx512, rows, (shape, x, w, y, first_row, start, end);
                1 4, 2 4, 3 4, 4 4, 5 2, 6 2, 7 2, 8 2)
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // index loops name the register blocking
    unsafe fn dot_rows<const R: usize, const W: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
    ) -> [[f32; R]; W] {
        let mut acc = [[_mm512_setzero_ps(); R]; W];
        // The weight rows this loop will read PREFETCH_ROWS rows from now: the
        // hardware prefetcher alone leaves the loads waiting on memory.
        let ahead = w.wrapping_add(PREFETCH_ROWS * k);
        let mut i = 0;
        while i + 16 <= k {
            let mut wv = [_mm512_setzero_ps(); W];
            for j in 0..W {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(j * k + i) as *const i8);
                wv[j] = _mm512_loadu_ps(w.add(j * k + i));
            }
            for r in 0..R {
                let xv = _mm512_loadu_ps(x.add(r * k + i));
                for j in 0..W {
                    acc[j][r] = _mm512_fmadd_ps(xv, wv[j], acc[j][r]);
                }
            }
            i += 16;
        }
        if i < k {
            let mask: __mmask16 = (1u32 << (k - i)).wrapping_sub(1) as __mmask16;
            for r in 0..R {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(r * k + i));
                for j in 0..W {
                    let wv = _mm512_maskz_loadu_ps(mask, w.add(j * k + i));
                    acc[j][r] = _mm512_fmadd_ps(xv, wv, acc[j][r]);
                }
            }
        }
        let mut sums = [[0.0f32; R]; W];
        for j in 0..W {
            for r in 0..R {
                sums[j][r] = _mm512_reduce_add_ps(acc[j][r]);
            }
        }
        sums
    }
}

/// x86-64 with AVX2 + FMA: the AVX-512 kernel's blocking in 8 lanes and 16
/// registers (accumulators + weight vectors + one input vector <= 16).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{DotRows, MatmulShape, OutPtr};
    use std::arch::x86_64::*;

    /// Prefetch distance in weight rows, as in the AVX-512 kernel.
    const PREFETCH_ROWS: usize = 4;

    pub(super) struct Avx2Fma;

    impl DotRows for Avx2Fma {
        unsafe fn dot_rows<const R: usize, const W: usize>(
            x: *const f32,
            w: *const f32,
            k: usize,
        ) -> [[f32; R]; W] {
            dot_rows::<R, W>(x, w, k)
        }

        unsafe fn row_group(
            shape: &MatmulShape,
            x: &[f32],
            w: &[f32],
            y: OutPtr,
            first_row: usize,
            rows: usize,
            start: usize,
            end: usize,
        ) {
            // R * W accumulators + W weight vectors + 1 input vector <= 16 registers.
            row_group_table!(Avx2Fma, rows, (shape, x, w, y, first_row, start, end);
                1 4, 2 4, 3 3, 4 2, 5 2, 6 2, 7 1, 8 1)
        }
    }

    /// 8 lanes, then the tail in order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // index loops name the register blocking
    unsafe fn dot_rows<const R: usize, const W: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
    ) -> [[f32; R]; W] {
        let mut acc = [[_mm256_setzero_ps(); R]; W];
        let ahead = w.wrapping_add(PREFETCH_ROWS * k);
        let mut i = 0;
        while i + 8 <= k {
            let mut wv = [_mm256_setzero_ps(); W];
            for j in 0..W {
                if i % 16 == 0 {
                    // One prefetch per 64-byte line.
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(j * k + i) as *const i8);
                }
                wv[j] = _mm256_loadu_ps(w.add(j * k + i));
            }
            for r in 0..R {
                let xv = _mm256_loadu_ps(x.add(r * k + i));
                for j in 0..W {
                    acc[j][r] = _mm256_fmadd_ps(xv, wv[j], acc[j][r]);
                }
            }
            i += 8;
        }
        let mut sums = [[0.0f32; R]; W];
        for j in 0..W {
            for r in 0..R {
                let mut sum = horizontal_sum(acc[j][r]);
                for t in i..k {
                    sum += *x.add(r * k + t) * *w.add(j * k + t);
                }
                sums[j][r] = sum;
            }
        }
        sums
    }

    /// The sum of a register's 8 lanes (also used by the quantized kernels).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn horizontal_sum(v: __m256) -> f32 {
        let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        let one = _mm_add_ss(pairs, _mm_movehdup_ps(pairs));
        _mm_cvtss_f32(one)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::SplitMix64 as TestRng;

    fn reference(shape: &MatmulShape, x: &[f32], w: &[f32]) -> Vec<f64> {
        let mut y = vec![0.0f64; shape.rows * shape.outs];
        for r in 0..shape.rows {
            for o in 0..shape.outs {
                y[r * shape.outs + o] = (0..shape.inner)
                    .map(|i| x[r * shape.inner + i] as f64 * w[o * shape.inner + i] as f64)
                    .sum();
            }
        }
        y
    }

    fn random(rng: &mut TestRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// `cases` random shapes up to `max` (rows, inner, outs), each computed by
    /// `compute` and compared with [`reference`].
    fn check_random_shapes(
        seed: u64,
        cases: usize,
        max: (usize, usize, usize),
        compute: impl Fn(&MatmulShape, &[f32], &[f32], &mut [f32]),
    ) {
        // Miri (scripts/sanitize.sh) interprets every load: a few small cases.
        let (cases, max) = if cfg!(miri) {
            (10, (3, 40, 9))
        } else {
            (cases, max)
        };
        let mut rng = TestRng::new(seed);
        for case in 0..cases {
            let shape = MatmulShape {
                rows: 1 + rng.below(max.0),
                inner: 1 + rng.below(max.1),
                outs: 1 + rng.below(max.2),
            };
            let x = random(&mut rng, shape.rows * shape.inner);
            let w = random(&mut rng, shape.outs * shape.inner);
            let mut y = vec![f32::NAN; shape.rows * shape.outs];
            compute(&shape, &x, &w, &mut y);
            for (i, (got, want)) in y.iter().zip(reference(&shape, &x, &w)).enumerate() {
                let tolerance = 1e-5 * (shape.inner as f64).sqrt() * 4.0;
                assert!(
                    (*got as f64 - want).abs() <= tolerance,
                    "seed {seed} case {case} {shape:?} element {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn matches_a_float64_reference_on_random_shapes() {
        check_random_shapes(7, 200, (20, 300, 150), |shape, x, w, y| {
            matmul_nt(shape, x, w, y).unwrap()
        });
    }

    #[test]
    fn the_portable_loop_matches_the_reference_too() {
        check_random_shapes(3, 50, (12, 200, 150), |shape, x, w, y| {
            let out = OutPtr::new(y);
            // SAFETY: sizes match the shape; one thread.
            unsafe { portable::tile(shape, x, w, out, 0, shape.outs) };
        });
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_kernel_matches_the_reference_where_the_cpu_has_it() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        check_random_shapes(5, 200, (20, 300, 150), |shape, x, w, y| {
            let out = OutPtr::new(y);
            // SAFETY: sizes match the shape; one thread; the CPU has AVX2 + FMA.
            unsafe { vectorized_tile::<avx2::Avx2Fma>(shape, x, w, out, 0, shape.outs) };
        });
    }

    #[test]
    fn a_row_does_not_depend_on_the_other_rows() {
        let mut rng = TestRng::new(11);
        let shape = MatmulShape {
            rows: 13,
            inner: 576,
            outs: 130,
        };
        let x = random(&mut rng, shape.rows * shape.inner);
        let w = random(&mut rng, shape.outs * shape.inner);
        let mut all = vec![0.0; shape.rows * shape.outs];
        matmul_nt(&shape, &x, &w, &mut all).unwrap();
        for row in [0, 7, 12] {
            let one = MatmulShape { rows: 1, ..shape };
            let mut y = vec![0.0; shape.outs];
            matmul_nt(&one, &x[row * shape.inner..][..shape.inner], &w, &mut y).unwrap();
            assert_eq!(y, all[row * shape.outs..][..shape.outs]);
        }
    }

    #[test]
    fn a_nan_or_infinite_input_gives_a_non_finite_row_in_every_kernel() {
        let mut rng = TestRng::new(13);
        for set in available_instruction_sets() {
            for rows in [1, 2, 9] {
                for bad in [f32::NAN, f32::INFINITY] {
                    // A tail of 5 past the lanes: the poisoned input sits in it.
                    let shape = MatmulShape {
                        rows,
                        inner: 37,
                        outs: 7,
                    };
                    let mut x = random(&mut rng, rows * shape.inner);
                    let w = random(&mut rng, shape.outs * shape.inner);
                    let poisoned = rows - 1;
                    x[poisoned * shape.inner + 35] = bad;
                    let mut y = vec![0.0; rows * shape.outs];
                    // SAFETY: the sizes are the shape's; one thread; the CPU has `set`.
                    unsafe { tile_with(set, &shape, &x, &w, OutPtr::new(&mut y), 0) };
                    for (r, row) in y.chunks(shape.outs).enumerate() {
                        let ok = if r != poisoned {
                            row.iter().all(|v| v.is_finite())
                        } else if bad.is_nan() {
                            row.iter().all(|v| v.is_nan())
                        } else {
                            row.iter().all(|v| !v.is_finite())
                        };
                        assert!(ok, "{set:?}, {rows} rows, input {bad}, row {r}: {row:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn wrong_sizes_are_errors_before_any_read() {
        let shape = MatmulShape {
            rows: 2,
            inner: 3,
            outs: 4,
        };
        let err = matmul_nt(&shape, &[0.0; 5], &[0.0; 12], &mut [0.0; 8]).unwrap_err();
        assert!(err.contains("x has 5 elements"), "{err}");
        let err = matmul_nt(&shape, &[0.0; 6], &[0.0; 12], &mut [0.0; 7]).unwrap_err();
        assert!(err.contains("y has 7 elements"), "{err}");
    }
}
