//! Mixture-of-experts linear layers on the host CPU: `y[n] = x[n] · W[e_n]ᵀ`,
//! each row through the expert its router picked, reading only the experts
//! some row was routed to.
//!
//! Owns [`expert_qmatmul`] (quantized experts, every format of
//! [`super::quant`]), [`expert_matmul`] (float32 or bfloat16 experts), the
//! grouping of a call's rows by expert ([`Routing`]) and the bfloat16 kernel
//! (float32 runs [`super::cpu_matmul`]'s, quantized formats
//! [`super::quant::qmatmul`]'s: nothing of their inner loops is repeated here).
//! XLA calls them through [`super::xla_ffi_experts`].
//!
//! A MoE layer routes each token to its top-k of `E` experts, so a call has
//! `N = tokens · k` rows. The live rows are sorted by expert (a stable counting
//! sort) and gathered into one contiguous block per routed expert; each routed
//! expert then runs the dense kernel over its rows, so its weights are
//! streamed from memory once per call whatever the number of rows routed to
//! it, and an expert no row was routed to is never read: a one-token decode
//! step with top-4 of 32 experts reads 4 experts' bytes, a 32-token step each
//! routed expert's once. The parallel units are (routed expert, tile of
//! weight rows); the results are scattered back to the rows' places.
//!
//! Layout (row-major): `x [rows, inner]` f32; `expert_ids [rows]` i32; the
//! experts back to back in one buffer, expert `e`'s weight rows being
//! `e * outs .. (e + 1) * outs`: quantized `w [experts * outs,
//! row_bytes(inner)]` bytes (each row its GGUF blocks) with, for per-channel
//! formats, `row_scales [experts * outs]` f32; float `w [experts, outs,
//! inner]`; `y [rows, outs]` f32. Rows `live_rows..` are padding: written as
//! zeros, their ids never read.
//!
//! A row's result is the dense kernel's for the rows routed to its expert in
//! this call: as a quantized product of one row takes the 16-bit integer path
//! and one of more rows the float path ([`super::quant::qmatmul`]), a row
//! alone on its expert differs in rounding from one that shares it.
//!
//! Invariants:
//! - every size, `live_rows` and every live row's expert id (in `0..experts`)
//!   are checked before any weight is read or any result written, so a bad id
//!   is an error, never an out-of-bounds read;
//! - only the weight rows (and row scales) of experts some live row is routed
//!   to are loaded ([`cpu_matmul`]'s float32 kernel also prefetches 4 weight
//!   rows ahead, which may reach past a routed expert's last row: a hint,
//!   which never faults; the bfloat16 and quantized kernels' prefetches stay
//!   inside the expert);
//! - each element of `y` is written by one unit of work; results do not
//!   depend on the number of threads.

use std::ops::Range;

use super::cpu_matmul::{self, MatmulShape, OutPtr};
use super::kv_element::{Bf16, KvElement};
use super::parallel::Parallel;
use super::quant::call::{self as quant_call, QuantShape};
use super::quant::formats::QuantType;
use super::quant::qmatmul::{self, Inputs};

/// Shapes of one call (layout in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// Rows of `x` and `y` (tokens x top-k), padding included.
    pub rows: usize,
    pub inner: usize,
    /// Output features of each expert.
    pub outs: usize,
    pub experts: usize,
}

/// The routed rows of one call: the inputs, each row's expert, and how many
/// rows are live.
#[derive(Clone, Copy, Debug)]
pub struct Routed<'a> {
    pub shape: ExpertShape,
    pub x: &'a [f32],
    pub expert_ids: &'a [i32],
    pub live_rows: usize,
}

impl Routed<'_> {
    /// Check `x`, `expert_ids`, `y` and `live_rows` against the shape (the
    /// weights are the caller's to check); `Err` names the first violation.
    fn validate(&self, y: &[f32]) -> Result<(), String> {
        let s = &self.shape;
        let sizes = [
            ("x", self.x.len(), s.rows * s.inner),
            ("expert_ids", self.expert_ids.len(), s.rows),
            ("y", y.len(), s.rows * s.outs),
        ];
        for (name, got, want) in sizes {
            if got != want {
                return Err(format!("{name} has {got} elements, its shape says {want}"));
            }
        }
        if self.live_rows > s.rows {
            return Err(format!(
                "live_rows {} is outside [0, {}]",
                self.live_rows, s.rows
            ));
        }
        Ok(())
    }
}

