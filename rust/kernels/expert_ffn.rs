//! The routed feed-forward of a mixture-of-experts layer in one host call:
//! router logits, top-k, the routing weights, each routed expert's gate and up
//! products, SwiGLU, its down product and the weighted sum of a token's
//! experts.
//!
//! Owns [`expert_ffn`], its shape ([`FfnShape`]), weights ([`FfnWeights`]) and
//! routing rule ([`Router`]). The products are [`super::quant::qmatmul`]'s
//! tiles over [`super::expert_matmul::Routing`]'s groups (nothing of their
//! loops is repeated here). XLA calls it through [`super::xla_ffi_experts`].
//!
//! Why one call: a one-token decode step of a top-4 MoE layer is ~6 M weights
//! of products, a few tens of microseconds, and run as XLA's router, top-k,
//! softmax and three expert calls it paid as much again in hand-offs between
//! them (`benches/RESULTS.md`, "One host call per MoE layer", 2026-11-28).
//! Here the calling thread routes, then the gate and up products of every
//! routed expert are one parallel region and the down products another.
//!
//! Layout (row-major): `x [tokens, hidden]` f32; `router [experts, hidden]`
//! f32 and `router_bias [experts]` f32 (or empty); `gate`, `up` the GGUF
//! blocks of `[experts, width, hidden]` weights, `down` of `[experts, hidden,
//! width]`, each expert after the one before; `y [tokens, hidden]` f32.
//! Tokens `live_tokens..` are padding: written as zeros, never routed.
//!
//! A token's result is, up to the float rounding of the activation and the
//! sum, that of the three separate expert calls on the same routing: each
//! expert's routed rows go through the same kernel with the same rows.
//!
//! Invariants:
//! - every size, `top_k` and the formats are checked before any weight is
//!   read or any result written;
//! - only the weight rows of routed experts are read (or prefetched);
//! - ties in the router logits go to the lower expert id (as `lax.top_k`);
//! - each element of `y` is written once; results do not depend on the
//!   number of threads.

use super::cpu_matmul::{self, MatmulShape, OutPtr};
use super::expert_matmul::Routing;
use super::parallel::Parallel;
use super::quant::call::{self as quant_call, QuantShape};
use super::quant::formats::QuantType;
use super::quant::qmatmul::{self, Inputs};

/// How a token's router logits become its experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// Softmax over every expert, keep the `top_k` largest (Mixtral,
    /// Qwen3-MoE, OLMoE); `renormalize`: divide them by their sum.
    SoftmaxTopK { renormalize: bool },
    /// The `top_k` largest logits, softmax over those (gpt-oss).
    TopKSoftmax,
}

/// Shapes of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FfnShape {
    pub tokens: usize,
    pub hidden: usize,
    /// Each expert's intermediate width.
    pub width: usize,
    pub experts: usize,
    pub top_k: usize,
}

/// The layer's weights (layout in the module docs).
#[derive(Clone, Copy, Debug)]
pub struct FfnWeights<'a> {
    pub router: &'a [f32],
    pub router_bias: &'a [f32],
    pub gate_up_kind: QuantType,
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down_kind: QuantType,
    pub down: &'a [u8],
    /// Gate and up (down) packed into tiles (`qmatmul::tile_packed`), each
    /// expert's matrix on its own.
    pub gate_up_packed: bool,
    pub down_packed: bool,
}

impl FfnWeights<'_> {
    /// Check every buffer against `shape`; `Err` names the first violation.
    fn validate(&self, s: &FfnShape, x: &[f32], y: &[f32]) -> Result<(), String> {
        if s.top_k == 0 || s.top_k > s.experts {
            return Err(format!(
                "top_k {} is outside [1, {}] experts",
                s.top_k, s.experts
            ));
        }
        let packed = [
            (self.gate_up_packed, self.gate_up_kind, s.width),
            (self.down_packed, self.down_kind, s.hidden),
        ];
        for (packed, kind, outs) in packed {
            if packed && !qmatmul::packs(kind, outs) {
                return Err(format!(
                    "{} experts of {outs} rows cannot be packed into tiles on this CPU",
                    kind.name()
                ));
            }
        }
        for kind in [self.gate_up_kind, self.down_kind] {
            if kind.row_scaled() {
                return Err(format!(
                    "{} experts carry row scales, which this call does not take",
                    kind.name()
                ));
            }
        }
        let row_bytes = |kind: QuantType, inner: usize| {
            kind.row_bytes(inner).ok_or_else(|| {
                format!(
                    "{} weights need an inner size that is a positive multiple of {}, got {inner}",
                    kind.name(),
                    kind.block_elems()
                )
            })
        };
        let gate_up = s.experts * s.width * row_bytes(self.gate_up_kind, s.hidden)?;
        let down = s.experts * s.hidden * row_bytes(self.down_kind, s.width)?;
        let bias = if self.router_bias.is_empty() {
            0
        } else {
            s.experts
        };
        let sizes = [
            ("x", x.len(), s.tokens * s.hidden),
            ("router", self.router.len(), s.experts * s.hidden),
            ("router_bias", self.router_bias.len(), bias),
            ("gate", self.gate.len(), gate_up),
            ("up", self.up.len(), gate_up),
            ("down", self.down.len(), down),
            ("y", y.len(), s.tokens * s.hidden),
        ];
        for (name, got, want) in sizes {
            if got != want {
                return Err(format!("{name} has {got} elements, its shape says {want}"));
            }
        }
        Ok(())
    }
}

