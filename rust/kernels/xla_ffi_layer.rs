//! XLA FFI handler of a whole decoder layer of a decode step
//! ([`crate::kernels::decoder_layer`]): `kvpage_decode_layer`.
//!
//! Arguments, in order (`T` rows, `D` hidden, `F` head features):
//! `hidden [T, D]` f32, `cos [T, F]` f32, `sin [T, F]` f32, `slots [T]` s32,
//! `kv_lens [T]` s32, `block_tables [T, M]` s32, `k_pages` and `v_pages`
//! `[kv_heads, pages, block_size, F]` f32, `input_norm [D]` f32, `post_norm
//! [D]` f32, `constants [2]` f32 (RMSNorm epsilon, softmax scale), `kinds [7]`
//! s32, then for each of q, k, v, o, gate, up, down its weight and its row
//! scales (`[outs]` f32 for int8, `[0]` otherwise). `kinds[j]` is -1 for an f32
//! weight `[outs, inner]`, else the index of its format in [`KIND_CODES`] (the
//! order of `pallas_kernels/cpu_qmatmul.py`'s `KINDS`), its weight the blocks
//! `[outs, row_bytes]` (u8; s8 for int8).
//!
//! Results: `out [T, D]` f32, then `k_pages` and `v_pages`, which the caller
//! aliases to the arguments (updated in place; if XLA gave separate buffers, the
//! pools are copied into them first).
//!
//! The invariants of [`crate::kernels::xla_ffi`] hold: nothing is read before
//! count, dtype, rank and size are checked; no panic crosses the boundary.

use std::ffi::c_void;

use super::decoder_layer::{
    decode_layer, LayerConstants, LayerShape, LayerWeights, Linear, RowInputs, Weight,
};
use super::quant::formats::QuantType;
use super::xla_ffi::{
    buffers, handle, CallFrame, View, XlaPool, DTYPE_F32, DTYPE_S32, DTYPE_S8, DTYPE_U8,
};

/// Weight formats by their code in `kinds` (`pallas_kernels/cpu_qmatmul.py`'s `KINDS`).
pub const KIND_CODES: [QuantType; 6] = QuantType::ALL;

const LINEARS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];
const FIRST_WEIGHT: usize = 12;
const ARGS: usize = FIRST_WEIGHT + 2 * LINEARS.len();

fn expect(view: &View, name: &str, dtype: i32, rank: usize) -> Result<(), String> {
    if view.dtype != dtype || view.dims.len() != rank {
        return Err(format!(
            "{name}: expected rank {rank} of dtype {dtype}, got rank {} of dtype {}",
            view.dims.len(),
            view.dtype
        ));
    }
    Ok(())
}

unsafe fn f32s<'a>(view: &View) -> &'a [f32] {
    std::slice::from_raw_parts(view.data as *const f32, view.len())
}

unsafe fn i32s<'a>(view: &View) -> &'a [i32] {
    std::slice::from_raw_parts(view.data as *const i32, view.len())
}

/// Linear `j` from its weight and row-scales views and its format code.
unsafe fn linear<'a>(w: &View, scales: &View, code: i32, j: usize) -> Result<Linear<'a>, String> {
    let name = LINEARS[j];
    if w.dims.len() != 2 {
        return Err(format!("{name} has rank {}, expected 2", w.dims.len()));
    }
    expect(scales, &format!("{name} row scales"), DTYPE_F32, 1)?;
    let outs = w.dims[0];
    if code == -1 {
        expect(w, name, DTYPE_F32, 2)?;
        return Ok(Linear {
            weight: Weight::Float(f32s(w)),
            outs,
            inner: w.dims[1],
        });
    }
    let Some(&kind) = usize::try_from(code).ok().and_then(|c| KIND_CODES.get(c)) else {
        return Err(format!("{name}: unknown weight format code {code}"));
    };
    let blocks_dtype = if kind == QuantType::Int8 {
        DTYPE_S8
    } else {
        DTYPE_U8
    };
    expect(w, name, blocks_dtype, 2)?;
    let elems = kind.block_elems();
    let bytes_per_block = kind.row_bytes(elems).unwrap_or(0);
    if bytes_per_block == 0 || !w.dims[1].is_multiple_of(bytes_per_block) {
        return Err(format!(
            "{name}: rows of {} bytes are not whole {} blocks",
            w.dims[1],
            kind.name()
        ));
    }
    Ok(Linear {
        weight: Weight::Quant {
            kind,
            blocks: std::slice::from_raw_parts(w.data as *const u8, w.len()),
            row_scales: f32s(scales),
        },
        outs,
        inner: w.dims[1] / bytes_per_block * elems,
    })
}

