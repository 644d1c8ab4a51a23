//! Every host kernel that reads a caller's buffer, run with each buffer's end
//! against an unmapped page ([`super::guard_page::Guarded`]): weights, inputs,
//! scales, the paged KV pool, block tables and outputs, for every weight
//! format and every row-count path of the products (1 row: the integer path;
//! 2-15: the float path; 16-127: the panel; >= 128: the step dequantizes and
//! XLA multiplies). A read or write past any buffer's end faults the test
//! process. Results must equal those of the same call on ordinary buffers.
//!
//! The fused decoder layer (`decoder_layer.rs`, opt-in and slated for removal
//! by issue #42) reads its buffers through these same product and attention
//! kernels.

use super::cpu_attention::{paged_decode_attention, Bf16, DecodeShape, KvElement, F16};
use super::cpu_matmul::{matmul_nt, MatmulShape, OutPtr};
use super::guard_page::Guarded;
use super::parallel::{ScopedThreads, Sequential};
use super::quant::formats::QuantType;
use super::quant::qmatmul::{self, qmatmul, QuantShape};
use super::quant::tests::random_weights;
use crate::test_rng::SplitMix64 as TestRng;

/// The product's row-count paths (module docs).
const ROWS: [usize; 5] = [1, 2, 7, 37, 130];

fn floats(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
        .collect()
}

#[test]
fn quantized_products_read_nothing_past_their_buffers() {
    let mut rng = TestRng::new(46);
    for kind in QuantType::ALL {
        for rows in ROWS {
            // An odd number of weight rows: the last tile is partial.
            let shape = QuantShape {
                kind,
                rows,
                inner: 2 * kind.block_elems(),
                outs: 19,
            };
            let x = floats(&mut rng, rows * shape.inner);
            let w = random_weights(&mut rng, kind, shape.outs, shape.inner);
            let scales = if kind.row_scaled() {
                vec![0.01; shape.outs]
            } else {
                Vec::new()
            };
            let mut want = vec![0.0; rows * shape.outs];
            qmatmul(&shape, &x, &w, &scales, &mut want).unwrap();
            let (gx, gw, gs) = (
                Guarded::from_slice(&x),
                Guarded::from_slice(&w),
                Guarded::from_slice(&scales),
            );
            let mut gy = Guarded::filled(rows * shape.outs, f32::NAN);
            qmatmul(
                &shape,
                gx.as_slice(),
                gw.as_slice(),
                gs.as_slice(),
                gy.as_mut_slice(),
            )
            .unwrap();
            assert_eq!(gy.as_slice(), &want[..], "{kind:?}, {rows} rows");
        }
    }
}

#[test]
fn dequantization_reads_nothing_past_its_buffers() {
    let mut rng = TestRng::new(47);
    for kind in QuantType::ALL {
        let (outs, inner) = (19, 3 * kind.block_elems());
        let w = Guarded::from_slice(&random_weights(&mut rng, kind, outs, inner));
        let scales = Guarded::from_slice(&if kind.row_scaled() {
            vec![0.02; outs]
        } else {
            Vec::new()
        });
        let mut out = Guarded::filled(outs * inner, f32::NAN);
        qmatmul::validate_dequantize(kind, inner, w.as_slice(), scales.as_slice(), out.as_slice())
            .unwrap();
        let target = OutPtr::new(out.as_mut_slice());
        for index in 0..outs.div_ceil(qmatmul::OUTS_PER_TILE) {
            // SAFETY: validated; one thread.
            unsafe {
                qmatmul::dequantize_tile(
                    kind,
                    inner,
                    w.as_slice(),
                    scales.as_slice(),
                    target,
                    outs,
                    index,
                )
            };
        }
        assert!(out.as_slice().iter().all(|v| v.is_finite()), "{kind:?}");
    }
}

#[test]
fn float_products_read_nothing_past_their_buffers() {
    let mut rng = TestRng::new(48);
    for rows in ROWS {
        for (inner, outs) in [(64, 19), (37, 5), (128, 33)] {
            let shape = MatmulShape { rows, inner, outs };
            let x = floats(&mut rng, rows * inner);
            let w = floats(&mut rng, outs * inner);
            let mut want = vec![0.0; rows * outs];
            matmul_nt(&shape, &x, &w, &mut want).unwrap();
            let (gx, gw) = (Guarded::from_slice(&x), Guarded::from_slice(&w));
            let mut gy = Guarded::filled(rows * outs, f32::NAN);
            matmul_nt(&shape, gx.as_slice(), gw.as_slice(), gy.as_mut_slice()).unwrap();
            assert_eq!(gy.as_slice(), &want[..], "{rows} x {inner} x {outs}");
        }
    }
}

