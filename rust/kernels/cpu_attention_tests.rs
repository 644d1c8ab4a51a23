//! Unit and seeded randomized tests of the host decode-attention kernel.

use super::*;
use crate::kernels::parallel::{ScopedThreads, Sequential};
use crate::test_rng::SplitMix64 as TestRng;

/// Naive float64 attention over the row's tokens, gathered token by token.
fn naive(
    s: &DecodeShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_lens: &[i32],
    tables: &[i32],
) -> Vec<f32> {
    let (group, d, bs) = (s.q_heads / s.kv_heads, s.head_dim, s.block_size);
    let mut out = vec![0.0f32; s.rows * s.q_heads * d];
    for row in 0..s.rows {
        let n = kv_lens[row] as usize;
        for qh in 0..s.q_heads {
            let h = qh / group;
            let qv = &q[(row * s.q_heads + qh) * d..][..d];
            let at = |pool: &[f32], t: usize| -> Vec<f64> {
                let page = tables[row * s.table_width + t / bs] as usize;
                let base = ((h * s.pages + page) * bs + t % bs) * d;
                pool[base..base + d].iter().map(|&x| f64::from(x)).collect()
            };
            let scores: Vec<f64> = (0..n)
                .map(|t| {
                    at(k, t)
                        .iter()
                        .zip(qv)
                        .map(|(a, b)| a * f64::from(*b))
                        .sum()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (t, w) in weights.iter().enumerate() {
                for (i, x) in at(v, t).iter().enumerate() {
                    out[(row * s.q_heads + qh) * d + i] += (w / total * x) as f32;
                }
            }
        }
    }
    out
}

/// q, k_pages, v_pages, kv_lens, block_tables.
type Case = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i32>, Vec<i32>);

fn random_case(rng: &mut TestRng, shape: DecodeShape) -> Case {
    let s = &shape;
    let mut floats = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.below(2001) as f32 - 1000.0) / 500.0)
            .collect()
    };
    let q = floats(s.rows * s.q_heads * s.head_dim);
    let mut k = floats(s.kv_heads * s.pages * s.block_size * s.head_dim);
    let mut v = floats(s.kv_heads * s.pages * s.block_size * s.head_dim);
    let kv_lens: Vec<i32> = (0..s.rows)
        .map(|_| rng.below(s.table_width * s.block_size + 1) as i32)
        .collect();
    let tables: Vec<i32> = (0..s.rows * s.table_width)
        .map(|_| rng.below(s.pages) as i32)
        .collect();
    // Garbage in every slot no row reads.
    let mut read = vec![false; s.pages * s.block_size];
    for row in 0..s.rows {
        for t in 0..kv_lens[row] as usize {
            let page = tables[row * s.table_width + t / s.block_size] as usize;
            read[page * s.block_size + t % s.block_size] = true;
        }
    }
    for h in 0..s.kv_heads {
        for (slot, &was_read) in read.iter().enumerate() {
            if !was_read {
                let base = (h * s.pages * s.block_size + slot) * s.head_dim;
                k[base..base + s.head_dim].fill(f32::NAN);
                v[base..base + s.head_dim].fill(f32::INFINITY);
            }
        }
    }
    (q, k, v, kv_lens, tables)
}

