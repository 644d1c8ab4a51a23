//! Criterion bench of the host decode-attention kernel (`rust/kernels/cpu_attention.rs`)
//! at SmolLM2-135M's shapes (9 query / 3 KV heads, head_dim 64, blocks of 16):
//! one layer of a decode step, f32 pool. Bytes read per call are printed so the
//! figure can be read as bandwidth. Run: `cargo bench --bench cpu_attention`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpage_core::kernels::cpu_attention::{paged_decode_attention, DecodeShape};
use kvpage_core::kernels::parallel::ScopedThreads;

fn decode_layer(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_decode_attention");
    for (rows, context) in [(1usize, 128usize), (32, 512), (8, 2048)] {
        let width = context / 16;
        let shape = DecodeShape {
            rows,
            q_heads: 9,
            kv_heads: 3,
            head_dim: 64,
            pages: rows * width + 1,
            block_size: 16,
            table_width: width,
        };
        let pool_len = shape.kv_heads * shape.pages * shape.block_size * shape.head_dim;
        let pool: Vec<f32> = (0..pool_len)
            .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
            .collect();
        let q: Vec<f32> = (0..rows * 9 * 64)
            .map(|i| ((i % 13) as f32 - 6.0) / 13.0)
            .collect();
        // Each row's pages scattered through the pool, as after many steps.
        let tables: Vec<i32> = (0..rows * width)
            .map(|i| ((i * 7919) % (rows * width)) as i32)
            .collect();
        let kv_lens = vec![context as i32; rows];
        let mut out = vec![0.0f32; q.len()];
        let bytes = 2 * rows * context * shape.kv_heads * shape.head_dim * 4;
        println!(
            "rows {rows} x context {context}: {:.1} MB of K/V per call",
            bytes as f64 / 1e6
        );
        group.bench_function(format!("rows{rows}_ctx{context}"), |b| {
            b.iter(|| {
                paged_decode_attention(
                    &ScopedThreads,
                    &shape,
                    &q,
                    &pool,
                    &pool,
                    &kv_lens,
                    &tables,
                    &mut out,
                )
                .unwrap();
                black_box(&out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode_layer);
criterion_main!(benches);
