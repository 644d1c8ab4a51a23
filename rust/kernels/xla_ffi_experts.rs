//! XLA FFI handlers of the mixture-of-experts linear layers
//! ([`crate::kernels::expert_matmul`]).
//!
//! - `kvpage_expert_qmatmul_<name>`, one per quantized format (`q8_0`, `q4_0`,
//!   `q4_1`, `q4_k`, `q6_k`, `int8`, as `kvpage_qmatmul_<name>`): arguments
//!   `x [N, K]` f32, `w [E, M, row_bytes(K)]` (u8, or s8 for int8: the GGUF
//!   blocks of `E` experts' `[M, K]` weights back to back), for int8
//!   `row_scales [E * M]` f32, `expert_ids [N]` s32, `live_rows [1]` s32;
//!   result `y [N, M]` f32.
//! - `kvpage_expert_matmul`: arguments `x [N, K]` f32, `w [E, M, K]` f32 or
//!   bf16, `expert_ids [N]` s32, `live_rows [1]` s32; result `y [N, M]` f32.
//!
//! `y[n] = x[n] · W[expert_ids[n]]ᵀ` for `n < live_rows`, zeros after; the ids
//! of padding rows are never read, a live row's id outside `[0, E)` is an
//! error. Rows are grouped by expert on the calling thread, then units of
//! (routed expert, tile of weight rows) run on XLA's intra-op pool; only the
//! routed experts' weights are read.
//!
//! The invariants of [`crate::kernels::xla_ffi`] hold: nothing is read before
//! count, dtype, rank and size are checked; no panic crosses the boundary.

use std::ffi::c_void;

use super::expert_matmul::{expert_matmul, expert_qmatmul, ExpertShape, Routed};
use super::kv_element::Bf16;
use super::quant::formats::QuantType;
use super::xla_ffi::{
    buffers, handle, CallFrame, View, XlaPool, DTYPE_BF16, DTYPE_F32, DTYPE_S32, DTYPE_S8, DTYPE_U8,
};
use super::xla_ffi_quant::live_rows;

/// The buffer of `view` as `len()` elements of `T` (empty for no elements,
/// whose data pointer XLA may leave null).
///
/// # Safety
/// `view` is a buffer of XLA's whose elements are `T`s.
unsafe fn slice_of<'a, T>(view: &View) -> &'a [T] {
    match view.len() {
        0 => &[],
        len => std::slice::from_raw_parts(view.data as *const T, len),
    }
}

/// As [`slice_of`], writable.
///
/// # Safety
/// As [`slice_of`], and nothing else reads or writes the buffer meanwhile.
unsafe fn slice_of_mut<'a, T>(view: &View) -> &'a mut [T] {
    match view.len() {
        0 => &mut [],
        len => std::slice::from_raw_parts_mut(view.data as *mut T, len),
    }
}

/// A call's routed rows and its result, checked for rank, dtype and shape.
struct Operands<'a> {
    routed: Routed<'a>,
    y: &'a mut [f32],
}

/// Check `x`, `w` (rank and shape; its dtype is the caller's to check),
/// `expert_ids`, `live_rows` and `y`, whose weight rows hold `w_row` elements
/// (`None`: no size fits `x`'s inner size).
unsafe fn operands<'a>(
    x: &View,
    w: &View,
    ids: &View,
    live: &View,
    y: &View,
    w_row: Option<usize>,
) -> Result<Operands<'a>, String> {
    let ranks = [
        (x, "x", 2),
        (w, "w", 3),
        (ids, "expert_ids", 1),
        (y, "y", 2),
    ];
    for (view, name, rank) in ranks {
        if view.dims.len() != rank {
            return Err(format!(
                "{name} has rank {}, expected {rank}",
                view.dims.len()
            ));
        }
    }
    if x.dtype != DTYPE_F32 || y.dtype != DTYPE_F32 {
        return Err("x and y must be float32".into());
    }
    if ids.dtype != DTYPE_S32 {
        return Err(format!("expert_ids must be int32, got dtype {}", ids.dtype));
    }
    let shape = ExpertShape {
        rows: x.dims[0],
        inner: x.dims[1],
        outs: w.dims[1],
        experts: w.dims[0],
    };
    if w_row != Some(w.dims[2]) || ids.dims != [shape.rows] || y.dims != [shape.rows, shape.outs] {
        return Err(format!(
            "inconsistent shapes: x {:?}, w {:?} (rows of {w_row:?} elements expected), \
             expert_ids {:?}, y {:?}",
            x.dims, w.dims, ids.dims, y.dims
        ));
    }
    Ok(Operands {
        routed: Routed {
            shape,
            x: slice_of(x),
            expert_ids: slice_of(ids),
            live_rows: live_rows(live, shape.rows)?,
        },
        y: slice_of_mut(y),
    })
}

