//! The AVX2 + FMA kernel of [`super::cpu_attention`]: one KV head's query group
//! over one row's live blocks, for pools whose `head_dim` is a multiple of 8. Pool
//! elements (f32, f16, bf16) are widened to f32 eight at a time as they are loaded
//! ([`KvElement::load8`]); every sum is in f32.
//!
//! Per block: the group's scores eight tokens at a time (eight accumulators, one
//! per token, reduced together), a vectorized `exp` for the block's softmax
//! weights, then the values into accumulators held in registers, 64 lanes of
//! the head at a time. f32 K/V rows are read in place from the pool; f16 and
//! bf16 rows of a block are widened once into a small f32 buffer that every
//! query head of the group then reads (each query head widened them itself
//! before), and the next block's K and V are asked of the cache while this
//! one is computed (its page is anywhere in the pool, so the hardware
//! prefetcher cannot guess it). Both together took decode attention from 8.8 %
//! to 5.8 % of a 32-request step of `kvpage bench moe`'s model (prefetch alone
//! 6.6 %, widening alone 8.3 %; 2026-11-28, benches/RESULTS.md).
//!
//! Invariants (the caller's, checked by [`super::cpu_attention::validate`] and the
//! dispatch in `cpu_attention.rs`): every page in `table` is inside `keys` and
//! `values`; `group <= MAX_GROUP`, `block_size <= MAX_BLOCK`, `head_dim % 8 == 0`.
//! Only slots `< kv_len` are read, so garbage past them never reaches a sum; with a
//! sliding window only slots `>= opts.start` too, from the table entry of block
//! `opts.start / block_size` on (earlier entries are not read).

use std::arch::x86_64::*;

use super::head_options::{finish, soft_cap, HeadOptions};
use super::kv_element::{KvElement, MAX_BLOCK, MAX_GROUP};

/// One KV head's pages and the shape of the query group that reads them.
pub(super) struct HeadPages<'a, E> {
    /// This head's keys, `[pages, block_size, head_dim]`.
    pub keys: &'a [E],
    /// This head's values, same layout.
    pub values: &'a [E],
    pub group: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// `out[g] = softmax(q[g] · K) · V` over the row's tokens `opts.start..kv_len`, for
/// the `group` query heads of this KV head (`q`, `out`: `[group, head_dim]`), with
/// `opts`' soft cap and sinks. `OPTIONS = false` (a call without options) ignores
/// `opts`, so every option check folds away and the plain loop is what runs.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C, and the module invariants hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_attention<E: KvElement, const OPTIONS: bool>(
    pages: &HeadPages<E>,
    table: &[i32],
    kv_len: usize,
    opts: &HeadOptions,
    q: &[f32],
    out: &mut [f32],
) {
    let (group, d, bs) = (pages.group, pages.head_dim, pages.block_size);
    debug_assert!(group <= MAX_GROUP && bs <= MAX_BLOCK && d % 8 == 0);
    debug_assert!(q.len() == group * d && out.len() == group * d);
    debug_assert!(
        table.len() == kv_len.div_ceil(bs),
        "the row's live blocks only"
    );
    let (start, cap) = if OPTIONS {
        (opts.start, opts.soft_cap)
    } else {
        (0, None)
    };
    out.fill(0.0);
    // f16 / bf16 rows widened once per block for the whole group (the widening is
    // exact, so each sum is the same as reading the pool per query head).
    let widen = group > 1 && std::mem::size_of::<E>() != std::mem::size_of::<f32>();
    let mut wide = if widen {
        vec![0.0f32; 2 * bs * d]
    } else {
        Vec::new()
    };
    let mut scores = Scores {
        weights: [0.0f32; MAX_BLOCK + 8],
        maxes: [f32::NEG_INFINITY; MAX_GROUP],
        sums: [0.0f32; MAX_GROUP],
        group,
        d,
        cap,
    };
    let first_block = start / bs;
    for (i, &page) in table[first_block..].iter().enumerate() {
        let b = first_block + i;
        // Slots `first..end` of this block: past the window's start, before kv_len.
        let first = start.saturating_sub(b * bs);
        let end = (kv_len - b * bs).min(bs);
        let live = end - first;
        let offset = (page as usize * bs + first) * d;
        let keys = &pages.keys[offset..][..live * d];
        let values = &pages.values[offset..][..live * d];
        // The next block's page is anywhere in the pool: ask for it now (`table`
        // holds the row's live blocks only).
        if let Some(&next) = table[first_block..].get(i + 1) {
            let at = next as usize * bs * d;
            let bytes = (kv_len - (b + 1) * bs).min(bs) * d * std::mem::size_of::<E>();
            prefetch(pages.keys[at..].as_ptr().cast(), bytes);
            prefetch(pages.values[at..].as_ptr().cast(), bytes);
        }
        if widen {
            let (wide_keys, wide_values) = wide.split_at_mut(bs * d);
            widen_into(keys, &mut wide_keys[..live * d]);
            widen_into(values, &mut wide_values[..live * d]);
            scores.block(q, wide_keys.as_ptr(), wide_values.as_ptr(), live, out);
        } else {
            scores.block(q, keys.as_ptr(), values.as_ptr(), live, out);
        }
    }
    let (maxes, sums) = (scores.maxes, scores.sums);
    for g in 0..group {
        let sink = if OPTIONS { opts.sink(g) } else { None };
        finish(&mut out[g * d..][..d], maxes[g], sums[g], sink);
    }
}

