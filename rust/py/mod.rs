//! PyO3 bindings: `kvpage._core`. A thin layer: argument conversion, numpy
//! arrays out, typed errors in. No logic lives here.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::KvError;
use crate::kv::block_pool::{BlockId, BlockPool as CoreBlockPool};
use crate::kv::kv_cache::{BlockCopy, KvCacheManager as CoreKvCacheManager, SeqId};
use crate::sched::request::{FinishReason, RequestParams, DEFAULT_MAX_TOKENS};
use crate::sched::scheduler::{Policy, Scheduler as CoreScheduler, SchedulerConfig, TokenEvent};
use crate::sched::step_plan::StepPlan as CoreStepPlan;

mod detokenizer;
mod output_streams;
mod structured;
use structured::{Grammar, GrammarVocab};

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

fn block_arg(block: i64) -> PyResult<BlockId> {
    BlockId::try_from(block)
        .map_err(|_| PyValueError::new_err(format!("block id {block} is out of range")))
}

fn copies_array<'py>(py: Python<'py>, copies: &[BlockCopy]) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let rows: Vec<Vec<i32>> = copies
        .iter()
        .map(|c| vec![c.src as i32, c.dst as i32])
        .collect();
    if rows.is_empty() {
        return PyArray1::<i32>::from_vec(py, Vec::new()).reshape([0, 2]);
    }
    Ok(PyArray2::from_vec2(py, &rows)?)
}

/// The raw block pool: a free list with refcounts, for direct use and tests.
#[pyclass(module = "kvpage._core")]
pub struct BlockPool {
    inner: CoreBlockPool,
}

#[pymethods]
impl BlockPool {
    #[new]
    fn new(num_blocks: usize, block_size: usize) -> PyResult<Self> {
        Ok(Self {
            inner: CoreBlockPool::new(num_blocks, block_size)?,
        })
    }

    /// Allocate `count` blocks (refcount 1 each) as an int32 array, or return
    /// None when fewer are free; a failed call allocates nothing.
    fn allocate<'py>(
        &mut self,
        py: Python<'py>,
        count: usize,
    ) -> Option<Bound<'py, PyArray1<i32>>> {
        if count > self.inner.num_free() {
            return None; // checked before reserving memory for the result
        }
        let mut out = Vec::with_capacity(count);
        self.inner.allocate(count, &mut out).ok()?;
        Some(PyArray1::from_vec(
            py,
            out.into_iter().map(|b| b as i32).collect(),
        ))
    }

    /// Drop one reference; the block returns to the free list at zero.
    fn free(&mut self, block: i64) -> PyResult<()> {
        Ok(self.inner.free(block_arg(block)?)?)
    }

    /// Add a reference to an allocated block.
    fn retain(&mut self, block: i64) -> PyResult<()> {
        Ok(self.inner.retain(block_arg(block)?)?)
    }

    fn refcount(&self, block: i64) -> PyResult<u32> {
        Ok(self.inner.refcount(block_arg(block)?)?)
    }

    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}

/// Page tables with copy-on-write over one block pool, plus the radix
/// prefix cache. Sequences are addressed by integer handles.
#[pyclass(module = "kvpage._core")]
pub struct KVCacheManager {
    inner: CoreKvCacheManager,
    copies: Vec<BlockCopy>,
}

