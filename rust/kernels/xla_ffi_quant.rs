//! XLA FFI handlers of the quantized linear layers ([`crate::kernels::quant`]).
//!
//! One C symbol per weight format, `kvpage_qmatmul_<name>` (`q8_0`, `q4_0`,
//! `q4_1`, `q4_k`, `q6_k`, `int8`, `q5_0`, `q5_1`), so the format is part of the target and no
//! attribute has to be parsed. Arguments: `x [T, K]` f32, `w [N, row_bytes]`
//! (u8, or s8 for int8), for int8 `row_scales [N]` f32, then `live_rows [1]`
//! s32; result `y [T, N]` f32. Only the first `live_rows` rows of `x` are
//! multiplied (the rest of a padded step's rows are padding); the result's
//! other rows are zeros. The live inputs are prepared once on the calling
//! thread (quantized for a single row, [`crate::kernels::quant::qmatmul`]),
//! then tiles of weight rows run on XLA's intra-op pool.
//!
//! `kvpage_qmatmul_multi_<name>` multiplies one `x` by up to
//! [`MAX_MULTI_WEIGHTS`] weights of the format (a layer's q/k/v, or gate and
//! up): arguments `x`, the weights, for int8 their row scales, then
//! `live_rows`; one result per weight. `x` is prepared once and all tiles run
//! in one hand-over to the pool (one-row q/k/v of bench moe's model: 31-36 ->
//! 26-29 us a layer, 2026-11-28).
//!
//! `kvpage_qmatmul_tiles_<name>`, `kvpage_qmatmul_multi_tiles_<name>` and
//! `kvpage_dequantize_tiles_<name>` (Q4_0, Q4_1) are the same calls on weights
//! packed into tiles of sixteen rows (`quant::tiles::pack_tiles`).
//!
//! `kvpage_qmatmul_invariant_<name>` is the same call with every row count on the
//! float path (batch-invariant inference: a row's result never depends on the
//! call's other rows).
//!
//! `kvpage_dequantize_<name>` takes `w` (and `row_scales`) and returns the float
//! weights `[N, K]`, for products of many rows, which XLA's GEMM runs.
//!
//! The invariants of [`crate::kernels::xla_ffi`] hold: nothing is read before
//! count, dtype, rank and size are checked; no panic crosses the boundary.

use std::ffi::c_void;

use super::cpu_matmul::OutPtr;
use super::parallel::Parallel;
use super::quant::call::{self, QuantShape};
use super::quant::dequantize;
use super::quant::formats::QuantType;
use super::quant::qmatmul::{self, Inputs};
use super::quant::tiles;
use super::xla_ffi::{
    buffers, handle, CallFrame, View, XlaPool, DTYPE_F32, DTYPE_S32, DTYPE_S8, DTYPE_U8,
};

/// The live row count a call's last operand holds, checked against its `rows`
/// (also read by [`super::xla_ffi_experts`]).
pub(super) unsafe fn live_rows(view: &View, rows: usize) -> Result<usize, String> {
    if view.dtype != DTYPE_S32 || view.len() != 1 {
        return Err(format!(
            "live_rows must be one int32, got dtype {} dims {:?}",
            view.dtype, view.dims
        ));
    }
    let live = *(view.data as *const i32);
    match usize::try_from(live) {
        Ok(live) if live <= rows => Ok(live),
        _ => Err(format!("live_rows {live} is outside [0, {rows}]")),
    }
}

/// One product of a call: its shape, weight blocks, row scales and result,
/// checked against the call's `x` (the first `live` rows of `y` are computed,
/// the others zeroed by [`Product::zero_padding`]).
struct Product<'a> {
    shape: QuantShape,
    w: &'a [u8],
    row_scales: &'a [f32],
    y: &'a mut [f32],
}

impl Product<'_> {
    /// Zero `y`'s rows from `live` on and narrow the product to the live rows.
    fn zero_padding(&mut self, live: usize) {
        self.y[live * self.shape.outs..].fill(0.0);
        self.shape.rows = live;
    }
}

/// Check `x` (float32 `[T, K]`): the operand every product of a call reads.
unsafe fn checked_x<'a>(x: &View) -> Result<&'a [f32], String> {
    if x.dims.len() != 2 {
        return Err(format!("x has rank {}, expected 2", x.dims.len()));
    }
    if x.dtype != DTYPE_F32 {
        return Err("x and y must be float32".into());
    }
    Ok(std::slice::from_raw_parts(x.data as *const f32, x.len()))
}

