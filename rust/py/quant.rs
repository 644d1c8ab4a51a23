//! `kvpage._core.quant_formats()`: the table of quantized weight formats
//! ([`crate::kernels::quant::formats::FORMATS`], which owns it), for
//! `kvpage.quant.formats` to build its tables from instead of writing them again.

use pyo3::prelude::*;

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

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_formats, m)?)
}
