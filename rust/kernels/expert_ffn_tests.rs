//! Tests of [`super::expert_ffn`]: the one call against routing plus three
//! [`super::expert_matmul::expert_qmatmul`] calls (bit for bit), the routing
//! rules against a float64 reference, ties, padding tokens, thread counts, bad
//! shapes and formats, and every weight buffer against an unmapped page.

use super::expert_ffn::{expert_ffn, route, FfnShape, FfnWeights, Router};
use super::expert_matmul::{expert_qmatmul, ExpertShape, Routed};
use super::guard_page::{Edge, Guarded};
use super::parallel::{Parallel, ScopedThreads, Sequential};
use super::quant::formats::QuantType;
use super::quant::qmatmul::{packed_matches_rows, packs};
use super::quant::tests::random_weights;
use super::quant::tiles::pack_tiles;
use crate::test_rng::SplitMix64 as TestRng;

fn floats(rng: &mut TestRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.below(2001) as f32 / 1000.0 - 1.0) * scale)
        .collect()
}

const RULES: [Router; 3] = [
    Router::SoftmaxTopK { renormalize: false },
    Router::SoftmaxTopK { renormalize: true },
    Router::TopKSoftmax,
];

/// One layer's random weights.
struct Layer {
    shape: FfnShape,
    router: Vec<f32>,
    bias: Vec<f32>,
    gate_up_kind: QuantType,
    gate: Vec<u8>,
    up: Vec<u8>,
    down_kind: QuantType,
    down: Vec<u8>,
    gate_up_packed: bool,
    down_packed: bool,
}

impl Layer {
    fn random(
        rng: &mut TestRng,
        shape: FfnShape,
        kinds: (QuantType, QuantType),
        bias: bool,
    ) -> Layer {
        let s = shape;
        Layer {
            shape,
            router: floats(rng, s.experts * s.hidden, 0.5),
            bias: if bias {
                floats(rng, s.experts, 0.3)
            } else {
                Vec::new()
            },
            gate_up_kind: kinds.0,
            gate: random_weights(rng, kinds.0, s.experts * s.width, s.hidden),
            up: random_weights(rng, kinds.0, s.experts * s.width, s.hidden),
            down_kind: kinds.1,
            down: random_weights(rng, kinds.1, s.experts * s.hidden, s.width),
            gate_up_packed: false,
            down_packed: false,
        }
    }

    /// The same layer with its packable matrices packed into tiles, expert by expert.
    fn packed(&self) -> Layer {
        let s = &self.shape;
        let pack = |rows: &[u8], kind: QuantType, outs: usize, inner: usize| {
            if !packs(kind, outs) {
                return (rows.to_vec(), false);
            }
            let bytes = outs * kind.row_bytes(inner).unwrap();
            let packed = rows
                .chunks(bytes)
                .flat_map(|expert| pack_tiles(kind, expert, outs, inner))
                .collect();
            (packed, true)
        };
        let (gate, gate_up_packed) = pack(&self.gate, self.gate_up_kind, s.width, s.hidden);
        let (up, _) = pack(&self.up, self.gate_up_kind, s.width, s.hidden);
        let (down, down_packed) = pack(&self.down, self.down_kind, s.hidden, s.width);
        Layer {
            router: self.router.clone(),
            bias: self.bias.clone(),
            gate,
            up,
            down,
            gate_up_packed,
            down_packed,
            ..*self
        }
    }