/// Check one product `y = x · dequant(w)ᵀ` of `kind` (`scales`: its row
/// scales, for row-scaled formats) before anything is read.
unsafe fn checked_product<'a>(
    kind: QuantType,
    x: &View,
    x_s: &[f32],
    w: &View,
    scales: Option<&View>,
    y: &View,
) -> Result<Product<'a>, String> {
    for (view, name) in [(w, "w"), (y, "y")] {
        if view.dims.len() != 2 {
            return Err(format!("{name} has rank {}, expected 2", view.dims.len()));
        }
    }
    if y.dtype != DTYPE_F32 {
        return Err("x and y must be float32".into());
    }
    if w.dtype != DTYPE_U8 && w.dtype != DTYPE_S8 {
        return Err(format!(
            "w must be uint8 or int8 blocks, got dtype {}",
            w.dtype
        ));
    }
    let shape = QuantShape {
        kind,
        rows: x.dims[0],
        inner: x.dims[1],
        outs: w.dims[0],
    };
    let row_bytes = kind.row_bytes(shape.inner);
    if row_bytes != Some(w.dims[1]) || y.dims != [shape.rows, shape.outs] {
        return Err(format!(
            "inconsistent shapes for {}: x {:?}, w {:?} (rows of {:?} bytes expected), y {:?}",
            kind.name(),
            x.dims,
            w.dims,
            row_bytes,
            y.dims
        ));
    }
    let row_scales: &[f32] = match scales {
        Some(scales) => {
            if scales.dtype != DTYPE_F32 || scales.dims != [shape.outs] {
                return Err(format!("row_scales must be float32 [{}]", shape.outs));
            }
            std::slice::from_raw_parts(scales.data as *const f32, scales.len())
        }
        None => &[],
    };
    let w_s = std::slice::from_raw_parts(w.data as *const u8, w.len());
    let y_s = std::slice::from_raw_parts_mut(y.data as *mut f32, y.len());
    call::validate(&shape, x_s, w_s, row_scales, y_s)?;
    Ok(Product {
        shape,
        w: w_s,
        row_scales,
        y: y_s,
    })
}

unsafe fn run_qmatmul(frame: &CallFrame, kind: QuantType, path: Path) -> Result<(), String> {
    let want = if kind.row_scaled() { 4 } else { 3 };
    let args = buffers(&frame.args, "arguments", want)?;
    let rets = buffers(&frame.rets, "results", 1)?;
    let x_s = checked_x(&args[0])?;
    let scales = kind.row_scaled().then(|| &args[2]);
    let mut product = checked_product(kind, &args[0], x_s, &args[1], scales, &rets[0])?;
    path.check(&product.shape)?;
    let live = live_rows(&args[want - 1], product.shape.rows)?;
    product.zero_padding(live);
    if live == 0 {
        return Ok(());
    }
    let x_s = &x_s[..live * product.shape.inner];
    let inputs = path.inputs(&product.shape, x_s);
    let Product {
        shape,
        w,
        row_scales,
        y,
    } = product;
    let out = OutPtr::new(y);
    // SAFETY: validated; each tile is claimed by exactly one thread.
    let tile = |index: usize| unsafe { path.tile(&shape, &inputs, w, row_scales, out, index) };
    XlaPool { frame }.run(call::tiles(&shape), &tile)
}

/// How a call reads its weights.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    /// GGUF's rows, the path the row count takes.
    Rows,
    /// GGUF's rows, every row count on the float path (batch-invariant).
    Invariant,
    /// Packed into tiles of sixteen rows (`quant::tiles::pack_tiles`).
    Tiles,
}

impl Path {
    /// Whether a product of `shape` can take this path here.
    fn check(self, shape: &QuantShape) -> Result<(), String> {
        if self == Path::Tiles && !qmatmul::packs(shape.kind, shape.outs) {
            return Err(format!(
                "{} weights of {} rows cannot be packed into tiles on this CPU",
                shape.kind.name(),
                shape.outs
            ));
        }
        Ok(())
    }