unsafe fn run(frame: &CallFrame) -> Result<(), String> {
    let args = buffers(&frame.args, "arguments", ARGS)?;
    let mut rets = buffers(&frame.rets, "results", 3)?;
    let names = [
        ("hidden", DTYPE_F32, 2),
        ("cos", DTYPE_F32, 2),
        ("sin", DTYPE_F32, 2),
        ("slots", DTYPE_S32, 1),
        ("kv_lens", DTYPE_S32, 1),
        ("block_tables", DTYPE_S32, 2),
        ("k_pages", DTYPE_F32, 4),
        ("v_pages", DTYPE_F32, 4),
        ("input_norm", DTYPE_F32, 1),
        ("post_norm", DTYPE_F32, 1),
        ("constants", DTYPE_F32, 1),
        ("kinds", DTYPE_S32, 1),
    ];
    for (view, (name, dtype, rank)) in args.iter().zip(names) {
        expect(view, name, dtype, rank)?;
    }
    for (view, name) in rets.iter().zip(["out", "k_pages result", "v_pages result"]) {
        expect(view, name, DTYPE_F32, if name == "out" { 2 } else { 4 })?;
    }
    let (constants, kinds) = (f32s(&args[10]), i32s(&args[11]));
    if constants.len() != 2 || kinds.len() != LINEARS.len() {
        return Err("constants must be [2] and kinds [7]".into());
    }
    let mut linears = Vec::with_capacity(LINEARS.len());
    for (j, &code) in kinds.iter().enumerate() {
        let (w, scales) = (&args[FIRST_WEIGHT + 2 * j], &args[FIRST_WEIGHT + 2 * j + 1]);
        linears.push(linear(w, scales, code, j)?);
    }
    let (hidden, cos, pools) = (&args[0], &args[1], &args[6].dims);
    let head_dim = cos.dims[1];
    if head_dim == 0
        || pools[3] != head_dim
        || args[7].dims != *pools
        || rets[1].dims != *pools
        || rets[2].dims != *pools
    {
        return Err(format!(
            "pools {:?} / {:?} and results {:?} / {:?} must agree, with {head_dim} features",
            pools, args[7].dims, rets[1].dims, rets[2].dims
        ));
    }
    let shape = LayerShape {
        rows: hidden.dims[0],
        hidden: hidden.dims[1],
        intermediate: linears[4].outs,
        q_heads: linears[0].outs / head_dim,
        kv_heads: pools[0],
        head_dim,
        pages: pools[1],
        block_size: pools[2],
        table_width: args[5].dims[1],
    };
    let weights = LayerWeights {
        input_norm: f32s(&args[8]),
        q: linears[0],
        k: linears[1],
        v: linears[2],
        o: linears[3],
        post_norm: f32s(&args[9]),
        gate: linears[4],
        up: linears[5],
        down: linears[6],
    };
    let rows = RowInputs {
        cos: f32s(cos),
        sin: f32s(&args[2]),
        slots: i32s(&args[3]),
        kv_lens: i32s(&args[4]),
        block_tables: i32s(&args[5]),
    };
    let constants = LayerConstants {
        rms_norm_eps: constants[0],
        sm_scale: constants[1],
    };
    for (arg, ret) in [(6, 1), (7, 2)] {
        if args[arg].data != rets[ret].data {
            // Not aliased: the result pool starts as the argument's copy.
            let n = args[arg].len();
            std::ptr::copy_nonoverlapping(
                args[arg].data as *const f32,
                rets[ret].data as *mut f32,
                n,
            );
        }
    }
    let (out, k_pages, v_pages) = {
        let [out, k, v] = &mut rets[..] else {
            return Err("expected 3 results".into());
        };
        (
            std::slice::from_raw_parts_mut(out.data as *mut f32, out.len()),
            std::slice::from_raw_parts_mut(k.data as *mut f32, k.len()),
            std::slice::from_raw_parts_mut(v.data as *mut f32, v.len()),
        )
    };
    decode_layer(
        &XlaPool { frame },
        &shape,
        &weights,
        constants,
        &rows,
        f32s(hidden),
        k_pages,
        v_pages,
        out,
    )
}

/// XLA FFI handler: one decoder layer of a decode step (module docs).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn kvpage_decode_layer(frame: *mut c_void) -> *mut c_void {
    handle(frame.cast(), "kvpage_decode_layer", run)
}
