//! Every host kernel that reads a caller's buffer, run with each buffer
//! against an unmapped page ([`super::guard_page::Guarded`]), at its end and
//! then at its start: weights, inputs, scales, the paged KV pool, block tables
//! and outputs, for every weight format, every kernel the CPU has (the portable
//! loops included) and every row-count path of the products. A read or write
//! past either edge of any buffer faults the test process. Results must equal
//! those of the same call on ordinary buffers.
//!
//! The row-count paths: quantized products take the integer path at
//! `integer_rows` (1 row with the portable loop, else up to 32; with AVX-512 VNNI any count, in blocks),
//! past it row groups of up to 10 below 16 rows, the panel from 16 (from 2 with AVX-512;
//! `KVPAGE_CPU_AVX512=0` runs the row groups), and from 128 rows the step dequantizes and XLA multiplies
//! (`DEQUANTIZE_ROWS`, `python/kvpage/kernels/host/cpu_qmatmul.py`); float products take row
//! groups of 8.

use super::cpu_attention::{
    paged_decode_attention, paged_decode_attention_with, AttentionOptions, Bf16, DecodeShape,
    KvElement, F16,
};
use super::cpu_matmul::{self, matmul_nt, MatmulShape, OutPtr};
use super::guard_page::{Edge, Guarded};
use super::parallel::{Parallel, ScopedThreads, Sequential};
use super::quant::call::{self, QuantShape};
use super::quant::dequantize;
use super::quant::formats::QuantType;
use super::quant::qmatmul::{self, qmatmul, Inputs};
use super::quant::tests::random_weights;
use crate::test_rng::SplitMix64 as TestRng;

/// Rows of a call, one or more on each side of every path's threshold (module
/// docs): 1; 2, 7, 12 (the integer path's groups of 4); 37 (the panel, an odd last block); 130.
const ROWS: [usize; 6] = [1, 2, 7, 12, 37, 130];

fn floats(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn row_scales(kind: QuantType, outs: usize) -> Vec<f32> {
    if kind.row_scaled() {
        vec![0.01; outs]
    } else {
        Vec::new()
    }
}

/// A quantized product into `y`: the dispatching kernel, or the portable loop.
type QuantKernel = fn(&QuantShape, &[f32], &[u8], &[f32], &mut [f32]);

fn dispatched(shape: &QuantShape, x: &[f32], w: &[u8], s: &[f32], y: &mut [f32]) {
    qmatmul(shape, x, w, s, y).unwrap();
}

fn portable(shape: &QuantShape, x: &[f32], w: &[u8], s: &[f32], y: &mut [f32]) {
    call::validate(shape, x, w, s, y).unwrap();
    let inputs = Inputs::prepare(shape, x);
    // SAFETY: validated; one thread.
    unsafe { qmatmul::portable_for_tests(shape, &inputs, w, s, OutPtr::new(y)) };
}

/// The batch-invariant targets' product: every row count on the float path.
fn float_path(shape: &QuantShape, x: &[f32], w: &[u8], s: &[f32], y: &mut [f32]) {
    call::validate(shape, x, w, s, y).unwrap();
    let inputs = Inputs::float_path(x);
    let out = OutPtr::new(y);
    for index in 0..call::tiles(shape) {
        // SAFETY: validated; one thread.
        unsafe { qmatmul::tile(shape, &inputs, w, s, out, index) };
    }
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
            let scales = row_scales(kind, shape.outs);
            for (name, kernel) in [
                ("dispatched", dispatched as QuantKernel),
                ("portable", portable),
                ("float path", float_path),
            ] {
                let mut want = vec![0.0; rows * shape.outs];
                kernel(&shape, &x, &w, &scales, &mut want);
                for edge in Edge::BOTH {
                    let (gx, gw, gs) = (
                        Guarded::new(&x, edge),
                        Guarded::new(&w, edge),
                        Guarded::new(&scales, edge),
                    );
                    let mut gy = Guarded::new(&vec![f32::NAN; want.len()], edge);
                    kernel(
                        &shape,
                        gx.as_slice(),
                        gw.as_slice(),
                        gs.as_slice(),
                        gy.as_mut_slice(),
                    );
                    let at = format!("{kind:?}, {rows} rows, {name}, {edge:?}");
                    assert_eq!(gy.as_slice(), &want[..], "{at}");
                }
            }
        }
    }
}