    /// `x` (validated for `shape`) as this path's kernels read it.
    fn inputs<'a>(self, shape: &QuantShape, x: &'a [f32]) -> Inputs<'a> {
        match self {
            Path::Rows => Inputs::prepare(shape, x),
            Path::Invariant => Inputs::float_path(x),
            Path::Tiles => Inputs::prepare_packed(shape, x),
        }
    }

    /// Tile `index` of a product on this path.
    ///
    /// # Safety
    /// As [`qmatmul::tile`] (and [`qmatmul::tile_packed`] for packed weights).
    unsafe fn tile(
        self,
        shape: &QuantShape,
        inputs: &Inputs,
        w: &[u8],
        row_scales: &[f32],
        y: OutPtr,
        index: usize,
    ) {
        match self {
            Path::Tiles => qmatmul::tile_packed(shape, inputs, w, y, index),
            _ => qmatmul::tile(shape, inputs, w, row_scales, y, index),
        }
    }
}

/// Most weights one `kvpage_qmatmul_multi_<name>` call multiplies.
pub const MAX_MULTI_WEIGHTS: usize = 4;

/// `y_m = x · dequant(w_m)ᵀ` for up to [`MAX_MULTI_WEIGHTS`] weights of one
/// format that read the same `x` (a layer's q/k/v, or gate and up): `x`
/// prepared once, and every weight's tiles units of one parallel run, so the
/// call costs one hand-over to the pool, not one per weight.
unsafe fn run_qmatmul_multi(frame: &CallFrame, kind: QuantType, path: Path) -> Result<(), String> {
    let count = usize::try_from(frame.rets.size).unwrap_or(0);
    if count == 0 || count > MAX_MULTI_WEIGHTS {
        return Err(format!(
            "expected 1 to {MAX_MULTI_WEIGHTS} results, got {}",
            frame.rets.size
        ));
    }
    let per_weight = if kind.row_scaled() { 2 } else { 1 };
    let args = buffers(&frame.args, "arguments", 2 + per_weight * count)?;
    let rets = buffers(&frame.rets, "results", count)?;
    let x_s = checked_x(&args[0])?;
    let mut products = Vec::with_capacity(count);
    for (m, y) in rets.iter().enumerate() {
        let scales = kind.row_scaled().then(|| &args[1 + count + m]);
        products.push(checked_product(
            kind,
            &args[0],
            x_s,
            &args[1 + m],
            scales,
            y,
        )?);
        path.check(&products[m].shape)?;
    }
    let live = live_rows(&args[1 + per_weight * count], args[0].dims[0])?;
    for product in &mut products {
        product.zero_padding(live);
    }
    if live == 0 {
        return Ok(());
    }
    let x_s = &x_s[..live * products[0].shape.inner];
    // Every product has x's rows and inner size, and `kind`: one preparation.
    let inputs = path.inputs(&products[0].shape, x_s);
    let mut first_tiles = Vec::with_capacity(count + 1);
    first_tiles.push(0);
    for product in &products {
        first_tiles.push(first_tiles.last().copied().unwrap_or(0) + call::tiles(&product.shape));
    }
    let targets: Vec<(QuantShape, &[u8], &[f32], OutPtr)> = products
        .into_iter()
        .map(|p| (p.shape, p.w, p.row_scales, OutPtr::new(p.y)))
        .collect();
    let tile = |index: usize| {
        let m = first_tiles.partition_point(|&first| first <= index) - 1;
        let (shape, w, row_scales, out) = &targets[m];
        // SAFETY: validated; each tile of each product is claimed by exactly one thread.
        unsafe { path.tile(shape, &inputs, w, row_scales, *out, index - first_tiles[m]) }
    };
    XlaPool { frame }.run(first_tiles[count], &tile)
}