    fn weights(&self) -> FfnWeights<'_> {
        FfnWeights {
            router: &self.router,
            router_bias: &self.bias,
            gate_up_kind: self.gate_up_kind,
            gate: &self.gate,
            up: &self.up,
            down_kind: self.down_kind,
            down: &self.down,
            gate_up_packed: self.gate_up_packed,
            down_packed: self.down_packed,
        }
    }

    fn run(&self, router: Router, x: &[f32], live: usize, parallel: &dyn Parallel) -> Vec<f32> {
        let mut y = vec![f32::NAN; self.shape.tokens * self.shape.hidden];
        expert_ffn(
            &self.shape,
            &self.weights(),
            router,
            x,
            live,
            &mut y,
            parallel,
        )
        .unwrap();
        y
    }

    /// The same layer as routing, then gate, up and down as separate expert
    /// calls, SwiGLU and the weighted sum in between.
    fn composed(&self, router: Router, x: &[f32], live: usize) -> Vec<f32> {
        let s = &self.shape;
        let (ids, gates) = route(s, &self.weights(), router, x, live, &Sequential).unwrap();
        let rows = ids.len();
        let routed: Vec<f32> = (0..rows)
            .flat_map(|r| x[r / s.top_k * s.hidden..][..s.hidden].to_vec())
            .collect();
        let product = |inputs: &[f32], inner: usize, outs: usize, kind, w: &[u8]| {
            let call = Routed {
                shape: ExpertShape {
                    rows,
                    inner,
                    outs,
                    experts: s.experts,
                },
                x: inputs,
                expert_ids: &ids,
                live_rows: rows,
            };
            let mut y = vec![0.0; rows * outs];
            expert_qmatmul(&call, kind, w, &[], &mut y, &ScopedThreads).unwrap();
            y
        };
        let gate = product(&routed, s.hidden, s.width, self.gate_up_kind, &self.gate);
        let up = product(&routed, s.hidden, s.width, self.gate_up_kind, &self.up);
        let hidden: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let down = product(&hidden, s.width, s.hidden, self.down_kind, &self.down);
        let mut y = vec![0.0f32; s.tokens * s.hidden];
        for r in 0..rows {
            for (o, d) in y[r / s.top_k * s.hidden..][..s.hidden]
                .iter_mut()
                .zip(&down[r * s.hidden..][..s.hidden])
            {
                *o += gates[r] * d;
            }
        }
        y
    }
}

fn shape(tokens: usize, hidden: usize, width: usize, experts: usize, top_k: usize) -> FfnShape {
    FfnShape {
        tokens,
        hidden,
        width,
        experts,
        top_k,
    }
}

#[test]
fn one_call_equals_routing_then_three_expert_calls() {
    let mut rng = TestRng::new(301);
    let cases = [
        ((QuantType::Q4_0, QuantType::Q4_0), 64, 32),
        ((QuantType::Q8_0, QuantType::Q8_0), 96, 64),
        ((QuantType::Q5_0, QuantType::Q4_1), 64, 96),
        ((QuantType::Q4K, QuantType::Q6K), 256, 256),
    ];
    for (kinds, hidden, width) in cases {
        for (tokens, experts, top_k) in [(1, 8, 2), (3, 6, 3), (9, 8, 4), (20, 5, 1)] {
            let s = shape(tokens, hidden, width, experts, top_k);
            let layer = Layer::random(&mut rng, s, kinds, tokens % 2 == 1);
            let x = floats(&mut rng, tokens * hidden, 1.0);
            for router in RULES {
                let got = layer.run(router, &x, tokens, &ScopedThreads);
                let want = layer.composed(router, &x, tokens);
                assert_eq!(got, want, "{kinds:?} {s:?} {router:?}");
            }
        }
    }
}

/// The same bits where packed weights give their rows' bits
/// (`qmatmul::packed_matches_rows`: AVX-512 VNNI), else the same results to the
/// integer path's rounding; and with any thread count the same bits.
#[test]
fn experts_packed_into_tiles_give_the_same_bits() {
    if !packs(QuantType::Q4_0, 16) {
        return; // no AVX2 here
    }
    let mut rng = TestRng::new(309);
    for kinds in [
        (QuantType::Q4_0, QuantType::Q4_0),
        (QuantType::Q4_0, QuantType::Q5_0),
        (QuantType::Q4_1, QuantType::Q4_0),
    ] {
        for (tokens, experts, top_k) in [(1, 8, 2), (3, 6, 3), (33, 8, 4), (40, 4, 4)] {
            let s = shape(tokens, 64, 32, experts, top_k);
            let layer = Layer::random(&mut rng, s, kinds, true);
            let packed = layer.packed();
            let x = floats(&mut rng, tokens * s.hidden, 1.0);
            let alone = packed.run(RULES[1], &x, tokens, &Sequential);
            for parallel in [&Sequential as &dyn Parallel, &ScopedThreads] {
                let want = layer.run(RULES[1], &x, tokens, parallel);
                let got = packed.run(RULES[1], &x, tokens, parallel);
                assert_eq!(got, alone, "{kinds:?} {s:?}: thread count");
                if packed_matches_rows(kinds.0) && packed_matches_rows(kinds.1) {
                    assert_eq!(got, want, "{kinds:?} {s:?}");
                } else {
                    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= 1e-3 * scale, "{kinds:?} {s:?}: {g} vs {w}");
                    }
                }
            }
        }
    }
}

