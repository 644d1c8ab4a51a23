//! PyO3 bindings of [`crate::detokenizer`]: `TokenDecoder`, the per-sample
//! `Detokenizer` (the interface of `kvpage.detokenizer.IncrementalDetokenizer`)
//! and `detokenize_batch`, which feeds every sample's new tokens in one call
//! with the GIL released.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::detokenizer::{Scratch, SeqDetokenizer, TokenDecoder};
use crate::python::extract_tokens;

/// A tokenizer's decoding, loaded from its ``tokenizer.json`` text (what a
/// Hugging Face fast tokenizer's ``backend_tokenizer.to_str()`` returns).
#[pyclass(module = "kvpage._core", name = "TokenDecoder", frozen)]
pub struct PyTokenDecoder {
    inner: Arc<TokenDecoder>,
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

/// The growing text of one sample, with stop-string detection; the same
/// text, deltas and stop decisions as ``kvpage.detokenizer.IncrementalDetokenizer``.
#[pyclass(module = "kvpage._core", name = "Detokenizer")]
pub struct PyDetokenizer {
    decoder: Arc<TokenDecoder>,
    seq: SeqDetokenizer,
}

#[pymethods]
impl PyDetokenizer {
    #[new]
    #[pyo3(signature = (
        decoder, prompt_token_ids, *, stop = Vec::new(), include_stop_str_in_output = false,
        skip_special_tokens = true
    ))]
    fn new(
        decoder: &PyTokenDecoder,
        prompt_token_ids: &Bound<'_, PyAny>,
        stop: Vec<String>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ) -> PyResult<Self> {
        let prompt = extract_tokens(prompt_token_ids)?;
        if stop.iter().any(String::is_empty) {
            return Err(PyValueError::new_err("stop strings must not be empty"));
        }
        Ok(PyDetokenizer {
            decoder: Arc::clone(&decoder.inner),
            seq: SeqDetokenizer::new(
                &prompt,
                stop,
                include_stop_str_in_output,
                skip_special_tokens,
            ),
        })
    }

    /// Append one generated token; returns True when a stop string matched.
    fn add_token(&mut self, token_id: u32) -> bool {
        self.seq
            .add_token(&self.decoder, token_id, &mut Scratch::default())
    }

    /// Text not yet handed out; until ``finished`` the tail that could still
    /// start a stop string is held back.
    fn take_delta(&mut self, finished: bool) -> String {
        self.seq.take_delta(finished).to_owned()
    }

    /// Output text so far (cut at a stop string once one matched).
    #[getter]
    fn text(&self) -> &str {
        self.seq.text()
    }

    /// Characters of ``text`` already handed out by ``take_delta``.
    #[getter]
    fn emitted(&self) -> usize {
        self.seq.emitted()
    }

    /// The stop string that matched, if any.
    #[getter]
    fn stop_reason(&self) -> Option<&str> {
        self.seq.stop_reason()
    }
}

/// Feed ``counts[i]`` tokens (consecutive in ``tokens``) to ``detokenizers[i]``
/// for every i, in one call with the GIL released. A detokenizer stops taking
/// tokens at a stop string. Returns ``(i, tokens taken)`` for each detokenizer
/// that has met a stop string (every other one took all its tokens).
#[pyfunction]
pub fn detokenize_batch(
    py: Python<'_>,
    mut detokenizers: Vec<PyRefMut<'_, PyDetokenizer>>,
    counts: Vec<usize>,
    tokens: &Bound<'_, PyAny>,
) -> PyResult<Vec<(usize, usize)>> {
    let tokens = extract_tokens(tokens)?;
    if counts.len() != detokenizers.len() || counts.iter().sum::<usize>() != tokens.len() {
        return Err(PyValueError::new_err(format!(
            "{} detokenizers, {} counts summing to {}, {} tokens: need one count per \
             detokenizer and one token per count",
            detokenizers.len(),
            counts.len(),
            counts.iter().sum::<usize>(),
            tokens.len()
        )));
    }
    let mut seqs: Vec<(&TokenDecoder, &mut SeqDetokenizer)> = detokenizers
        .iter_mut()
        .map(|d| {
            let PyDetokenizer { decoder, seq } = &mut **d;
            (&**decoder, seq)
        })
        .collect();
    Ok(py.detach(move || {
        let mut scratch = Scratch::default();
        let mut start = 0;
        let mut stopped = Vec::new();
        for (i, ((decoder, seq), &count)) in seqs.iter_mut().zip(&counts).enumerate() {
            let taken = seq.add_tokens(decoder, &tokens[start..start + count], &mut scratch);
            start += count;
            if seq.stop_reason().is_some() {
                stopped.push((i, taken));
            }
        }
        stopped
    }))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenDecoder>()?;
    m.add_class::<PyDetokenizer>()?;
    m.add_function(wrap_pyfunction!(detokenize_batch, m)?)?;
    Ok(())
}
