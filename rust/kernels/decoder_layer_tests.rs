//! Unit and seeded randomized tests of the one-call decoder layer.

use super::*;
use crate::kernels::parallel::{ScopedThreads, Sequential};
use crate::kernels::quant::formats::dequantize_row;
use crate::test_rng::SplitMix64 as TestRng;

struct Case {
    shape: LayerShape,
    hidden: Vec<f32>,
    norms: [Vec<f32>; 2],
    /// q, k, v, o, gate, up, down as float `[outs, inner]`.
    weights: Vec<Vec<f32>>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    slots: Vec<i32>,
    kv_lens: Vec<i32>,
    tables: Vec<i32>,
    k_pages: Vec<f32>,
    v_pages: Vec<f32>,
}

const CONSTANTS: LayerConstants = LayerConstants {
    rms_norm_eps: 1e-5,
    sm_scale: 0.25,
};

fn floats(rng: &mut TestRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.below(2001) as f32 - 1000.0) / 1000.0 * scale)
        .collect()
}

fn linear_sizes(s: &LayerShape) -> [(usize, usize); 7] {
    let (q, kv) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
    [
        (q, s.hidden),
        (kv, s.hidden),
        (kv, s.hidden),
        (s.hidden, q),
        (s.intermediate, s.hidden),
        (s.intermediate, s.hidden),
        (s.hidden, s.intermediate),
    ]
}

/// A layer over `rows` decode rows, the last `padding` of them padding (kv_len 0,
/// writing the scratch page, the pool's last).
fn random_case(rng: &mut TestRng, rows: usize, padding: usize) -> Case {
    let kv_heads = 1 + rng.below(2);
    let head_dim = [8, 16][rng.below(2)];
    let shape = LayerShape {
        rows,
        hidden: 32 * (1 + rng.below(2)),
        intermediate: 32 * (2 + rng.below(2)),
        q_heads: kv_heads * (1 + rng.below(3)),
        kv_heads,
        head_dim,
        pages: 4 * rows + 1,
        block_size: 4,
        table_width: 4,
    };
    let s = &shape;
    let weights = linear_sizes(s)
        .iter()
        .map(|&(outs, inner)| floats(rng, outs * inner, 0.3))
        .collect();
    let pool = s.kv_heads * s.pages * s.block_size * s.head_dim;
    let (mut slots, mut kv_lens, mut tables) = (vec![], vec![], vec![]);
    for r in 0..rows {
        // Row r owns pages 4r .. 4r + 4; a padding row has no context.
        let live = r < rows - padding;
        let len = if live { 1 + rng.below(16) } else { 0 };
        tables.extend((0..4).map(|p| (4 * r + p) as i32));
        kv_lens.push(len as i32);
        let scratch = (s.pages - 1) * s.block_size;
        slots.push(if live {
            (4 * r * s.block_size + len - 1) as i32
        } else {
            scratch as i32
        });
    }
    let angles: Vec<f32> = floats(rng, rows * head_dim / 2, 3.0);
    let (mut cos, mut sin) = (vec![], vec![]);
    for r in 0..rows {
        for _ in 0..2 {
            let half = &angles[r * head_dim / 2..][..head_dim / 2];
            cos.extend(half.iter().map(|a| a.cos()));
            sin.extend(half.iter().map(|a| a.sin()));
        }
    }
    Case {
        hidden: floats(rng, rows * s.hidden, 2.0),
        norms: [floats(rng, s.hidden, 1.5), floats(rng, s.hidden, 1.5)],
        weights,
        cos,
        sin,
        slots,
        kv_lens,
        tables,
        k_pages: floats(rng, pool, 1.0),
        v_pages: floats(rng, pool, 1.0),
        shape,
    }
}

fn float_weights<'a>(case: &'a Case, stored: &'a [Vec<f32>]) -> LayerWeights<'a> {
    layer_weights(case, |j| Weight::Float(&stored[j]))
}

/// The layer's weights, linear `j` (q, k, v, o, gate, up, down) stored as `weight(j)`.
fn layer_weights<'a>(case: &'a Case, weight: impl Fn(usize) -> Weight<'a>) -> LayerWeights<'a> {
    let sizes = linear_sizes(&case.shape);
    let l = |j: usize| Linear {
        weight: weight(j),
        outs: sizes[j].0,
        inner: sizes[j].1,
    };
    LayerWeights {
        input_norm: &case.norms[0],
        q: l(0),
        k: l(1),
        v: l(2),
        o: l(3),
        post_norm: &case.norms[1],
        gate: l(4),
        up: l(5),
        down: l(6),
    }
}