/// Tokens per unit of the router's parallel product.
const ROUTER_TOKENS_PER_UNIT: usize = 16;

/// Each live token's `top_k` experts (row `t * top_k + j`: token `t`'s `j`-th,
/// by falling weight) and their weights.
pub fn route(
    s: &FfnShape,
    weights: &FfnWeights,
    router: Router,
    x: &[f32],
    live_tokens: usize,
    parallel: &dyn Parallel,
) -> Result<(Vec<i32>, Vec<f32>), String> {
    let mut logits = vec![0.0f32; live_tokens * s.experts];
    let out = OutPtr::new(&mut logits);
    let unit = |index: usize| {
        let first = index * ROUTER_TOKENS_PER_UNIT;
        let rows = ROUTER_TOKENS_PER_UNIT.min(live_tokens - first);
        let shape = MatmulShape {
            rows,
            inner: s.hidden,
            outs: s.experts,
        };
        let x = &x[first * s.hidden..][..rows * s.hidden];
        // SAFETY: `x` and `router` passed `validate`; each unit writes its own
        // tokens' logits, `rows * experts` elements from `first * experts`.
        unsafe {
            let y = OutPtr::new(std::slice::from_raw_parts_mut(
                out.at(first * s.experts),
                rows * s.experts,
            ));
            for tile in 0..cpu_matmul::tiles(&shape) {
                cpu_matmul::matmul_nt_tile(&shape, x, weights.router, y, tile);
            }
        }
    };
    parallel.run(live_tokens.div_ceil(ROUTER_TOKENS_PER_UNIT), &unit)?;
    let k = s.top_k;
    let mut ids = vec![0i32; live_tokens * k];
    let mut gates = vec![0.0f32; live_tokens * k];
    for (t, logits) in logits.chunks_exact_mut(s.experts).enumerate() {
        for (logit, bias) in logits.iter_mut().zip(weights.router_bias) {
            *logit += bias;
        }
        let (ids, gates) = (&mut ids[t * k..][..k], &mut gates[t * k..][..k]);
        top_k(logits, ids, gates);
        match router {
            Router::SoftmaxTopK { renormalize } => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = logits.iter().map(|l| (l - max).exp()).sum();
                for g in gates.iter_mut() {
                    *g = (*g - max).exp() / total;
                }
                if renormalize {
                    let kept: f32 = gates.iter().sum();
                    gates.iter_mut().for_each(|g| *g /= kept);
                }
            }
            Router::TopKSoftmax => {
                let max = gates[0];
                gates.iter_mut().for_each(|g| *g = (*g - max).exp());
                let total: f32 = gates.iter().sum();
                gates.iter_mut().for_each(|g| *g /= total);
            }
        }
    }
    Ok((ids, gates))
}

/// The `ids.len()` largest of `logits`, largest first (ties: lower id first),
/// into `ids` and their logits into `values`. NaN is never picked over a number.
fn top_k(logits: &[f32], ids: &mut [i32], values: &mut [f32]) {
    let mut taken = vec![false; logits.len()];
    for (id, value) in ids.iter_mut().zip(values.iter_mut()) {
        let mut best: Option<usize> = None;
        for (e, &l) in logits.iter().enumerate() {
            let better = match best {
                None => true,
                Some(b) => l > logits[b] || (logits[b].is_nan() && !l.is_nan()),
            };
            if !taken[e] && better {
                best = Some(e);
            }
        }
        let best = best.expect("top_k <= experts, checked");
        taken[best] = true;
        *id = best as i32;
        *value = logits[best];
    }
}

