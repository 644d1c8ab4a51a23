//! PyO3 bindings of [`crate::output::output_streams`]: `OutputStreams`, driven by the
//! engine with three bulk calls a step (`push`, `detokenize`, `take_outputs`).

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::output::output_streams::{
    OutputMode, OutputStreams, PushedTokens, RequestOutputView, StopReason, TextSpec,
};
use crate::py::convert::{extract_tokens, finish_reason_arg};
use crate::py::detokenizer::PyTokenDecoder;

/// Every live request's output streams: tokens, text with stop strings, finish
/// and stop reasons, and what was handed out (see ``rust/output/output_streams.rs``).
#[pyclass(module = "kvpage._core", name = "OutputStreams")]
pub struct PyOutputStreams {
    inner: OutputStreams,
    accepted: Vec<bool>,
    /// Called as `completion_output(index, text, token_ids, cumulative_logprob,
    /// None, finish_reason, stop_reason, params_versions)` for each sample output.
    completion_output: Py<PyAny>,
}

fn mode_arg(mode: &str) -> PyResult<OutputMode> {
    match mode {
        "delta" => Ok(OutputMode::Delta),
        "cumulative" => Ok(OutputMode::Cumulative),
        "final" => Ok(OutputMode::FinalOnly),
        _ => Err(PyValueError::new_err(format!(
            "output mode must be 'delta', 'cumulative' or 'final', got {mode:?}"
        ))),
    }
}

/// `(handle, done, first_token_time, last_token_time, completions)`, each
/// completion made by `completion_output` (see [`PyOutputStreams`]).
fn view_to_py<'py>(
    py: Python<'py>,
    completion_output: &Bound<'py, PyAny>,
    view: RequestOutputView<'_>,
) -> PyResult<Bound<'py, PyTuple>> {
    let completions = PyList::empty(py);
    for s in &view.samples {
        let stop = match s.stop {
            None => py.None().into_bound(py),
            Some(StopReason::Token(token)) => token.into_pyobject(py)?.into_any(),
            Some(StopReason::Text(text)) => text.into_pyobject(py)?.into_any(),
        };
        let cumulative = view.report_logprob.then_some(s.cumulative_logprob);
        completions.append(completion_output.call1((
            s.index,
            s.text,
            s.tokens,
            cumulative,
            py.None(),
            s.finish.map(|f| f.as_str()),
            stop,
            s.versions.to_vec(),
        ))?)?;
    }
    (
        view.handle,
        view.done,
        view.first_token_time,
        view.last_token_time,
        completions,
    )
        .into_pyobject(py)
}

#[pymethods]
impl PyOutputStreams {
    /// ``completion_output``: the type of each sample's output (the engine passes
    /// ``kvpage.outputs.CompletionOutput``), called with its eight fields in order
    /// (logprob dicts None: the engine adds them for the requests that ask).
    #[new]
    fn new(completion_output: Py<PyAny>) -> Self {
        PyOutputStreams {
            inner: OutputStreams::new(),
            accepted: Vec::new(),
            completion_output,
        }
    }

