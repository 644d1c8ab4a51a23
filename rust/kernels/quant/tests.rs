//! Tests of the quantized product against a float64 reference built from
//! [`formats::dequantize_row`] and the 16-bit inputs, for every type, both
//! kernels and random shapes.

use super::activations::Q16Rows;
use super::call::{self, QuantShape};
use super::dequantize;
use super::formats::{self, f16_to_f32, QuantType, SUB};
use super::qmatmul::{self, integer_blocks, integer_rows, qmatmul, takes_integer_path, Inputs};
use crate::kernels::cpu_matmul::OutPtr;
use crate::test_rng::SplitMix64 as TestRng;

/// An f16 with a small magnitude (scales of real files are 1e-4 .. 1e-1).
fn small_f16(rng: &mut TestRng) -> [u8; 2] {
    let exponent = 3 + rng.below(10) as u16; // 2^-12 .. 2^-3
    let bits = (exponent << 10) | rng.below(1024) as u16 | ((rng.below(2) as u16) << 15);
    bits.to_le_bytes()
}

/// A random, well-formed block of `kind` (random integers, small scales).
fn random_block(rng: &mut TestRng, kind: QuantType) -> Vec<u8> {
    let mut block: Vec<u8> = (0..kind.block_bytes())
        .map(|_| rng.below(256) as u8)
        .collect();
    let halves: &[usize] = match kind {
        QuantType::Q8_0 | QuantType::Q4_0 => &[0],
        QuantType::Q4_1 | QuantType::Q4K | QuantType::Q5_1 => &[0, 2],
        QuantType::Q5_0 => &[0],
        QuantType::Q6K => &[208],
        QuantType::Int8 => &[],
    };
    for &at in halves {
        block[at..at + 2].copy_from_slice(&small_f16(rng));
    }
    block
}

/// Random, well-formed weights of `kind` for `outs` rows of `inner` inputs.
pub(crate) fn random_weights(
    rng: &mut TestRng,
    kind: QuantType,
    outs: usize,
    inner: usize,
) -> Vec<u8> {
    let blocks = outs * inner / kind.block_elems();
    (0..blocks).flat_map(|_| random_block(rng, kind)).collect()
}

/// A call of `rows x inner` inputs in [-1, 1] and `outs` random weight rows of `kind`.
fn random_case(
    rng: &mut TestRng,
    kind: QuantType,
    rows: usize,
    inner: usize,
    outs: usize,
) -> (QuantShape, Vec<f32>, Vec<u8>) {
    let shape = QuantShape {
        kind,
        rows,
        inner,
        outs,
    };
    let x = (0..rows * inner)
        .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
        .collect();
    (shape, x, random_weights(rng, kind, outs, inner))
}

/// Row scales `1e-3, 2e-3, ...` for the `outs` rows of a per-channel `kind`, else none.
fn row_scales(kind: QuantType, outs: usize) -> Vec<f32> {
    if kind.row_scaled() {
        (0..outs).map(|o| (1 + o) as f32 * 1e-3).collect()
    } else {
        Vec::new()
    }
}

/// `y[r, o]` in float64 from the unpacked weights `scale * q + min` and the
/// inputs as the call's path reads them: the integer path multiplies
/// `scale * q` by the 16-bit inputs and `min` by the float ones; the float
/// path reads float inputs throughout.
fn reference(shape: &QuantShape, x: &[f32], w: &[u8], row_scales: &[f32]) -> Vec<f64> {
    let integer = takes_integer_path(shape.kind, shape.rows);
    reference_of(
        shape,
        x,
        w,
        row_scales,
        integer,
        folds_offset(shape.kind),
        16,
    )
}

