//! The float weights of quantized blocks, `scale * q + min` per weight: for
//! products of many rows, which XLA's GEMM then runs faster than the kernels of
//! [`super::qmatmul`] (`python/kvpage/kernels/host/cpu_qmatmul.py` picks by row
//! count).
//!
//! Owns [`validate_dequantize`], [`dequantize_tile`] (one tile of
//! [`OUTS_PER_TILE`] weight rows, the unit the XLA FFI handler runs on XLA's
//! thread pool) and the portable loop, which is [`dequantize_row`], the
//! reference. On AVX2 each sub-block is unpacked in registers
//! ([`super::unpack_avx2`]) and expanded with one FMA per 8 weights.

use super::call::{validate, vectorized, QuantShape, OUTS_PER_TILE};
use super::formats::{dequantize_row, QuantType};
use crate::kernels::cpu_matmul::OutPtr;

/// Validate a dequantization of `outs` rows of `inner` weights into `out`.
pub fn validate_dequantize(
    kind: QuantType,
    inner: usize,
    w: &[u8],
    row_scales: &[f32],
    out: &[f32],
) -> Result<(), String> {
    let outs = out.len().checked_div(inner).unwrap_or(0);
    let shape = QuantShape {
        kind,
        rows: 0,
        inner,
        outs,
    };
    validate(&shape, &[], w, row_scales, &[])?;
    if out.len() != outs * inner {
        return Err(format!(
            "out has {} elements, not a multiple of {inner}",
            out.len()
        ));
    }
    Ok(())
}

/// Rows `index * OUTS_PER_TILE ..` (one tile) of the float weights `out [outs,
/// inner]` (`scale * q + min`, one FMA each on AVX2): for products of many rows,
/// which XLA's GEMM then runs faster than [`tile`] does.
///
/// # Safety
/// [`validate_dequantize`] passed for these buffers; no other thread writes the
/// same tile.
pub unsafe fn dequantize_tile(
    kind: QuantType,
    inner: usize,
    w: &[u8],
    row_scales: &[f32],
    out: OutPtr,
    outs: usize,
    index: usize,
) {
    let start = index * OUTS_PER_TILE;
    let end = (start + OUTS_PER_TILE).min(outs);
    #[cfg(target_arch = "x86_64")]
    if vectorized() {
        return avx2::dequantize_rows(kind, inner, w, row_scales, out, start, end);
    }
    portable_dequantize_rows(kind, inner, w, row_scales, out, start, end)
}

/// Weight rows `start..end` of [`dequantize_tile`] through the portable loop.
///
/// # Safety
/// As [`dequantize_tile`], for rows `start..end`.
pub(crate) unsafe fn portable_dequantize_rows(
    kind: QuantType,
    inner: usize,
    w: &[u8],
    row_scales: &[f32],
    out: OutPtr,
    start: usize,
    end: usize,
) {
    let row_bytes = kind.row_bytes(inner).expect("validated");
    for o in start..end {
        let scale = if kind.row_scaled() {
            row_scales[o]
        } else {
            1.0
        };
        let values = dequantize_row(kind, &w[o * row_bytes..][..row_bytes], inner, scale);
        for (i, v) in values.into_iter().enumerate() {
            *out.at(o * inner + i) = v;
        }
    }
}

/// x86-64 with AVX2 + FMA + F16C: each sub-block unpacked and expanded in registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::kernels::cpu_matmul::OutPtr;
    use crate::kernels::quant::formats::{QuantType, SUB};
    use crate::kernels::quant::unpack_avx2::{by_format, expand, Format};
    use std::arch::x86_64::*;

    pub(super) unsafe fn dequantize_rows(
        kind: QuantType,
        inner: usize,
        w: &[u8],
        row_scales: &[f32],
        out: OutPtr,
        start: usize,
        end: usize,
    ) {
        by_format!(
            kind,
            dequantize_rows_of,
            (inner, w, row_scales, out, start, end)
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // `o` indexes the rows, the scales and the output
    unsafe fn dequantize_rows_of<F: Format>(
        inner: usize,
        w: &[u8],
        row_scales: &[f32],
        out: OutPtr,
        start: usize,
        end: usize,
    ) {
        let row_bytes = F::KIND.row_bytes(inner).expect("validated");
        let subs_per_block = F::KIND.block_elems() / SUB;
        for o in start..end {
            let row = w.as_ptr().add(o * row_bytes);
            let scale = if F::KIND.row_scaled() {
                row_scales[o]
            } else {
                1.0
            };
            for b in 0..inner / F::KIND.block_elems() {
                for j in 0..subs_per_block {
                    let sub = F::sub(row.add(b * F::KIND.block_bytes()), j, scale);
                    let base = o * inner + (b * subs_per_block + j) * SUB;
                    for (c, weight) in expand::<F>(&sub).iter().enumerate() {
                        _mm256_storeu_ps(out.at(base + 8 * c), *weight);
                    }
                }
            }
        }
    }
}
