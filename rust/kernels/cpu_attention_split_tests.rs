//! Seeded tests that a call's split across threads never changes its output: by
//! rows, and for few rows by ranges of KV heads (`cpu_attention.rs`, module docs).

use super::tests::random_case;
use super::*;
use crate::kernels::parallel::{Parallel, ScopedThreads, Sequential};
use crate::test_rng::SplitMix64 as TestRng;

#[test]
fn threaded_split_equals_single_thread() {
    let mut rng = TestRng::new(11);
    let shape = DecodeShape {
        rows: 24,
        q_heads: 9,
        kv_heads: 3,
        head_dim: 64,
        pages: 300,
        block_size: 16,
        table_width: 20,
    };
    let (q, k, v, mut kv_lens, tables) = random_case(&mut rng, shape);
    // Every slot readable and long rows, so the call is split across threads.
    kv_lens.iter_mut().for_each(|n| *n = 200 + (*n % 120));
    let k: Vec<f32> = k
        .iter()
        .map(|x| if x.is_finite() { *x } else { 0.5 })
        .collect();
    let v: Vec<f32> = v
        .iter()
        .map(|x| if x.is_finite() { *x } else { 0.5 })
        .collect();
    let mut threaded = vec![0.0; q.len()];
    paged_decode_attention(
        &ScopedThreads,
        &shape,
        &q,
        &k,
        &v,
        &kv_lens,
        &tables,
        &mut threaded,
    )
    .unwrap();
    let row_len = shape.q_heads * shape.head_dim;
    for row in 0..shape.rows {
        let one = DecodeShape { rows: 1, ..shape };
        let mut single = vec![0.0; row_len];
        let (kv, table) = (&kv_lens[row..row + 1], &tables[row * 20..(row + 1) * 20]);
        paged_decode_attention(
            &Sequential,
            &one,
            &q[row * row_len..][..row_len],
            &k,
            &v,
            kv,
            table,
            &mut single,
        )
        .unwrap();
        assert_eq!(&threaded[row * row_len..][..row_len], &single[..]);
    }
}

#[test]
fn threaded_split_with_a_window_equals_single_thread() {
    let mut rng = TestRng::new(41);
    let shape = DecodeShape {
        rows: 16,
        q_heads: 8,
        kv_heads: 2,
        head_dim: 64,
        pages: 400,
        block_size: 16,
        table_width: 24,
    };
    let (q, k, v, mut kv_lens, mut tables) = random_case(&mut rng, shape);
    kv_lens.iter_mut().for_each(|n| *n = 200 + (*n % 180));
    // Distinct pages per row, all readable.
    tables
        .iter_mut()
        .enumerate()
        .for_each(|(i, p)| *p = i as i32);
    let finite = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .map(|x| if x.is_finite() { *x } else { 0.5 })
            .collect()
    };
    let (k, v) = (finite(&k), finite(&v));
    let sinks = [0.5f32; 8];
    let options = AttentionOptions {
        sliding_window: Some(150),
        soft_cap: Some(5.0),
        sinks: Some(&sinks),
        table_rows: None,
    };
    let call = |parallel: &dyn Parallel| {
        let mut out = vec![0.0; q.len()];
        paged_decode_attention_with(
            parallel, &shape, &options, &q, &k, &v, &kv_lens, &tables, &mut out,
        )
        .unwrap();
        out
    };
    assert_eq!(call(&ScopedThreads), call(&Sequential));
}

/// Claims `threads` threads and runs the units on the caller, last unit first:
/// the split a call makes for that many threads, without threads.
struct SplitFor(usize);

impl Parallel for SplitFor {
    fn threads(&self) -> usize {
        self.0
    }

    fn run(&self, units: usize, work: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        (0..units).rev().for_each(work);
        Ok(())
    }
}

#[test]
fn few_rows_split_by_kv_heads_equal_one_thread_bit_for_bit() {
    let mut rng = TestRng::new(53);
    for (rows, kv_heads, group) in [(1, 2, 4), (1, 3, 3), (1, 8, 1), (2, 4, 2), (3, 5, 2)] {
        let shape = DecodeShape {
            rows,
            q_heads: kv_heads * group,
            kv_heads,
            head_dim: 64,
            pages: rows * 64,
            block_size: 16,
            table_width: 64,
        };
        let (q, k, v, mut kv_lens, mut tables) = random_case(&mut rng, shape);
        // Rows long enough that two threads or more take pieces.
        kv_lens.iter_mut().for_each(|n| *n = 700 + (*n % 300));
        tables
            .iter_mut()
            .enumerate()
            .for_each(|(i, p)| *p = ((i * 13) % (rows * 64)) as i32);
        let finite = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|x| if x.is_finite() { *x } else { 0.5 })
                .collect()
        };
        let (k, v) = (finite(&k), finite(&v));
        let sinks: Vec<f32> = (0..shape.q_heads).map(|h| h as f32 * 0.1 - 0.3).collect();
        for options in [
            AttentionOptions::default(),
            AttentionOptions {
                sliding_window: Some(600),
                soft_cap: Some(4.0),
                sinks: Some(&sinks),
                table_rows: None,
            },
        ] {
            let call = |parallel: &dyn Parallel| {
                // NaN where a piece would leave an output unwritten.
                let mut out = vec![f32::NAN; q.len()];
                paged_decode_attention_with(
                    parallel, &shape, &options, &q, &k, &v, &kv_lens, &tables, &mut out,
                )
                .unwrap();
                out
            };
            let one = call(&Sequential);
            assert!(one.iter().all(|x| x.is_finite()));
            for threads in [2, 3, 4, 8] {
                let split = call(&SplitFor(threads));
                let same = split
                    .iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "rows {rows} kv_heads {kv_heads} threads {threads}");
            }
        }
    }
}
