//! Criterion bench of the host mixture-of-experts product
//! (`rust/kernels/expert_matmul.rs`): 32 Q4_K experts of `[512, 1024]` (288 KiB
//! each, 9.4 MB a layer), top-4 routing, for one token (N = 4 rows, 4 experts
//! read) and 32 tokens (N = 128 rows, each routed expert read once). Each
//! iteration runs one call per layer over 64 layers of experts (604 MB), each
//! layer routed differently, so the weights come from memory as in a real
//! step. Throughput is the routed experts' bytes (what the kernel reads by
//! construction), so the GB/s figures are effective bandwidth. For contrast,
//! `per_row` runs the dense kernel once per row with that row's expert, which
//! streams an expert once per row routed to it. One thread, then every core
//! ([`Claiming`]: as XLA's pool runs the units, each of a fixed set of threads
//! claiming the next unit; `ScopedThreads` spawns a thread per unit, ~1000 a call
//! here).
//! Run: `cargo bench --bench expert_matmul`.

use std::collections::BTreeSet;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvpage_core::kernels::expert_ffn::{expert_ffn, FfnShape, FfnWeights, Router};
use kvpage_core::kernels::expert_matmul::{expert_qmatmul, ExpertShape, Routed};
use kvpage_core::kernels::parallel::{Parallel, Sequential};
use kvpage_core::kernels::quant::call::QuantShape;
use kvpage_core::kernels::quant::formats::QuantType;
use kvpage_core::kernels::quant::qmatmul::qmatmul;

const LAYERS: usize = 64;
const EXPERTS: usize = 32;
const TOP_K: usize = 4;
const INNER: usize = 1024;
const OUTS: usize = 512;
const KIND: QuantType = QuantType::Q4K;

/// Every core's thread (the caller's included) claiming units in order until
/// none is left.
struct Claiming;

impl Parallel for Claiming {
    fn threads(&self) -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }

    fn run(&self, units: usize, work: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        let next = AtomicUsize::new(0);
        let claim = || loop {
            let unit = next.fetch_add(1, Ordering::Relaxed);
            if unit >= units {
                break;
            }
            work(unit);
        };
        std::thread::scope(|scope| {
            for _ in 1..self.threads().min(units) {
                scope.spawn(claim);
            }
            claim();
        });
        Ok(())
    }
}

/// `EXPERTS` experts' Q4_K blocks with pseudo-random integers and small, valid
/// f16 scales.
fn layer_weights(seed: usize) -> Vec<u8> {
    let row_bytes = KIND.row_bytes(INNER).expect("whole blocks");
    let mut bytes: Vec<u8> = (0..EXPERTS * OUTS * row_bytes)
        .map(|i| ((i.wrapping_mul(2654435761) + seed) >> 7) as u8)
        .collect();
    for block in bytes.chunks_exact_mut(KIND.block_bytes()) {
        for at in [0, 2] {
            block[at..at + 2].copy_from_slice(&0x1800u16.to_le_bytes()); // 2^-9
        }
    }
    bytes
}

/// Each token's `TOP_K` distinct experts, by a small LCG (a layer's own seed).
fn routing(tokens: usize, seed: u64) -> Vec<i32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut ids = Vec::with_capacity(tokens * TOP_K);
    for _ in 0..tokens {
        let mut chosen = BTreeSet::new();
        while chosen.len() < TOP_K {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            chosen.insert((state >> 33) as usize % EXPERTS);
        }
        ids.extend(chosen.into_iter().map(|e| e as i32));
    }
    ids
}

fn expert_bytes() -> usize {
    OUTS * KIND.row_bytes(INNER).unwrap()
}

fn routed_experts(ids: &[i32]) -> usize {
    ids.iter().collect::<BTreeSet<_>>().len()
}