/// The live rows of a call sorted by expert: `experts[i]` is the `i`-th
/// routed expert (ascending ids), its rows are `order[offsets[i] ..
/// offsets[i + 1]]` (ascending: the sort is stable).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub offsets: Vec<usize>,
    pub order: Vec<usize>,
}

impl Routing {
    /// Sort rows `0..ids.len()` by their expert; `Err` if an id is outside
    /// `0..experts`.
    pub fn new(ids: &[i32], experts: usize) -> Result<Routing, String> {
        let mut counts = vec![0usize; experts];
        for (row, &id) in ids.iter().enumerate() {
            match usize::try_from(id) {
                Ok(e) if e < experts => counts[e] += 1,
                _ => {
                    return Err(format!(
                        "expert id {id} of row {row} is outside [0, {experts})"
                    ))
                }
            }
        }
        let mut routing = Routing {
            experts: Vec::new(),
            offsets: vec![0],
            order: vec![0; ids.len()],
        };
        // `next[e]`: where expert e's next row goes in `order`.
        let mut next = vec![0usize; experts];
        let mut at = 0;
        for (e, &count) in counts.iter().enumerate() {
            if count > 0 {
                next[e] = at;
                at += count;
                routing.experts.push(e);
                routing.offsets.push(at);
            }
        }
        for (row, &id) in ids.iter().enumerate() {
            let e = id as usize; // checked above
            routing.order[next[e]] = row;
            next[e] += 1;
        }
        Ok(routing)
    }

    /// Positions in `order` of the `i`-th routed expert's rows.
    pub fn rows_of(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }
}

/// The live rows of `x` in routing order, one contiguous block per routed
/// expert, and the buffer their results go to before the scatter.
struct Grouped {
    routing: Routing,
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Grouped {
    /// Route and gather the live rows of a call that passed
    /// [`Routed::validate`].
    fn gather(call: &Routed) -> Result<Grouped, String> {
        let (inner, outs) = (call.shape.inner, call.shape.outs);
        let live = call.live_rows;
        let routing = Routing::new(&call.expert_ids[..live], call.shape.experts)?;
        let mut x = Vec::with_capacity(live * inner);
        for &row in &routing.order {
            x.extend_from_slice(&call.x[row * inner..][..inner]);
        }
        Ok(Grouped {
            routing,
            x,
            y: vec![0.0; live * outs],
        })
    }

    /// The gathered inputs of the `i`-th routed expert.
    fn x_of<'a>(x: &'a [f32], routing: &Routing, i: usize, inner: usize) -> &'a [f32] {
        let rows = routing.rows_of(i);
        &x[rows.start * inner..rows.end * inner]
    }

    /// One output pointer per routed expert, each at its rows of `y` (`outs`
    /// per row).
    fn outputs(y: &mut [f32], routing: &Routing, outs: usize) -> Vec<OutPtr> {
        let mut rest = y;
        let mut outputs = Vec::with_capacity(routing.experts.len());
        for i in 0..routing.experts.len() {
            let (mine, others) = rest.split_at_mut(routing.rows_of(i).len() * outs);
            outputs.push(OutPtr::new(mine));
            rest = others;
        }
        outputs
    }

    /// Every live row's result to its place in `y`.
    fn scatter(&self, y: &mut [f32], outs: usize) {
        for (p, &row) in self.routing.order.iter().enumerate() {
            y[row * outs..][..outs].copy_from_slice(&self.y[p * outs..][..outs]);
        }
    }
}

/// Route and gather the live rows (checking every live id), then zero the
/// padding rows of `y`; `None` when no row is live.
fn route_and_gather(call: &Routed, y: &mut [f32]) -> Result<Option<Grouped>, String> {
    // Route (checking every live id) before writing anything.
    let grouped = Grouped::gather(call)?;
    y[call.live_rows * call.shape.outs..].fill(0.0);
    Ok((call.live_rows > 0).then_some(grouped))
}