#[pymethods]
impl KVCacheManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true))]
    fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> PyResult<Self> {
        Ok(Self {
            inner: CoreKvCacheManager::new(num_blocks, block_size, enable_prefix_caching)?,
            copies: Vec::new(),
        })
    }

    /// A new empty sequence; blocks are shared only with the same `salt`.
    #[pyo3(signature = (salt = None))]
    fn create_sequence(&mut self, salt: Option<&str>) -> SeqId {
        self.inner.create_sequence(salt)
    }

    /// Attach the longest cached whole-block prefix of `tokens` to an empty
    /// sequence; returns the number of tokens matched.
    fn match_prefix(&mut self, seq: SeqId, tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let tokens = extract_tokens(tokens)?;
        Ok(self.inner.match_prefix(seq, &tokens)?)
    }

    /// Blocks that `allocate_slots(seq, n)` would take.
    fn blocks_needed(&self, seq: SeqId, num_new_tokens: usize) -> PyResult<usize> {
        Ok(self.inner.blocks_needed(seq, num_new_tokens)?)
    }

    /// Reserve slots for `num_new_tokens` more positions. Returns the
    /// copy-on-write orders as an int32 [C, 2] array of (src, dst), or None
    /// (and changes nothing) when the pool cannot supply the blocks.
    fn allocate_slots<'py>(
        &mut self,
        py: Python<'py>,
        seq: SeqId,
        num_new_tokens: usize,
    ) -> PyResult<Option<Bound<'py, PyArray2<i32>>>> {
        self.copies.clear();
        match self
            .inner
            .allocate_slots(seq, num_new_tokens, &mut self.copies)
        {
            Ok(()) => Ok(Some(copies_array(py, &self.copies)?)),
            Err(KvError::OutOfBlocks { .. }) => Ok(None),
            Err(err) => Err(err.into()),
        }
    }

    /// Slot ids (block * block_size + offset) of positions start..start+n.
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq: SeqId,
        start: usize,
        n: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let num_tokens = self.inner.num_tokens(seq)?;
        if start.checked_add(n).is_none_or(|end| end > num_tokens) {
            return Err(PyValueError::new_err(format!(
                "positions {start}..{start}+{n} exceed the {num_tokens} tokens of sequence {seq}"
            )));
        }
        let mut out = vec![0i32; n];
        self.inner.write_slots(seq, start, &mut out)?;
        Ok(PyArray1::from_vec(py, out))
    }

    fn block_table<'py>(&self, py: Python<'py>, seq: SeqId) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let table = self.inner.block_table(seq)?;
        Ok(PyArray1::from_vec(
            py,
            table.iter().map(|&b| b as i32).collect(),
        ))
    }

    fn num_tokens(&self, seq: SeqId) -> PyResult<usize> {
        Ok(self.inner.num_tokens(seq)?)
    }

    /// Cache the full blocks among the sequence's first len(tokens) positions.
    fn cache_blocks(&mut self, seq: SeqId, tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let tokens = extract_tokens(tokens)?;
        Ok(self.inner.cache_blocks(seq, &tokens)?)
    }

    /// A child sequence sharing every block (copy-on-write).
    fn fork(&mut self, seq: SeqId) -> PyResult<SeqId> {
        Ok(self.inner.fork(seq)?)
    }

    fn free_sequence(&mut self, seq: SeqId) -> PyResult<()> {
        Ok(self.inner.free_sequence(seq)?)
    }

    fn refcount(&self, block: i64) -> PyResult<u32> {
        Ok(self.inner.refcount(block_arg(block)?)?)
    }

    fn reset_prefix_cache(&mut self) -> PyResult<()> {
        Ok(self.inner.reset_prefix_cache()?)
    }

    /// Evict up to `count` unreferenced cached blocks, LRU first.
    fn evict(&mut self, count: usize) -> PyResult<usize> {
        Ok(self.inner.evict(count)?)
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    #[getter]
    fn num_available_blocks(&self) -> usize {
        self.inner.num_available_blocks()
    }

    #[getter]
    fn num_referenced_blocks(&self) -> usize {
        self.inner.num_referenced_blocks()
    }

    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.num_cached_blocks()
    }

    #[getter]
    fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
    }

    /// Fraction of blocks held by live sequences.
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    /// Prefix-cache counters: queries, query/hit tokens, hit/inserted/evicted blocks.
    fn prefix_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.prefix_cache_stats();
        let dict = PyDict::new(py);
        dict.set_item("queries", s.queries)?;
        dict.set_item("query_tokens", s.query_tokens)?;
        dict.set_item("hit_tokens", s.hit_tokens)?;
        dict.set_item("hit_blocks", s.hit_blocks)?;
        dict.set_item("inserted_blocks", s.inserted_blocks)?;
        dict.set_item("evicted_blocks", s.evicted_blocks)?;
        Ok(dict)
    }

    /// Raise KVPageError describing the first violated invariant, if any.
    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}