#[test]
fn only_what_this_cpu_packs_may_be_called_packed() {
    let mut rng = TestRng::new(310);
    let s = shape(2, 64, 40, 4, 2); // 40 rows: not whole tiles
    let layer = Layer::random(&mut rng, s, (QuantType::Q4_0, QuantType::Q8_0), false);
    let x = floats(&mut rng, s.tokens * s.hidden, 1.0);
    let mut y = vec![0.0f32; s.tokens * s.hidden];
    for weights in [
        FfnWeights {
            gate_up_packed: true,
            ..layer.weights()
        },
        FfnWeights {
            down_packed: true,
            ..layer.weights()
        },
    ] {
        let err = expert_ffn(&s, &weights, RULES[0], &x, 2, &mut y, &Sequential).unwrap_err();
        assert!(err.contains("cannot be packed"), "{err}");
    }
}

#[test]
fn routing_matches_a_float64_reference() {
    let mut rng = TestRng::new(302);
    let s = shape(7, 64, 32, 12, 3);
    let layer = Layer::random(&mut rng, s, (QuantType::Q4_0, QuantType::Q4_0), true);
    let x = floats(&mut rng, s.tokens * s.hidden, 1.0);
    for router in RULES {
        let (ids, gates) =
            route(&s, &layer.weights(), router, &x, s.tokens, &ScopedThreads).unwrap();
        for t in 0..s.tokens {
            let logits: Vec<f64> = (0..s.experts)
                .map(|e| {
                    let dot: f64 = (0..s.hidden)
                        .map(|i| x[t * s.hidden + i] as f64 * layer.router[e * s.hidden + i] as f64)
                        .sum();
                    dot + layer.bias[e] as f64
                })
                .collect();
            let mut order: Vec<usize> = (0..s.experts).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            let top = &order[..s.top_k];
            let max = logits[order[0]];
            let all: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            let kept: f64 = top.iter().map(|&e| (logits[e] - max).exp()).sum();
            for (j, &e) in top.iter().enumerate() {
                assert_eq!(ids[t * s.top_k + j], e as i32, "{router:?} token {t}");
                let p = (logits[e] - max).exp();
                let want = match router {
                    Router::SoftmaxTopK { renormalize: false } => p / all,
                    _ => p / kept,
                };
                let got = gates[t * s.top_k + j] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "{router:?} token {t}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn ties_go_to_the_lower_expert_id() {
    let mut rng = TestRng::new(303);
    let s = shape(2, 32, 32, 6, 4);
    let mut layer = Layer::random(&mut rng, s, (QuantType::Q8_0, QuantType::Q8_0), false);
    layer.router.fill(0.0);
    let x = floats(&mut rng, s.tokens * s.hidden, 1.0);
    for router in RULES {
        let (ids, gates) = route(&s, &layer.weights(), router, &x, s.tokens, &Sequential).unwrap();
        assert_eq!(ids, [0, 1, 2, 3, 0, 1, 2, 3], "{router:?}");
        let want = match router {
            Router::SoftmaxTopK { renormalize: false } => 1.0 / 6.0,
            _ => 0.25,
        };
        assert!(
            gates.iter().all(|&g| (g - want).abs() < 1e-6),
            "{router:?} {gates:?}"
        );
    }
}

#[test]
fn padding_tokens_are_zeros_and_never_read() {
    let mut rng = TestRng::new(304);
    let s = shape(6, 64, 32, 8, 2);
    let layer = Layer::random(&mut rng, s, (QuantType::Q4_0, QuantType::Q8_0), false);
    let values = floats(&mut rng, s.tokens * s.hidden, 1.0);
    for live in [0, 1, 4, 6] {
        let mut x = values.clone();
        x[live * s.hidden..].fill(f32::NAN);
        let y = layer.run(RULES[1], &x, live, &ScopedThreads);
        let alone = Layer {
            shape: FfnShape { tokens: live, ..s },
            router: layer.router.clone(),
            bias: layer.bias.clone(),
            gate: layer.gate.clone(),
            up: layer.up.clone(),
            down: layer.down.clone(),
            ..layer
        };
        let want = alone.run(RULES[1], &x[..live * s.hidden], live, &ScopedThreads);
        assert_eq!(y[..live * s.hidden], want[..], "live {live}");
        assert!(
            y[live * s.hidden..].iter().all(|&v| v == 0.0),
            "live {live}"
        );
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let mut rng = TestRng::new(305);
    let s = shape(40, 64, 96, 8, 2);
    let layer = Layer::random(&mut rng, s, (QuantType::Q4_1, QuantType::Q5_0), true);
    let x = floats(&mut rng, s.tokens * s.hidden, 1.0);
    for router in RULES {
        let one = layer.run(router, &x, 37, &Sequential);
        assert_eq!(one, layer.run(router, &x, 37, &ScopedThreads), "{router:?}");
    }
}

#[test]
fn bad_shapes_formats_and_top_k_are_errors_before_any_write() {
    let mut rng = TestRng::new(306);
    let s = shape(3, 64, 32, 4, 2);
    let layer = Layer::random(&mut rng, s, (QuantType::Q4_0, QuantType::Q4_0), false);
    let x = floats(&mut rng, s.tokens * s.hidden, 1.0);
    let attempt = |s: &FfnShape, w: &FfnWeights, x: &[f32], live: usize| {
        let mut y = vec![f32::NAN; s.tokens * s.hidden];
        let result = expert_ffn(s, w, RULES[0], x, live, &mut y, &Sequential);
        assert!(
            y.iter().all(|v| v.is_nan()),
            "wrote before failing: {result:?}"
        );
        result.unwrap_err()
    };
    let w = layer.weights();
    assert!(attempt(&FfnShape { top_k: 0, ..s }, &w, &x, 3).contains("top_k"));
    assert!(attempt(&FfnShape { top_k: 5, ..s }, &w, &x, 3).contains("top_k"));
    assert!(attempt(&s, &w, &x, 4).contains("live_tokens"));
    assert!(attempt(&s, &w, &x[1..], 3).contains("x has"));
    let short = &layer.down[..layer.down.len() - 1];
    assert!(attempt(&s, &FfnWeights { down: short, ..w }, &x, 3).contains("down has"));
    let bias = [0.0f32; 3];
    assert!(attempt(
        &s,
        &FfnWeights {
            router_bias: &bias,
            ..w
        },
        &x,
        3
    )
    .contains("router_bias"));
    let int8 = FfnWeights {
        gate_up_kind: QuantType::Int8,
        ..w
    };
    assert!(attempt(&s, &int8, &x, 3).contains("row scales"));
    let k_quant = FfnWeights {
        gate_up_kind: QuantType::Q4K,
        ..w
    };
    assert!(attempt(&s, &k_quant, &x, 3).contains("multiple of 256"));
}

#[test]
fn every_weight_buffer_may_end_or_start_at_an_unmapped_page() {
    let mut rng = TestRng::new(307);
    for kinds in [
        (QuantType::Q4_0, QuantType::Q5_0),
        (QuantType::Q4K, QuantType::Q6K),
    ] {
        let s = shape(5, 256, 256, 4, 4); // every expert routed
        let mut layer = Layer::random(&mut rng, s, kinds, true);
        if packs(kinds.0, s.width) {
            layer = layer.packed(); // Q4_0 gate and up read tile by tile
        }
        let x = floats(&mut rng, s.tokens * s.hidden, 1.0);
        let want = layer.run(RULES[1], &x, s.tokens, &ScopedThreads);
        for edge in Edge::BOTH {
            let (router, bias) = (
                Guarded::new(&layer.router, edge),
                Guarded::new(&layer.bias, edge),
            );
            let (gate, up) = (
                Guarded::new(&layer.gate, edge),
                Guarded::new(&layer.up, edge),
            );
            let (down, xs) = (Guarded::new(&layer.down, edge), Guarded::new(&x, edge));
            let weights = FfnWeights {
                router: router.as_slice(),
                router_bias: bias.as_slice(),
                gate: gate.as_slice(),
                up: up.as_slice(),
                down: down.as_slice(),
                ..layer.weights()
            };
            let mut y = Guarded::new(&vec![0.0f32; s.tokens * s.hidden], edge);
            expert_ffn(
                &s,
                &weights,
                RULES[1],
                xs.as_slice(),
                s.tokens,
                y.as_mut_slice(),
                &ScopedThreads,
            )
            .unwrap();
            assert_eq!(y.as_slice(), &want[..], "{kinds:?} {edge:?}");
        }
    }
}
