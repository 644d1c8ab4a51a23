//! Tests of [`super::expert_matmul`]: every quantized format, float32 and
//! bfloat16 experts against a float64 reference and, bit for bit, against the
//! dense kernel run on each expert's rows; rows sharing an expert, experts no
//! row is routed to (their pages unmapped, so a read faults), padding rows,
//! bad expert ids and sizes, thread counts, and every buffer against an
//! unmapped page ([`super::guard_page`]).

use super::cpu_attention::{Bf16, KvElement};
use super::cpu_matmul::{matmul_nt, MatmulShape, OutPtr};
use super::expert_matmul::{
    bf16_portable_tile, expert_matmul, expert_qmatmul, ExpertShape, FloatWeight, Routed, Routing,
};
use super::guard_page::{Edge, Guarded};
use super::parallel::{Parallel, ScopedThreads, Sequential};
use super::quant::call::QuantShape;
use super::quant::formats::{dequantize_row, QuantType};
use super::quant::qmatmul::qmatmul;
use super::quant::tests::random_weights;
use crate::test_rng::SplitMix64 as TestRng;

fn floats(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn ids(rng: &mut TestRng, rows: usize, experts: usize) -> Vec<i32> {
    (0..rows).map(|_| rng.below(experts) as i32).collect()
}

fn row_scales(rng: &mut TestRng, kind: QuantType, n: usize) -> Vec<f32> {
    if kind.row_scaled() {
        (0..n).map(|_| (1 + rng.below(100)) as f32 * 1e-3).collect()
    } else {
        Vec::new()
    }
}

fn bf16s(rng: &mut TestRng, n: usize) -> Vec<Bf16> {
    floats(rng, n)
        .into_iter()
        .map(|v| Bf16((v.to_bits() >> 16) as u16))
        .collect()
}

/// The quantized experts of one test case.
struct Quantized {
    kind: QuantType,
    w: Vec<u8>,
    scales: Vec<f32>,
}

impl Quantized {
    fn random(rng: &mut TestRng, kind: QuantType, shape: &ExpertShape) -> Quantized {
        let rows = shape.experts * shape.outs;
        Quantized {
            kind,
            w: random_weights(rng, kind, rows, shape.inner),
            scales: row_scales(rng, kind, rows),
        }
    }

    fn run(&self, call: &Routed, parallel: &dyn Parallel) -> Result<Vec<f32>, String> {
        let mut y = vec![f32::NAN; call.shape.rows * call.shape.outs];
        expert_qmatmul(call, self.kind, &self.w, &self.scales, &mut y, parallel)?;
        Ok(y)
    }

    /// Expert `e`'s float weights, `[outs, inner]`.
    fn dequantized(&self, shape: &ExpertShape, e: usize) -> Vec<f32> {
        let row_bytes = self.kind.row_bytes(shape.inner).unwrap();
        (e * shape.outs..(e + 1) * shape.outs)
            .flat_map(|o| {
                let scale = self.scales.get(o).copied().unwrap_or(1.0);
                let row = &self.w[o * row_bytes..][..row_bytes];
                dequantize_row(self.kind, row, shape.inner, scale)
            })
            .collect()
    }

    /// Expert `e`'s rows through the dense quantized kernel.
    fn dense(&self, shape: &ExpertShape, e: usize, x: &[f32], rows: usize) -> Vec<f32> {
        let row_bytes = self.kind.row_bytes(shape.inner).unwrap();
        let bytes = shape.outs * row_bytes;
        let scaled = if self.kind.row_scaled() {
            shape.outs
        } else {
            0
        };
        let dense = QuantShape {
            kind: self.kind,
            rows,
            inner: shape.inner,
            outs: shape.outs,
        };
        let mut y = vec![0.0; rows * shape.outs];
        let (w, s) = (
            &self.w[e * bytes..][..bytes],
            &self.scales[e * scaled..][..scaled],
        );
        qmatmul(&dense, x, w, s, &mut y).unwrap();
        y
    }
}

/// `y` in float64 from each expert's float weights `[experts][outs * inner]`;
/// padding rows zero.
fn reference(call: &Routed, weights: &[Vec<f32>]) -> Vec<f64> {
    let s = call.shape;
    let mut y = vec![0.0f64; s.rows * s.outs];
    for n in 0..call.live_rows {
        let w = &weights[call.expert_ids[n] as usize];
        for o in 0..s.outs {
            y[n * s.outs + o] = (0..s.inner)
                .map(|i| f64::from(call.x[n * s.inner + i]) * f64::from(w[o * s.inner + i]))
                .sum();
        }
    }
    y
}

fn assert_close(got: &[f32], want: &[f64], relative: f64, what: &str) {
    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= relative * scale,
            "{what} element {i}: {g} vs {w}"
        );
    }
}

