//! XLA FFI handler `kvpage_zeros`: a zero-filled result that holds no memory
//! until written ([`crate::kernels::lazy_zeros`]), for the KV pools.
//!
//! No arguments; one result of dtype f32, f16, bf16, s32, s8 or u8 and any
//! shape. XLA:CPU allocates the result; the handler zeroes it by releasing its
//! whole pages. The invariants of [`crate::kernels::xla_ffi`] hold.

use std::ffi::c_void;

use super::lazy_zeros::zero_lazily;
use super::xla_ffi::{
    buffers, handle, CallFrame, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_S32, DTYPE_S8, DTYPE_U8,
};

/// Bytes per element of the dtypes a zero-filled result may have.
fn element_bytes(dtype: i32) -> Option<usize> {
    match dtype {
        DTYPE_F32 | DTYPE_S32 => Some(4),
        DTYPE_F16 | DTYPE_BF16 => Some(2),
        DTYPE_S8 | DTYPE_U8 => Some(1),
        _ => None,
    }
}

unsafe fn run_zeros(frame: &CallFrame) -> Result<(), String> {
    buffers(&frame.args, "arguments", 0)?;
    let rets = buffers(&frame.rets, "results", 1)?;
    let out = &rets[0];
    let width = element_bytes(out.dtype)
        .ok_or_else(|| format!("unsupported result dtype {}", out.dtype))?;
    let bytes = out
        .len()
        .checked_mul(width)
        .ok_or("the result's size overflows")?;
    if bytes > 0 {
        zero_lazily(std::slice::from_raw_parts_mut(out.data.cast::<u8>(), bytes));
    }
    Ok(())
}

/// XLA FFI handler: a zero-filled result, its pages released rather than
/// written (module docs).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn kvpage_zeros(frame: *mut c_void) -> *mut c_void {
    handle(frame.cast(), "kvpage_zeros", run_zeros)
}