/// `y[n] = x[n] · dequant(W[expert_ids[n]])ᵀ` for the live rows, zeros after
/// them; `w` holds the experts' blocks back to back (module docs), in format
/// `kind`. Units of (routed expert, [`quant_call::OUTS_PER_TILE`] weight rows)
/// run on `parallel`.
pub fn expert_qmatmul(
    call: &Routed,
    kind: QuantType,
    w: &[u8],
    row_scales: &[f32],
    y: &mut [f32],
    parallel: &dyn Parallel,
) -> Result<(), String> {
    let s = call.shape;
    call.validate(y)?;
    let Some(row_bytes) = kind.row_bytes(s.inner) else {
        return Err(format!(
            "{} weights need an inner size that is a positive multiple of {}, got {}",
            kind.name(),
            kind.block_elems(),
            s.inner
        ));
    };
    let expert_bytes = s.outs * row_bytes;
    let scales_per_expert = if kind.row_scaled() { s.outs } else { 0 };
    let sizes = [
        ("w", w.len(), s.experts * expert_bytes),
        (
            "row_scales",
            row_scales.len(),
            s.experts * scales_per_expert,
        ),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(format!("{name} has {got} elements, its shape says {want}"));
        }
    }
    let Some(mut grouped) = route_and_gather(call, y)? else {
        return Ok(());
    };
    let routing = &grouped.routing;
    let mut experts = Vec::with_capacity(routing.experts.len());
    for (i, &e) in routing.experts.iter().enumerate() {
        let shape = QuantShape {
            kind,
            rows: routing.rows_of(i).len(),
            inner: s.inner,
            outs: s.outs,
        };
        let x = Grouped::x_of(&grouped.x, routing, i, s.inner);
        let w = &w[e * expert_bytes..][..expert_bytes];
        let scales = &row_scales[e * scales_per_expert..][..scales_per_expert];
        let y_len = shape.rows * shape.outs;
        quant_call::validate(&shape, x, w, scales, &grouped.y[..y_len])?;
        experts.push((shape, Inputs::prepare(&shape, x), w, scales));
    }
    let outputs = Grouped::outputs(&mut grouped.y, routing, s.outs);
    let tiles = s.outs.div_ceil(quant_call::OUTS_PER_TILE);
    let unit = |index: usize| {
        let (shape, inputs, w, scales) = &experts[index / tiles];
        // SAFETY: each expert's inputs, weights, scales and output rows
        // passed `validate` for its shape; each (expert, tile) is one unit.
        unsafe {
            qmatmul::tile(
                shape,
                inputs,
                w,
                scales,
                outputs[index / tiles],
                index % tiles,
            )
        }
    };
    parallel.run(experts.len() * tiles, &unit)?;
    grouped.scatter(y, s.outs);
    Ok(())
}

/// A float weight element [`expert_matmul`] reads: f32 (through
/// [`cpu_matmul`]'s kernels) or [`Bf16`] (through this module's).
pub trait FloatWeight: Copy + Send + Sync + sealed::Sealed {
    /// Weight rows per unit of parallel work.
    const OUTS_PER_TILE: usize;

    /// Columns `index * OUTS_PER_TILE ..` (one tile) of `y = x · wᵀ`.
    ///
    /// # Safety
    /// `x`, `w` (`outs * inner` elements) and the buffer behind `y` have the
    /// sizes `shape` says; no other thread writes the same tile.
    unsafe fn tile(shape: &MatmulShape, x: &[f32], w: &[Self], y: OutPtr, index: usize);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::Bf16 {}
}

impl FloatWeight for f32 {
    const OUTS_PER_TILE: usize = cpu_matmul::OUTS_PER_TILE;

    unsafe fn tile(shape: &MatmulShape, x: &[f32], w: &[f32], y: OutPtr, index: usize) {
        cpu_matmul::matmul_nt_tile(shape, x, w, y, index)
    }
}

impl FloatWeight for Bf16 {
    const OUTS_PER_TILE: usize = BF16_OUTS_PER_TILE;

    unsafe fn tile(shape: &MatmulShape, x: &[f32], w: &[Bf16], y: OutPtr, index: usize) {
        bf16_tile(shape, x, w, y, index)
    }
}