unsafe fn run_expert_qmatmul(frame: &CallFrame, kind: QuantType) -> Result<(), String> {
    let want = if kind.row_scaled() { 5 } else { 4 };
    let args = buffers(&frame.args, "arguments", want)?;
    let rets = buffers(&frame.rets, "results", 1)?;
    let (x, w, ids, live) = (&args[0], &args[1], &args[want - 2], &args[want - 1]);
    if w.dtype != DTYPE_U8 && w.dtype != DTYPE_S8 {
        return Err(format!(
            "w must be uint8 or int8 blocks, got dtype {}",
            w.dtype
        ));
    }
    let inner = x.dims.get(1).copied().unwrap_or(0);
    let call = operands(x, w, ids, live, &rets[0], kind.row_bytes(inner))?;
    let row_scales: &[f32] = if kind.row_scaled() {
        let scales = &args[2];
        let want = call.routed.shape.experts * call.routed.shape.outs;
        if scales.dtype != DTYPE_F32 || scales.dims != [want] {
            return Err(format!("row_scales must be float32 [{want}]"));
        }
        slice_of(scales)
    } else {
        &[]
    };
    expert_qmatmul(
        &call.routed,
        kind,
        slice_of(w),
        row_scales,
        call.y,
        &XlaPool { frame },
    )
}

unsafe fn run_expert_matmul(frame: &CallFrame) -> Result<(), String> {
    let args = buffers(&frame.args, "arguments", 4)?;
    let rets = buffers(&frame.rets, "results", 1)?;
    let [x, w, ids, live] = &args[..] else {
        unreachable!("four arguments checked")
    };
    let inner = x.dims.get(1).copied();
    let call = operands(x, w, ids, live, &rets[0], inner)?;
    let pool = XlaPool { frame };
    match w.dtype {
        DTYPE_F32 => expert_matmul::<f32>(&call.routed, slice_of(w), call.y, &pool),
        DTYPE_BF16 => expert_matmul::<Bf16>(&call.routed, slice_of(w), call.y, &pool),
        other => Err(format!("w must be float32 or bfloat16, got dtype {other}")),
    }
}

/// XLA FFI handler: `y[n] = x[n] · W[expert_ids[n]]ᵀ` with float32 or bfloat16
/// experts (module docs).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn kvpage_expert_matmul(frame: *mut c_void) -> *mut c_void {
    handle(frame.cast(), "kvpage_expert_matmul", run_expert_matmul)
}

macro_rules! handlers {
    ($($kind:expr => $name:ident;)*) => {$(
        /// XLA FFI handler: `y[n] = x[n] · dequant(W[expert_ids[n]])ᵀ` for one
        /// weight format (module docs).
        ///
        /// # Safety
        /// Called by XLA with a valid call frame.
        #[no_mangle]
        pub unsafe extern "C" fn $name(frame: *mut c_void) -> *mut c_void {
            unsafe fn body(frame: &CallFrame) -> Result<(), String> {
                run_expert_qmatmul(frame, $kind)
            }
            handle(frame.cast(), stringify!($name), body)
        }
    )*};
}

handlers! {
    QuantType::Q8_0 => kvpage_expert_qmatmul_q8_0;
    QuantType::Q4_0 => kvpage_expert_qmatmul_q4_0;
    QuantType::Q4_1 => kvpage_expert_qmatmul_q4_1;
    QuantType::Q4K => kvpage_expert_qmatmul_q4_k;
    QuantType::Q6K => kvpage_expert_qmatmul_q6_k;
    QuantType::Int8 => kvpage_expert_qmatmul_int8;
    QuantType::Q5_0 => kvpage_expert_qmatmul_q5_0;
    QuantType::Q5_1 => kvpage_expert_qmatmul_q5_1;
}
