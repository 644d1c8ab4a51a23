//! PyO3 binding of [`crate::output::detokenizer`]'s `TokenDecoder` and of its
//! byte-level token bytes (for the grammar vocabulary); the per-sample
//! detokenizers live in `OutputStreams` (`py/output_streams.rs`).

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::output::detokenizer::{byte_level_bytes, TokenDecoder};
use crate::py::convert::extract_tokens;

/// A tokenizer's decoding, loaded from its ``tokenizer.json`` text (what a
/// Hugging Face fast tokenizer's ``backend_tokenizer.to_str()`` returns).
#[pyclass(module = "kvpage._core", name = "TokenDecoder", frozen)]
pub struct PyTokenDecoder {
    inner: Arc<TokenDecoder>,
}

impl PyTokenDecoder {
    pub(crate) fn shared(&self) -> Arc<TokenDecoder> {
        Arc::clone(&self.inner)
    }
}

#[pymethods]
impl PyTokenDecoder {
    #[new]
    fn new(tokenizer_json: &str) -> PyResult<Self> {
        let inner = TokenDecoder::from_json(tokenizer_json).map_err(PyValueError::new_err)?;
        Ok(PyTokenDecoder {
            inner: Arc::new(inner),
        })
    }

    /// True when windows decode from precomputed token bytes (a ByteLevel decoder);
    /// else each window goes through the ``tokenizers`` crate's ``decode``.
    #[getter]
    fn is_byte_level(&self) -> bool {
        self.inner.is_byte_level()
    }

    /// ``tokenizer.decode(ids, skip_special_tokens)``.
    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        Ok(self
            .inner
            .decode(&extract_tokens(ids)?, skip_special_tokens))
    }
}

/// The bytes each token (a string of the vocabulary, as
/// ``convert_ids_to_tokens`` gives it) stands for under a ``ByteLevel``
/// decoder: exactly the bytes ``TokenDecoder`` decodes it from, so the grammar
/// vocabulary and the detokenizer agree with ``tokenizer.decode``.
#[pyfunction]
fn byte_level_token_bytes<'py>(py: Python<'py>, tokens: Vec<String>) -> Vec<Bound<'py, PyBytes>> {
    let mut buf = Vec::new();
    tokens
        .iter()
        .map(|token| {
            buf.clear();
            byte_level_bytes(token, &mut buf);
            PyBytes::new(py, &buf)
        })
        .collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenDecoder>()?;
    m.add_function(wrap_pyfunction!(byte_level_token_bytes, m)?)?;
    Ok(())
}