/// Whether the vectorized integer path for `kind` folds its offset into the
/// integers, so that it multiplies the quantized inputs where the other
/// integer paths add `min · Σ x` exactly: Q6_K's -32 per weight on the AVX-512
/// VNNI path, Q4_0's -8 on the AVX2 one (`unpack_avx2.rs`).
fn folds_offset(kind: QuantType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::call::vectorized()
        && match kind {
            QuantType::Q6K => super::integer_avx512::takes(kind),
            QuantType::Q4_0 => !super::lanes_avx512::takes(kind),
            _ => false,
        };
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// [`reference`], the offsets of the integer path on the quantized inputs
/// when `folds_offset`.
fn reference_of(
    shape: &QuantShape,
    x: &[f32],
    w: &[u8],
    row_scales: &[f32],
    integer: bool,
    folds_offset: bool,
    bits: u32,
) -> Vec<f64> {
    let kind = shape.kind;
    let row_bytes = kind.row_bytes(shape.inner).unwrap();
    let per_block = kind.block_elems() / SUB;
    let xq = Q16Rows::quantize_to(x, shape.rows, shape.inner, bits);
    let mut y = vec![0.0; shape.rows * shape.outs];
    for o in 0..shape.outs {
        let scale = if kind.row_scaled() {
            row_scales[o]
        } else {
            1.0
        };
        let row = &w[o * row_bytes..][..row_bytes];
        for r in 0..shape.rows {
            let mut total = 0.0f64;
            for s in 0..shape.inner / SUB {
                let block = &row[(s / per_block) * kind.block_bytes()..];
                let sub = formats::unpack(kind, block, s % per_block, scale);
                for i in 0..SUB {
                    let at = r * shape.inner + s * SUB + i;
                    let exact = f64::from(x[at]);
                    let scaled_input = if integer {
                        f64::from(xq.q[at]) * f64::from(xq.d[at / SUB])
                    } else {
                        exact
                    };
                    let offset_input = if integer && folds_offset {
                        scaled_input
                    } else {
                        exact
                    };
                    total += f64::from(sub.scale[i / 16]) * f64::from(sub.q[i]) * scaled_input
                        + f64::from(sub.min[i / 16]) * offset_input;
                }
            }
            y[r * shape.outs + o] = total;
        }
    }
    y
}

fn check(
    seed: u64,
    cases: usize,
    vectorized: bool,
    compute: impl Fn(&QuantShape, &[f32], &[u8], &[f32], &mut [f32]),
) {
    // Miri (scripts/sanitize.sh) interprets every load: two small cases a type.
    let (cases, rows, blocks, outs) = if cfg!(miri) {
        (12, 3, 1, 5)
    } else {
        (cases, 40, 4, 40)
    };
    let mut rng = TestRng::new(seed);
    for case in 0..cases {
        let kind = QuantType::ALL[case % QuantType::ALL.len()];
        let shape = QuantShape {
            kind,
            // Every type's one-row (integer) path in a third of its cases.
            rows: if (case / QuantType::ALL.len()).is_multiple_of(3) {
                1
            } else {
                1 + rng.below(rows) // both float paths (panel from 16 rows)
            },
            inner: kind.block_elems() * (1 + rng.below(blocks)),
            outs: 1 + rng.below(outs),
        };
        let x: Vec<f32> = (0..shape.rows * shape.inner)
            .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
            .collect();
        let w = random_weights(&mut rng, kind, shape.outs, shape.inner);
        let row_scales: Vec<f32> = if kind.row_scaled() {
            (0..shape.outs)
                .map(|_| (1 + rng.below(100)) as f32 * 1e-3)
                .collect()
        } else {
            Vec::new()
        };
        let mut y = vec![f32::NAN; shape.rows * shape.outs];
        compute(&shape, &x, &w, &row_scales, &mut y);
        let folds = vectorized && folds_offset(kind);
        let integer = takes_integer_path(shape.kind, shape.rows);
        let want = reference_of(&shape, &x, &w, &row_scales, integer, folds, 16);
        let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (i, (got, want)) in y.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*got) - want).abs() <= 2e-5 * scale,
                "seed {seed} case {case} {shape:?} element {i}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn every_type_matches_a_float64_reference_on_random_shapes() {
    check(17, 120, true, |shape, x, w, s, y| {
        qmatmul(shape, x, w, s, y).unwrap()
    });
}