/// The online softmax of one KV head's query group across blocks.
struct Scores {
    /// One block's weights per query head, padded with -inf to a multiple of 8.
    weights: [f32; MAX_BLOCK + 8],
    maxes: [f32; MAX_GROUP],
    sums: [f32; MAX_GROUP],
    group: usize,
    d: usize,
    cap: Option<f32>,
}

impl Scores {
    /// One block's `live` keys and values (rows of `d`) into `out`, each query head
    /// of the group in turn.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<T: KvElement>(
        &mut self,
        q: &[f32],
        keys: *const T,
        values: *const T,
        live: usize,
        out: &mut [f32],
    ) {
        let d = self.d;
        let padded = live.next_multiple_of(8);
        for g in 0..self.group {
            let qg = q.as_ptr().add(g * d);
            let w = self.weights.as_mut_ptr();
            let mut t = 0;
            while t + 8 <= live {
                _mm256_storeu_ps(w.add(t), dot8(qg, keys.add(t * d), d));
                t += 8;
            }
            while t < live {
                *w.add(t) = dot1(qg, keys.add(t * d), d);
                t += 1;
            }
            if let Some(cap) = self.cap {
                soft_cap(&mut self.weights[..live], cap);
            }
            self.weights[live..padded].fill(f32::NEG_INFINITY);
            // Online softmax: rescale what the earlier blocks summed.
            let block_max = max_of(w, padded);
            let new_max = self.maxes[g].max(block_max);
            let alpha = (self.maxes[g] - new_max).exp(); // 0 on the first block
            self.maxes[g] = new_max;
            self.sums[g] = self.sums[g] * alpha + exp_in_place(w, padded, new_max);
            let acc = out.as_mut_ptr().add(g * d);
            let mut lane = 0;
            while lane < d {
                let (acc, values) = (acc.add(lane), values.add(lane));
                macro_rules! by_width {
                    ($($n:literal),*) => {
                        match (d - lane).min(64) / 8 {
                            $($n => accumulate::<T, $n>(acc, alpha, w, values, live, d),)*
                            _ => unreachable!("1..=8 registers of lanes"),
                        }
                    };
                }
                by_width!(1, 2, 3, 4, 5, 6, 7, 8);
                lane += 64;
            }
        }
    }
}