    /// Start streaming request ``handle`` of ``n`` samples; ``mode`` is
    /// "delta" (streaming), "cumulative" or "final" (one output at the end).
    /// With a ``decoder``, samples get text: the last prompt ids seed it, and
    /// ``stop`` strings end a sample. A sample that finishes with "stop" on one
    /// of ``stop_token_ids`` (EOS and the request's stop token ids) shows no
    /// text for that token unless ``include_stop_str_in_output``. Without a
    /// decoder, text is empty. With ``logprobs`` outputs carry the cumulative
    /// logprob (else None).
    #[pyo3(signature = (
        handle, n, mode, *, logprobs = false, decoder = None, prompt_token_ids = None,
        stop = Vec::new(), include_stop_str_in_output = false, skip_special_tokens = true,
        stop_token_ids = Vec::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        handle: u64,
        n: u32,
        mode: &str,
        logprobs: bool,
        decoder: Option<&PyTokenDecoder>,
        prompt_token_ids: Option<&Bound<'_, PyAny>>,
        stop: Vec<String>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        stop_token_ids: Vec<u32>,
    ) -> PyResult<()> {
        let mode = mode_arg(mode)?;
        let text = match decoder {
            None => None,
            Some(decoder) => Some(TextSpec {
                decoder: decoder.shared(),
                prompt_token_ids: match prompt_token_ids {
                    Some(ids) => extract_tokens(ids)?,
                    None => Vec::new(),
                },
                stops: stop,
                include_stop: include_stop_str_in_output,
                skip_special: skip_special_tokens,
                stop_token_ids,
            }),
        };
        self.inner
            .add_request(handle, n, mode, logprobs, text)
            .map_err(PyValueError::new_err)
    }

    /// Append a step's sampled tokens (``Scheduler.update``'s arrays, with each
    /// row's logprob) at time ``now`` under weights ``version``. Returns which
    /// entries were taken (not those of finished samples or unknown requests).
    #[allow(clippy::too_many_arguments)]
    fn push<'py>(
        &mut self,
        py: Python<'py>,
        handles: PyReadonlyArray1<'py, u64>,
        sample_indices: PyReadonlyArray1<'py, i32>,
        tokens: PyReadonlyArray1<'py, i32>,
        finish_codes: PyReadonlyArray1<'py, u8>,
        stop_tokens: PyReadonlyArray1<'py, bool>,
        logprobs: PyReadonlyArray1<'py, f32>,
        now: f64,
        version: u32,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let to_u32 = |values: &PyReadonlyArray1<'py, i32>, what: &str| -> PyResult<Vec<u32>> {
            values
                .as_array()
                .iter()
                .map(|&v| {
                    u32::try_from(v)
                        .map_err(|_| PyValueError::new_err(format!("negative {what}: {v}")))
                })
                .collect()
        };
        let samples = to_u32(&sample_indices, "sample index")?;
        let tokens = to_u32(&tokens, "token id")?;
        let handles = handles.as_slice()?;
        let codes = finish_codes.as_slice()?;
        let flags = stop_tokens.as_slice()?;
        let logprobs = logprobs.as_slice()?;
        let step = PushedTokens {
            handles,
            sample_indices: &samples,
            tokens: &tokens,
            finish_codes: codes,
            stop_tokens: flags,
            logprobs,
        };
        self.inner
            .push(step, now, version, &mut self.accepted)
            .map_err(PyValueError::new_err)?;
        Ok(PyArray1::from_slice(py, &self.accepted))
    }

    /// Make the text of every pending token (GIL released). Returns
    /// ``(handle, sample index)`` of the samples a stop string finished (tell
    /// the scheduler).
    fn detokenize(&mut self, py: Python<'_>) -> Vec<(u64, u32)> {
        let inner = &mut self.inner;
        py.detach(move || inner.detokenize())
    }

    /// What is new for every request with new tokens or a new finish, as
    /// ``(handle, done, first_token_time, last_token_time, samples)`` tuples
    /// (see ``take_request``); done requests are dropped after it.
    fn take_outputs<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let outputs = PyList::empty(py);
        let completion_output = self.completion_output.bind(py);
        let mut result = Ok(());
        self.inner.take_outputs(|view| {
            if result.is_ok() {
                result = view_to_py(py, completion_output, view).and_then(|t| outputs.append(t));
            }
        });
        result.map(|()| outputs)
    }

    /// One request's output now, ``(handle, done, first_token_time,
    /// last_token_time, completions)``; None if it has no streams. Dropped if done.
    fn take_request<'py>(
        &mut self,
        py: Python<'py>,
        handle: u64,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let completion_output = self.completion_output.bind(py);
        self.inner
            .take_request(handle, |view| view_to_py(py, completion_output, view))
            .transpose()
    }

    /// End a request from outside ("abort", "error"): its next output is its last.
    fn finish_request(&mut self, handle: u64, reason: &str) -> PyResult<bool> {
        Ok(self
            .inner
            .finish_request(handle, finish_reason_arg(reason)?))
    }

    /// Drop a request's streams without an output.
    fn remove(&mut self, handle: u64) -> bool {
        self.inner.remove(handle)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(&self, handle: u64) -> bool {
        self.inner.get(handle).is_some()
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(PyValueError::new_err)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyOutputStreams>()
}
