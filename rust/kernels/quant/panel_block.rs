//! The register block of the quantized panel float path, shared by its AVX2
//! (`qmatmul_avx2.rs`) and AVX-512 (`panel_avx512.rs`) kernels: where one
//! block of input rows x weight rows reads its span and keeps its sums.

use std::arch::x86_64::__m256;

use super::call::OUTS_PER_TILE;

/// Inner elements of a tile's weight rows expanded to float at once (a
/// multiple of every format's block, so a span never splits one): the
/// tile's span, 16 x 256 floats, stays in L1 while every input row reads it.
pub(super) const PANEL_INNER: usize = 256;

/// One block of input rows x weight rows over one span: `acc[r][o] += x[r] *
/// panel[o]`, eight lanes at a time.
pub(super) struct Block {
    /// The first weight row's span, rows `PANEL_INNER` apart.
    pub(super) panel: *const f32,
    /// The first input row's span, rows `x_stride` apart.
    pub(super) x: *const f32,
    pub(super) x_stride: usize,
    pub(super) len: usize,
    /// The first row's first accumulator, rows `OUTS_PER_TILE` apart.
    pub(super) acc: *mut __m256,
}

impl Block {
    /// The block of input rows from `r` and weight rows from `o` over the
    /// span `span..span + len` of a tile: `panel` its expanded weight rows,
    /// `x` the call's input rows (`inner` apart), `acc` the tile's
    /// accumulators.
    ///
    /// # Safety
    /// `r` and `o` index rows of the call and of the tile's panel and
    /// accumulators; `span + len <= inner`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) unsafe fn at(
        panel: *const f32,
        x: &[f32],
        inner: usize,
        span: usize,
        len: usize,
        acc: *mut __m256,
        r: usize,
        o: usize,
    ) -> Block {
        Block {
            panel: panel.add(o * PANEL_INNER),
            x: x.as_ptr().add(r * inner + span),
            x_stride: inner,
            len,
            acc: acc.add(r * OUTS_PER_TILE + o),
        }
    }
}