fn rows_of(case: &Case) -> RowInputs<'_> {
    RowInputs {
        cos: &case.cos,
        sin: &case.sin,
        slots: &case.slots,
        kv_lens: &case.kv_lens,
        block_tables: &case.tables,
    }
}

/// `out`, `k_pages` and `v_pages` after a call.
type Results = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The kernel's [`Results`].
fn run(parallel: &dyn Parallel, case: &Case, weights: &LayerWeights) -> Result<Results, String> {
    let (mut k, mut v) = (case.k_pages.clone(), case.v_pages.clone());
    let mut out = vec![0.0; case.hidden.len()];
    decode_layer(
        parallel,
        &case.shape,
        weights,
        CONSTANTS,
        &rows_of(case),
        &case.hidden,
        &mut k,
        &mut v,
        &mut out,
    )?;
    Ok((out, k, v))
}

/// The layer in float64, step by step as `kvpage/model/llama.py` writes it.
fn naive(case: &Case) -> (Vec<f64>, Vec<f32>, Vec<f32>) {
    let s = &case.shape;
    let (d, t) = (s.head_dim, s.rows);
    let matmul = |x: &[f64], j: usize| -> Vec<f64> {
        let (outs, inner) = linear_sizes(s)[j];
        let w = &case.weights[j];
        x.chunks(inner)
            .flat_map(|row| {
                (0..outs).map(move |o| {
                    row.iter()
                        .zip(&w[o * inner..][..inner])
                        .map(|(a, b)| a * f64::from(*b))
                        .sum::<f64>()
                })
            })
            .collect()
    };
    let norm = |x: &[f64], weight: &[f32]| -> Vec<f64> {
        x.chunks(s.hidden)
            .flat_map(|row| {
                let mean = row.iter().map(|v| v * v).sum::<f64>() / s.hidden as f64;
                let scale = 1.0 / (mean + f64::from(CONSTANTS.rms_norm_eps)).sqrt();
                row.iter()
                    .zip(weight)
                    .map(move |(v, w)| f64::from(*w) * v * scale)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let rope = |x: &mut [f64], r: usize| {
        for head in x.chunks_mut(d) {
            let rotated: Vec<f64> = (0..d)
                .map(|i| {
                    if i < d / 2 {
                        -head[i + d / 2]
                    } else {
                        head[i - d / 2]
                    }
                })
                .collect();
            for i in 0..d {
                head[i] = head[i] * f64::from(case.cos[r * d + i])
                    + rotated[i] * f64::from(case.sin[r * d + i]);
            }
        }
    };
    let hidden: Vec<f64> = case.hidden.iter().map(|&x| f64::from(x)).collect();
    let normed = norm(&hidden, &case.norms[0]);
    let (mut q, mut k, v) = (matmul(&normed, 0), matmul(&normed, 1), matmul(&normed, 2));
    let (qs, kvs) = (s.q_heads * d, s.kv_heads * d);
    for r in 0..t {
        rope(&mut q[r * qs..][..qs], r);
        rope(&mut k[r * kvs..][..kvs], r);
    }
    let (mut k_pages, mut v_pages) = (case.k_pages.clone(), case.v_pages.clone());
    let head_stride = s.pages * s.block_size * d;
    for r in 0..t {
        for h in 0..s.kv_heads {
            let dst = h * head_stride + case.slots[r] as usize * d;
            for i in 0..d {
                k_pages[dst + i] = k[r * kvs + h * d + i] as f32;
                v_pages[dst + i] = v[r * kvs + h * d + i] as f32;
            }
        }
    }
    let mut attended = vec![0.0f64; t * qs];
    let group = s.q_heads / s.kv_heads;
    for r in 0..t {
        let n = case.kv_lens[r] as usize;
        for qh in 0..s.q_heads {
            let h = qh / group;
            let at = |pool: &[f32], pos: usize, i: usize| -> f64 {
                let page = case.tables[r * s.table_width + pos / s.block_size] as usize;
                f64::from(
                    pool[h * head_stride + (page * s.block_size + pos % s.block_size) * d + i],
                )
            };
            let scores: Vec<f64> = (0..n)
                .map(|pos| {
                    (0..d)
                        .map(|i| {
                            q[r * qs + qh * d + i]
                                * f64::from(CONSTANTS.sm_scale)
                                * at(&k_pages, pos, i)
                        })
                        .sum()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for (pos, w) in e.iter().enumerate() {
                for i in 0..d {
                    attended[r * qs + qh * d + i] += w / total * at(&v_pages, pos, i);
                }
            }
        }
    }
    let residual: Vec<f64> = matmul(&attended, 3)
        .iter()
        .zip(&hidden)
        .map(|(a, b)| a + b)
        .collect();
    let normed = norm(&residual, &case.norms[1]);
    let (gate, up) = (matmul(&normed, 4), matmul(&normed, 5));
    let act: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    let out = matmul(&act, 6)
        .iter()
        .zip(&residual)
        .map(|(a, b)| a + b)
        .collect();
    (out, k_pages, v_pages)
}

fn assert_close(got: &[f32], want: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        assert!(
            err <= tolerance * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w} (error {err})"
        );
    }
}

#[test]
fn float_layers_match_the_naive_layer_and_write_only_their_slots() {
    let mut rng = TestRng::new(7);
    for case_index in 0..40 {
        let rows = 1 + rng.below(5);
        let padding = rng.below(rows);
        let case = random_case(&mut rng, rows, padding);
        let weights = float_weights(&case, &case.weights);
        let (out, k, v) = run(&Sequential, &case, &weights).unwrap();
        let (want, want_k, want_v) = naive(&case);
        assert_close(&out, &want, 2e-4, &format!("case {case_index} out"));
        let pools = |got: &[f32], want: &[f32], name: &str| {
            let want: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
            assert_close(got, &want, 1e-5, &format!("case {case_index} {name}"));
        };
        pools(&k, &want_k, "k_pages");
        pools(&v, &want_v, "v_pages");
    }
}

#[test]
fn results_do_not_depend_on_the_threads() {
    let mut rng = TestRng::new(11);
    for _ in 0..10 {
        let rows = 1 + rng.below(4);
        let case = random_case(&mut rng, rows, 0);
        let weights = float_weights(&case, &case.weights);
        assert_eq!(
            run(&Sequential, &case, &weights).unwrap(),
            run(&ScopedThreads, &case, &weights).unwrap()
        );
    }
}

/// Q8_0 blocks of `values` (scale 1/64: every stored weight is `q / 64`, exact).
fn q8_0_blocks(rng: &mut TestRng, outs: usize, inner: usize) -> (Vec<u8>, Vec<f32>) {
    let scale_bits: u16 = 0x2400; // f16 1/64
    let mut blocks = Vec::new();
    for _ in 0..outs * inner / 32 {
        blocks.extend(scale_bits.to_le_bytes());
        blocks.extend((0..32).map(|_| (rng.below(61) as i32 - 30) as i8 as u8));
    }
    let row_bytes = QuantType::Q8_0.row_bytes(inner).unwrap();
    let floats = blocks
        .chunks(row_bytes)
        .flat_map(|row| dequantize_row(QuantType::Q8_0, row, inner, 1.0))
        .collect();
    (blocks, floats)
}

/// A random case whose every linear layer can hold quantized rows: inner sizes in
/// whole blocks of 32 (redrawn until they are).
fn quantizable_case(rng: &mut TestRng, rows: usize) -> Case {
    loop {
        let case = random_case(rng, rows, 0);
        if linear_sizes(&case.shape)
            .iter()
            .all(|&(_, inner)| inner % 32 == 0)
        {
            return case;
        }
    }
}

#[test]
fn quantized_layers_match_the_layer_of_their_float_values() {
    let mut rng = TestRng::new(23);
    for rows in [1, 3] {
        let mut case = quantizable_case(&mut rng, rows);
        let sizes = linear_sizes(&case.shape);
        let (blocks, floats): (Vec<_>, Vec<_>) = sizes
            .iter()
            .map(|&(outs, inner)| q8_0_blocks(&mut rng, outs, inner))
            .unzip();
        case.weights = floats;
        let (want, _, _) = naive(&case);
        let weights = layer_weights(&case, |j| Weight::Quant {
            kind: QuantType::Q8_0,
            blocks: &blocks[j],
            row_scales: &[],
        });
        let (out, _, _) = run(&ScopedThreads, &case, &weights).unwrap();
        // One row takes the 16-bit input path (relative rounding ~1.5e-5 per input).
        assert_close(
            &out,
            &want,
            if rows == 1 { 2e-3 } else { 2e-4 },
            "quantized out",
        );
    }
}

#[test]
fn a_bad_slot_or_shape_is_an_error_before_any_write() {
    let mut rng = TestRng::new(5);
    let mut case = random_case(&mut rng, 2, 0);
    let stored = case.weights.clone();
    case.slots[1] = (case.shape.pages * case.shape.block_size) as i32;
    let err = run(&Sequential, &case, &float_weights(&case, &stored)).unwrap_err();
    assert!(err.contains("slot"), "{err}");
    case.slots[1] = -1;
    assert!(run(&Sequential, &case, &float_weights(&case, &stored)).is_err());
    case.slots[1] = 0;

    let mut short = stored.clone();
    short[6].pop();
    let err = run(&Sequential, &case, &float_weights(&case, &short)).unwrap_err();
    assert!(err.contains("down_proj"), "{err}");

    case.kv_lens[0] = 1000;
    let err = run(&Sequential, &case, &float_weights(&case, &stored)).unwrap_err();
    assert!(err.contains("kv_len"), "{err}");
    // Nothing was written: the validation runs before the K/V write.
    let (mut k, mut v) = (case.k_pages.clone(), case.v_pages.clone());
    let mut out = vec![0.0; case.hidden.len()];
    let weights = float_weights(&case, &stored);
    assert!(decode_layer(
        &Sequential,
        &case.shape,
        &weights,
        CONSTANTS,
        &rows_of(&case),
        &case.hidden,
        &mut k,
        &mut v,
        &mut out
    )
    .is_err());
    assert_eq!((k, v), (case.k_pages.clone(), case.v_pages.clone()));
}

#[test]
fn every_buffer_is_read_and_written_within_its_edges() {
    use crate::kernels::guard_page::{Edge, Guarded};
    let mut rng = TestRng::new(46);
    for rows in [1, 3] {
        let mut case = quantizable_case(&mut rng, rows);
        // Row 0 fills its table, whose last page is the pool's last (the
        // scratch page, unused here), and writes its newest K/V at the pool's
        // last slot; its first page is the pool's first.
        let s = case.shape;
        case.kv_lens[0] = (s.table_width * s.block_size) as i32;
        case.tables[s.table_width - 1] = (s.pages - 1) as i32;
        case.slots[0] = (s.pages * s.block_size - 1) as i32;
        let sizes = linear_sizes(&s);
        let quantized: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&(outs, inner)| q8_0_blocks(&mut rng, outs, inner).0)
            .collect();
        for quant in [false, true] {
            let plain = |j: usize| match quant {
                false => Weight::Float(&case.weights[j]),
                true => Weight::Quant {
                    kind: QuantType::Q8_0,
                    blocks: &quantized[j],
                    row_scales: &[],
                },
            };
            let want = run(&Sequential, &case, &layer_weights(&case, plain)).unwrap();
            for edge in Edge::BOTH {
                let g = |v: &[f32]| Guarded::new(v, edge);
                let gi = |v: &[i32]| Guarded::new(v, edge);
                let floats: Vec<_> = case.weights.iter().map(|w| g(w)).collect();
                let blocks: Vec<_> = quantized.iter().map(|w| Guarded::new(w, edge)).collect();
                let no_scales = g(&[]);
                let weight = |j: usize| match quant {
                    false => Weight::Float(floats[j].as_slice()),
                    true => Weight::Quant {
                        kind: QuantType::Q8_0,
                        blocks: blocks[j].as_slice(),
                        row_scales: no_scales.as_slice(),
                    },
                };
                let norms = [g(&case.norms[0]), g(&case.norms[1])];
                let mut weights = layer_weights(&case, weight);
                (weights.input_norm, weights.post_norm) =
                    (norms[0].as_slice(), norms[1].as_slice());
                let (cos, sin, hidden) = (g(&case.cos), g(&case.sin), g(&case.hidden));
                let (slots, kv_lens, tables) =
                    (gi(&case.slots), gi(&case.kv_lens), gi(&case.tables));
                let (mut k, mut v) = (g(&case.k_pages), g(&case.v_pages));
                let mut out = g(&vec![f32::NAN; case.hidden.len()]);
                let row_inputs = RowInputs {
                    cos: cos.as_slice(),
                    sin: sin.as_slice(),
                    slots: slots.as_slice(),
                    kv_lens: kv_lens.as_slice(),
                    block_tables: tables.as_slice(),
                };
                decode_layer(
                    &Sequential,
                    &s,
                    &weights,
                    CONSTANTS,
                    &row_inputs,
                    hidden.as_slice(),
                    k.as_mut_slice(),
                    v.as_mut_slice(),
                    out.as_mut_slice(),
                )
                .unwrap();
                let got = (
                    out.as_slice().to_vec(),
                    k.as_slice().to_vec(),
                    v.as_slice().to_vec(),
                );
                assert!(got == want, "{rows} rows, quantized {quant}, {edge:?}");
            }
        }
    }
}
