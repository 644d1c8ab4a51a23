//! What every quantized call shares: its shape ([`QuantShape`]), the checks
//! before any read ([`validate`]), its split into tiles of weight rows
//! ([`OUTS_PER_TILE`], [`tiles`]) and the choice of kernels ([`vectorized`]).
//! A leaf beside [`super::formats`]: the product ([`super::qmatmul`]), its AVX2
//! kernels and the dequantization ([`super::dequantize`]) all depend on it.

use std::sync::OnceLock;

use super::formats::QuantType;

/// Shapes and weight format of one call (layout in [`super::qmatmul`]'s docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantShape {
    pub kind: QuantType,
    pub rows: usize,
    pub inner: usize,
    pub outs: usize,
}

/// Weight rows per unit of parallel work.
pub const OUTS_PER_TILE: usize = 16;

/// Check the invariants of [`super`] for a call of `shape`; `Err` names the
/// first violation.
pub fn validate(
    shape: &QuantShape,
    x: &[f32],
    w: &[u8],
    row_scales: &[f32],
    y: &[f32],
) -> Result<(), String> {
    let s = shape;
    let Some(row_bytes) = s.kind.row_bytes(s.inner) else {
        return Err(format!(
            "{} weights need an inner size that is a positive multiple of {}, got {}",
            s.kind.name(),
            s.kind.block_elems(),
            s.inner
        ));
    };
    let scales = if s.kind.row_scaled() { s.outs } else { 0 };
    let sizes = [
        ("x", x.len(), s.rows * s.inner),
        ("w", w.len(), s.outs * row_bytes),
        ("row_scales", row_scales.len(), scales),
        ("y", y.len(), s.rows * s.outs),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(format!("{name} has {got} elements, its shape says {want}"));
        }
    }
    Ok(())
}

/// Number of tiles of [`OUTS_PER_TILE`] weight rows a call splits into.
pub fn tiles(shape: &QuantShape) -> usize {
    shape.outs.div_ceil(OUTS_PER_TILE)
}

/// The row scale of weight row `out` (1 for types without one).
pub(super) fn row_scale(shape: &QuantShape, row_scales: &[f32], out: usize) -> f32 {
    if shape.kind.row_scaled() {
        row_scales[out]
    } else {
        1.0
    }
}

/// Whether calls run the AVX2 kernel (else the portable loop); chosen once per
/// process. `KVPAGE_CPU_MATMUL_PORTABLE=1` forces the portable loop.
pub fn vectorized() -> bool {
    static CHOSEN: OnceLock<bool> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if std::env::var("KVPAGE_CPU_MATMUL_PORTABLE").as_deref() == Ok("1") {
            return false;
        }
        detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> bool {
    false
}
