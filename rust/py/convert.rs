//! Argument conversions shared by the bound classes: token ids from numpy
//! arrays or sequences, finish reasons from their names.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::sched::request::FinishReason;

/// Token ids from a numpy int32/int64/uint32 array or any sequence of ints.
pub(crate) fn extract_tokens(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    fn checked(values: impl Iterator<Item = i64>) -> PyResult<Vec<u32>> {
        values
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    PyValueError::new_err(format!("token id {v} is out of range 0..=4294967295"))
                })
            })
            .collect()
    }
    if let Ok(array) = tokens.extract::<PyReadonlyArray1<'_, i32>>() {
        return checked(array.as_array().iter().map(|&v| v as i64));
    }
    if let Ok(array) = tokens.extract::<PyReadonlyArray1<'_, i64>>() {
        return checked(array.as_array().iter().copied());
    }
    if let Ok(array) = tokens.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(array.as_array().to_vec());
    }
    let values: Vec<i64> = tokens.extract().map_err(|_| {
        PyValueError::new_err("tokens must be a 1-D integer numpy array or a sequence of ints")
    })?;
    checked(values.into_iter())
}

pub(crate) fn finish_reason_arg(reason: &str) -> PyResult<FinishReason> {
    FinishReason::parse(reason).ok_or_else(|| {
        PyValueError::new_err(format!(
            "finish reason must be one of 'stop', 'length', 'abort', 'error'; got {reason:?}"
        ))
    })
}
