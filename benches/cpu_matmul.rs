//! Criterion bench of the host small-batch linear layer (`rust/kernels/cpu_matmul.rs`) at
//! SmolLM2-135M's MLP shape (`[T, 576] x [1536, 576]ᵀ`), one thread, cycling
//! through 30 weight matrices (one per layer, 106 MB) so weights come from
//! memory as in a real step. Bytes and FLOPs per iteration are printed so the
//! figures read as bandwidth and compute. Run: `cargo bench --bench cpu_matmul`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpage_core::kernels::cpu_matmul::{matmul_nt, MatmulShape};

const LAYERS: usize = 30;

fn mlp_projection(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_matmul_nt");
    let (inner, outs) = (576usize, 1536usize);
    let weights: Vec<Vec<f32>> = (0..LAYERS)
        .map(|l| {
            (0..outs * inner)
                .map(|i| (((i + l) % 89) as f32 - 44.0) / 89.0)
                .collect()
        })
        .collect();
    for rows in [1usize, 2, 4, 8, 16] {
        let shape = MatmulShape { rows, inner, outs };
        let x: Vec<f32> = (0..rows * inner)
            .map(|i| ((i % 13) as f32 - 6.0) / 13.0)
            .collect();
        let mut y = vec![0.0f32; rows * outs];
        println!(
            "rows {rows}: {:.0} MB of weights, {:.2} GFLOP per iteration ({LAYERS} products)",
            (LAYERS * outs * inner * 4) as f64 / 1e6,
            (2 * LAYERS * rows * outs * inner) as f64 / 1e9
        );
        group.bench_function(format!("rows{rows}_576x1536_x{LAYERS}"), |b| {
            b.iter(|| {
                for w in &weights {
                    matmul_nt(&shape, &x, w, &mut y).unwrap();
                    black_box(&y);
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, mlp_projection);
criterion_main!(benches);