fn q4k_top4(c: &mut Criterion) {
    let weights: Vec<Vec<u8>> = (0..LAYERS).map(layer_weights).collect();
    println!(
        "{LAYERS} layers of {EXPERTS} Q4_K experts [{OUTS}, {INNER}]: {:.1} MB a layer, \
         {:.0} MB in all; {} bytes an expert",
        (EXPERTS * expert_bytes()) as f64 / 1e6,
        (LAYERS * EXPERTS * expert_bytes()) as f64 / 1e6,
        expert_bytes()
    );
    let mut group = c.benchmark_group("expert_qmatmul_q4_k_top4");
    group.sample_size(10);
    for tokens in [1usize, 32] {
        let rows = tokens * TOP_K;
        let ids: Vec<Vec<i32>> = (0..LAYERS).map(|l| routing(tokens, l as u64)).collect();
        let active: usize = ids.iter().map(|ids| routed_experts(ids)).sum();
        let active_bytes = active * expert_bytes();
        println!(
            "N = {rows} ({tokens} tokens x top-{TOP_K}): {:.1} routed experts a layer, \
             {:.2} MB of routed experts' bytes a call (what the kernel reads), \
             per-row dense calls would read {:.2} MB",
            active as f64 / LAYERS as f64,
            active_bytes as f64 / LAYERS as f64 / 1e6,
            (rows * expert_bytes()) as f64 / 1e6
        );
        let x: Vec<f32> = (0..rows * INNER)
            .map(|i| ((i % 13) as f32 - 6.0) / 13.0)
            .collect();
        let mut y = vec![0.0f32; rows * OUTS];
        let shape = ExpertShape {
            rows,
            inner: INNER,
            outs: OUTS,
            experts: EXPERTS,
        };
        group.throughput(Throughput::Bytes(active_bytes as u64));
        let threads: [(&str, &dyn Parallel); 2] =
            [("1thread", &Sequential), ("all_cores", &Claiming)];
        for (name, parallel) in threads {
            group.bench_function(format!("grouped_n{rows}_{name}_x{LAYERS}"), |b| {
                b.iter(|| {
                    for (w, ids) in weights.iter().zip(&ids) {
                        let call = Routed {
                            shape,
                            x: &x,
                            expert_ids: ids,
                            live_rows: rows,
                        };
                        expert_qmatmul(&call, KIND, w, &[], &mut y, parallel).unwrap();
                        black_box(&y);
                    }
                })
            });
        }
        // The dense kernel once per row, each with its row's expert (one thread).
        let one = QuantShape {
            kind: KIND,
            rows: 1,
            inner: INNER,
            outs: OUTS,
        };
        group.throughput(Throughput::Bytes((LAYERS * rows * expert_bytes()) as u64));
        group.bench_function(format!("per_row_n{rows}_1thread_x{LAYERS}"), |b| {
            b.iter(|| {
                for (w, ids) in weights.iter().zip(&ids) {
                    for (n, &e) in ids.iter().enumerate() {
                        let w = &w[e as usize * expert_bytes()..][..expert_bytes()];
                        let (x, y) = (&x[n * INNER..][..INNER], &mut y[n * OUTS..][..OUTS]);
                        qmatmul(&one, x, w, &[], y).unwrap();
                    }
                    black_box(&y);
                }
            })
        });
    }
    group.finish();
}

/// `kvpage bench moe`'s layer (`python/kvpage/bench/moe_model.py`): 32 Q4_0
/// experts of width 512 over hidden 1024, top-4, router in f32; one token
/// through [`expert_ffn`] (router, gate and up, SwiGLU, down, weighted sum),
/// `FFN_LAYERS` layers of weights (226 MB) so they come from memory. The
/// throughput is the active experts' bytes: four experts' gate, up and down.
fn moe_layer_one_token(c: &mut Criterion) {
    const FFN_LAYERS: usize = 8;
    const HIDDEN: usize = 1024;
    const WIDTH: usize = 512;
    let kind = QuantType::Q4_0;
    let quantized = |rows: usize, inner: usize, seed: usize| -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..EXPERTS * rows * kind.row_bytes(inner).unwrap())
            .map(|i| ((i.wrapping_mul(2654435761) + seed) >> 7) as u8)
            .collect();
        for block in bytes.chunks_exact_mut(kind.block_bytes()) {
            block[..2].copy_from_slice(&0x1800u16.to_le_bytes()); // 2^-9
        }
        bytes
    };
    let layers: Vec<[Vec<u8>; 3]> = (0..FFN_LAYERS)
        .map(|l| {
            [
                quantized(WIDTH, HIDDEN, 3 * l),
                quantized(WIDTH, HIDDEN, 3 * l + 1),
                quantized(HIDDEN, WIDTH, 3 * l + 2),
            ]
        })
        .collect();
    let routers: Vec<Vec<f32>> = (0..FFN_LAYERS)
        .map(|l| {
            (0..EXPERTS * HIDDEN)
                .map(|i| (((i * 7919 + l * 104729) % 997) as f32 - 498.0) / 4980.0)
                .collect()
        })
        .collect();
    let shape = FfnShape {
        tokens: 1,
        hidden: HIDDEN,
        width: WIDTH,
        experts: EXPERTS,
        top_k: TOP_K,
    };
    let active = FFN_LAYERS * TOP_K * 3 * WIDTH * kind.row_bytes(HIDDEN).unwrap();
    let x: Vec<f32> = (0..HIDDEN)
        .map(|i| ((i % 13) as f32 - 6.0) / 13.0)
        .collect();
    let mut y = vec![0.0f32; HIDDEN];
    let mut group = c.benchmark_group("expert_ffn_q4_0_top4");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(active as u64));
    let threads: [(&str, &dyn Parallel); 2] = [("1thread", &Sequential), ("all_cores", &Claiming)];
    for (name, parallel) in threads {
        group.bench_function(format!("one_token_{name}_x{FFN_LAYERS}"), |b| {
            b.iter(|| {
                for ([gate, up, down], router) in layers.iter().zip(&routers) {
                    let weights = FfnWeights {
                        router,
                        router_bias: &[],
                        gate_up_kind: kind,
                        gate,
                        up,
                        down_kind: kind,
                        down,
                        gate_up_packed: false,
                        down_packed: false,
                    };
                    let router = Router::SoftmaxTopK { renormalize: true };
                    expert_ffn(&shape, &weights, router, &x, 1, &mut y, parallel).unwrap();
                    black_box(&y);
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, q4k_top4, moe_layer_one_token);
criterion_main!(benches);
