//! Paged decode attention on the host CPU: one query token per row, K/V read
//! straight from the paged pool.
//!
//! Owns [`paged_decode_attention`], the math behind the `xla` backend's decode
//! rows on CPU (XLA calls it through [`crate::kernels::xla_ffi`]). XLA:CPU gathers paged
//! blocks at ~5 GB/s, so decode attention over long contexts cost more than
//! every matmul of the step; this reads each live block once, in place. On
//! AVX2 + FMA + F16C CPUs, pools of any element with `head_dim % 8 == 0` go through
//! `cpu_attention_avx2.rs` (each element type widened to f32 in registers); other
//! CPUs and shapes through the generic loop here (same math, same order of blocks).
//!
//! Layout (the pool layout of every backend):
//! - `q`: `[rows, q_heads, head_dim]` f32, already multiplied by the softmax scale;
//! - `k_pages`, `v_pages`: `[kv_heads, pages, block_size, head_dim]`, f32, f16 or bf16;
//! - `kv_lens`: `[rows]`, the tokens of each row's context (0: row not computed);
//! - `block_tables`: `[rows, table_width]` page ids (or `[n, table_width]` with
//!   `AttentionOptions::table_rows` naming each row's table row);
//! - `out`: `[rows, q_heads, head_dim]` f32. Query head `h * group + g` reads KV
//!   head `h` (`group = q_heads / kv_heads`).
//!
//! Invariants (checked before any read, so a bad plan is an error, never an
//! out-of-bounds read):
//! - `q_heads % kv_heads == 0`, every buffer has the size its shape says;
//! - `0 <= kv_len <= table_width * block_size` for every row;
//! - every page id a row reads (`block_tables[s, first..ceil(kv_len / block_size)]`,
//!   `first` 0 or, with a sliding window, its first block) is `< pages`; entries past
//!   a row's live blocks or before its window are never read, and neither are slots
//!   at or past `kv_len` (they may hold garbage) or before the window.
//!
//! A row with `kv_len == 0` gets zeros. Work is split across threads by visible
//! context length: whole rows, or where a call has fewer rows than threads (one
//! long sequence decoding) each row's KV heads in contiguous ranges, so a lone
//! row's context is read by every thread instead of one. Each KV head's result
//! is computed the same way whatever the split, so no output depends on it.
//!
//! Options ([`AttentionOptions`], the contract of `python/kvpage/kernels/xla/reference.py`;
//! the default is none of them, and then the loops are the plain ones):
//! - `sliding_window = w >= 1`: the row's query (position `kv_len - 1`) sees positions
//!   `>= window_start = kv_len.saturating_sub(w)` only. The block loop starts at block
//!   `window_start / block_size`: table entries before it are neither validated nor
//!   read (the scheduler may free those blocks and leave any id there), and slots of
//!   the first block below `window_start` are not read either;
//! - `soft_cap = c > 0`: each score becomes `c * tanh(score / c)` (scores already carry
//!   the softmax scale, since `q` does);
//! - `sinks`: `[q_heads]` logits, each joining its head's softmax denominator once,
//!   when the row is finished: `out = Σ e^s v / (Σ e^s + e^sink)`.

use std::ops::Range;
use std::sync::{Mutex, OnceLock};

#[cfg(target_arch = "x86_64")]
use crate::kernels::cpu_attention_avx2::{group_attention, HeadPages};
use crate::kernels::head_options::{finish, soft_cap, HeadOptions};
pub use crate::kernels::kv_element::{Bf16, KvElement, F16};
use crate::kernels::kv_element::{MAX_BLOCK, MAX_GROUP, MAX_HEAD_DIM};
use crate::kernels::parallel::Parallel;

pub use crate::kernels::cpu_attention_checks::{validate, validate_with};

/// Shapes of one call (see the module docs for the layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub rows: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub pages: usize,
    pub block_size: usize,
    pub table_width: usize,
}