/// `silu(gate) * up`, SwiGLU's activation.
fn swiglu(gate: f32, up: f32) -> f32 {
    gate / (1.0 + (-gate).exp()) * up
}

/// The routed rows' products with one weight of every routed expert: `x` the
/// rows in routing order (`inner` each), `w` the experts' blocks back to back,
/// `outs` weight rows each; into `y` (`outs` per row, routing order).
struct Products<'a> {
    shapes: Vec<QuantShape>,
    inputs: Vec<Inputs<'a>>,
    /// The weights are packed into tiles (`qmatmul::tile_packed`).
    packed: bool,
}

impl<'a> Products<'a> {
    fn prepare(
        routing: &Routing,
        (kind, packed): (QuantType, bool),
        x: &'a [f32],
        inner: usize,
        outs: usize,
    ) -> Self {
        let mut shapes = Vec::with_capacity(routing.experts.len());
        let mut inputs = Vec::with_capacity(routing.experts.len());
        for i in 0..routing.experts.len() {
            let rows = routing.rows_of(i);
            let shape = QuantShape {
                kind,
                rows: rows.len(),
                inner,
                outs,
            };
            let x = &x[rows.start * inner..rows.end * inner];
            inputs.push(if packed {
                Inputs::prepare_packed(&shape, x)
            } else {
                Inputs::prepare(&shape, x)
            });
            shapes.push(shape);
        }
        Products {
            shapes,
            inputs,
            packed,
        }
    }

    /// Tile `tile` of routed expert `i`'s product with `w` into `y`.
    ///
    /// # Safety
    /// `w` holds every expert's blocks for these shapes, `y` `outs` floats per
    /// routed row; no other thread writes the same (expert, tile).
    unsafe fn tile(&self, routing: &Routing, w: &[u8], y: OutPtr, i: usize, tile: usize) {
        let shape = &self.shapes[i];
        let bytes = shape.outs * shape.kind.row_bytes(shape.inner).expect("validated");
        let w = &w[routing.experts[i] * bytes..][..bytes];
        let y = OutPtr::new(std::slice::from_raw_parts_mut(
            y.at(routing.rows_of(i).start * shape.outs),
            shape.rows * shape.outs,
        ));
        if self.packed {
            qmatmul::tile_packed(shape, &self.inputs[i], w, y, tile);
        } else {
            qmatmul::tile(shape, &self.inputs[i], w, &[], y, tile);
        }
    }

    /// Ask the cache (L2) for the weight rows of tile `tile` of routed expert
    /// `i` in `w`: a hint, which never faults. (A packed tile holds the same
    /// bytes as its rows, in another order.)
    fn prefetch(&self, routing: &Routing, w: &[u8], i: usize, tile: usize) {
        let shape = &self.shapes[i];
        let row_bytes = shape.kind.row_bytes(shape.inner).expect("validated");
        let start = tile * quant_call::OUTS_PER_TILE;
        let end = (start + quant_call::OUTS_PER_TILE).min(shape.outs);
        let base = routing.experts[i] * shape.outs * row_bytes;
        let bytes = &w[base + start * row_bytes..base + end * row_bytes];
        #[cfg(target_arch = "x86_64")]
        for line in bytes.chunks(64) {
            // SAFETY: a prefetch of an address inside `w`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    line.as_ptr().cast(),
                )
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bytes;
    }
}

/// The (matrix, tile) of unit `index + 2` of a region of `matrices` matrices
/// of `tiles` tiles each (unit = matrix * tiles + tile), where it lies in
/// another matrix than unit `index`.
///
/// The kernel asks for the tile after next of its own matrix; where that tile
/// is another matrix's (another routed expert, elsewhere in memory), the
/// caller asks for it, or that matrix starts cold (a one-token layer 120-153
/// -> 111-112 us with `SharedJob`'s counting, 2026-11-28; benches/RESULTS.md).
fn after_next_in_another_matrix(
    index: usize,
    matrices: usize,
    tiles: usize,
) -> Option<(usize, usize)> {
    let ahead = index + 2;
    (ahead < matrices * tiles && ahead / tiles != index / tiles)
        .then_some((ahead / tiles, ahead % tiles))
}