/// One step's plan as numpy arrays (format: `rust/step_plan.rs`).
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
    fn from_core(py: Python<'_>, p: &CoreStepPlan) -> PyResult<Self> {
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

pub(crate) fn finish_reason_arg(reason: &str) -> PyResult<FinishReason> {
    FinishReason::parse(reason).ok_or_else(|| {
        PyValueError::new_err(format!(
            "finish reason must be one of 'stop', 'length', 'abort', 'error'; got {reason:?}"
        ))
    })
}

/// The continuous-batching scheduler (see `rust/scheduler.rs`).
#[pyclass(module = "kvpage._core")]
pub struct Scheduler {
    inner: CoreScheduler,
    events: Vec<TokenEvent>,
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size = 16, max_num_seqs = 256, max_num_batched_tokens = 2048,
        max_model_len = 2048, enable_chunked_prefill = true, long_prefill_token_threshold = 0,
        enable_prefix_caching = true, scheduling_policy = "fcfs", eos_token_ids = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: usize,
        block_size: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        enable_chunked_prefill: bool,
        long_prefill_token_threshold: usize,
        enable_prefix_caching: bool,
        scheduling_policy: &str,
        eos_token_ids: Option<Vec<u32>>,
    ) -> PyResult<Self> {
        let config = SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill,
            long_prefill_token_threshold,
            enable_prefix_caching,
            policy: Policy::parse(scheduling_policy)?,
            eos_token_ids: eos_token_ids.unwrap_or_default(),
        };
        Ok(Self {
            inner: CoreScheduler::new(config)?,
            events: Vec::new(),
        })
    }

    /// Queue a request; returns its integer handle. Raises ValueError naming
    /// the problem for an empty prompt, one that leaves no room to generate,
    /// or limits that cannot be met. `max_tokens=None` generates until
    /// `max_model_len`; any value is clamped to the room the prompt leaves.
    /// Only scheduling facts come here: sampling knobs belong to the runner.
    #[pyo3(signature = (
        prompt_token_ids, *, n = 1, max_tokens = Some(DEFAULT_MAX_TOKENS), min_tokens = 0,
        ignore_eos = false,
        stop_token_ids = None, priority = 0, cache_salt = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        prompt_token_ids: &Bound<'_, PyAny>,
        n: u32,
        max_tokens: Option<u32>,
        min_tokens: u32,
        ignore_eos: bool,
        stop_token_ids: Option<Vec<u32>>,
        priority: i64,
        cache_salt: Option<&str>,
    ) -> PyResult<u64> {
        let prompt = extract_tokens(prompt_token_ids)?;
        let params = RequestParams {
            n,
            max_tokens: max_tokens.unwrap_or(u32::MAX),
            min_tokens,
            ignore_eos,
            stop_token_ids: stop_token_ids.unwrap_or_default(),
        };
        Ok(self
            .inner
            .add_request(&prompt, params, priority, cache_salt)?)
    }

    /// Plan the next step (an empty plan when there is nothing to run).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<StepPlan> {
        let plan = self.inner.schedule()?;
        StepPlan::from_core(py, plan)
    }

    /// Apply one sampled token per sampled row of the last plan. Returns
    /// (request handles u64, sample indices i32, tokens i32, finish codes u8,
    /// plan rows i32, stop-token flags bool) where the code is 0 while
    /// running, else a key of `FINISH_REASONS`; the flag marks a stop on one
    /// of the request's `stop_token_ids` (the token is the stop reason).
    /// Rows of requests aborted meanwhile are left out.
    #[allow(clippy::type_complexity)]
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        sampled: &Bound<'py, PyAny>,
    ) -> PyResult<(
        Bound<'py, PyArray1<u64>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<u8>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<bool>>,
    )> {
        let sampled: Vec<i64> = if let Ok(a) = sampled.extract::<PyReadonlyArray1<'_, i32>>() {
            a.as_array().iter().map(|&v| v as i64).collect()
        } else if let Ok(a) = sampled.extract::<PyReadonlyArray1<'_, i64>>() {
            a.as_array().to_vec()
        } else {
            sampled.extract().map_err(|_| {
                PyValueError::new_err(
                    "sampled tokens must be a 1-D integer numpy array or a sequence of ints",
                )
            })?
        };
        self.events.clear();
        self.inner.update(&sampled, &mut self.events)?;
        let e = &self.events;
        Ok((
            PyArray1::from_vec(py, e.iter().map(|e| e.request).collect()),
            PyArray1::from_vec(py, e.iter().map(|e| e.sample_index as i32).collect()),
            PyArray1::from_vec(py, e.iter().map(|e| e.token as i32).collect()),
            PyArray1::from_vec(
                py,
                e.iter().map(|e| e.finish.map_or(0, |r| r as u8)).collect(),
            ),
            PyArray1::from_vec(py, e.iter().map(|e| e.row as i32).collect()),
            PyArray1::from_vec(py, e.iter().map(|e| e.stop_token).collect()),
        ))
    }

    /// Abort a request in any state; False if the handle is not live.
    fn abort_request(&mut self, handle: u64) -> PyResult<bool> {
        Ok(self.inner.abort_request(handle)?)
    }

    /// Finish every sample of a request with a reason ("stop", "error", ...).
    fn finish_request(&mut self, handle: u64, reason: &str) -> PyResult<bool> {
        Ok(self
            .inner
            .finish_request(handle, finish_reason_arg(reason)?)?)
    }

    /// Finish one sample of a request (e.g. it produced a stop string).
    fn finish_sample(&mut self, handle: u64, sample_index: u32, reason: &str) -> PyResult<bool> {
        Ok(self
            .inner
            .finish_sample(handle, sample_index, finish_reason_arg(reason)?)?)
    }

    /// Prompt plus output tokens of one live sample, or None.
    fn sample_tokens<'py>(
        &self,
        py: Python<'py>,
        handle: u64,
        sample_index: u32,
    ) -> Option<Bound<'py, PyArray1<u32>>> {
        self.inner
            .sample_tokens(handle, sample_index)
            .map(|t| PyArray1::from_slice(py, t))
    }

    /// Constrain a queued (not yet scheduled) request's samples to `grammar`.
    fn set_grammar(&mut self, handle: u64, grammar: &Grammar) -> PyResult<()> {
        Ok(self.inner.set_grammar(handle, &grammar.inner)?)
    }

    /// Sampled rows of the last plan that carry a grammar.
    fn num_constrained_rows(&self) -> usize {
        self.inner.num_constrained_rows()
    }

    /// Token masks of the last plan's sampled rows as int32 [rows, words]
    /// (bit t % 32 of word t / 32 allows token t; unconstrained rows allow
    /// all). Computed with the GIL released.
    fn fill_token_bitmask<'py>(
        &mut self,
        py: Python<'py>,
        words: usize,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let rows = self.inner.plan().num_sampled();
        let mut out = vec![0u32; rows * words];
        let inner = &mut self.inner;
        py.detach(|| inner.fill_token_bitmask(&mut out, words))?;
        let out: Vec<i32> = out.into_iter().map(|w| w as i32).collect();
        PyArray1::from_vec(py, out).reshape([rows, words])
    }

    /// Prompt tokens served from the prefix cache at admission, or None.
    fn num_cached_tokens(&self, handle: u64) -> Option<usize> {
        self.inner.num_cached_tokens(handle)
    }

    fn reset_prefix_cache(&mut self) -> PyResult<()> {
        Ok(self.inner.reset_prefix_cache()?)
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// True between a non-empty `schedule()` and its `update()`.
    #[getter]
    fn awaiting_update(&self) -> bool {
        self.inner.awaiting_update()
    }

    #[getter]
    fn num_requests_running(&self) -> usize {
        self.inner.num_running()
    }

    #[getter]
    fn num_requests_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    /// Fraction of KV blocks held by live sequences.
    #[getter]
    fn kv_cache_usage_perc(&self) -> f64 {
        self.inner.kv().usage()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.kv().num_free_blocks()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.kv().num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.kv().block_size()
    }

    /// Counters: running, waiting, KV usage, prefix cache, preemptions, tokens per step.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner.stats;
        let kv = self.inner.kv();
        let cache = kv.prefix_cache_stats();
        let (reserved, used) = self.inner.kv_slot_usage();
        let d = PyDict::new(py);
        d.set_item("num_requests_running", self.inner.num_running())?;
        d.set_item("num_requests_waiting", self.inner.num_waiting())?;
        d.set_item("kv_cache_usage_perc", kv.usage())?;
        d.set_item("num_referenced_blocks", kv.num_referenced_blocks())?;
        d.set_item("num_cached_blocks", kv.num_cached_blocks())?;
        d.set_item("num_free_blocks", kv.num_free_blocks())?;
        d.set_item("kv_slots_reserved", reserved)?;
        d.set_item("kv_slots_used", used)?;
        d.set_item("prefix_cache_queries", cache.queries)?;
        d.set_item("prefix_cache_query_tokens", cache.query_tokens)?;
        d.set_item("prefix_cache_hit_tokens", cache.hit_tokens)?;
        d.set_item("prefix_cache_hit_blocks", cache.hit_blocks)?;
        d.set_item("prefix_cache_evicted_blocks", cache.evicted_blocks)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_steps", s.num_steps)?;
        d.set_item("prompt_tokens_scheduled", s.prompt_tokens_scheduled)?;
        d.set_item("decode_tokens_scheduled", s.decode_tokens_scheduled)?;
        d.set_item("last_step_tokens", s.last_step_tokens)?;
        d.set_item("last_step_seqs", s.last_step_seqs)?;
        d.set_item("seq_rows", s.seq_rows)?;
        d.set_item("ghost_rows", s.ghost_rows)?;
        d.set_item("idle_seats_while_waiting", s.idle_seats_while_waiting)?;
        d.set_item("num_finished_requests", s.num_finished_requests)?;
        d.set_item("num_aborted_requests", s.num_aborted_requests)?;
        Ok(d)
    }

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let error_type = m.py().get_type::<KVPageError>();
    // Named for where it lives, so errors pickle across processes.
    error_type.setattr("__module__", "kvpage._core")?;
    m.add("KVPageError", error_type)?;
    let reasons = PyDict::new(m.py());
    for reason in FinishReason::ALL {
        reasons.set_item(reason as u8, reason.as_str())?;
    }
    // Finish code -> name, as `Scheduler.update` reports codes.
    m.add("FINISH_REASONS", reasons)?;
    m.add("DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS)?;
    m.add_class::<BlockPool>()?;
    m.add_class::<KVCacheManager>()?;
    m.add_class::<Scheduler>()?;
    m.add_class::<StepPlan>()?;
    m.add_class::<GrammarVocab>()?;
    m.add_class::<Grammar>()?;
    detokenizer::register(m)?;
    output_streams::register(m)?;
    Ok(())
}