unsafe fn run_dequantize(frame: &CallFrame, kind: QuantType, path: Path) -> Result<(), String> {
    let want = if kind.row_scaled() { 2 } else { 1 };
    let args = buffers(&frame.args, "arguments", want)?;
    let mut rets = buffers(&frame.rets, "results", 1)?;
    let (w, out) = (&args[0], &mut rets[0]);
    if w.dims.len() != 2 || out.dims.len() != 2 || out.dtype != DTYPE_F32 {
        return Err("expected w [N, row_bytes] and a float32 result [N, K]".into());
    }
    if w.dtype != DTYPE_U8 && w.dtype != DTYPE_S8 {
        return Err(format!(
            "w must be uint8 or int8 blocks, got dtype {}",
            w.dtype
        ));
    }
    let (outs, inner) = (out.dims[0], out.dims[1]);
    if w.dims[0] != outs || kind.row_bytes(inner) != Some(w.dims[1]) {
        return Err(format!(
            "inconsistent shapes for {}: w {:?}, result {:?}",
            kind.name(),
            w.dims,
            out.dims
        ));
    }
    let row_scales: &[f32] = if kind.row_scaled() {
        let scales = &args[1];
        if scales.dtype != DTYPE_F32 || scales.dims != [outs] {
            return Err(format!("row_scales must be float32 [{outs}]"));
        }
        std::slice::from_raw_parts(scales.data as *const f32, scales.len())
    } else {
        &[]
    };
    let w_s = std::slice::from_raw_parts(w.data as *const u8, w.len());
    let out_s = std::slice::from_raw_parts_mut(out.data as *mut f32, out.len());
    dequantize::validate_dequantize(kind, inner, w_s, row_scales, out_s)?;
    let target = OutPtr::new(out_s);
    if path == Path::Tiles {
        path.check(&QuantShape {
            kind,
            rows: 0,
            inner,
            outs,
        })?;
        let tile_bytes = call::OUTS_PER_TILE * w.dims[1];
        // Each tile back in row order (in cache), then dequantized as rows.
        let tile = |index: usize| {
            let mut rows = vec![0u8; tile_bytes];
            tiles::unpack_tile(
                kind,
                &w_s[index * tile_bytes..][..tile_bytes],
                inner,
                &mut rows,
            );
            let out = target.from(index * call::OUTS_PER_TILE * inner);
            // SAFETY: validated; each tile is claimed by exactly one thread.
            unsafe {
                dequantize::dequantize_tile(kind, inner, &rows, &[], out, call::OUTS_PER_TILE, 0)
            }
        };
        return XlaPool { frame }.run(outs / call::OUTS_PER_TILE, &tile);
    }
    // SAFETY: validated; each tile is claimed by exactly one thread.
    let tile = |index: usize| unsafe {
        dequantize::dequantize_tile(kind, inner, w_s, row_scales, target, outs, index)
    };
    XlaPool { frame }.run(outs.div_ceil(call::OUTS_PER_TILE), &tile)
}

macro_rules! handlers {
    ($($kind:expr => $qmatmul:ident, $invariant:ident, $multi:ident, $dequantize:ident;)*) => {$(
        /// XLA FFI handler: `y = x · dequant(w)ᵀ` for one weight format (module docs).
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $qmatmul(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_qmatmul(frame, $kind, Path::Rows)
            }
            handle(frame.cast(), stringify!($qmatmul), body)
        }

        /// XLA FFI handler: as the one above, every row count on the float path,
        /// so a row's result does not depend on the other rows (batch-invariant
        /// inference).
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $invariant(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_qmatmul(frame, $kind, Path::Invariant)
            }
            handle(frame.cast(), stringify!($invariant), body)
        }

        /// XLA FFI handler: several products of one format that read the same
        /// `x` in one call (module docs).
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $multi(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_qmatmul_multi(frame, $kind, Path::Rows)
            }
            handle(frame.cast(), stringify!($multi), body)
        }

        /// XLA FFI handler: the float weights `[N, K]` of one format's blocks
        /// (module docs), for products of many rows.
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $dequantize(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_dequantize(frame, $kind, Path::Rows)
            }
            handle(frame.cast(), stringify!($dequantize), body)
        }
    )*};
}