/// Every tile of a dequantization: the dispatching kernel, or the portable loop.
fn dequantize(portable: bool, kind: QuantType, inner: usize, w: &[u8], s: &[f32], out: &mut [f32]) {
    dequantize::validate_dequantize(kind, inner, w, s, out).unwrap();
    let outs = out.len() / inner;
    let target = OutPtr::new(out);
    for index in 0..outs.div_ceil(call::OUTS_PER_TILE) {
        let (start, end) = (
            index * call::OUTS_PER_TILE,
            ((index + 1) * call::OUTS_PER_TILE).min(outs),
        );
        // SAFETY: validated; one thread.
        unsafe {
            if portable {
                dequantize::portable_dequantize_rows(kind, inner, w, s, target, start, end)
            } else {
                dequantize::dequantize_tile(kind, inner, w, s, target, outs, index)
            }
        };
    }
}

#[test]
fn dequantization_reads_nothing_past_its_buffers() {
    let mut rng = TestRng::new(47);
    for kind in QuantType::ALL {
        let (outs, inner) = (19, 3 * kind.block_elems());
        let w = random_weights(&mut rng, kind, outs, inner);
        let scales = row_scales(kind, outs);
        for portable in [false, true] {
            let mut want = vec![f32::NAN; outs * inner];
            dequantize(portable, kind, inner, &w, &scales, &mut want);
            assert!(want.iter().all(|v| v.is_finite()), "{kind:?}");
            for edge in Edge::BOTH {
                let (gw, gs) = (Guarded::new(&w, edge), Guarded::new(&scales, edge));
                let mut out = Guarded::new(&vec![f32::NAN; want.len()], edge);
                dequantize(
                    portable,
                    kind,
                    inner,
                    gw.as_slice(),
                    gs.as_slice(),
                    out.as_mut_slice(),
                );
                let at = format!("{kind:?}, portable {portable}, {edge:?}");
                assert_eq!(out.as_slice(), &want[..], "{at}");
            }
        }
    }
}

#[test]
fn float_products_read_nothing_past_their_buffers() {
    let mut rng = TestRng::new(48);
    for set in cpu_matmul::available_instruction_sets() {
        let product = |shape: &MatmulShape, x: &[f32], w: &[f32], y: &mut [f32]| {
            cpu_matmul::validate(shape, x, w, y).unwrap();
            let out = OutPtr::new(y);
            for tile in 0..cpu_matmul::tiles(shape) {
                // SAFETY: validated; one thread; the CPU has `set`.
                unsafe { cpu_matmul::tile_with(set, shape, x, w, out, tile) };
            }
        };
        for rows in ROWS {
            // A tail of 5 lanes (37), two tiles (70 weight rows).
            for (inner, outs) in [(64, 19), (37, 5), (128, 70)] {
                let shape = MatmulShape { rows, inner, outs };
                let x = floats(&mut rng, rows * inner);
                let w = floats(&mut rng, outs * inner);
                let mut want = vec![0.0; rows * outs];
                product(&shape, &x, &w, &mut want);
                for edge in Edge::BOTH {
                    let (gx, gw) = (Guarded::new(&x, edge), Guarded::new(&w, edge));
                    let mut gy = Guarded::new(&vec![f32::NAN; want.len()], edge);
                    product(&shape, gx.as_slice(), gw.as_slice(), gy.as_mut_slice());
                    let at = format!("{set:?}, {rows} x {inner} x {outs}, {edge:?}");
                    assert_eq!(gy.as_slice(), &want[..], "{at}");
                }
            }
        }
    }
    // The entry point, with whichever kernel it chose.
    let shape = MatmulShape {
        rows: 3,
        inner: 37,
        outs: 5,
    };
    let (x, w) = (floats(&mut rng, 3 * 37), floats(&mut rng, 5 * 37));
    let (gx, gw) = (Guarded::from_slice(&x), Guarded::from_slice(&w));
    let mut gy = Guarded::from_slice(&[0.0; 15]);
    matmul_nt(&shape, gx.as_slice(), gw.as_slice(), gy.as_mut_slice()).unwrap();
}