#[test]
fn the_portable_loop_matches_the_reference_too() {
    check(19, 60, false, |shape, x, w, s, y| {
        call::validate(shape, x, w, s, y).unwrap();
        let inputs = Inputs::prepare(shape, x);
        let out = OutPtr::new(y);
        // SAFETY: validated; one thread.
        unsafe { portable_all_tiles(shape, &inputs, w, s, out) };
    });
}

/// Every tile through the portable loop, whatever the CPU has.
unsafe fn portable_all_tiles(shape: &QuantShape, inputs: &Inputs, w: &[u8], s: &[f32], y: OutPtr) {
    qmatmul::portable_for_tests(shape, inputs, w, s, y);
}

#[test]
fn a_row_does_not_depend_on_the_other_rows_of_a_multi_row_call() {
    let mut rng = TestRng::new(23);
    for kind in QuantType::ALL {
        let shape = QuantShape {
            kind,
            rows: 40, // past every integer path's rows: `all` takes a float path
            inner: 512,
            outs: 37,
        };
        let x: Vec<f32> = (0..shape.rows * shape.inner)
            .map(|_| rng.below(2001) as f32 / 500.0 - 2.0)
            .collect();
        let w = random_weights(&mut rng, kind, shape.outs, shape.inner);
        let s: Vec<f32> = if kind.row_scaled() {
            vec![0.01; shape.outs]
        } else {
            Vec::new()
        };
        let mut all = vec![0.0; shape.rows * shape.outs];
        qmatmul(&shape, &x, &w, &s, &mut all).unwrap();
        let rows_of = |first: usize, count: usize| {
            let part = QuantShape {
                rows: count,
                ..shape
            };
            let mut y = vec![0.0; count * shape.outs];
            let xs = &x[first * shape.inner..][..count * shape.inner];
            qmatmul(&part, xs, &w, &s, &mut y).unwrap();
            y
        };
        // Row groups and the panel (16 rows and more) sum in the same order; the
        // integer path (up to `integer_rows` rows, and past them in blocks of that
        // many where `integer_blocks`) sums each row alone.
        let cases = [
            (0, 2),
            (8, 3),
            (3, 8),
            (5, 9),
            (0, 16),
            (4, 16),
            (2, 17),
            (1, 32),
            (3, 33),
            (0, 36),
        ];
        for (first, count) in cases {
            let y = rows_of(first, count);
            if takes_integer_path(kind, count) {
                for r in 0..count {
                    let alone = rows_of(first + r, 1);
                    assert_eq!(
                        &y[r * shape.outs..][..shape.outs],
                        alone,
                        "{kind:?} row {r}"
                    );
                }
            } else {
                let want = &all[first * shape.outs..][..count * shape.outs];
                assert_eq!(y, want, "{kind:?} rows {first}..");
            }
        }
        // One row on the float path (the batch-invariant targets) equals that row of
        // the multi-row call on the float path, bit for bit.
        let mut all = vec![0.0; shape.rows * shape.outs];
        let inputs = Inputs::float_path(&x);
        let out = OutPtr::new(&mut all);
        for index in 0..call::tiles(&shape) {
            // SAFETY: shapes as validated by the multi-row call; one thread.
            unsafe { qmatmul::tile(&shape, &inputs, &w, &s, out, index) };
        }
        for row in [0, 7, 19, 39] {
            let one = QuantShape { rows: 1, ..shape };
            let xs = &x[row * shape.inner..][..shape.inner];
            let inputs = Inputs::float_path(xs);
            let mut y = vec![0.0; shape.outs];
            let out = OutPtr::new(&mut y);
            for index in 0..call::tiles(&one) {
                // SAFETY: shapes as validated by the multi-row call; one thread.
                unsafe { qmatmul::tile(&one, &inputs, &w, &s, out, index) };
            }
            assert_eq!(
                y,
                &all[row * shape.outs..][..shape.outs],
                "{kind:?} row {row}"
            );
        }
    }
}