/// The rows of `call` routed to expert `e`, gathered, and their places.
fn rows_of(call: &Routed, e: usize) -> (Vec<usize>, Vec<f32>) {
    let inner = call.shape.inner;
    let rows: Vec<usize> = (0..call.live_rows)
        .filter(|&n| call.expert_ids[n] as usize == e)
        .collect();
    let x = rows
        .iter()
        .flat_map(|&n| call.x[n * inner..][..inner].iter().copied())
        .collect();
    (rows, x)
}

/// Each expert's rows of `y` equal, bit for bit, `dense` run on those rows alone.
fn assert_each_expert_is_dense(
    call: &Routed,
    y: &[f32],
    dense: impl Fn(usize, &[f32], usize) -> Vec<f32>,
) {
    let outs = call.shape.outs;
    for e in 0..call.shape.experts {
        let (rows, x) = rows_of(call, e);
        if rows.is_empty() {
            continue;
        }
        let want = dense(e, &x, rows.len());
        for (i, &n) in rows.iter().enumerate() {
            assert_eq!(
                y[n * outs..][..outs],
                want[i * outs..][..outs],
                "expert {e}, row {n}"
            );
        }
    }
}

#[test]
fn routing_is_a_stable_sort_of_the_rows_by_expert() {
    let routing = Routing::new(&[3, 0, 3, 5, 0, 3], 6).unwrap();
    assert_eq!(routing.experts, [0, 3, 5]);
    assert_eq!(routing.offsets, [0, 2, 5, 6]);
    assert_eq!(routing.order, [1, 4, 0, 2, 5, 3]);
    let empty = Routing::new(&[], 4).unwrap();
    assert!(empty.experts.is_empty() && empty.order.is_empty());
}

#[test]
fn every_format_matches_a_reference_and_the_dense_kernel_on_each_experts_rows() {
    let mut rng = TestRng::new(81);
    let row_counts: &[usize] = if cfg!(miri) { &[1, 3] } else { &[1, 4, 13, 40] };
    for kind in QuantType::ALL {
        for &rows in row_counts {
            let shape = ExpertShape {
                rows,
                inner: 2 * kind.block_elems(),
                outs: 19, // a partial last tile
                experts: 5,
            };
            let q = Quantized::random(&mut rng, kind, &shape);
            let x = floats(&mut rng, rows * shape.inner);
            let ids = ids(&mut rng, rows, shape.experts);
            let call = Routed {
                shape,
                x: &x,
                expert_ids: &ids,
                live_rows: rows,
            };
            let y = q.run(&call, &ScopedThreads).unwrap();
            let weights: Vec<Vec<f32>> = (0..shape.experts)
                .map(|e| q.dequantized(&shape, e))
                .collect();
            // One row on an expert takes 16-bit inputs (relative error ~1e-5).
            let what = format!("{} rows {rows}", kind.name());
            assert_close(&y, &reference(&call, &weights), 2e-4, &what);
            assert_each_expert_is_dense(&call, &y, |e, x, n| q.dense(&shape, e, x, n));
        }
    }
}