/// Decode attention whose rows read the pool's last block to its last slot
/// (and its first block from its first slot).
fn attention_reads_nothing_past_its_buffers<T: KvElement + Copy>(narrow: fn(f32) -> T) {
    let mut rng = TestRng::new(49);
    // head_dim 13 takes the generic loop, the others the AVX2 kernel where the
    // CPU has it.
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
        // Every row's context fills its three pages, the first and the last of
        // the pool among them; the last row's table is the buffer's last entry.
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
        for edge in Edge::BOTH {
            let (gq, gk, gv) = (
                Guarded::new(&q, edge),
                Guarded::new(&k, edge),
                Guarded::new(&v, edge),
            );
            let (glens, gtables) = (Guarded::new(&kv_lens, edge), Guarded::new(&tables, edge));
            for threads in [&Sequential as &dyn Parallel, &ScopedThreads] {
                let mut out = Guarded::new(&vec![f32::NAN; q.len()], edge);
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
                let at = format!("{rows} rows, head_dim {head_dim}, {edge:?}");
                assert_eq!(out.as_slice(), &want[..], "{at}");
                // Each query row naming its table row (all rows' tables are alike).
                let table_rows: Vec<i32> = (0..rows as i32).rev().collect();
                let grows = Guarded::new(&table_rows, edge);
                let options = AttentionOptions {
                    table_rows: Some(grows.as_slice()),
                    ..AttentionOptions::default()
                };
                let mut out = Guarded::new(&vec![f32::NAN; q.len()], edge);
                paged_decode_attention_with(
                    threads,
                    &shape,
                    &options,
                    gq.as_slice(),
                    gk.as_slice(),
                    gv.as_slice(),
                    glens.as_slice(),
                    gtables.as_slice(),
                    out.as_mut_slice(),
                )
                .unwrap();
                assert_eq!(out.as_slice(), &want[..], "{at}, table_rows");
            }
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

/// Run by [`the_guard_pages_fault_a_read_one_byte_outside`] in a child process.
#[test]
#[ignore = "faults on purpose; run in a child process by the test below"]
fn reading_one_byte_past_a_guarded_buffer() {
    let buffer = Guarded::new(&[1u8, 2, 3], Edge::End);
    // SAFETY: none; this read must fault (the guard page follows the buffer).
    let past = unsafe { std::ptr::read_volatile(buffer.as_slice().as_ptr().add(3)) };
    println!("read {past} past the end: the guard page did not fault");
}

/// Run by [`the_guard_pages_fault_a_read_one_byte_outside`] in a child process.
#[test]
#[ignore = "faults on purpose; run in a child process by the test below"]
fn reading_one_byte_before_a_guarded_buffer() {
    let buffer = Guarded::new(&[1u8, 2, 3], Edge::Start);
    // SAFETY: none; this read must fault (the guard page precedes the buffer).
    let before = unsafe { std::ptr::read_volatile(buffer.as_slice().as_ptr().sub(1)) };
    println!("read {before} before the start: the guard page did not fault");
}

#[test]
fn the_guard_pages_fault_a_read_one_byte_outside() {
    use std::os::unix::process::ExitStatusExt;

    for test in [
        "reading_one_byte_past_a_guarded_buffer",
        "reading_one_byte_before_a_guarded_buffer",
    ] {
        let name = format!("kernels::guard_page_tests::{test}");
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                &name,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        // The child ran the test (a filter matching nothing would pass), and
        // died of the fault: SIGSEGV, or AddressSanitizer's report of it.
        assert!(stdout.contains("running 1 test"), "{test}: {stdout}");
        let faulted = out.status.signal() == Some(libc::SIGSEGV)
            || (!out.status.success() && stderr.contains("SEGV"));
        assert!(faulted, "{test}: {:?}\n{stdout}{stderr}", out.status);
    }
}