/// Decode attention whose rows read the pool's last block to its last slot.
fn attention_reads_nothing_past_its_buffers<T: KvElement + Copy>(narrow: fn(f32) -> T) {
    let mut rng = TestRng::new(49);
    for (rows, head_dim, block_size) in [(1, 64, 16), (3, 13, 4), (9, 128, 32)] {
        let shape = DecodeShape {
            rows,
            q_heads: 6,
            kv_heads: 2,
            head_dim,
            pages: 5,
            block_size,
            table_width: 3,
        };
        let pool_len = shape.kv_heads * shape.pages * block_size * head_dim;
        let k: Vec<T> = floats(&mut rng, pool_len).into_iter().map(narrow).collect();
        let v: Vec<T> = floats(&mut rng, pool_len).into_iter().map(narrow).collect();
        let q = floats(&mut rng, rows * shape.q_heads * head_dim);
        // Every row ends in the last page, full; the last row's table is the
        // buffer's last entry.
        let tables: Vec<i32> = (0..rows * shape.table_width)
            .map(|i| [0, 3, 4][i % 3])
            .collect();
        let kv_lens = vec![(shape.table_width * block_size) as i32; rows];
        let mut want = vec![0.0; q.len()];
        paged_decode_attention(
            &Sequential,
            &shape,
            &q,
            &k,
            &v,
            &kv_lens,
            &tables,
            &mut want,
        )
        .unwrap();
        let (gq, gk, gv) = (
            Guarded::from_slice(&q),
            Guarded::from_slice(&k),
            Guarded::from_slice(&v),
        );
        let (glens, gtables) = (Guarded::from_slice(&kv_lens), Guarded::from_slice(&tables));
        for threads in [
            &Sequential as &dyn super::parallel::Parallel,
            &ScopedThreads,
        ] {
            let mut out = Guarded::filled(q.len(), f32::NAN);
            paged_decode_attention(
                threads,
                &shape,
                gq.as_slice(),
                gk.as_slice(),
                gv.as_slice(),
                glens.as_slice(),
                gtables.as_slice(),
                out.as_mut_slice(),
            )
            .unwrap();
            assert_eq!(
                out.as_slice(),
                &want[..],
                "{rows} rows, head_dim {head_dim}"
            );
        }
    }
}

#[test]
fn attention_over_a_float32_pool_reads_nothing_past_it() {
    attention_reads_nothing_past_its_buffers::<f32>(|x| x);
}

#[test]
fn attention_over_a_float16_pool_reads_nothing_past_it() {
    attention_reads_nothing_past_its_buffers::<F16>(F16::from_f32);
}

#[test]
fn attention_over_a_bfloat16_pool_reads_nothing_past_it() {
    attention_reads_nothing_past_its_buffers::<Bf16>(|x| Bf16((x.to_bits() >> 16) as u16));
}

/// Run by [`the_guard_page_faults_a_read_one_byte_past`] in a child process.
#[test]
#[ignore = "faults on purpose; run in a child process by the test below"]
fn reading_one_byte_past_a_guarded_buffer() {
    let buffer = Guarded::from_slice(&[1u8, 2, 3]);
    // SAFETY: none; this read must fault (the guard page follows the buffer).
    let past = unsafe { std::ptr::read_volatile(buffer.as_slice().as_ptr().add(3)) };
    println!("read {past} past the end: the guard page did not fault");
}

#[test]
fn the_guard_page_faults_a_read_one_byte_past() {
    use std::os::unix::process::ExitStatusExt;

    let name = "kernels::guard_page_tests::reading_one_byte_past_a_guarded_buffer";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let faulted = out.status.signal() == Some(libc::SIGSEGV)
        || (!out.status.success() && stderr.contains("SEGV")); // under AddressSanitizer
    assert!(
        faulted,
        "{:?}\n{}{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}