/// `y[t] = Σ_j gate_tj · down_e(swiglu(gate_e(x_t), up_e(x_t)))` over token
/// `t`'s routed experts `e` (module docs), zeros for the padding tokens.
pub fn expert_ffn(
    s: &FfnShape,
    weights: &FfnWeights,
    router: Router,
    x: &[f32],
    live_tokens: usize,
    y: &mut [f32],
    parallel: &dyn Parallel,
) -> Result<(), String> {
    weights.validate(s, x, y)?;
    if live_tokens > s.tokens {
        return Err(format!(
            "live_tokens {live_tokens} is outside [0, {}]",
            s.tokens
        ));
    }
    y.fill(0.0);
    if live_tokens == 0 {
        return Ok(());
    }
    let (ids, gates) = route(s, weights, router, x, live_tokens, parallel)?;
    let routing = Routing::new(&ids, s.experts)?;
    let (k, hidden, width) = (s.top_k, s.hidden, s.width);
    let mut rows = Vec::with_capacity(ids.len() * hidden);
    for &row in &routing.order {
        rows.extend_from_slice(&x[row / k * hidden..][..hidden]);
    }
    // Gate and up: one region, units (which, routed expert, tile).
    let mut gate_y = vec![0.0f32; ids.len() * width];
    let mut up_y = vec![0.0f32; ids.len() * width];
    let gate_up = (weights.gate_up_kind, weights.gate_up_packed);
    let first = Products::prepare(&routing, gate_up, &rows, hidden, width);
    let tiles = width.div_ceil(quant_call::OUTS_PER_TILE);
    let routed = routing.experts.len();
    let (gate_out, up_out) = (OutPtr::new(&mut gate_y), OutPtr::new(&mut up_y));
    let unit = |index: usize| {
        let (which, i, tile) = (
            index / (routed * tiles),
            index / tiles % routed,
            index % tiles,
        );
        let (w, out) = if which == 0 {
            (weights.gate, gate_out)
        } else {
            (weights.up, up_out)
        };
        // SAFETY: shapes validated; each (which, expert, tile) is one unit.
        unsafe { first.tile(&routing, w, out, i, tile) };
        if let Some((matrix, tile)) = after_next_in_another_matrix(index, 2 * routed, tiles) {
            let w = if matrix < routed {
                weights.gate
            } else {
                weights.up
            };
            first.prefetch(&routing, w, matrix % routed, tile);
        }
    };
    parallel.run(2 * routed * tiles, &unit)?;
    for (g, u) in gate_y.iter_mut().zip(&up_y) {
        *g = swiglu(*g, *u);
    }
    // Down: units (routed expert, tile).
    let mut down_y = vec![0.0f32; ids.len() * hidden];
    let down = (weights.down_kind, weights.down_packed);
    let second = Products::prepare(&routing, down, &gate_y, width, hidden);
    let tiles = hidden.div_ceil(quant_call::OUTS_PER_TILE);
    let down_out = OutPtr::new(&mut down_y);
    let unit = |index: usize| {
        // SAFETY: as above.
        unsafe {
            second.tile(
                &routing,
                weights.down,
                down_out,
                index / tiles,
                index % tiles,
            )
        };
        if let Some((i, tile)) = after_next_in_another_matrix(index, routed, tiles) {
            second.prefetch(&routing, weights.down, i, tile);
        }
    };
    parallel.run(routed * tiles, &unit)?;
    // Each token's experts in `j` order, weighted.
    let mut position = vec![0usize; ids.len()];
    for (p, &row) in routing.order.iter().enumerate() {
        position[row] = p;
    }
    for (row, &p) in position.iter().enumerate() {
        let (out, gate) = (&mut y[row / k * hidden..][..hidden], gates[row]);
        for (o, d) in out.iter_mut().zip(&down_y[p * hidden..][..hidden]) {
            *o += gate * d;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::after_next_in_another_matrix;

    #[test]
    fn the_unit_after_next_is_named_only_across_a_matrix_boundary() {
        // 3 matrices of 4 tiles: units 0..12.
        let named: Vec<_> = (0..12)
            .map(|i| after_next_in_another_matrix(i, 3, 4))
            .collect();
        let mut want = vec![None; 12];
        want[2] = Some((1, 0));
        want[3] = Some((1, 1));
        want[6] = Some((2, 0));
        want[7] = Some((2, 1));
        assert_eq!(named, want);
        // One tile a matrix: every unit after next is another matrix's.
        assert_eq!(after_next_in_another_matrix(0, 3, 1), Some((2, 0)));
        assert_eq!(after_next_in_another_matrix(1, 3, 1), None);
    }
}
