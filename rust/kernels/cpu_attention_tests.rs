//! Unit and seeded randomized tests of the host decode-attention kernel.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

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
    let plain = AttentionOptions::default();
    naive_with(s, &plain, q, k, v, kv_lens, tables)
}

/// [`naive`] with the options, from their definitions: the query at `n - 1` sees
/// tokens `t > n - 1 - window`; scores are capped by `cap * tanh(x / cap)`; the sink
/// is one more logit in the softmax whose column is dropped.
fn naive_with(
    s: &DecodeShape,
    options: &AttentionOptions,
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
        let first = match options.sliding_window {
            Some(w) => (0..n)
                .find(|&t| t as i64 > n as i64 - 1 - w as i64)
                .unwrap_or(n),
            None => 0,
        };
        for qh in 0..s.q_heads {
            let h = qh / group;
            let qv = &q[(row * s.q_heads + qh) * d..][..d];
            let at = |pool: &[f32], t: usize| -> Vec<f64> {
                let page = tables[row * s.table_width + t / bs] as usize;
                let base = ((h * s.pages + page) * bs + t % bs) * d;
                pool[base..base + d].iter().map(|&x| f64::from(x)).collect()
            };
            let scores: Vec<f64> = (first..n)
                .map(|t| {
                    let x: f64 = at(k, t)
                        .iter()
                        .zip(qv)
                        .map(|(a, b)| a * f64::from(*b))
                        .sum();
                    match options.soft_cap {
                        Some(cap) => f64::from(cap) * (x / f64::from(cap)).tanh(),
                        None => x,
                    }
                })
                .collect();
            let sink = options.sinks.map(|sinks| f64::from(sinks[qh]));
            let max = scores
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = weights.iter().sum::<f64>() + sink.map_or(0.0, |x| (x - max).exp());
            for (t, w) in (first..n).zip(&weights) {
                for (i, x) in at(v, t).iter().enumerate() {
                    out[(row * s.q_heads + qh) * d + i] += (w / total * x) as f32;
                }
            }
        }
    }
    out
}

/// q, k_pages, v_pages, kv_lens, block_tables.
pub(super) type Case = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i32>, Vec<i32>);

pub(super) fn random_case(rng: &mut TestRng, shape: DecodeShape) -> Case {
    random_case_windowed(rng, shape, None)
}

