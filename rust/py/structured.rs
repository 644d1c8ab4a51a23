//! PyO3 bindings of structured outputs (`rust/grammar/structured_output.rs`):
//! `GrammarVocab` (one per model) compiles guided-decoding specs into
//! `Grammar`s, which `Scheduler.set_grammar` attaches to a request. A thin
//! layer: conversion and GIL release only.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::grammar::structured_output::{
    Grammar as CoreGrammar, GrammarVocab as CoreVocab, GuidedSpec,
};

/// The model's vocabulary for structured outputs: token byte strings (special
/// tokens start with b"\xff", ids past the tokenizer are b"") and EOS ids.
#[pyclass(module = "kvpage._core", frozen)]
pub struct GrammarVocab {
    inner: Arc<CoreVocab>,
}

#[pymethods]
impl GrammarVocab {
    #[new]
    fn new(
        py: Python<'_>,
        token_bytes: Vec<Bound<'_, PyBytes>>,
        eos_token_ids: Vec<u32>,
    ) -> PyResult<Self> {
        let tokens: Vec<Vec<u8>> = token_bytes.iter().map(|b| b.as_bytes().to_vec()).collect();
        let inner = py.detach(|| CoreVocab::new(tokens, &eos_token_ids))?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Compile `value` as `kind` ("json", "json_object", "regex", "choice" as
    /// a JSON list, "grammar" in Lark syntax). Releases the GIL; raises
    /// ValueError naming the field and the problem.
    fn compile(&self, py: Python<'_>, kind: &str, value: &str) -> PyResult<Grammar> {
        let spec = GuidedSpec::parse(kind, value)?;
        let vocab = self.inner.clone();
        let grammar = py.detach(move || vocab.compile(&spec))?;
        Ok(Grammar { inner: grammar })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// int32 words per mask row: ceil(vocab_size / 32).
    #[getter]
    fn words(&self) -> usize {
        self.inner.words()
    }
}

/// A compiled grammar in its start state (shared by requests that reuse it).
#[pyclass(module = "kvpage._core", frozen)]
pub struct Grammar {
    pub(crate) inner: CoreGrammar,
}

#[pymethods]
impl Grammar {
    /// Token masks of a walk through the grammar: for each prefix of
    /// `tokens`, the allowed next tokens as sorted ids (a test and debugging
    /// aid). Raises ValueError at the first token the grammar rejects.
    fn allowed_tokens(&self, tokens: Vec<u32>) -> PyResult<Vec<Vec<u32>>> {
        let mut matcher = self.inner.matcher();
        let words = matcher.vocab_size().div_ceil(32);
        let mut out = Vec::new();
        let mut mask = vec![0u32; words];
        for (i, &token) in tokens.iter().chain(std::iter::once(&u32::MAX)).enumerate() {
            matcher
                .fill_mask(&mut mask)
                .map_err(PyValueError::new_err)?;
            out.push(
                (0..matcher.vocab_size() as u32)
                    .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
                    .collect(),
            );
            if i == tokens.len() {
                break;
            }
            matcher.consume(token).map_err(|e| {
                PyValueError::new_err(format!("token {token} at position {i} is rejected: {e}"))
            })?;
        }
        Ok(out)
    }
}