/// Optional attention features of one call (module docs); `Default` is none of them.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionOptions<'a> {
    /// Tokens the query sees, itself included (`>= 1`).
    pub sliding_window: Option<usize>,
    /// Scores become `cap * tanh(score / cap)` (`cap > 0`).
    pub soft_cap: Option<f32>,
    /// One logit per query head that joins the softmax denominator, `[q_heads]`.
    pub sinks: Option<&'a [f32]>,
    /// `[rows]`: the row of `block_tables` each query row reads, so that the
    /// query tokens of one sequence (a prompt chunk, a speculative verification)
    /// share its table row; `None`: row `r` reads table row `r`. Not an attention
    /// feature: it changes no math.
    pub table_rows: Option<&'a [i32]>,
}

impl AttentionOptions<'_> {
    /// Whether any option is set (else the kernels run their plain loops).
    pub fn any(&self) -> bool {
        self.sliding_window.is_some() || self.soft_cap.is_some() || self.sinks.is_some()
    }

    /// The row of `block_tables` query row `row` reads.
    pub fn table_row(&self, row: usize) -> usize {
        self.table_rows.map_or(row, |rows| rows[row] as usize)
    }

    /// First position the query of a row of `kv_len` tokens sees.
    pub fn window_start(&self, kv_len: usize) -> usize {
        self.sliding_window
            .map_or(0, |window| kv_len.saturating_sub(window))
    }
}

impl DecodeShape {
    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    pub(super) fn blocks_of(&self, kv_len: usize) -> usize {
        kv_len.div_ceil(self.block_size)
    }
}

/// Context tokens times KV heads (the K/V rows a call reads) per thread added;
/// below it a call runs on the calling thread only. A hand-off to XLA's pool
/// costs a few us; splitting from 128 (64 KiB of f32 K and V at head_dim 64)
/// rather than 512 tokens per thread took in-process decode of SmolLM2 Q4_1
/// from 212 to 221 tok/s at one request and 375 to 425 at four, and of `kvpage
/// bench moe`'s model from ~535 to ~580 at one (2026-11-28, benches/RESULTS.md).
const MIN_ROWS_READ_PER_THREAD: usize = 128;

/// Decode attention for every row (module docs: layout and invariants), rows
/// split over `parallel` (XLA's pool under XLA, [`crate::kernels::parallel::ScopedThreads`]
/// elsewhere).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<T: KvElement>(
    parallel: &dyn Parallel,
    shape: &DecodeShape,
    q: &[f32],
    k_pages: &[T],
    v_pages: &[T],
    kv_lens: &[i32],
    block_tables: &[i32],
    out: &mut [f32],
) -> Result<(), String> {
    let plain = AttentionOptions::default();
    paged_decode_attention_with(
        parallel,
        shape,
        &plain,
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        out,
    )
}