#[test]
fn wrong_sizes_are_errors_before_any_read() {
    let shape = QuantShape {
        kind: QuantType::Q4_1,
        rows: 2,
        inner: 64,
        outs: 3,
    };
    let err = qmatmul(&shape, &[0.0; 128], &[0; 119], &[], &mut [0.0; 6]).unwrap_err();
    assert!(
        err.contains("w has 119 elements, its shape says 120"),
        "{err}"
    );
    let odd = QuantShape { inner: 48, ..shape };
    let err = qmatmul(&odd, &[0.0; 96], &[0; 90], &[], &mut [0.0; 6]).unwrap_err();
    assert!(err.contains("multiple of 32"), "{err}");
    let int8 = QuantShape {
        kind: QuantType::Int8,
        ..shape
    };
    let err = qmatmul(&int8, &[0.0; 128], &[0; 192], &[1.0; 2], &mut [0.0; 6]).unwrap_err();
    assert!(err.contains("row_scales has 2 elements"), "{err}");
}

#[test]
fn zero_inputs_give_zero_and_no_nan() {
    let shape = QuantShape {
        kind: QuantType::Q8_0,
        rows: 3,
        inner: 64,
        outs: 5,
    };
    let mut rng = TestRng::new(29);
    let w = random_weights(&mut rng, shape.kind, shape.outs, shape.inner);
    let mut y = vec![f32::NAN; 15];
    qmatmul(&shape, &[0.0; 192], &w, &[], &mut y).unwrap();
    assert!(y.iter().all(|v| *v == 0.0), "{y:?}");
}