/// `y[n] = x[n] · W[expert_ids[n]]ᵀ` for the live rows, zeros after them;
/// `w [experts, outs, inner]` (module docs). Units of (routed expert,
/// `T::OUTS_PER_TILE` weight rows) run on `parallel`.
pub fn expert_matmul<T: FloatWeight>(
    call: &Routed,
    w: &[T],
    y: &mut [f32],
    parallel: &dyn Parallel,
) -> Result<(), String> {
    let s = call.shape;
    call.validate(y)?;
    let expert_len = s.outs * s.inner;
    if w.len() != s.experts * expert_len {
        return Err(format!(
            "w has {} elements, its shape says {}",
            w.len(),
            s.experts * expert_len
        ));
    }
    let Some(mut grouped) = route_and_gather(call, y)? else {
        return Ok(());
    };
    let routing = &grouped.routing;
    let experts: Vec<(MatmulShape, &[f32], &[T])> = (routing.experts.iter().enumerate())
        .map(|(i, &e)| {
            let shape = MatmulShape {
                rows: routing.rows_of(i).len(),
                inner: s.inner,
                outs: s.outs,
            };
            let x = Grouped::x_of(&grouped.x, routing, i, s.inner);
            (shape, x, &w[e * expert_len..][..expert_len])
        })
        .collect();
    let outputs = Grouped::outputs(&mut grouped.y, routing, s.outs);
    let tiles = s.outs.div_ceil(T::OUTS_PER_TILE);
    let unit = |index: usize| {
        let (shape, x, w) = &experts[index / tiles];
        // SAFETY: each expert's inputs, weights and output rows have its
        // shape's sizes (checked above); each (expert, tile) is one unit.
        unsafe { T::tile(shape, x, w, outputs[index / tiles], index % tiles) }
    };
    parallel.run(experts.len() * tiles, &unit)?;
    grouped.scatter(y, s.outs);
    Ok(())
}

/// bfloat16 weight rows per unit of parallel work (32 KB at 1024 inputs).
const BF16_OUTS_PER_TILE: usize = 16;

/// Input rows per pass over a bfloat16 weight row group.
const BF16_ROW_GROUP: usize = 8;

