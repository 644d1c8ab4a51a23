//! One Llama-family decoder layer of a decode step on the host CPU, in one call.
//!
//! Owns [`decode_layer`]: RMSNorm, the Q/K/V products, RoPE, the write of this
//! step's K/V into the paged pool, paged attention, the output product and
//! residual, RMSNorm, the gate/up products, SiLU-gating, the down product and
//! residual. XLA:CPU pays a few microseconds for every op it runs, and a layer
//! traced op by op runs ~30 of them around its ~8 products and attention: at one
//! row, SmolLM2's 30 layers spent more time in that overhead than in their
//! products. Here a layer is one custom call, whose parallel parts (the
//! products, attention) run on the caller's [`Parallel`] as before.
//!
//! Layout (row-major; one query token per row):
//! - `hidden`, `out`: `[rows, hidden]` f32 (the layer's input and output);
//! - `cos`, `sin`: `[rows, head_dim]` f32, the angles of each row's position in
//!   the "rotate half" convention (feature `i` pairs with `i + head_dim / 2`);
//! - `slots`: `[rows]`, where each row's K/V is written (`page * block_size +
//!   offset`; padding rows name the scratch page);
//! - `kv_lens`, `block_tables`, `k_pages`, `v_pages`: as
//!   [`crate::kernels::cpu_attention`] reads them, the pools f32;
//! - each linear weight `[outs, inner]` (HF orientation), f32 or quantized
//!   blocks ([`crate::kernels::quant`]).
//!
//! Invariants (checked by [`validate`] before any element is read or written):
//! - every weight has the shape the layer's sizes give it, and its buffers their
//!   size; `q_heads % kv_heads == 0`, `head_dim` is even;
//! - every slot lies in the pool (`0 <= slot < pages * block_size`), and the
//!   attention invariants of [`crate::kernels::cpu_attention`] hold;
//! - the math is the traced layer's (`kvpage/model/llama.py`): statistics and
//!   sums in f32, the softmax scale applied to `q` before attention. Sums may run
//!   in another order than XLA's, so results agree to rounding, not bits.

use super::cpu_attention::{paged_decode_attention, DecodeShape};
use super::cpu_matmul::{self, MatmulShape, OutPtr};
use super::parallel::Parallel;
use super::quant::formats::QuantType;
use super::quant::qmatmul::{self, Inputs, QuantShape};

/// The stored values of one linear weight.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    /// `[outs, inner]` f32.
    Float(&'a [f32]),
    /// `[outs, row_bytes(inner)]` blocks, and `[outs]` row scales for int8 (else empty).
    Quant {
        kind: QuantType,
        blocks: &'a [u8],
        row_scales: &'a [f32],
    },
}

/// A linear weight `[outs, inner]`.
#[derive(Clone, Copy)]
pub struct Linear<'a> {
    pub weight: Weight<'a>,
    pub outs: usize,
    pub inner: usize,
}

impl Linear<'_> {
    fn tiles(&self) -> usize {
        match self.weight {
            Weight::Float(_) => self.outs.div_ceil(cpu_matmul::OUTS_PER_TILE),
            Weight::Quant { .. } => self.outs.div_ceil(qmatmul::OUTS_PER_TILE),
        }
    }

    /// Check the weight's buffers against `[outs, inner]`.
    fn validate(&self, name: &str) -> Result<(), String> {
        let checked = match self.weight {
            Weight::Float(w) => {
                let want = self.outs * self.inner;
                (w.len() == want)
                    .then_some(())
                    .ok_or_else(|| format!("has {} elements, its shape says {want}", w.len()))
            }
            Weight::Quant {
                kind,
                blocks,
                row_scales,
            } => {
                let shape = QuantShape {
                    kind,
                    rows: 0,
                    inner: self.inner,
                    outs: self.outs,
                };
                qmatmul::validate(&shape, &[], blocks, row_scales, &[])
            }
        };
        checked.map_err(|e| format!("{name}: {e}"))
    }
}

/// The weights of one layer (norm weights `[hidden]` f32).
pub struct LayerWeights<'a> {
    pub input_norm: &'a [f32],
    pub q: Linear<'a>,
    pub k: Linear<'a>,
    pub v: Linear<'a>,
    pub o: Linear<'a>,
    pub post_norm: &'a [f32],
    pub gate: Linear<'a>,
    pub up: Linear<'a>,
    pub down: Linear<'a>,
}

/// Sizes of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub rows: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub pages: usize,
    pub block_size: usize,
    pub table_width: usize,
}

impl LayerShape {
    fn attention(&self) -> DecodeShape {
        DecodeShape {
            rows: self.rows,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            pages: self.pages,
            block_size: self.block_size,
            table_width: self.table_width,
        }
    }
}