#[test]
fn half_precision_converts_exactly() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("f16c") {
        for bits in 0..=u16::MAX {
            // SAFETY: the CPU has F16C.
            let hardware = unsafe { f16c(bits) };
            let ours = f16_to_f32(bits);
            assert!(
                ours.to_bits() == hardware.to_bits() || (ours.is_nan() && hardware.is_nan()),
                "{bits:#x}"
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
unsafe fn f16c(bits: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[test]
fn q4_k_and_q6_k_unpack_as_their_layouts_say() {
    // Q4_K: sub-block 5 is the high nibbles of qs[64..96], scale/min from the packed bytes.
    let mut block = vec![0u8; 144];
    block[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
    block[2..4].copy_from_slice(&0x3800u16.to_le_bytes()); // dmin = 0.5
    block[4 + 1] = 0b01_000011; // j = 1: sc = 3; feeds j = 5's high bits of sc
    block[4 + 5] = 0b10_000111; // j = 1: m = 7; feeds j = 5's high bits of m
    block[4 + 9] = 0b0101_0010; // j = 5: sc low 4 bits = 2, m low 4 bits = 5
    block[16 + 64] = 0xa7; // weight 0 of sub-blocks 4 (7) and 5 (10)
    let sub = formats::unpack(QuantType::Q4K, &block, 5, 1.0);
    assert_eq!(sub.q[0], 10);
    assert_eq!(sub.scale, [(2 | (1 << 4)) as f32; 2]);
    assert_eq!(sub.min, [-0.5 * (5 | (2 << 4)) as f32; 2]);
    // Q6_K: sub-block 6 (second half, chunk 2): weight 17 = ql[64 + 17] >> 4 | ((qh[32 + 17] >> 4) & 3) << 4.
    let mut block = vec![0u8; 210];
    block[208..210].copy_from_slice(&0x3c00u16.to_le_bytes());
    block[64 + 17] = 0x90;
    block[128 + 32 + 17] = 0b0010_0000;
    block[192 + 8 + 4 + 1] = (-3i8) as u8;
    let sub = formats::unpack(QuantType::Q6K, &block, 6, 1.0);
    assert_eq!(sub.q[17], 9 | (2 << 4));
    assert_eq!(sub.scale[1], -3.0);
    assert_eq!(sub.min[1], 96.0);
}

#[test]
fn dequantize_tiles_equal_the_reference_unpacking() {
    let mut rng = TestRng::new(31);
    for kind in QuantType::ALL {
        let (outs, inner) = (37, 2 * kind.block_elems());
        let w = random_weights(&mut rng, kind, outs, inner);
        let scales: Vec<f32> = if kind.row_scaled() {
            vec![0.02; outs]
        } else {
            Vec::new()
        };
        let mut out = vec![f32::NAN; outs * inner];
        dequantize::validate_dequantize(kind, inner, &w, &scales, &out).unwrap();
        let target = OutPtr::new(&mut out);
        for index in 0..outs.div_ceil(call::OUTS_PER_TILE) {
            // SAFETY: validated; one thread.
            unsafe { dequantize::dequantize_tile(kind, inner, &w, &scales, target, outs, index) };
        }
        let row_bytes = kind.row_bytes(inner).unwrap();
        for o in 0..outs {
            let scale = if kind.row_scaled() { 0.02 } else { 1.0 };
            let want =
                formats::dequantize_row(kind, &w[o * row_bytes..][..row_bytes], inner, scale);
            for (i, (got, want)) in out[o * inner..][..inner].iter().zip(&want).enumerate() {
                // One FMA here, a multiply then an add in the reference.
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "{kind:?} {o} {i}"
                );
            }
        }
    }
}

#[test]
fn a_nan_or_infinite_input_gives_a_non_finite_row_on_every_path() {
    // One row alone takes the 16-bit integer path, where a NaN once vanished
    // (f32::max skips it, and NaN casts to integer 0): one row gave a finite
    // result where two gave NaN.
    let mut rng = TestRng::new(37);
    for kind in QuantType::ALL {
        // The integer path, row groups (one, two), the panel (below and past 128).
        for rows in [1, 2, 7, 12, 20, 130] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let shape = QuantShape {
                    kind,
                    rows,
                    inner: 2 * kind.block_elems(),
                    outs: 9,
                };
                let mut x: Vec<f32> = (0..rows * shape.inner)
                    .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let poisoned = rows - 1;
                x[poisoned * shape.inner + 5] = bad;
                let w = random_weights(&mut rng, kind, shape.outs, shape.inner);
                let s = if kind.row_scaled() {
                    vec![0.01; shape.outs]
                } else {
                    Vec::new()
                };
                for portable in [false, true] {
                    let mut y = vec![0.0; rows * shape.outs];
                    if portable {
                        let inputs = Inputs::prepare(&shape, &x);
                        // SAFETY: the sizes are the shape's; one thread.
                        unsafe { portable_all_tiles(&shape, &inputs, &w, &s, OutPtr::new(&mut y)) };
                    } else {
                        qmatmul(&shape, &x, &w, &s, &mut y).unwrap();
                    }
                    let at = format!("{kind:?}, {rows} rows, portable {portable}, input {bad}");
                    for (r, row) in y.chunks(shape.outs).enumerate() {
                        if r != poisoned {
                            assert!(row.iter().all(|v| v.is_finite()), "{at}: row {r}");
                        } else if bad.is_nan() {
                            assert!(row.iter().all(|v| v.is_nan()), "{at}: {row:?}");
                        } else {
                            assert!(row.iter().all(|v| !v.is_finite()), "{at}: {row:?}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_format_table_is_in_code_order_and_its_names_round_trip() {
    for (code, (kind, info)) in QuantType::ALL.iter().zip(formats::FORMATS).enumerate() {
        assert_eq!((*kind as usize, info.kind), (code, *kind));
        assert_eq!(QuantType::from_name(info.name), Some(*kind));
        assert_eq!(kind.row_bytes(info.block_elems), Some(info.block_bytes));
        // GGUF stores every format but kvpage's per-channel int8, which alone
        // carries row scales.
        assert_eq!(info.gguf.is_none(), info.row_scaled, "{kind:?}");
    }
}

/// Inner sizes of whole groups of 16 sub-blocks and of partial ones, every row
/// count of the integer path (the AVX-512 VNNI kernels where the CPU has them,
/// else AVX2's; blocks past them with VNNI), against the reference.
#[test]
fn products_of_many_sub_blocks_match_the_reference_at_every_integer_row_count() {
    let mut rng = TestRng::new(29);
    for kind in QuantType::ALL {
        for subs in [8usize, 16, 18, 28, 40, 48] {
            let inner = (subs * SUB).next_multiple_of(kind.block_elems());
            let blocks = if integer_blocks(kind) {
                vec![33, 70]
            } else {
                vec![]
            };
            for rows in (1..=integer_rows(kind).max(2)).chain(blocks) {
                let (shape, x, w) = random_case(&mut rng, kind, rows, inner, 21);
                let s = row_scales(kind, shape.outs);
                let mut y = vec![f32::NAN; rows * shape.outs];
                qmatmul(&shape, &x, &w, &s, &mut y).unwrap();
                let want = reference(&shape, &x, &w, &s);
                let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                for (i, (got, want)) in y.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(*got) - want).abs() <= 2e-5 * scale,
                        "{shape:?} element {i}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// Packed weights give their rows' bits where [`qmatmul::packed_matches_rows`]
/// (AVX-512 VNNI), else (AVX2) the float64 reference of the integer path (no
/// offset folded) within its rounding; either way a row's result does not
/// depend on the call's other rows.
#[test]
fn weights_packed_into_tiles_give_the_bits_of_their_rows() {
    use super::tiles::pack_tiles;
    use crate::kernels::guard_page::{Edge, Guarded};
    if !qmatmul::packs(QuantType::Q4_0, 16) {
        return; // no AVX2 here
    }
    let mut rng = TestRng::new(611);
    for kind in [QuantType::Q4_0, QuantType::Q4_1] {
        for (rows, inner, outs) in [(1, 64, 16), (2, 96, 48), (5, 576, 32), (33, 64, 64)] {
            let (shape, x, w) = random_case(&mut rng, kind, rows, inner, outs);
            let mut want = vec![0.0f32; rows * outs];
            qmatmul(&shape, &x, &w, &[], &mut want).unwrap();
            let packed = pack_tiles(kind, &w, outs, inner);
            let inputs = Inputs::prepare_packed(&shape, &x);
            let packed_product = |x: &[f32], shape: &QuantShape, w: &[u8]| {
                let inputs = Inputs::prepare_packed(shape, x);
                let mut y = vec![f32::NAN; shape.rows * outs];
                let out = OutPtr::new(&mut y);
                for index in 0..call::tiles(shape) {
                    // SAFETY: shapes as validated by `qmatmul` above; one thread.
                    unsafe { qmatmul::tile_packed(shape, &inputs, w, out, index) };
                }
                y
            };
            if !qmatmul::packed_matches_rows(kind) {
                let exact = reference_of(&shape, &x, &w, &[], true, false, 16);
                let scale = exact.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                let got = packed_product(&x, &shape, &packed);
                for (i, (got, exact)) in got.iter().zip(&exact).enumerate() {
                    assert!(
                        (f64::from(*got) - exact).abs() <= 2e-5 * scale,
                        "{kind:?} {rows}x{inner}x{outs} element {i}: {got} vs {exact}"
                    );
                }
                // Each row alone: the bits it has among the others.
                let one = QuantShape { rows: 1, ..shape };
                for r in 0..rows {
                    let alone = packed_product(&x[r * inner..][..inner], &one, &packed);
                    assert_eq!(
                        alone[..],
                        got[r * outs..][..outs],
                        "{kind:?} row {r} of {rows}"
                    );
                }
                want = got;
            }
            // The packed weights' first and last bytes against an unmapped page.
            for edge in Edge::BOTH {
                let guarded = Guarded::new(&packed, edge);
                let mut got = vec![f32::NAN; rows * outs];
                let out = OutPtr::new(&mut got);
                for index in 0..call::tiles(&shape) {
                    // SAFETY: shapes as validated by `qmatmul` above; one thread.
                    unsafe {
                        qmatmul::tile_packed(&shape, &inputs, guarded.as_slice(), out, index)
                    };
                }
                assert_eq!(got, want, "{kind:?} {rows}x{inner}x{outs} {edge:?}");
            }
        }
    }
    assert!(!qmatmul::packs(QuantType::Q4_0, 40) && !qmatmul::packs(QuantType::Q8_0, 16));
}

/// With 8-bit inputs (`set_cpu_input_bits(8)`) packed weights and weight rows
/// give the float64 reference of their 8-bit inputs within rounding (the lanes
/// kernels leave the zero low bytes out), and stay within 8-bit rounding of
/// the 16-bit products; the weights' ends against an unmapped page change nothing.
#[test]
fn eight_bit_inputs_give_the_products_of_their_8_bit_values() {
    use super::tiles::pack_tiles;
    use crate::kernels::guard_page::{Edge, Guarded};
    let mut rng = TestRng::new(809);
    for kind in [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q8_0,
        QuantType::Q4K,
    ] {
        for (rows, inner, outs) in [(1, 256, 16), (3, 512, 48), (17, 256, 32)] {
            let (shape, x, w) = random_case(&mut rng, kind, rows, inner, outs);
            let s = row_scales(kind, outs);
            let packed = qmatmul::packs(kind, outs);
            let block = if packed {
                qmatmul::packed_rows(kind)
            } else {
                integer_rows(kind)
            };
            let inputs = Inputs {
                x: &x,
                integer: x
                    .chunks(block * inner)
                    .map(|b| Q16Rows::quantize_to(b, b.len() / inner, inner, 8))
                    .collect(),
            };
            let weights = if packed {
                pack_tiles(kind, &w, outs, inner)
            } else {
                w.clone()
            };
            let product = |weights: &[u8]| {
                let mut y = vec![f32::NAN; rows * outs];
                let out = OutPtr::new(&mut y);
                for index in 0..call::tiles(&shape) {
                    // SAFETY: sizes as `qmatmul` validates them; one thread.
                    unsafe {
                        if packed {
                            qmatmul::tile_packed(&shape, &inputs, weights, out, index)
                        } else {
                            qmatmul::tile(&shape, &inputs, weights, &s, out, index)
                        }
                    };
                }
                y
            };
            let y = product(&weights);
            // The weights' first and last bytes against an unmapped page.
            for edge in Edge::BOTH {
                let guarded = Guarded::new(&weights, edge);
                assert_eq!(
                    product(guarded.as_slice()),
                    y,
                    "{kind:?} {rows} rows {edge:?}"
                );
            }
            let folds = !packed && folds_offset(kind);
            let exact = reference_of(&shape, &x, &w, &s, true, folds, 8);
            let sixteen = reference_of(&shape, &x, &w, &s, true, folds, 16);
            let scale = exact.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            for (i, got) in y.iter().enumerate() {
                let case = format!("{kind:?} {rows}x{inner}x{outs} element {i}");
                // Within rounding of the 8-bit values' products, and of 8-bit
                // rounding of the 16-bit ones.
                for (want, tolerance) in [(exact[i], 2e-5), (sixteen[i], 2e-2)] {
                    let got = f64::from(*got);
                    assert!(
                        (got - want).abs() <= tolerance * scale,
                        "{case}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
