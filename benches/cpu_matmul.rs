//! Criterion bench of the host small-batch linear layer (`rust/kernels/cpu_matmul.rs`) at
//! SmolLM2-135M's MLP shape (`[T, 576] x [1536, 576]ᵀ`), one thread, cycling
//! through 30 weight matrices (one per layer, 106 MB) so weights come from
//! memory as in a real step. Bytes and FLOPs per iteration are printed so the
//! figures read as bandwidth and compute. The same products with quantized
//! weights (`rust/kernels/quant/`, every format, the bytes each streams) follow.
//! Two threads sharing one-row Q4_1 products follow: each taking alternate
//! 16-row tiles against each taking a contiguous half (how the host kernels'
//! fork-join hands out units, `rust/kernels/xla_ffi.rs`).
//! One-row products of the model's two formats over 160 MB of weights follow:
//! past the 32 MB L3 of the machine in `benches/RESULTS.md`, as a decode step
//! streams SmolLM2's 96 MB (the 30-product sets above fit in L3 for the 4-bit
//! formats).
//! Q4_0 and Q4_1 packed into tiles (`quant_packed`, where this CPU packs them:
//! what a loaded model's projections and experts are) follow both sets, with
//! 16-bit inputs and (names ending `_8bit`) 8-bit ones (`--cpu-input-bits 8`).
//! Run: `cargo bench --bench cpu_matmul` (`-- quant` for the quantized ones,
//! `-- split` for the two-thread split, `-- from_dram` for the 160 MB one).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpage_core::kernels::cpu_matmul::OutPtr;
use kvpage_core::kernels::cpu_matmul::{matmul_nt, MatmulShape};
use kvpage_core::kernels::quant::activations::set_cpu_input_bits;
use kvpage_core::kernels::quant::call::{tiles, QuantShape};
use kvpage_core::kernels::quant::formats::QuantType;
use kvpage_core::kernels::quant::qmatmul::{packs, qmatmul, tile, tile_packed, Inputs};
use kvpage_core::kernels::quant::tiles::pack_tiles;

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
        let x = inputs(rows * inner);
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

/// `n` deterministic inputs in `[-0.46, 0.46]`.
fn inputs(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 13) as f32 - 6.0) / 13.0).collect()
}

/// Blocks of `kind` with pseudo-random integers and small, valid f16 scales.
fn quantized_weights(kind: QuantType, outs: usize, inner: usize, seed: usize) -> Vec<u8> {
    let row_bytes = kind.row_bytes(inner).expect("whole blocks");
    let mut bytes: Vec<u8> = (0..outs * row_bytes)
        .map(|i| ((i * 2654435761 + seed) >> 7) as u8)
        .collect();
    let scale_at: &[usize] = match kind {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => &[0],
        QuantType::Q4_1 | QuantType::Q4K | QuantType::Q5_1 => &[0, 2],
        QuantType::Q6K => &[208],
        QuantType::Int8 => &[],
    };
    for block in bytes.chunks_exact_mut(kind.block_bytes()) {
        for &at in scale_at {
            block[at..at + 2].copy_from_slice(&0x1800u16.to_le_bytes()); // 2^-9
        }
    }
    bytes
}

fn quantized_projection(c: &mut Criterion) {
    let mut group = c.benchmark_group("quant_qmatmul");
    group.sample_size(20);
    for kind in QuantType::ALL {
        // K-quant rows hold blocks of 256: those take the down projection's shape.
        let (inner, outs) = if 576 % kind.block_elems() == 0 {
            (576usize, 1536usize)
        } else {
            (1536, 576)
        };
        let weights: Vec<Vec<u8>> = (0..LAYERS)
            .map(|l| quantized_weights(kind, outs, inner, l))
            .collect();
        let scales: Vec<f32> = if kind.row_scaled() {
            vec![1e-3; outs]
        } else {
            Vec::new()
        };
        for rows in [1usize, 2, 4, 6, 8, 16, 32] {
            let shape = QuantShape {
                kind,
                rows,
                inner,
                outs,
            };
            let x = inputs(rows * inner);
            let mut y = vec![0.0f32; rows * outs];
            println!(
                "{} rows {rows}: {:.1} MB of weights per iteration ({LAYERS} products)",
                kind.name(),
                (LAYERS * weights[0].len()) as f64 / 1e6
            );
            group.bench_function(
                format!("{}_rows{rows}_{inner}x{outs}_x{LAYERS}", kind.name()),
                |b| {
                    b.iter(|| {
                        for w in &weights {
                            qmatmul(&shape, &x, w, &scales, &mut y).unwrap();
                            black_box(&y);
                        }
                    })
                },
            );
        }
    }
    group.finish();
}

/// Which tiles of `tiles` thread `t` of `threads` runs.
fn mine(split: &str, tile: usize, tiles: usize, t: usize, threads: usize) -> bool {
    match split {
        "alternate" => tile % threads == t,
        _ => tile * threads / tiles == t,
    }
}