#[test]
fn rows_routed_to_one_expert_are_one_dense_product() {
    let mut rng = TestRng::new(82);
    for kind in [QuantType::Q4K, QuantType::Q8_0, QuantType::Int8] {
        // 37 rows: the dense kernel's panel path, in one expert.
        for rows in [2, 37] {
            let shape = ExpertShape {
                rows,
                inner: kind.block_elems().max(64),
                outs: 40,
                experts: 4,
            };
            let q = Quantized::random(&mut rng, kind, &shape);
            let x = floats(&mut rng, rows * shape.inner);
            let ids = vec![2; rows];
            let call = Routed {
                shape,
                x: &x,
                expert_ids: &ids,
                live_rows: rows,
            };
            let y = q.run(&call, &ScopedThreads).unwrap();
            assert_eq!(y, q.dense(&shape, 2, &x, rows), "{kind:?} rows {rows}");
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let mut rng = TestRng::new(83);
    let shape = ExpertShape {
        rows: 24,
        inner: 256,
        outs: 70,
        experts: 6,
    };
    let x = floats(&mut rng, shape.rows * shape.inner);
    let ids = ids(&mut rng, shape.rows, shape.experts);
    let call = Routed {
        shape,
        x: &x,
        expert_ids: &ids,
        live_rows: shape.rows,
    };
    let q = Quantized::random(&mut rng, QuantType::Q4K, &shape);
    assert_eq!(
        q.run(&call, &ScopedThreads).unwrap(),
        q.run(&call, &Sequential).unwrap()
    );
    let w = bf16s(&mut rng, shape.experts * shape.outs * shape.inner);
    let (mut a, mut b) = (vec![0.0; 24 * 70], vec![0.0; 24 * 70]);
    expert_matmul(&call, &w, &mut a, &ScopedThreads).unwrap();
    expert_matmul(&call, &w, &mut b, &Sequential).unwrap();
    assert_eq!(a, b);
}

fn float_case<T: FloatWeight>(
    rng: &mut TestRng,
    shape: ExpertShape,
    w: &[T],
    weights: &[Vec<f32>],
) -> Vec<f32> {
    let x = floats(rng, shape.rows * shape.inner);
    let ids = ids(rng, shape.rows, shape.experts);
    let call = Routed {
        shape,
        x: &x,
        expert_ids: &ids,
        live_rows: shape.rows,
    };
    let mut y = vec![f32::NAN; shape.rows * shape.outs];
    expert_matmul(&call, w, &mut y, &ScopedThreads).unwrap();
    let tolerance = 1e-5 * (shape.inner as f64).sqrt();
    assert_close(
        &y,
        &reference(&call, weights),
        tolerance,
        &format!("{shape:?}"),
    );
    y
}

#[test]
fn float32_and_bfloat16_experts_match_a_reference() {
    let mut rng = TestRng::new(84);
    // Inner sizes with a tail past the 8 lanes; rows over several row groups.
    let cases: &[(usize, usize, usize)] = if cfg!(miri) {
        &[(3, 13, 5)]
    } else {
        &[(1, 64, 17), (5, 100, 33), (23, 37, 80), (40, 256, 16)]
    };
    for &(rows, inner, outs) in cases {
        let shape = ExpertShape {
            rows,
            inner,
            outs,
            experts: 7,
        };
        let per_expert = outs * inner;
        let w = floats(&mut rng, shape.experts * per_expert);
        let weights: Vec<Vec<f32>> = w.chunks(per_expert).map(<[f32]>::to_vec).collect();
        let y = float_case(&mut rng, shape, &w, &weights);
        assert!(y.iter().all(|v| v.is_finite()));
        let wb = bf16s(&mut rng, shape.experts * per_expert);
        let weights: Vec<Vec<f32>> = wb
            .chunks(per_expert)
            .map(|c| c.iter().map(|v| v.to_f32()).collect())
            .collect();
        float_case(&mut rng, shape, &wb, &weights);
    }
}

#[test]
fn float32_experts_equal_the_dense_kernel_on_each_experts_rows() {
    let mut rng = TestRng::new(85);
    let shape = ExpertShape {
        rows: 30,
        inner: 96,
        outs: 70,
        experts: 4,
    };
    let w = floats(&mut rng, shape.experts * shape.outs * shape.inner);
    let x = floats(&mut rng, shape.rows * shape.inner);
    let ids = ids(&mut rng, shape.rows, shape.experts);
    let call = Routed {
        shape,
        x: &x,
        expert_ids: &ids,
        live_rows: shape.rows,
    };
    let mut y = vec![0.0; shape.rows * shape.outs];
    expert_matmul(&call, &w, &mut y, &ScopedThreads).unwrap();
    let per_expert = shape.outs * shape.inner;
    assert_each_expert_is_dense(&call, &y, |e, x, rows| {
        let dense = MatmulShape {
            rows,
            inner: shape.inner,
            outs: shape.outs,
        };
        let mut y = vec![0.0; rows * shape.outs];
        matmul_nt(&dense, x, &w[e * per_expert..][..per_expert], &mut y).unwrap();
        y
    });
}

#[test]
fn the_portable_and_vectorized_bfloat16_loops_match_a_reference() {
    let mut rng = TestRng::new(86);
    for (rows, inner, outs) in [(1, 24, 9), (3, 37, 5), (11, 64, 13)] {
        let shape = MatmulShape { rows, inner, outs };
        let x = floats(&mut rng, rows * inner);
        let w = bf16s(&mut rng, outs * inner);
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let mut want = vec![0.0; rows * outs];
        matmul_nt(&shape, &x, &wf, &mut want).unwrap();
        let want: Vec<f64> = want.into_iter().map(f64::from).collect();
        let mut y = vec![f32::NAN; rows * outs];
        // SAFETY: sizes are the shape's; one thread.
        unsafe { bf16_portable_tile(&shape, &x, &w, OutPtr::new(&mut y), 0, outs) };
        assert_close(&y, &want, 1e-5, "portable");
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let mut y = vec![f32::NAN; rows * outs];
            // SAFETY: as above, and the CPU has AVX2 + FMA.
            unsafe {
                super::expert_matmul::bf16_avx2::tile(&shape, &x, &w, OutPtr::new(&mut y), 0, outs)
            };
            assert_close(&y, &want, 1e-5, "avx2");
        }
    }
}

#[test]
fn padding_rows_are_zeros_and_their_ids_are_never_read() {
    let mut rng = TestRng::new(87);
    let shape = ExpertShape {
        rows: 9,
        inner: 64,
        outs: 21,
        experts: 3,
    };
    let x = floats(&mut rng, shape.rows * shape.inner);
    let q = Quantized::random(&mut rng, QuantType::Q4_0, &shape);
    let wf = floats(&mut rng, shape.experts * shape.outs * shape.inner);
    for live in [0, 1, 5, 9] {
        let mut ids = ids(&mut rng, shape.rows, shape.experts);
        for (n, id) in ids.iter_mut().enumerate().skip(live) {
            *id = if n % 2 == 0 { 999 } else { -1 };
        }
        let call = Routed {
            shape,
            x: &x,
            expert_ids: &ids,
            live_rows: live,
        };
        let alone = Routed {
            shape: ExpertShape {
                rows: live,
                ..shape
            },
            x: &x[..live * shape.inner],
            expert_ids: &ids[..live],
            live_rows: live,
        };
        let y = q.run(&call, &ScopedThreads).unwrap();
        let live_len = live * shape.outs;
        assert_eq!(y[..live_len], q.run(&alone, &ScopedThreads).unwrap());
        assert!(y[live_len..].iter().all(|&v| v == 0.0), "live {live}");
        let mut y = vec![f32::NAN; shape.rows * shape.outs];
        expert_matmul(&call, &wf, &mut y, &ScopedThreads).unwrap();
        let mut want = vec![f32::NAN; live_len];
        expert_matmul(&alone, &wf, &mut want, &ScopedThreads).unwrap();
        assert_eq!(y[..live_len], want);
        assert!(y[live_len..].iter().all(|&v| v == 0.0), "live {live}");
    }
}

#[test]
fn an_expert_id_out_of_range_is_an_error_before_any_write() {
    let mut rng = TestRng::new(88);
    let shape = ExpertShape {
        rows: 4,
        inner: 32,
        outs: 8,
        experts: 3,
    };
    let x = floats(&mut rng, shape.rows * shape.inner);
    let q = Quantized::random(&mut rng, QuantType::Q8_0, &shape);
    let wf = floats(&mut rng, shape.experts * shape.outs * shape.inner);
    for bad in [3, -1, i32::MAX, i32::MIN] {
        let ids = [0, 1, bad, 2];
        let call = Routed {
            shape,
            x: &x,
            expert_ids: &ids,
            live_rows: 4,
        };
        let mut y = vec![7.0; shape.rows * shape.outs];
        let err = expert_qmatmul(&call, q.kind, &q.w, &q.scales, &mut y, &Sequential).unwrap_err();
        assert!(err.contains(&format!("expert id {bad} of row 2")), "{err}");
        let err = expert_matmul(&call, &wf, &mut y, &Sequential).unwrap_err();
        assert!(err.contains("outside [0, 3)"), "{err}");
        assert!(y.iter().all(|&v| v == 7.0), "nothing is written");
    }
}

#[test]
fn wrong_sizes_are_errors_before_any_read() {
    let shape = ExpertShape {
        rows: 2,
        inner: 32,
        outs: 4,
        experts: 3,
    };
    let (x, ids) = (vec![0.0; 64], [0, 1]);
    let call = Routed {
        shape,
        x: &x,
        expert_ids: &ids,
        live_rows: 2,
    };
    let mut y = vec![0.0; 8];
    let run = |kind: QuantType, w: &[u8], s: &[f32], call: &Routed, y: &mut [f32]| {
        expert_qmatmul(call, kind, w, s, y, &Sequential).unwrap_err()
    };
    let err = run(QuantType::Q8_0, &[0; 34 * 4 * 2], &[], &call, &mut y);
    assert!(err.contains("w has 272 elements"), "{err}");
    let err = run(QuantType::Int8, &[0; 32 * 12], &[1.0; 4], &call, &mut y);
    assert!(err.contains("row_scales has 4 elements"), "{err}");
    let err = run(QuantType::Q4K, &[0; 1], &[], &call, &mut y);
    assert!(err.contains("multiple of 256"), "{err}");
    let err = run(QuantType::Q8_0, &[0; 34 * 12], &[], &call, &mut y[..7]);
    assert!(err.contains("y has 7 elements"), "{err}");
    let ids_short = Routed {
        expert_ids: &ids[..1],
        ..call
    };
    let err = run(QuantType::Q8_0, &[0; 34 * 12], &[], &ids_short, &mut y);
    assert!(err.contains("expert_ids has 1 elements"), "{err}");
    let too_live = Routed {
        live_rows: 3,
        ..call
    };
    let err = run(QuantType::Q8_0, &[0; 34 * 12], &[], &too_live, &mut y);
    assert!(err.contains("live_rows 3"), "{err}");
    let err = expert_matmul(&call, &[0.0f32; 10], &mut y, &Sequential).unwrap_err();
    assert!(err.contains("w has 10 elements"), "{err}");
}

#[path = "expert_matmul_memory_tests.rs"]
mod memory;