/// Ask the cache for the `bytes` at `at`, a line at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch(at: *const i8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(at.add(line));
    }
}

/// `dst[i] = src[i]` as f32, eight at a time (`src.len()` a multiple of 8: whole
/// rows of a `head_dim` that is).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_into<E: KvElement>(src: &[E], dst: &mut [f32]) {
    debug_assert!(src.len() == dst.len() && src.len().is_multiple_of(8));
    for c in (0..src.len()).step_by(8) {
        _mm256_storeu_ps(dst.as_mut_ptr().add(c), E::load8(src.as_ptr().add(c)));
    }
}

/// `q · k[t]` for eight consecutive tokens `t` (rows of `d` floats from `keys`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot8<E: KvElement>(q: *const f32, keys: *const E, d: usize) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < d {
        let qv = _mm256_loadu_ps(q.add(i));
        for (t, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(qv, E::load8(keys.add(t * d + i)), *a);
        }
        i += 8;
    }
    // Pairwise sums within 128-bit lanes, then the two lanes added: token t's
    // total lands in lane t.
    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let low = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
    let high = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
    _mm256_add_ps(low, high)
}

/// `q · key` for one token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot1<E: KvElement>(q: *const f32, key: *const E, d: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < d {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i)), E::load8(key.add(i)), acc);
        i += 8;
    }
    sum_of(acc)
}

/// The largest of `w[..n]` (`n` a multiple of 8).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_of(w: *const f32, n: usize) -> f32 {
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in (0..n).step_by(8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(w.add(c)));
    }
    let halves = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_max_ps(pairs, _mm_movehdup_ps(pairs)))
}

/// `w[i] = exp(w[i] - max)` for `i < n` (a multiple of 8; -inf gives 0); returns
/// their sum.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_in_place(w: *mut f32, n: usize, max: f32) -> f32 {
    let shift = _mm256_set1_ps(max);
    let mut total = _mm256_setzero_ps();
    for c in (0..n).step_by(8) {
        let x = _mm256_sub_ps(_mm256_loadu_ps(w.add(c)), shift);
        let live = _mm256_cmp_ps::<_CMP_NEQ_OQ>(x, _mm256_set1_ps(f32::NEG_INFINITY));
        let p = _mm256_and_ps(exp256(x), live);
        _mm256_storeu_ps(w.add(c), p);
        total = _mm256_add_ps(total, p);
    }
    sum_of(total)
}

/// `acc[..8 * N] = acc * alpha + Σ_t w[t] · values[t][..8 * N]`, the `N`
/// accumulators in registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate<E: KvElement, const N: usize>(
    acc: *mut f32,
    alpha: f32,
    w: *const f32,
    values: *const E,
    live: usize,
    d: usize,
) {
    let scale = _mm256_set1_ps(alpha);
    let mut regs = [_mm256_setzero_ps(); N];
    for (i, r) in regs.iter_mut().enumerate() {
        *r = _mm256_mul_ps(_mm256_loadu_ps(acc.add(8 * i)), scale);
    }
    for t in 0..live {
        let p = _mm256_broadcast_ss(&*w.add(t));
        let row = values.add(t * d);
        for (i, r) in regs.iter_mut().enumerate() {
            *r = _mm256_fmadd_ps(p, E::load8(row.add(8 * i)), *r);
        }
    }
    for (i, r) in regs.iter().enumerate() {
        _mm256_storeu_ps(acc.add(8 * i), *r);
    }
}

/// The sum of the eight lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_of(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// `exp(x)` in eight lanes (Cephes' `expf`: `x = n ln 2 + r`, a degree-5
/// polynomial for `e^r`, `2^n` from the exponent bits), within 2 ulp over the
/// inputs softmax gives it (`x <= 0`); inputs below -87.3 give ~0.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.376_26));
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.336_55));
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    // r = x - n ln 2, with ln 2 split in two for precision.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
}
