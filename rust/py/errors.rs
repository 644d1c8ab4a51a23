//! `KVPageError` and how the core's typed errors become Python exceptions:
//! `ValueError` for bad arguments, `KVPageError` for everything else.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use crate::error::KvError;

create_exception!(
    _core,
    KVPageError,
    PyException,
    "An error raised by the kvpage Rust core."
);

impl From<KvError> for PyErr {
    fn from(err: KvError) -> PyErr {
        match err {
            KvError::InvalidArgument(_) | KvError::TokenCountMismatch { .. } => {
                PyValueError::new_err(err.to_string())
            }
            _ => KVPageError::new_err(err.to_string()),
        }
    }
}