#[test]
fn matches_naive_attention_with_garbage_in_unread_slots() {
    let mut rng = TestRng::new(7);
    for case in 0..80 {
        let group = [1, 2, 3, 4, 20][case % 5];
        let shape = DecodeShape {
            rows: 1 + rng.below(9),
            q_heads: group * (1 + rng.below(3)),
            kv_heads: 0,
            head_dim: [4, 8, 13, 64, 72, 128][rng.below(6)],
            pages: 2 + rng.below(20),
            block_size: [1, 4, 16, 32][rng.below(4)],
            table_width: 1 + rng.below(6),
        };
        let shape = DecodeShape {
            kv_heads: shape.q_heads / group,
            ..shape
        };
        let (q, k, v, kv_lens, tables) = random_case(&mut rng, shape);
        let mut out = vec![f32::NAN; q.len()];
        paged_decode_attention(
            &ScopedThreads,
            &shape,
            &q,
            &k,
            &v,
            &kv_lens,
            &tables,
            &mut out,
        )
        .unwrap();
        let want = naive(&shape, &q, &k, &v, &kv_lens, &tables);
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "case {case} [{i}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn bf16_pool_reads_as_its_f32_value() {
    let mut rng = TestRng::new(3);
    let shape = DecodeShape {
        rows: 3,
        q_heads: 6,
        kv_heads: 2,
        head_dim: 16,
        pages: 8,
        block_size: 4,
        table_width: 3,
    };
    let (q, k, v, kv_lens, tables) = random_case(&mut rng, shape);
    let to_bf16 = |x: &Vec<f32>| -> Vec<Bf16> {
        x.iter().map(|f| Bf16((f.to_bits() >> 16) as u16)).collect()
    };
    let (kb, vb) = (to_bf16(&k), to_bf16(&v));
    let truncated = |x: &Vec<Bf16>| -> Vec<f32> { x.iter().map(|b| b.to_f32()).collect() };
    let mut out = vec![0.0; q.len()];
    paged_decode_attention(
        &ScopedThreads,
        &shape,
        &q,
        &kb,
        &vb,
        &kv_lens,
        &tables,
        &mut out,
    )
    .unwrap();
    let want = naive(
        &shape,
        &q,
        &truncated(&kb),
        &truncated(&vb),
        &kv_lens,
        &tables,
    );
    for (a, b) in out.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

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
fn bad_plans_are_errors_not_reads() {
    let shape = DecodeShape {
        rows: 1,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 4,
        pages: 2,
        block_size: 2,
        table_width: 2,
    };
    let (q, pool) = (vec![0.0; 8], vec![0.0f32; 16]);
    let mut out = vec![0.0; 8];
    let run = |kv: i32, table: [i32; 2], out: &mut Vec<f32>| {
        paged_decode_attention(&ScopedThreads, &shape, &q, &pool, &pool, &[kv], &table, out)
    };
    assert!(run(5, [0, 1], &mut out).unwrap_err().contains("kv_len 5"));
    assert!(run(3, [0, 2], &mut out).unwrap_err().contains("page id 2"));
    assert!(run(-1, [0, 1], &mut out).is_err());
    // Entries past the live blocks are never read, whatever they hold.
    run(2, [1, 99], &mut out).unwrap();
    let bad_heads = DecodeShape {
        q_heads: 3,
        kv_heads: 2,
        ..shape
    };
    let err = paged_decode_attention(
        &ScopedThreads,
        &bad_heads,
        &q,
        &pool,
        &pool,
        &[1],
        &[0, 0],
        &mut out,
    );
    assert!(err.unwrap_err().contains("multiple"));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_exp_is_within_two_ulp_of_exp() {
    use std::arch::x86_64::*;
    if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
        return;
    }
    let mut x = -87.0f32;
    while x <= 0.0 {
        let lanes: [f32; 8] = std::array::from_fn(|i| x + i as f32 * 1e-3);
        let mut got = [0.0f32; 8];
        // SAFETY: the CPU reports AVX2 and FMA.
        unsafe {
            let v = crate::kernels::cpu_attention_avx2::exp256(_mm256_loadu_ps(lanes.as_ptr()));
            _mm256_storeu_ps(got.as_mut_ptr(), v);
        }
        for (l, g) in lanes.iter().zip(got) {
            let want = f64::from(*l).exp();
            let ulp = f64::from(f32::EPSILON) * want;
            assert!(
                (f64::from(g) - want).abs() <= 2.0 * ulp,
                "exp({l}) = {g}, want {want}"
            );
        }
        x += 0.0137;
    }
}
