//! `kvpage._core.quant_formats()`: the table of quantized weight formats
//! ([`crate::kernels::quant::formats::FORMATS`], which owns it), for
//! `kvpage.quant.formats` to build its tables from instead of writing them again;
//! and `set_cpu_input_bits` / `cpu_input_bits`, the process's input precision of
//! quantized products on the host CPU ([`crate::kernels::quant::activations`]).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::quant::activations;
use crate::kernels::quant::formats::FORMATS;

/// One row of [`quant_formats`].
type FormatRow = (
    usize,
    &'static str,
    usize,
    usize,
    bool,
    Option<&'static str>,
);

/// One row per format, in the order of their codes (a row's index is its code):
/// `(code, name, weights per block, bytes per block, row_scaled, GGUF type name
/// or None)`.
#[pyfunction]
fn quant_formats() -> Vec<FormatRow> {
    FORMATS
        .iter()
        .map(|f| {
            (
                f.kind as usize,
                f.name,
                f.block_elems,
                f.block_bytes,
                f.row_scaled,
                f.gguf,
            )
        })
        .collect()
}

/// Quantized products on the host CPU from now on quantize their inputs to
/// `bits` per block of 32: 16 (the default) or 8 (llama.cpp's numerics, half
/// the multiply-adds of the packed-weight kernels). Process-wide.
#[pyfunction]
fn set_cpu_input_bits(bits: u32) -> PyResult<()> {
    activations::set_cpu_input_bits(bits).map_err(PyValueError::new_err)
}

/// The input bits of host CPU quantized products now (16 unless set).
#[pyfunction]
fn cpu_input_bits() -> u32 {
    activations::cpu_input_bits()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_formats, m)?)?;
    m.add_function(wrap_pyfunction!(set_cpu_input_bits, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_input_bits, m)?)
}