handlers! {
    QuantType::Q8_0 => kvpage_qmatmul_q8_0, kvpage_qmatmul_invariant_q8_0, kvpage_qmatmul_multi_q8_0, kvpage_dequantize_q8_0;
    QuantType::Q4_0 => kvpage_qmatmul_q4_0, kvpage_qmatmul_invariant_q4_0, kvpage_qmatmul_multi_q4_0, kvpage_dequantize_q4_0;
    QuantType::Q4_1 => kvpage_qmatmul_q4_1, kvpage_qmatmul_invariant_q4_1, kvpage_qmatmul_multi_q4_1, kvpage_dequantize_q4_1;
    QuantType::Q4K => kvpage_qmatmul_q4_k, kvpage_qmatmul_invariant_q4_k, kvpage_qmatmul_multi_q4_k, kvpage_dequantize_q4_k;
    QuantType::Q6K => kvpage_qmatmul_q6_k, kvpage_qmatmul_invariant_q6_k, kvpage_qmatmul_multi_q6_k, kvpage_dequantize_q6_k;
    QuantType::Int8 => kvpage_qmatmul_int8, kvpage_qmatmul_invariant_int8, kvpage_qmatmul_multi_int8, kvpage_dequantize_int8;
    QuantType::Q5_0 => kvpage_qmatmul_q5_0, kvpage_qmatmul_invariant_q5_0, kvpage_qmatmul_multi_q5_0, kvpage_dequantize_q5_0;
    QuantType::Q5_1 => kvpage_qmatmul_q5_1, kvpage_qmatmul_invariant_q5_1, kvpage_qmatmul_multi_q5_1, kvpage_dequantize_q5_1;
}

macro_rules! tile_handlers {
    ($($kind:expr => $qmatmul:ident, $multi:ident, $dequantize:ident;)*) => {$(
        /// XLA FFI handler: `kvpage_qmatmul_<name>` on weights packed into
        /// tiles (`quant::tiles::pack_tiles`).
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $qmatmul(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_qmatmul(frame, $kind, Path::Tiles)
            }
            handle(frame.cast(), stringify!($qmatmul), body)
        }

        /// XLA FFI handler: `kvpage_qmatmul_multi_<name>` on weights packed
        /// into tiles.
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $multi(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_qmatmul_multi(frame, $kind, Path::Tiles)
            }
            handle(frame.cast(), stringify!($multi), body)
        }

        /// XLA FFI handler: `kvpage_dequantize_<name>` of weights packed into
        /// tiles.
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $dequantize(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_dequantize(frame, $kind, Path::Tiles)
            }
            handle(frame.cast(), stringify!($dequantize), body)
        }
    )*};
}

tile_handlers! {
    QuantType::Q4_0 => kvpage_qmatmul_tiles_q4_0, kvpage_qmatmul_multi_tiles_q4_0, kvpage_dequantize_tiles_q4_0;
    QuantType::Q4_1 => kvpage_qmatmul_tiles_q4_1, kvpage_qmatmul_multi_tiles_q4_1, kvpage_dequantize_tiles_q4_1;
}

/// 1 when the quantized kernels run vectorized (AVX2 + FMA + F16C) here, 0 for
/// the portable loop.
#[no_mangle]
pub extern "C" fn kvpage_qmatmul_vectorized() -> i32 {
    i32::from(call::vectorized())
}

/// The rows the integer path reads at once for the format of FFI code `code`
/// here ([`qmatmul::integer_rows`]), or 0 for an unknown code.
#[no_mangle]
pub extern "C" fn kvpage_qmatmul_integer_rows(code: i32) -> i32 {
    usize::try_from(code)
        .ok()
        .and_then(|code| QuantType::ALL.get(code))
        .map_or(0, |kind| qmatmul::integer_rows(*kind) as i32)
}

/// 1 when calls of any row count of the format of FFI code `code` take the
/// integer path here, in blocks of [`kvpage_qmatmul_integer_rows`] rows
/// ([`qmatmul::integer_blocks`]), else 0.
#[no_mangle]
pub extern "C" fn kvpage_qmatmul_integer_blocks(code: i32) -> i32 {
    usize::try_from(code)
        .ok()
        .and_then(|code| QuantType::ALL.get(code))
        .map_or(0, |kind| i32::from(qmatmul::integer_blocks(*kind)))
}

/// 1 when weights of `outs` rows (FFI code `code`) may be packed into
/// tiles here (`qmatmul::packs`, `quant::tiles::pack_tiles`), else 0.
#[no_mangle]
pub extern "C" fn kvpage_qmatmul_packs(code: i32, outs: i64) -> i32 {
    let kind = usize::try_from(code)
        .ok()
        .and_then(|code| QuantType::ALL.get(code));
    match (kind, usize::try_from(outs)) {
        (Some(kind), Ok(outs)) => i32::from(qmatmul::packs(*kind, outs)),
        _ => 0,
    }
}