/// [`paged_decode_attention`] with a sliding window, soft-capping or sinks
/// (module docs).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_with<T: KvElement>(
    parallel: &dyn Parallel,
    shape: &DecodeShape,
    options: &AttentionOptions,
    q: &[f32],
    k_pages: &[T],
    v_pages: &[T],
    kv_lens: &[i32],
    block_tables: &[i32],
    out: &mut [f32],
) -> Result<(), String> {
    validate_with(
        shape,
        options,
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        out,
    )?;
    let row_len = shape.q_heads * shape.head_dim;
    if row_len == 0 || shape.rows == 0 {
        return Ok(());
    }
    // Tokens each row reads: its window's, not its whole context.
    let visible = |row: usize| {
        let kv_len = kv_lens[row] as usize;
        kv_len - options.window_start(kv_len)
    };
    let total_read: usize = (0..shape.rows).map(visible).sum::<usize>() * shape.kv_heads;
    let threads = parallel
        .threads()
        .min(shape.rows * shape.kv_heads)
        .min(total_read / MIN_ROWS_READ_PER_THREAD)
        .max(1);
    let pools = Pools {
        shape: *shape,
        options: *options,
        k_pages,
        v_pages,
    };
    let all_heads = 0..shape.kv_heads;
    if threads == 1 {
        for (row, dst) in out.chunks_mut(row_len).enumerate() {
            let q_row = &q[row * row_len..][..row_len];
            pools.row(row, all_heads.clone(), q_row, kv_lens, block_tables, dst);
        }
        return Ok(());
    }
    // Pieces: whole rows, or each row's KV heads in up to `threads / rows`
    // contiguous ranges. Longest first, each to the least loaded share.
    let ranges = threads.div_ceil(shape.rows).min(shape.kv_heads);
    let head_len = shape.group() * shape.head_dim;
    let mut pieces: Vec<Piece> = Vec::with_capacity(shape.rows * ranges);
    for (row, mut dst) in out.chunks_mut(row_len).enumerate() {
        let mut start = 0;
        for r in 0..ranges {
            let end = shape.kv_heads * (r + 1) / ranges;
            let (part, rest) = dst.split_at_mut((end - start) * head_len);
            pieces.push((row, start..end, part));
            (dst, start) = (rest, end);
        }
    }
    pieces.sort_by_key(|(row, heads, _)| std::cmp::Reverse(visible(*row) * heads.len()));
    let mut shares: Vec<(usize, Vec<Piece>)> = (0..threads).map(|_| (0, Vec::new())).collect();
    for piece in pieces {
        let lightest = shares
            .iter_mut()
            .min_by_key(|(load, _)| *load)
            .expect("at least one thread");
        lightest.0 += (visible(piece.0) + 1) * piece.1.len();
        lightest.1.push(piece);
    }
    let shares: Vec<Mutex<Vec<Piece>>> = shares
        .into_iter()
        .map(|(_, share)| Mutex::new(share))
        .collect();
    let pools = &pools;
    parallel.run(threads, &|unit| {
        let share = std::mem::take(&mut *shares[unit].lock().unwrap_or_else(|e| e.into_inner()));
        for (row, heads, dst) in share {
            let q_row = &q[row * row_len..][..row_len];
            pools.row(row, heads, q_row, kv_lens, block_tables, dst);
        }
    })
}

/// A row, a range of its KV heads, and the output of those heads' query heads.
type Piece<'o> = (usize, Range<usize>, &'o mut [f32]);

struct Pools<'a, T> {
    shape: DecodeShape,
    options: AttentionOptions<'a>,
    k_pages: &'a [T],
    v_pages: &'a [T],
}

