//! PyO3 binding of [`crate::sched::step_plan`]: one step's plan as numpy
//! arrays, copied out of the core's plan once per step.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use crate::sched::step_plan::StepPlan as CoreStepPlan;

/// One step's plan as numpy arrays (format: `rust/sched/step_plan.rs`).
#[pyclass(module = "kvpage._core", get_all, frozen)]
pub struct StepPlan {
    token_ids: Py<PyArray1<i32>>,
    positions: Py<PyArray1<i32>>,
    slot_mapping: Py<PyArray1<i32>>,
    cu_q_lens: Py<PyArray1<i32>>,
    kv_lens: Py<PyArray1<i32>>,
    row_request: Py<PyArray1<u64>>,
    block_tables: Py<PyArray2<i32>>,
    logits_indices: Py<PyArray1<i32>>,
    copy_src: Py<PyArray1<i32>>,
    copy_dst: Py<PyArray1<i32>>,
    sample_request: Py<PyArray1<u64>>,
    sample_index: Py<PyArray1<i32>>,
    sample_output_len: Py<PyArray1<i32>>,
    sample_suppress_stop: Py<PyArray1<bool>>,
    sample_rows: Py<PyArray1<i32>>,
    sample_new_seat: Py<PyArray1<bool>>,
    freed_seats: Py<PyArray1<i32>>,
    first_scheduled: Py<PyArray1<u64>>,
    first_scheduled_cached: Py<PyArray1<i32>>,
    decode_only: bool,
    preempted: Py<PyArray1<u64>>,
    preempted_index: Py<PyArray1<i32>>,
    num_tokens: usize,
    num_seqs: usize,
    num_prefill_tokens: usize,
    num_decode_tokens: usize,
    num_sampled: usize,
}

fn arr<T: numpy::Element + Copy>(py: Python<'_>, v: &[T]) -> Py<PyArray1<T>> {
    PyArray1::from_slice(py, v).unbind()
}

impl StepPlan {
    pub(super) fn from_core(py: Python<'_>, p: &CoreStepPlan) -> PyResult<Self> {
        let rows = p.num_seqs();
        let tables =
            PyArray1::from_slice(py, &p.block_tables).reshape([rows, p.block_table_width])?;
        Ok(Self {
            token_ids: arr(py, &p.token_ids),
            positions: arr(py, &p.positions),
            slot_mapping: arr(py, &p.slot_mapping),
            cu_q_lens: arr(py, &p.cu_q_lens),
            kv_lens: arr(py, &p.kv_lens),
            row_request: arr(py, &p.row_request),
            block_tables: tables.unbind(),
            logits_indices: arr(py, &p.logits_indices),
            copy_src: arr(py, &p.copy_src),
            copy_dst: arr(py, &p.copy_dst),
            sample_request: arr(py, &p.sample_request),
            sample_index: arr(py, &p.sample_index),
            sample_output_len: arr(py, &p.sample_output_len),
            sample_suppress_stop: arr(py, &p.sample_suppress_stop),
            sample_rows: arr(py, &p.sample_rows),
            sample_new_seat: arr(py, &p.sample_new_seat),
            freed_seats: arr(py, &p.freed_seats),
            first_scheduled: arr(py, &p.first_scheduled),
            first_scheduled_cached: arr(py, &p.first_scheduled_cached),
            decode_only: p.decode_only,
            preempted: arr(py, &p.preempted),
            preempted_index: arr(py, &p.preempted_index),
            num_tokens: p.num_tokens(),
            num_seqs: rows,
            num_prefill_tokens: p.num_prefill_tokens,
            num_decode_tokens: p.num_decode_tokens,
            num_sampled: p.num_sampled(),
        })
    }
}

#[pymethods]
impl StepPlan {
    fn __len__(&self) -> usize {
        self.num_tokens
    }
}
