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
//! - `kvpage_expert_ffn`: a whole routed MoE feed-forward
//!   ([`crate::kernels::expert_ffn`]): arguments `x [T, H]` f32, `router [E,
//!   H]` f32, `router_bias [E]` or `[0]` f32, `gate [E, M, row_bytes(H)]`,
//!   `up` (same), `down [E, H, row_bytes(M)]` (u8 blocks), `live_tokens [1]`
//!   s32, `config [6]` s32: the index in `QuantType::ALL` of gate's and up's
//!   format, of down's, `top_k`, the router (0: softmax then top-k, 1: the
//!   same renormalised, 2: top-k then softmax), and whether gate and up, and
//!   down, are packed into tiles (1) or GGUF rows (0,
//!   `quant::tiles::pack_tiles`); result `y [T, H]` f32.
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

use super::expert_ffn::{expert_ffn, FfnShape, FfnWeights, Router};
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

/// `Err` naming the first of `views` (view, name, rank) whose rank differs.
fn check_ranks(views: &[(&View, &str, usize)]) -> Result<(), String> {
    for &(view, name, rank) in views {
        if view.dims.len() != rank {
            return Err(format!(
                "{name} has rank {}, expected {rank}",
                view.dims.len()
            ));
        }
    }
    Ok(())
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
    check_ranks(&[
        (x, "x", 2),
        (w, "w", 3),
        (ids, "expert_ids", 1),
        (y, "y", 2),
    ])?;
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

/// The format whose index in [`QuantType::ALL`] is `index`.
fn kind_at(index: i32, what: &str) -> Result<QuantType, String> {
    usize::try_from(index)
        .ok()
        .and_then(|i| QuantType::ALL.get(i).copied())
        .ok_or_else(|| format!("{what} format index {index} names no format"))
}

unsafe fn run_expert_ffn(frame: &CallFrame) -> Result<(), String> {
    let args = buffers(&frame.args, "arguments", 8)?;
    let rets = buffers(&frame.rets, "results", 1)?;
    let [x, router, bias, gate, up, down, live, config] = &args[..] else {
        unreachable!("eight arguments checked")
    };
    let y = &rets[0];
    check_ranks(&[
        (x, "x", 2),
        (router, "router", 2),
        (bias, "router_bias", 1),
        (gate, "gate", 3),
        (up, "up", 3),
        (down, "down", 3),
        (config, "config", 1),
        (y, "y", 2),
    ])?;
    for (view, name) in [
        (x, "x"),
        (router, "router"),
        (bias, "router_bias"),
        (y, "y"),
    ] {
        if view.dtype != DTYPE_F32 {
            return Err(format!("{name} must be float32, got dtype {}", view.dtype));
        }
    }
    for (view, name) in [(gate, "gate"), (up, "up"), (down, "down")] {
        if view.dtype != DTYPE_U8 {
            return Err(format!(
                "{name} must be uint8 blocks, got dtype {}",
                view.dtype
            ));
        }
    }
    if config.dtype != DTYPE_S32 || config.dims != [6] {
        return Err("config must be int32 [6]".into());
    }
    let config: &[i32] = slice_of(config);
    let router_rule = match config[3] {
        0 => Router::SoftmaxTopK { renormalize: false },
        1 => Router::SoftmaxTopK { renormalize: true },
        2 => Router::TopKSoftmax,
        other => return Err(format!("router rule {other} is not 0, 1 or 2")),
    };
    let shape = FfnShape {
        tokens: x.dims[0],
        hidden: x.dims[1],
        width: gate.dims[1],
        experts: gate.dims[0],
        top_k: usize::try_from(config[2]).map_err(|_| format!("top_k {} < 0", config[2]))?,
    };
    let (gate_up_kind, down_kind) = (kind_at(config[0], "gate/up")?, kind_at(config[1], "down")?);
    let s = &shape;
    let consistent = router.dims == [s.experts, s.hidden]
        && up.dims == gate.dims
        && gate_up_kind.row_bytes(s.hidden) == Some(gate.dims[2])
        && down.dims[..2] == [s.experts, s.hidden]
        && down_kind.row_bytes(s.width) == Some(down.dims[2])
        && y.dims == x.dims;
    if !consistent {
        return Err(format!(
            "inconsistent shapes: x {:?}, router {:?}, gate {:?}, up {:?}, down {:?}, y {:?} \
             ({} gate/up, {} down)",
            x.dims,
            router.dims,
            gate.dims,
            up.dims,
            down.dims,
            y.dims,
            gate_up_kind.name(),
            down_kind.name()
        ));
    }
    let weights = FfnWeights {
        router: slice_of(router),
        router_bias: slice_of(bias),
        gate_up_kind,
        gate: slice_of(gate),
        up: slice_of(up),
        down_kind,
        down: slice_of(down),
        gate_up_packed: config[4] != 0,
        down_packed: config[5] != 0,
    };
    expert_ffn(
        s,
        &weights,
        router_rule,
        slice_of(x),
        live_rows(live, s.tokens)?,
        slice_of_mut(y),
        &XlaPool { frame },
    )
}

/// XLA FFI handler: a routed MoE feed-forward in one call (module docs).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn kvpage_expert_ffn(frame: *mut c_void) -> *mut c_void {
    handle(frame.cast(), "kvpage_expert_ffn", run_expert_ffn)
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