impl<T: KvElement> Pools<'_, T> {
    /// KV heads `heads` of one row, each with its query heads, over the row's
    /// live blocks (online softmax): `q` the whole row, `out` those heads' part.
    fn row(
        &self,
        row: usize,
        heads: Range<usize>,
        q: &[f32],
        kv_lens: &[i32],
        tables: &[i32],
        out: &mut [f32],
    ) {
        let s = &self.shape;
        let kv_len = kv_lens[row] as usize;
        if kv_len == 0 {
            out.fill(0.0);
            return;
        }
        let table = &tables[self.options.table_row(row) * s.table_width..][..s.blocks_of(kv_len)];
        let (group, d, bs) = (s.group(), s.head_dim, s.block_size);
        let start = self.options.window_start(kv_len);
        let options = |h: usize| HeadOptions {
            start,
            soft_cap: self.options.soft_cap,
            sinks: self.options.sinks.map(|sinks| &sinks[h * group..][..group]),
        };
        #[cfg(target_arch = "x86_64")]
        if avx2_fma_f16c() && group <= MAX_GROUP && bs <= MAX_BLOCK && d % 8 == 0 {
            let head_len = s.pages * bs * d;
            for h in heads.clone() {
                let pages = HeadPages {
                    keys: &self.k_pages[h * head_len..][..head_len],
                    values: &self.v_pages[h * head_len..][..head_len],
                    group,
                    head_dim: d,
                    block_size: bs,
                };
                let (range, local) = (
                    h * group * d..(h + 1) * group * d,
                    (h - heads.start) * group * d..(h + 1 - heads.start) * group * d,
                );
                // Without options the kernel's option checks fold away.
                let call = if self.options.any() {
                    group_attention::<T, true>
                } else {
                    group_attention::<T, false>
                };
                // SAFETY: the CPU reports AVX2, FMA and F16C; the plan was
                // validated and the shape fits the kernel's buffers.
                unsafe {
                    call(
                        &pages,
                        table,
                        kv_len,
                        &options(h),
                        &q[range],
                        &mut out[local],
                    )
                };
            }
            return;
        }
        for h in heads.clone() {
            let q_group = &q[h * group * d..][..group * d];
            let out_group = &mut out[(h - heads.start) * group * d..][..group * d];
            let opts = options(h);
            if group <= MAX_GROUP && d <= MAX_HEAD_DIM && bs <= MAX_BLOCK {
                if self.options.any() {
                    self.head_fastest::<true>(h, q_group, table, kv_len, &opts, out_group);
                } else {
                    self.head_fastest::<false>(h, q_group, table, kv_len, &opts, out_group);
                }
            } else {
                for g in 0..group {
                    let q_one = &q_group[g * d..][..d];
                    let out_one = &mut out_group[g * d..][..d];
                    let one = HeadOptions {
                        sinks: opts.sinks.map(|sinks| &sinks[g..g + 1]),
                        ..opts
                    };
                    self.head_slow(h, q_one, table, kv_len, &one, out_one);
                }
            }
        }
    }

    fn page_slice<'p>(&self, pool: &'p [T], head: usize, page: usize) -> &'p [T] {
        let s = &self.shape;
        let len = s.block_size * s.head_dim;
        &pool[(head * s.pages + page) * len..][..len]
    }

    /// [`Self::head`] compiled for the widest vector unit this CPU has.
    fn head_fastest<const OPTIONS: bool>(
        &self,
        h: usize,
        q: &[f32],
        table: &[i32],
        kv_len: usize,
        opts: &HeadOptions,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            if simd_level() == SimdLevel::Avx512 {
                // SAFETY: the CPU reports AVX-512F.
                return unsafe { self.head_avx512::<OPTIONS>(h, q, table, kv_len, opts, out) };
            }
            if simd_level() == SimdLevel::Avx2 {
                // SAFETY: the CPU reports AVX2.
                return unsafe { self.head_avx2::<OPTIONS>(h, q, table, kv_len, opts, out) };
            }
        }
        self.head::<OPTIONS>(h, q, table, kv_len, opts, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn head_avx512<const OPTIONS: bool>(
        &self,
        h: usize,
        q: &[f32],
        table: &[i32],
        kv_len: usize,
        opts: &HeadOptions,
        out: &mut [f32],
    ) {
        self.head::<OPTIONS>(h, q, table, kv_len, opts, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn head_avx2<const OPTIONS: bool>(
        &self,
        h: usize,
        q: &[f32],
        table: &[i32],
        kv_len: usize,
        opts: &HeadOptions,
        out: &mut [f32],
    ) {
        self.head::<OPTIONS>(h, q, table, kv_len, opts, out)
    }

    /// The query heads of KV head `h`, a block at a time from the first block the
    /// window touches: scores of the block, one rescale per block, then the block's
    /// values. Inlined into each vector-width variant above. `OPTIONS = false`
    /// ignores `opts` (the option checks fold away).
    #[inline(always)]
    fn head<const OPTIONS: bool>(
        &self,
        h: usize,
        q: &[f32],
        table: &[i32],
        kv_len: usize,
        opts: &HeadOptions,
        out: &mut [f32],
    ) {
        let s = &self.shape;
        let (group, d, bs) = (s.group(), s.head_dim, s.block_size);
        let mut maxes = [f32::NEG_INFINITY; MAX_GROUP];
        let mut sums = [0.0f32; MAX_GROUP];
        let mut scores = [0.0f32; MAX_GROUP * MAX_BLOCK];
        let mut key = [0.0f32; MAX_HEAD_DIM];
        let (start, cap) = if OPTIONS {
            (opts.start, opts.soft_cap)
        } else {
            (0, None)
        };
        out.fill(0.0);
        let first_block = start / bs;
        for (i, &page) in table[first_block..].iter().enumerate() {
            let b = first_block + i;
            let first = start.saturating_sub(b * bs); // > 0 on the window's first block
            let live = (kv_len - b * bs).min(bs);
            let keys = self.page_slice(self.k_pages, h, page as usize);
            let values = self.page_slice(self.v_pages, h, page as usize);
            for t in first..live {
                to_f32(&keys[t * d..][..d], &mut key[..d]);
                for g in 0..group {
                    scores[g * bs + t] = dot(&q[g * d..][..d], &key[..d]);
                }
            }
            for g in 0..group {
                let block_scores = &mut scores[g * bs + first..g * bs + live];
                if let Some(cap) = cap {
                    soft_cap(block_scores, cap);
                }
                let block_max = block_scores
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let new_max = maxes[g].max(block_max);
                let alpha = (maxes[g] - new_max).exp(); // 0 on the first block
                maxes[g] = new_max;
                let mut block_sum = 0.0;
                for p in block_scores.iter_mut() {
                    *p = (*p - new_max).exp();
                    block_sum += *p;
                }
                sums[g] = sums[g] * alpha + block_sum;
                let acc = &mut out[g * d..][..d];
                if alpha != 1.0 {
                    acc.iter_mut().for_each(|a| *a *= alpha);
                }
            }
            for t in first..live {
                to_f32(&values[t * d..][..d], &mut key[..d]);
                for g in 0..group {
                    axpy(scores[g * bs + t], &key[..d], &mut out[g * d..][..d]);
                }
            }
        }
        for g in 0..group {
            let sink = if OPTIONS { opts.sink(g) } else { None };
            finish(&mut out[g * d..][..d], maxes[g], sums[g], sink);
        }
    }

    /// One query head, token by token: shapes too large for the stack buffers
    /// (`opts.sinks`, if any, is this head's one sink).
    fn head_slow(
        &self,
        h: usize,
        q: &[f32],
        table: &[i32],
        kv_len: usize,
        opts: &HeadOptions,
        out: &mut [f32],
    ) {
        let s = &self.shape;
        let (d, bs) = (s.head_dim, s.block_size);
        let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
        let mut row = vec![0.0f32; d];
        out.fill(0.0);
        for (b, &page) in table.iter().enumerate().skip(opts.start / bs) {
            let first = opts.start.saturating_sub(b * bs);
            let live = (kv_len - b * bs).min(bs);
            let keys = self.page_slice(self.k_pages, h, page as usize);
            let values = self.page_slice(self.v_pages, h, page as usize);
            for t in first..live {
                to_f32(&keys[t * d..][..d], &mut row);
                let mut score = [dot(q, &row)];
                if let Some(cap) = opts.soft_cap {
                    soft_cap(&mut score, cap);
                }
                let [score] = score;
                let new_max = max.max(score);
                let alpha = (max - new_max).exp();
                let p = (score - new_max).exp();
                max = new_max;
                sum = sum * alpha + p;
                to_f32(&values[t * d..][..d], &mut row);
                out.iter_mut()
                    .zip(&row)
                    .for_each(|(a, v)| *a = *a * alpha + p * v);
            }
        }
        finish(out, max, sum, opts.sink(0));
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SimdLevel {
    Baseline,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                return SimdLevel::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Baseline
    })
}

/// The CPU has AVX2, FMA and F16C ([`group_attention`]'s instructions; every
/// AVX2 CPU shipped has all three).
#[cfg(target_arch = "x86_64")]
fn avx2_fma_f16c() -> bool {
    static ALL: OnceLock<bool> = OnceLock::new();
    *ALL.get_or_init(|| {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    })
}

#[inline(always)]
fn to_f32<T: KvElement>(src: &[T], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
}

/// Lanes of [`dot`]'s independent partial sums: one AVX-512 register, two AVX2 ones.
const LANES: usize = 16;

/// Dot product in independent lanes (so the compiler can vectorize it).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (a8, a_rest) = a.split_at(a.len() / LANES * LANES);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(LANES).zip(b8.chunks_exact(LANES)) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

#[inline(always)]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x);
}

#[cfg(test)]
#[path = "cpu_attention_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "cpu_attention_split_tests.rs"]
mod split_tests;