fn two_thread_split(c: &mut Criterion) {
    let mut group = c.benchmark_group("quant_split");
    group.sample_size(20);
    let kind = QuantType::Q4_1;
    let shape = QuantShape {
        kind,
        rows: 1,
        inner: 576,
        outs: 1536,
    };
    let weights: Vec<Vec<u8>> = (0..LAYERS)
        .map(|l| quantized_weights(kind, shape.outs, shape.inner, l))
        .collect();
    let x = inputs(shape.inner);
    let inputs = Inputs::prepare(&shape, &x);
    let count = tiles(&shape);
    let mut ys = vec![vec![0.0f32; shape.outs]; LAYERS];
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr::new(y)).collect();
    for (threads, split) in [(1usize, "contiguous"), (2, "alternate"), (2, "contiguous")] {
        group.bench_function(
            format!("q4_1_rows1_x{LAYERS}_{threads}threads_{split}"),
            |b| {
                b.iter(|| {
                    std::thread::scope(|scope| {
                        for t in 0..threads {
                            let (weights, outs, inputs, shape) = (&weights, &outs, &inputs, &shape);
                            scope.spawn(move || {
                                for (w, y) in weights.iter().zip(outs) {
                                    for index in
                                        (0..count).filter(|&i| mine(split, i, count, t, threads))
                                    {
                                        // SAFETY: shapes as built above; each tile has one writer.
                                        unsafe { tile(shape, inputs, w, &[], *y, index) };
                                    }
                                }
                            });
                        }
                    });
                })
            },
        );
    }
    group.finish();
    black_box(&ys);
}

/// One-row (K-quants included; and, for Q4_1, four-row: a speculative verification's or a
/// small decode batch's) products cycling through 160 MB of weights, one thread.
fn one_row_from_dram(c: &mut Criterion) {
    let mut group = c.benchmark_group("quant_one_row");
    group.sample_size(10);
    for (kind, rows) in [
        (QuantType::Q4_1, 1usize),
        (QuantType::Q4_0, 1),
        (QuantType::Q8_0, 1),
        (QuantType::Q4_1, 4),
        (QuantType::Q4K, 1),
        (QuantType::Q6K, 1),
    ] {
        // K-quant rows hold blocks of 256: the down projection's shape.
        let (inner, outs) = if kind.block_elems() == 256 {
            (1536usize, 576usize)
        } else {
            (576, 1536)
        };
        let bytes = kind.row_bytes(inner).expect("whole blocks") * outs;
        let count = 160_000_000usize.div_ceil(bytes);
        let weights: Vec<Vec<u8>> = (0..count)
            .map(|l| quantized_weights(kind, outs, inner, l))
            .collect();
        let shape = QuantShape {
            kind,
            rows,
            inner,
            outs,
        };
        let x = inputs(rows * inner);
        let mut y = vec![0.0f32; rows * outs];
        println!(
            "{} {rows} rows: {:.0} MB of weights per iteration ({count} products)",
            kind.name(),
            (count * bytes) as f64 / 1e6
        );
        group.bench_function(format!("{}_rows{rows}_from_dram", kind.name()), |b| {
            b.iter(|| {
                for w in &weights {
                    qmatmul(&shape, &x, w, &[], &mut y).unwrap();
                    black_box(&y);
                }
            })
        });
    }
    group.finish();
}

/// `quant_qmatmul`'s and `quant_one_row`'s Q4_0 and Q4_1 products with the
/// weights packed into tiles, as a loaded model holds them where this CPU
/// packs (`qmatmul::packs`).
fn packed_projection(c: &mut Criterion) {
    let mut group = c.benchmark_group("quant_packed");
    group.sample_size(10);
    let (inner, outs) = (576usize, 1536usize);
    for kind in [QuantType::Q4_0, QuantType::Q4_1] {
        if !packs(kind, outs) {
            println!("{} is not packed on this CPU", kind.name());
            continue;
        }
        let bytes = kind.row_bytes(inner).expect("whole blocks") * outs;
        for (count, place) in [
            (LAYERS, "cache"),
            (160_000_000usize.div_ceil(bytes), "dram"),
        ] {
            let weights: Vec<Vec<u8>> = (0..count)
                .map(|l| pack_tiles(kind, &quantized_weights(kind, outs, inner, l), outs, inner))
                .collect();
            let rows_set: &[usize] = if place == "dram" {
                &[1]
            } else {
                &[1, 2, 4, 8, 16, 32, 128]
            };
            // 8-bit inputs (`--cpu-input-bits 8`) beside the default 16, in cache.
            let bits_set: &[u32] = if place == "dram" { &[16] } else { &[16, 8] };
            for (&rows, &bits) in rows_set
                .iter()
                .flat_map(|r| bits_set.iter().map(move |b| (r, b)))
            {
                set_cpu_input_bits(bits).expect("8 or 16");
                let shape = QuantShape {
                    kind,
                    rows,
                    inner,
                    outs,
                };
                let x = inputs(rows * inner);
                let mut y = vec![0.0f32; rows * outs];
                let suffix = if bits == 8 { "_8bit" } else { "" };
                let name = format!(
                    "{}_rows{rows}_{inner}x{outs}_x{count}_{place}{suffix}",
                    kind.name()
                );
                group.bench_function(name, |b| {
                    b.iter(|| {
                        for w in &weights {
                            let prepared = Inputs::prepare_packed(&shape, &x);
                            let out = OutPtr::new(&mut y);
                            for index in 0..tiles(&shape) {
                                // SAFETY: shapes as built above; `w` packed; one thread.
                                unsafe { tile_packed(&shape, &prepared, w, out, index) };
                            }
                            black_box(&y);
                        }
                    })
                });
            }
        }
    }
    set_cpu_input_bits(16).expect("16");
    group.finish();
}

criterion_group!(
    benches,
    mlp_projection,
    quantized_projection,
    packed_projection,
    two_thread_split,
    one_row_from_dram
);
criterion_main!(benches);