/// The step's per-row inputs (layout in the module docs).
pub struct RowInputs<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub slots: &'a [i32],
    pub kv_lens: &'a [i32],
    pub block_tables: &'a [i32],
}

/// The layer's scalar settings.
#[derive(Clone, Copy, Debug)]
pub struct LayerConstants {
    pub rms_norm_eps: f32,
    pub sm_scale: f32,
}

/// Check the invariants in the module docs; `Err` names the first violation.
pub fn validate(
    shape: &LayerShape,
    weights: &LayerWeights,
    rows: &RowInputs,
    hidden: &[f32],
    k_pages: &[f32],
    v_pages: &[f32],
    out: &[f32],
) -> Result<(), String> {
    let s = shape;
    if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) || !s.head_dim.is_multiple_of(2) {
        return Err(format!(
            "{} query heads, {} KV heads of {} features: need a multiple of the KV heads \
             and an even head size",
            s.q_heads, s.kv_heads, s.head_dim
        ));
    }
    let (q_size, kv_size) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
    let linears = [
        ("q_proj", &weights.q, q_size, s.hidden),
        ("k_proj", &weights.k, kv_size, s.hidden),
        ("v_proj", &weights.v, kv_size, s.hidden),
        ("o_proj", &weights.o, s.hidden, q_size),
        ("gate_proj", &weights.gate, s.intermediate, s.hidden),
        ("up_proj", &weights.up, s.intermediate, s.hidden),
        ("down_proj", &weights.down, s.hidden, s.intermediate),
    ];
    for (name, linear, outs, inner) in linears {
        if (linear.outs, linear.inner) != (outs, inner) {
            return Err(format!(
                "{name} is [{}, {}], the layer's sizes say [{outs}, {inner}]",
                linear.outs, linear.inner
            ));
        }
        linear.validate(name)?;
    }
    let pool = s.kv_heads * s.pages * s.block_size * s.head_dim;
    let sizes = [
        ("hidden", hidden.len(), s.rows * s.hidden),
        ("out", out.len(), s.rows * s.hidden),
        ("input_norm", weights.input_norm.len(), s.hidden),
        ("post_norm", weights.post_norm.len(), s.hidden),
        ("cos", rows.cos.len(), s.rows * s.head_dim),
        ("sin", rows.sin.len(), s.rows * s.head_dim),
        ("slots", rows.slots.len(), s.rows),
        ("k_pages", k_pages.len(), pool),
        ("v_pages", v_pages.len(), pool),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(format!("{name} has {got} elements, its shape says {want}"));
        }
    }
    let slots = s.pages * s.block_size;
    if let Some((row, slot)) = rows
        .slots
        .iter()
        .enumerate()
        .find(|(_, &slot)| slot < 0 || slot as usize >= slots)
    {
        return Err(format!(
            "row {row}: slot {slot} outside the pool of {slots} slots"
        ));
    }
    let attention = s.attention();
    super::cpu_attention::validate(
        &attention,
        &vec![0.0; s.rows * q_size],
        k_pages,
        v_pages,
        rows.kv_lens,
        rows.block_tables,
        &vec![0.0; s.rows * q_size],
    )
}

/// One decoder layer over `rows` decode tokens: `out = layer(hidden)`, this
/// step's K/V written into `k_pages`/`v_pages` at `slots` (module docs).
#[allow(clippy::too_many_arguments)]
pub fn decode_layer(
    parallel: &dyn Parallel,
    shape: &LayerShape,
    weights: &LayerWeights,
    constants: LayerConstants,
    rows: &RowInputs,
    hidden: &[f32],
    k_pages: &mut [f32],
    v_pages: &mut [f32],
    out: &mut [f32],
) -> Result<(), String> {
    validate(shape, weights, rows, hidden, k_pages, v_pages, out)?;
    let s = shape;
    let t = s.rows;
    let eps = constants.rms_norm_eps;
    let (q_size, kv_size) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);

    // Attention block.
    let mut normed = vec![0.0; t * s.hidden];
    rms_norm(hidden, weights.input_norm, eps, &mut normed);
    let (mut q, mut k, mut v) = (
        vec![0.0; t * q_size],
        vec![0.0; t * kv_size],
        vec![0.0; t * kv_size],
    );
    products(
        parallel,
        t,
        &normed,
        &mut [
            (&weights.q, &mut q),
            (&weights.k, &mut k),
            (&weights.v, &mut v),
        ],
    )?;
    for r in 0..t {
        let (cos, sin) = (
            &rows.cos[r * s.head_dim..][..s.head_dim],
            &rows.sin[r * s.head_dim..][..s.head_dim],
        );
        for head in q[r * q_size..][..q_size].chunks_exact_mut(s.head_dim) {
            rotate_half(head, cos, sin);
            head.iter_mut().for_each(|x| *x *= constants.sm_scale);
        }
        for head in k[r * kv_size..][..kv_size].chunks_exact_mut(s.head_dim) {
            rotate_half(head, cos, sin);
        }
    }
    write_kv(s, rows.slots, &k, &v, k_pages, v_pages);
    let mut attended = vec![0.0; t * q_size];
    paged_decode_attention(
        parallel,
        &s.attention(),
        &q,
        k_pages,
        v_pages,
        rows.kv_lens,
        rows.block_tables,
        &mut attended,
    )?;
    products(parallel, t, &attended, &mut [(&weights.o, &mut *out)])?;
    out.iter_mut().zip(hidden).for_each(|(o, h)| *o += h);

    // MLP block.
    rms_norm(out, weights.post_norm, eps, &mut normed);
    let (mut gate, mut up) = (vec![0.0; t * s.intermediate], vec![0.0; t * s.intermediate]);
    products(
        parallel,
        t,
        &normed,
        &mut [(&weights.gate, &mut gate), (&weights.up, &mut up)],
    )?;
    gate.iter_mut()
        .zip(&up)
        .for_each(|(g, u)| *g = silu(*g) * u);
    let mut down = vec![0.0; t * s.hidden];
    products(parallel, t, &gate, &mut [(&weights.down, &mut down)])?;
    out.iter_mut().zip(&down).for_each(|(o, d)| *o += d);
    Ok(())
}