/// Columns `index * BF16_OUTS_PER_TILE ..` of `y = x · wᵀ`, bfloat16 `w`: each
/// weight row widened to f32 in registers eight at a time
/// ([`KvElement::load8`]) and multiplied against up to eight input rows
/// while it is there, with the float kernel's register blocking.
///
/// # Safety
/// As [`FloatWeight::tile`].
unsafe fn bf16_tile(shape: &MatmulShape, x: &[f32], w: &[Bf16], y: OutPtr, index: usize) {
    let start = index * BF16_OUTS_PER_TILE;
    let end = (start + BF16_OUTS_PER_TILE).min(shape.outs);
    if start >= end {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if bf16_vectorized() {
        return bf16_avx2::tile(shape, x, w, y, start, end);
    }
    bf16_portable_tile(shape, x, w, y, start, end)
}

/// Whether the bfloat16 kernel runs vectorized: AVX2 + FMA, unless
/// `KVPAGE_CPU_MATMUL_PORTABLE=1` ([`cpu_matmul::instruction_set`]).
#[cfg(target_arch = "x86_64")]
fn bf16_vectorized() -> bool {
    cpu_matmul::instruction_set() != cpu_matmul::InstructionSet::Portable
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
}

/// Any CPU: 8-lane partial sums, then the tail, as [`cpu_matmul`]'s portable loop.
///
/// # Safety
/// As [`FloatWeight::tile`], for weight rows `start..end`.
pub(crate) unsafe fn bf16_portable_tile(
    shape: &MatmulShape,
    x: &[f32],
    w: &[Bf16],
    y: OutPtr,
    start: usize,
    end: usize,
) {
    const LANES: usize = 8;
    let k = shape.inner;
    for row in 0..shape.rows {
        let x_row = &x[row * k..][..k];
        for out in start..end {
            let w_row = &w[out * k..][..k];
            let mut lanes = [0.0f32; LANES];
            let mut x_chunks = x_row.chunks_exact(LANES);
            let mut w_chunks = w_row.chunks_exact(LANES);
            for (xc, wc) in (&mut x_chunks).zip(&mut w_chunks) {
                for lane in 0..LANES {
                    lanes[lane] += xc[lane] * wc[lane].to_f32();
                }
            }
            let tail: f32 = (x_chunks.remainder().iter())
                .zip(w_chunks.remainder())
                .map(|(a, b)| a * b.to_f32())
                .sum();
            *y.at(row * shape.outs + out) = lanes.iter().sum::<f32>() + tail;
        }
    }
}

/// x86-64 with AVX2 + FMA: [`cpu_matmul`]'s AVX2 blocking (input rows x
/// weight rows per pass within 16 registers), weights loaded as bfloat16.
#[cfg(target_arch = "x86_64")]
pub(crate) mod bf16_avx2 {
    use std::arch::x86_64::*;

    use super::{Bf16, KvElement, BF16_ROW_GROUP};
    use crate::kernels::cpu_matmul::avx2::horizontal_sum;
    use crate::kernels::cpu_matmul::{MatmulShape, OutPtr};

    /// Prefetch distance in weight rows, as the float kernels'.
    const PREFETCH_ROWS: usize = 4;

    /// # Safety
    /// As [`super::FloatWeight::tile`]; the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn tile(
        shape: &MatmulShape,
        x: &[f32],
        w: &[Bf16],
        y: OutPtr,
        start: usize,
        end: usize,
    ) {
        for first_row in (0..shape.rows).step_by(BF16_ROW_GROUP) {
            let args = (shape, x, w, y, first_row, start, end);
            // R * W accumulators + W weight vectors + 1 input vector <= 16.
            match (shape.rows - first_row).min(BF16_ROW_GROUP) {
                1 => group::<1, 4>(args),
                2 => group::<2, 4>(args),
                3 => group::<3, 3>(args),
                4 => group::<4, 2>(args),
                5 => group::<5, 2>(args),
                6 => group::<6, 2>(args),
                7 => group::<7, 1>(args),
                8 => group::<8, 1>(args),
                _ => unreachable!("row groups hold 1..={BF16_ROW_GROUP} rows"),
            }
        }
    }

    type GroupArgs<'a> = (
        &'a MatmulShape,
        &'a [f32],
        &'a [Bf16],
        OutPtr,
        usize,
        usize,
        usize,
    );

    /// Rows `first_row .. first_row + R` of `y`, columns `start..end`, `W`
    /// weight rows per pass, then one at a time.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group<const R: usize, const W: usize>(args: GroupArgs) {
        let (shape, x, w, y, first_row, start, end) = args;
        let k = shape.inner;
        let x = x.as_ptr().add(first_row * k);
        let w = w.as_ptr();
        let store = |out: usize, sums: &[f32; R]| {
            for (r, value) in sums.iter().enumerate() {
                *y.at((first_row + r) * shape.outs + out) = *value;
            }
        };
        // Prefetch only rows of this expert: its neighbours may not be routed.
        let ahead = |out: usize, rows: usize| out + PREFETCH_ROWS + rows <= shape.outs;
        let mut out = start;
        while out + W <= end {
            let sums = dot_rows::<R, W>(x, w.add(out * k), k, ahead(out, W));
            for (j, row_sums) in sums.iter().enumerate() {
                store(out + j, row_sums);
            }
            out += W;
        }
        while out < end {
            let [sums] = dot_rows::<R, 1>(x, w.add(out * k), k, ahead(out, 1));
            store(out, &sums);
            out += 1;
        }
    }

    /// `sums[j][r] = x[r] · w[j]` for `R` input rows and `W` weight rows (both
    /// stride `k`): one accumulator per pair over 8 lanes, then the tail in
    /// order, so a sum does not depend on `R` or `W`. With `prefetch`, the
    /// weight rows [`PREFETCH_ROWS`] further on are fetched meanwhile.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // index loops name the register blocking
    unsafe fn dot_rows<const R: usize, const W: usize>(
        x: *const f32,
        w: *const Bf16,
        k: usize,
        prefetch: bool,
    ) -> [[f32; R]; W] {
        let mut acc = [[_mm256_setzero_ps(); R]; W];
        let ahead = w.wrapping_add(PREFETCH_ROWS * k);
        let mut i = 0;
        while i + 8 <= k {
            let mut wv = [_mm256_setzero_ps(); W];
            for j in 0..W {
                if prefetch && i % 32 == 0 {
                    // One prefetch per 64-byte line; a prefetch never faults.
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(j * k + i) as *const i8);
                }
                wv[j] = Bf16::load8(w.add(j * k + i));
            }
            for r in 0..R {
                let xv = _mm256_loadu_ps(x.add(r * k + i));
                for j in 0..W {
                    acc[j][r] = _mm256_fmadd_ps(xv, wv[j], acc[j][r]);
                }
            }
            i += 8;
        }
        let mut sums = [[0.0f32; R]; W];
        for j in 0..W {
            for r in 0..R {
                let mut sum = horizontal_sum(acc[j][r]);
                for t in i..k {
                    sum += *x.add(r * k + t) * (*w.add(j * k + t)).to_f32();
                }
                sums[j][r] = sum;
            }
        }
        sums
    }
}
