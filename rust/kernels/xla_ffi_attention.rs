//! XLA FFI handler of paged decode attention ([`crate::kernels::cpu_attention`]):
//! `kvpage_paged_decode_attention` and the operand-layout version
//! `kvpage_paged_decode_attention_abi` that Python checks before passing the
//! window / soft-cap / sink operands.
//!
//! The invariants of [`crate::kernels::xla_ffi`] hold: nothing is read before
//! count, dtype, rank and size are checked; no panic crosses the boundary.

use std::ffi::c_void;

use super::xla_ffi::{
    buffers, handle, CallFrame, View, XlaPool, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_S32,
};
use crate::kernels::cpu_attention::{
    paged_decode_attention_with, AttentionOptions, Bf16, DecodeShape, KvElement, F16,
};

/// XLA FFI handler: paged decode attention on the host
/// ([`crate::kernels::cpu_attention`]). Arguments: `q [S, Hq, D]` f32, `k_pages` and
/// `v_pages [Hkv, P, B, D]` (f32, f16 or bf16, same dtype), `kv_lens [S]` s32,
/// `block_tables [S, M]` s32; result `[S, Hq, D]` f32.
///
/// Three more arguments turn on the options ([`AttentionOptions`]; all three or
/// none): `sliding_window` s32 (one element, 0 = none), `soft_cap` f32 (one element,
/// 0 = none) and `sinks [Hq]` f32 (a sink of -inf adds nothing to its denominator,
/// so a caller with a window but no sinks passes -inf). A ninth, `table_rows [S]`
/// s32, names the row of `block_tables [N, M]` each query row reads (the query
/// tokens of one sequence share its row).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn kvpage_paged_decode_attention(frame: *mut c_void) -> *mut c_void {
    handle(
        frame.cast(),
        "kvpage_paged_decode_attention",
        run_paged_decode_attention,
    )
}

/// The ABI of [`kvpage_paged_decode_attention`]: 2 takes the three option
/// arguments, 3 also `table_rows` (Python checks this before passing them to a
/// core built earlier).
#[no_mangle]
pub extern "C" fn kvpage_paged_decode_attention_abi() -> i32 {
    3
}

