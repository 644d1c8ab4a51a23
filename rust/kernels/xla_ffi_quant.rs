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

unsafe fn run_qmatmul(frame: &CallFrame, kind: QuantType, invariant: bool) -> Result<(), String> {
    let want = if kind.row_scaled() { 4 } else { 3 };
    let args = buffers(&frame.args, "arguments", want)?;
    let mut rets = buffers(&frame.rets, "results", 1)?;
    let (x, w) = (&args[0], &args[1]);
    let y = &mut rets[0];
    for (view, name) in [(x, "x"), (w, "w"), (&*y, "y")] {
        if view.dims.len() != 2 {
            return Err(format!("{name} has rank {}, expected 2", view.dims.len()));
        }
    }
    if x.dtype != DTYPE_F32 || y.dtype != DTYPE_F32 {
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
    let row_scales: &[f32] = if kind.row_scaled() {
        let scales = &args[2];
        if scales.dtype != DTYPE_F32 || scales.dims != [shape.outs] {
            return Err(format!("row_scales must be float32 [{}]", shape.outs));
        }
        std::slice::from_raw_parts(scales.data as *const f32, scales.len())
    } else {
        &[]
    };
    let x_s = std::slice::from_raw_parts(x.data as *const f32, x.len());
    let w_s = std::slice::from_raw_parts(w.data as *const u8, w.len());
    let y_s = std::slice::from_raw_parts_mut(y.data as *mut f32, y.len());
    call::validate(&shape, x_s, w_s, row_scales, y_s)?;
    let live = live_rows(&args[want - 1], shape.rows)?;
    let (y_s, padding) = y_s.split_at_mut(live * shape.outs);
    padding.fill(0.0);
    if live == 0 {
        return Ok(());
    }
    let shape = QuantShape {
        rows: live,
        ..shape
    };
    let x_s = &x_s[..live * shape.inner];
    let inputs = if invariant {
        Inputs::float_path(x_s)
    } else {
        Inputs::prepare(&shape, x_s)
    };
    let out = OutPtr::new(y_s);
    // SAFETY: validated; each tile is claimed by exactly one thread.
    let tile =
        |index: usize| unsafe { qmatmul::tile(&shape, &inputs, w_s, row_scales, out, index) };
    XlaPool { frame }.run(call::tiles(&shape), &tile)
}

unsafe fn run_dequantize(frame: &CallFrame, kind: QuantType) -> Result<(), String> {
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
    // SAFETY: validated; each tile is claimed by exactly one thread.
    let tile = |index: usize| unsafe {
        dequantize::dequantize_tile(kind, inner, w_s, row_scales, target, outs, index)
    };
    XlaPool { frame }.run(outs.div_ceil(call::OUTS_PER_TILE), &tile)
}

macro_rules! handlers {
    ($($kind:expr => $qmatmul:ident, $invariant:ident, $dequantize:ident;)*) => {$(
        /// XLA FFI handler: `y = x · dequant(w)ᵀ` for one weight format (module docs).
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $qmatmul(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_qmatmul(frame, $kind, false)
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
                run_qmatmul(frame, $kind, true)
            }
            handle(frame.cast(), stringify!($invariant), body)
        }

        /// XLA FFI handler: the float weights `[N, K]` of one format's blocks
        /// (module docs), for products of many rows.
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $dequantize(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_dequantize(frame, $kind)
            }
            handle(frame.cast(), stringify!($dequantize), body)
        }
    )*};
}

handlers! {
    QuantType::Q8_0 => kvpage_qmatmul_q8_0, kvpage_qmatmul_invariant_q8_0, kvpage_dequantize_q8_0;
    QuantType::Q4_0 => kvpage_qmatmul_q4_0, kvpage_qmatmul_invariant_q4_0, kvpage_dequantize_q4_0;
    QuantType::Q4_1 => kvpage_qmatmul_q4_1, kvpage_qmatmul_invariant_q4_1, kvpage_dequantize_q4_1;
    QuantType::Q4K => kvpage_qmatmul_q4_k, kvpage_qmatmul_invariant_q4_k, kvpage_dequantize_q4_k;
    QuantType::Q6K => kvpage_qmatmul_q6_k, kvpage_qmatmul_invariant_q6_k, kvpage_dequantize_q6_k;
    QuantType::Int8 => kvpage_qmatmul_int8, kvpage_qmatmul_invariant_int8, kvpage_dequantize_int8;
    QuantType::Q5_0 => kvpage_qmatmul_q5_0, kvpage_qmatmul_invariant_q5_0, kvpage_dequantize_q5_0;
    QuantType::Q5_1 => kvpage_qmatmul_q5_1, kvpage_qmatmul_invariant_q5_1, kvpage_dequantize_q5_1;
}

/// 1 when the quantized kernels run vectorized (AVX2 + FMA + F16C) here, 0 for
/// the portable loop.
#[no_mangle]
pub extern "C" fn kvpage_qmatmul_vectorized() -> i32 {
    i32::from(call::vectorized())
}

/// The rows the integer path reads at once for the format of FFI code `code`
/// here ([`qmatmul::integer_rows`]; from 2 on, any row count takes it in
/// blocks of that many), or 0 for an unknown code.
#[no_mangle]
pub extern "C" fn kvpage_qmatmul_integer_rows(code: i32) -> i32 {
    usize::try_from(code)
        .ok()
        .and_then(|code| QuantType::ALL.get(code))
        .map_or(0, |kind| qmatmul::integer_rows(*kind) as i32)
}