/// A random case whose every slot no row's window reads holds garbage (NaN keys,
/// infinite values), and whose table entries before each row's window hold page ids
/// outside the pool.
fn random_case_windowed(rng: &mut TestRng, shape: DecodeShape, window: Option<usize>) -> Case {
    let s = &shape;
    let options = AttentionOptions {
        sliding_window: window,
        ..AttentionOptions::default()
    };
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
    let mut tables: Vec<i32> = (0..s.rows * s.table_width)
        .map(|_| rng.below(s.pages) as i32)
        .collect();
    // Garbage in every slot no row reads.
    let mut read = vec![false; s.pages * s.block_size];
    for row in 0..s.rows {
        let start = options.window_start(kv_lens[row] as usize);
        for t in start..kv_lens[row] as usize {
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
    // Blocks wholly before the window may have been freed: any id, even a bad one.
    for row in 0..s.rows {
        let first = options.window_start(kv_lens[row] as usize) / s.block_size;
        for (b, entry) in tables[row * s.table_width..][..first]
            .iter_mut()
            .enumerate()
        {
            *entry = [-1, s.pages as i32, i32::MAX][b % 3];
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

fn to_bf16(x: f32) -> Bf16 {
    Bf16((x.to_bits() >> 16) as u16)
}

/// The kernel over a pool of `T` equals naive attention over the pool's f32 values,
/// for random shapes reaching both the AVX2 kernel and the generic loop.
fn narrow_pool_reads_as_its_f32_value<T: KvElement>(narrow: fn(f32) -> T, seed: u64) {
    let mut rng = TestRng::new(seed);
    for case in 0..30 {
        let group = [1, 3, 20][case % 3];
        let q_heads = group * (1 + rng.below(2));
        let shape = DecodeShape {
            rows: 1 + rng.below(5),
            q_heads,
            kv_heads: q_heads / group,
            head_dim: [13, 16, 64][rng.below(3)],
            pages: 2 + rng.below(12),
            block_size: [1, 4, 16][rng.below(3)],
            table_width: 1 + rng.below(5),
        };
        let (q, k, v, kv_lens, tables) = random_case(&mut rng, shape);
        // Unread slots hold NaN / inf garbage: keep it, narrowed to the pool's type.
        let pool = |x: &[f32]| -> Vec<T> {
            x.iter()
                .map(|&f| {
                    if f.is_finite() {
                        narrow(f)
                    } else {
                        narrow(1.0)
                    }
                })
                .collect()
        };
        let (kn, vn) = (pool(&k), pool(&v));
        let wide = |x: &[T]| -> Vec<f32> { x.iter().map(|e| e.to_f32()).collect() };
        let mut out = vec![f32::NAN; q.len()];
        paged_decode_attention(
            &ScopedThreads,
            &shape,
            &q,
            &kn,
            &vn,
            &kv_lens,
            &tables,
            &mut out,
        )
        .unwrap();
        let want = naive(&shape, &q, &wide(&kn), &wide(&vn), &kv_lens, &tables);
        for (a, b) in out.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "case {case}: {a} vs {b}"
            );
        }
        // And bit for bit the kernel over the same values stored as f32: widening
        // (per query head or once per block for the group) is exact.
        let mut from_f32 = vec![f32::NAN; q.len()];
        let (kw, vw) = (wide(&kn), wide(&vn));
        paged_decode_attention(
            &ScopedThreads,
            &shape,
            &q,
            &kw,
            &vw,
            &kv_lens,
            &tables,
            &mut from_f32,
        )
        .unwrap();
        let same = out
            .iter()
            .zip(&from_f32)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "case {case}: {shape:?}");
    }
}

#[test]
fn bf16_pool_reads_as_its_f32_value() {
    narrow_pool_reads_as_its_f32_value(to_bf16, 3);
}

#[test]
fn f16_pool_reads_as_its_f32_value() {
    narrow_pool_reads_as_its_f32_value(F16::from_f32, 5);
}

#[test]
fn f16_widens_exactly() {
    let known = [
        (0x3c00, 1.0),
        (0xc000, -2.0),
        (0x7bff, 65504.0),
        (0x0400, 6.103_515_6e-5),
        (0x0001, 5.960_464_5e-8), // smallest subnormal, 2^-24
        (0x03ff, 6.097_555e-5),   // largest subnormal
        (0x8000, -0.0),
        (0x7c00, f32::INFINITY),
        (0xfc00, f32::NEG_INFINITY),
    ];
    for (bits, want) in known {
        let got = F16(bits).to_f32();
        assert_eq!(got.to_bits(), f32::to_bits(want), "{bits:#06x}: {got}");
    }
    assert!(F16(0x7e00).to_f32().is_nan());
    // Every bit pattern against the CPU's own conversion, where it has one.
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("f16c") {
        for bits in 0..=u16::MAX {
            // SAFETY: the CPU reports F16C.
            let hardware = unsafe { f16c_widen(bits) };
            let software = F16(bits).to_f32();
            assert_eq!(software.to_bits(), hardware.to_bits(), "{bits:#06x}");
        }
    }
}

#[test]
fn f16_narrows_to_nearest_even_as_f16c_does() {
    let known = [
        (1.0, 0x3c00),
        (65504.0, 0x7bff),
        (65519.0, 0x7bff),
        (65520.0, 0x7c00),
        (-1e9, 0xfc00),
        (5.960_464_5e-8, 0x0001),
        (2.980_232_2e-8, 0x0000),     // 2^-25: a tie, to the even 0
        (1.0 + 1.0 / 2048.0, 0x3c00), // a tie between 1 and its successor: even
        (1.0 + 3.0 / 2048.0, 0x3c02),
        (-0.0, 0x8000),
    ];
    for (x, want) in known {
        assert_eq!(F16::from_f32(x).0, want, "{x}");
    }
    assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("f16c") {
        let mut rng = TestRng::new(17);
        // Every tie between two normal f16s, then between two subnormal ones.
        let normal_ties = (0x0400..0x7c00u32).map(|h| ((h + (112 << 10)) << 13) + 0x1000);
        let subnormal_ties = (0..0x400u32).map(|m| ((2 * m + 1) as f32 * 2f32.powi(-25)).to_bits());
        let random = (0..1 << 20).map(|_| rng.next_u64() as u32);
        for bits in normal_ties.chain(subnormal_ties).chain(random) {
            let x = f32::from_bits(bits);
            // SAFETY: the CPU reports F16C.
            let hardware = unsafe { f16c_narrow(x) };
            assert_eq!(F16::from_f32(x).0, hardware, "{bits:#010x}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
unsafe fn f16c_narrow(x: f32) -> u16 {
    _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set1_ps(x))) as u16
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
unsafe fn f16c_widen(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
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

#[test]
fn options_match_naive_attention_and_skip_blocks_outside_the_window() {
    let mut rng = TestRng::new(23);
    for case in 0..120 {
        let group = [1, 2, 3, 4, 20][case % 5];
        let q_heads = group * (1 + rng.below(3));
        let shape = DecodeShape {
            rows: 1 + rng.below(9),
            q_heads,
            kv_heads: q_heads / group,
            // 13: the generic loop; 72 and 300: the AVX2 kernel and the slow loop.
            head_dim: [4, 8, 13, 64, 72, 300][rng.below(6)],
            pages: 2 + rng.below(20),
            block_size: [1, 4, 16, 32][rng.below(4)],
            table_width: 1 + rng.below(6),
        };
        let window = [None, Some(1), Some(5), Some(17), Some(1000)][case % 5];
        let (q, k, v, kv_lens, tables) = random_case_windowed(&mut rng, shape, window);
        let sinks: Vec<f32> = (0..q_heads)
            .map(|_| (rng.below(2001) as f32 - 1000.0) / 250.0)
            .collect();
        let options = AttentionOptions {
            sliding_window: window,
            soft_cap: [None, Some(0.7), Some(3.0)][case % 3],
            sinks: (case % 4 != 0).then_some(&sinks[..]),
            table_rows: None,
        };
        let mut out = vec![f32::NAN; q.len()];
        paged_decode_attention_with(
            &ScopedThreads,
            &shape,
            &options,
            &q,
            &k,
            &v,
            &kv_lens,
            &tables,
            &mut out,
        )
        .unwrap();
        let want = naive_with(&shape, &options, &q, &k, &v, &kv_lens, &tables);
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "case {case} ({options:?}, {shape:?}) [{i}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn window_skip_reads_no_block_before_the_window() {
    // One row of 4 blocks of 4, window 6: the query at 13 sees 8..=13, blocks 2 and 3.
    let shape = DecodeShape {
        rows: 1,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 8,
        pages: 4,
        block_size: 4,
        table_width: 4,
    };
    let q: Vec<f32> = (0..16).map(|i| i as f32 / 16.0).collect();
    let mut k: Vec<f32> = (0..128).map(|i| ((i * 7) % 11) as f32 / 11.0).collect();
    let mut v: Vec<f32> = (0..128).map(|i| ((i * 5) % 13) as f32 / 13.0).collect();
    let run = |k: &[f32], v: &[f32], table: [i32; 4], window: usize| {
        let options = AttentionOptions {
            sliding_window: Some(window),
            ..AttentionOptions::default()
        };
        let mut out = vec![0.0; 16];
        paged_decode_attention_with(
            &Sequential,
            &shape,
            &options,
            &q,
            k,
            v,
            &[14],
            &table,
            &mut out,
        )
        .map(|()| out)
    };
    let want = run(&k, &v, [0, 1, 2, 3], 6).unwrap();
    // Pages 0 and 1 freed: NaN in them, and their entries pointing anywhere.
    k[..64].fill(f32::NAN);
    v[..64].fill(f32::NAN);
    assert_eq!(run(&k, &v, [-7, 99, 2, 3], 6).unwrap(), want);
    // The window's first block is read from its first visible slot: NaN below it in
    // that block (slots 8 and 9 are visible for window 6, 10..=13 for window 4).
    k[64..64 + 2 * 8].fill(f32::NAN);
    v[64..64 + 2 * 8].fill(f32::NAN);
    let narrow = run(&k, &v, [-7, 99, 2, 3], 4).unwrap();
    assert!(narrow.iter().all(|x| x.is_finite()));
    // An id inside the window is still checked.
    assert!(run(&k, &v, [0, 1, 99, 3], 6)
        .unwrap_err()
        .contains("page id 99"));
}

#[test]
fn sink_of_minus_infinity_is_no_sink_and_options_are_checked() {
    let mut rng = TestRng::new(31);
    let shape = DecodeShape {
        rows: 3,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        pages: 12,
        block_size: 4,
        table_width: 4,
    };
    let (q, k, v, kv_lens, tables) = random_case(&mut rng, shape);
    let mut plain = vec![0.0; q.len()];
    paged_decode_attention(
        &Sequential,
        &shape,
        &q,
        &k,
        &v,
        &kv_lens,
        &tables,
        &mut plain,
    )
    .unwrap();
    let no_sinks = [f32::NEG_INFINITY; 4];
    let run = |options: AttentionOptions, out: &mut Vec<f32>| {
        paged_decode_attention_with(
            &Sequential,
            &shape,
            &options,
            &q,
            &k,
            &v,
            &kv_lens,
            &tables,
            out,
        )
    };
    let mut out = vec![0.0; q.len()];
    let sinks_off = AttentionOptions {
        sinks: Some(&no_sinks),
        ..AttentionOptions::default()
    };
    run(sinks_off, &mut out).unwrap();
    assert_eq!(out, plain);
    let errors = [
        (
            AttentionOptions {
                sliding_window: Some(0),
                ..sinks_off
            },
            "sliding_window",
        ),
        (
            AttentionOptions {
                soft_cap: Some(0.0),
                ..sinks_off
            },
            "soft_cap",
        ),
        (
            AttentionOptions {
                soft_cap: Some(f32::NAN),
                ..sinks_off
            },
            "soft_cap",
        ),
        (
            AttentionOptions {
                sinks: Some(&no_sinks[..3]),
                ..sinks_off
            },
            "sinks",
        ),
    ];
    for (options, what) in errors {
        assert!(run(options, &mut out).unwrap_err().contains(what), "{what}");
    }
}

/// Query rows that name their table row (`table_rows`) give, bit for bit, what the
/// same rows give with each one's table copied out; a bad table row is an error.
#[test]
fn table_rows_equal_copied_tables_and_are_checked() {
    let mut rng = TestRng::new(11);
    for case in 0..40 {
        let sequences = 1 + rng.below(4);
        let shape = DecodeShape {
            rows: 1 + rng.below(12),
            q_heads: 4,
            kv_heads: 2,
            head_dim: [8, 64][case % 2],
            pages: 4 + rng.below(12),
            block_size: [4, 16][rng.below(2)],
            table_width: 1 + rng.below(5),
        };
        let tables: Vec<i32> = (0..sequences * shape.table_width)
            .map(|_| rng.below(shape.pages) as i32)
            .collect();
        let rows: Vec<i32> = (0..shape.rows)
            .map(|_| rng.below(sequences) as i32)
            .collect();
        let copied: Vec<i32> = rows
            .iter()
            .flat_map(|&r| tables[r as usize * shape.table_width..][..shape.table_width].to_vec())
            .collect();
        let (q, mut k, mut v, kv_lens, _) = random_case(&mut rng, shape);
        // Its garbage marks slots of its own tables; these tables read others.
        for x in k.iter_mut().chain(v.iter_mut()).filter(|x| !x.is_finite()) {
            *x = 0.25;
        }
        let run = |options: &AttentionOptions, tables: &[i32]| {
            let mut out = vec![f32::NAN; q.len()];
            paged_decode_attention_with(
                &ScopedThreads,
                &shape,
                options,
                &q,
                &k,
                &v,
                &kv_lens,
                tables,
                &mut out,
            )
            .map(|()| out)
        };
        let shared = AttentionOptions {
            table_rows: Some(&rows),
            ..AttentionOptions::default()
        };
        let want = run(&AttentionOptions::default(), &copied).unwrap();
        assert_eq!(run(&shared, &tables).unwrap(), want, "case {case}");
        let mut bad = rows.clone();
        bad[0] = sequences as i32;
        let out_of_range = AttentionOptions {
            table_rows: Some(&bad),
            ..AttentionOptions::default()
        };
        assert!(run(&out_of_range, &tables)
            .unwrap_err()
            .contains("table row"));
        let short = AttentionOptions {
            table_rows: Some(&rows[1..]),
            ..AttentionOptions::default()
        };
        assert!(run(&short, &tables).unwrap_err().contains("table_rows"));
    }
}