unsafe fn run_paged_decode_attention(frame: &CallFrame) -> Result<(), String> {
    let count = match frame.args.size {
        9 => 9,
        8 => 8,
        _ => 5,
    };
    let with_options = count >= 8;
    let args = buffers(&frame.args, "arguments", count)?;
    let mut rets = buffers(&frame.rets, "results", 1)?;
    let [q, k, v, kv_lens, tables] = &args[..5] else {
        unreachable!("five arguments checked")
    };
    let out = &mut rets[0];
    let ranks = [(q, 3, "q"), (k, 4, "k_pages"), (v, 4, "v_pages")];
    for (view, rank, name) in ranks.into_iter().chain([(&*out, 3, "out")]) {
        if view.dims.len() != rank {
            return Err(format!(
                "{name} has rank {}, expected {rank}",
                view.dims.len()
            ));
        }
    }
    if kv_lens.dims.len() != 1 || tables.dims.len() != 2 {
        return Err("kv_lens must be rank 1 and block_tables rank 2".into());
    }
    if q.dtype != DTYPE_F32 || out.dtype != DTYPE_F32 {
        return Err("q and the result must be float32".into());
    }
    if kv_lens.dtype != DTYPE_S32 || tables.dtype != DTYPE_S32 {
        return Err("kv_lens and block_tables must be int32".into());
    }
    if k.dtype != v.dtype || k.dims != v.dims {
        return Err("k_pages and v_pages differ in dtype or shape".into());
    }
    if out.dims != q.dims {
        return Err("the result's shape differs from q's".into());
    }
    let shape = DecodeShape {
        rows: q.dims[0],
        q_heads: q.dims[1],
        kv_heads: k.dims[0],
        head_dim: q.dims[2],
        pages: k.dims[1],
        block_size: k.dims[2],
        table_width: tables.dims[1],
    };
    let table_rows = if count == 9 {
        let rows = &args[8];
        if rows.dtype != DTYPE_S32 || rows.dims != [shape.rows] {
            return Err(format!("table_rows must be int32 [{}]", shape.rows));
        }
        Some(std::slice::from_raw_parts(
            rows.data as *const i32,
            rows.len(),
        ))
    } else {
        None
    };
    if k.dims[3] != shape.head_dim || (table_rows.is_none() && tables.dims[0] != shape.rows) {
        return Err(format!(
            "inconsistent shapes: q {:?}, pages {:?}, block_tables {:?}",
            q.dims, k.dims, tables.dims
        ));
    }
    let slice_f32 = |view: &View| std::slice::from_raw_parts(view.data as *const f32, view.len());
    let slice_i32 = |view: &View| std::slice::from_raw_parts(view.data as *const i32, view.len());
    let out_slice = std::slice::from_raw_parts_mut(out.data as *mut f32, out.len());
    let (q_s, lens_s, tables_s) = (slice_f32(q), slice_i32(kv_lens), slice_i32(tables));
    let mut options = AttentionOptions::default();
    if with_options {
        let [window, cap, sinks] = &args[5..8] else {
            unreachable!("eight arguments checked")
        };
        if window.dtype != DTYPE_S32 || window.len() != 1 {
            return Err("sliding_window must be one int32".into());
        }
        if cap.dtype != DTYPE_F32 || cap.len() != 1 {
            return Err("soft_cap must be one float32".into());
        }
        if sinks.dtype != DTYPE_F32 || sinks.dims != [shape.q_heads] {
            return Err(format!("sinks must be float32 [{}]", shape.q_heads));
        }
        let window = *(window.data as *const i32);
        if window < 0 {
            return Err(format!("sliding_window {window} is negative"));
        }
        let cap = *(cap.data as *const f32);
        options = AttentionOptions {
            sliding_window: (window > 0).then_some(window as usize),
            soft_cap: (cap != 0.0).then_some(cap),
            // All -inf is no sink: the plain loops where no option is set.
            sinks: Some(slice_f32(sinks)).filter(|s| s.iter().any(|&x| x != f32::NEG_INFINITY)),
            table_rows,
        };
    }
    let pool = XlaPool { frame };
    let call = DecodeCall {
        pool: &pool,
        shape: &shape,
        options: &options,
        q: q_s,
        kv_lens: lens_s,
        block_tables: tables_s,
    };
    match k.dtype {
        DTYPE_F32 => call.run::<f32>(k, v, out_slice),
        DTYPE_F16 => call.run::<F16>(k, v, out_slice),
        DTYPE_BF16 => call.run::<Bf16>(k, v, out_slice),
        other => Err(format!(
            "k_pages dtype {other} is not float32, float16 or bfloat16"
        )),
    }
}

/// The inputs of one decode attention call but its pools, whose element type the
/// dtype selects.
struct DecodeCall<'a> {
    pool: &'a XlaPool<'a>,
    shape: &'a DecodeShape,
    options: &'a AttentionOptions<'a>,
    q: &'a [f32],
    kv_lens: &'a [i32],
    block_tables: &'a [i32],
}

impl DecodeCall<'_> {
    /// # Safety
    /// `k` and `v` hold elements of type `T` (their dtype was matched).
    unsafe fn run<T: KvElement>(&self, k: &View, v: &View, out: &mut [f32]) -> Result<(), String> {
        let pages = |view: &View| std::slice::from_raw_parts(view.data as *const T, view.len());
        paged_decode_attention_with(
            self.pool,
            self.shape,
            self.options,
            self.q,
            pages(k),
            pages(v),
            self.kv_lens,
            self.block_tables,
            out,
        )
    }
}