/// `out = weight * x / sqrt(mean(x^2) + eps)` per row of `weight.len()` values.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mean = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((d, v), w) in dst.iter_mut().zip(row).zip(weight) {
            *d = w * (v * scale);
        }
    }
}

/// Rotate one head's features by its row's angles ("rotate half").
fn rotate_half(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    for i in 0..half {
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos[i] - b * sin[i];
        head[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Write each row's K/V heads at its slot (validated: inside the pool).
fn write_kv(
    s: &LayerShape,
    slots: &[i32],
    k: &[f32],
    v: &[f32],
    k_pages: &mut [f32],
    v_pages: &mut [f32],
) {
    let head_stride = s.pages * s.block_size * s.head_dim;
    let kv_size = s.kv_heads * s.head_dim;
    for (r, &slot) in slots.iter().enumerate() {
        for h in 0..s.kv_heads {
            let src = r * kv_size + h * s.head_dim;
            let dst = h * head_stride + slot as usize * s.head_dim;
            k_pages[dst..][..s.head_dim].copy_from_slice(&k[src..][..s.head_dim]);
            v_pages[dst..][..s.head_dim].copy_from_slice(&v[src..][..s.head_dim]);
        }
    }
}

/// `y_j = x · w_jᵀ` for every `(w_j, y_j)` of `jobs` (all with `x`'s inner
/// size, validated), their tiles in one parallel run.
fn products(
    parallel: &dyn Parallel,
    rows: usize,
    x: &[f32],
    jobs: &mut [(&Linear, &mut [f32])],
) -> Result<(), String> {
    let inner = jobs[0].0.inner;
    let quant_inputs = jobs
        .iter()
        .find_map(|(linear, _)| match linear.weight {
            Weight::Quant { kind, .. } => Some(QuantShape {
                kind,
                rows,
                inner,
                outs: linear.outs,
            }),
            Weight::Float(_) => None,
        })
        .map(|shape| Inputs::prepare(&shape, x));
    let outs: Vec<(Linear, OutPtr)> = jobs
        .iter_mut()
        .map(|(linear, y)| (**linear, OutPtr::new(y)))
        .collect();
    let mut starts = Vec::with_capacity(outs.len() + 1);
    starts.push(0);
    for (linear, _) in &outs {
        starts.push(starts.last().copied().unwrap_or(0) + linear.tiles());
    }
    let total = starts[outs.len()];
    let work = |unit: usize| {
        let job = starts.partition_point(|&start| start <= unit) - 1;
        let (linear, y) = &outs[job];
        let index = unit - starts[job];
        // SAFETY: every weight, `x` and `y` were validated for these shapes
        // ([`validate`]); each tile of each product is one unit, run once.
        unsafe {
            match linear.weight {
                Weight::Float(w) => {
                    let shape = MatmulShape {
                        rows,
                        inner,
                        outs: linear.outs,
                    };
                    cpu_matmul::matmul_nt_tile(&shape, x, w, *y, index);
                }
                Weight::Quant {
                    kind,
                    blocks,
                    row_scales,
                } => {
                    let shape = QuantShape {
                        kind,
                        rows,
                        inner,
                        outs: linear.outs,
                    };
                    let inputs = quant_inputs
                        .as_ref()
                        .expect("prepared for quantized weights");
                    qmatmul::tile(&shape, inputs, blocks, row_scales, *y, index);
                }
            }
        }
    };
    parallel.run(total, &work)
}

#[cfg(test)]
#[path = "decoder_layer_tests.rs"]
mod tests;
