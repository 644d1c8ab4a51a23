//! PyO3 binding of [`crate::sched::scheduler`]: `Scheduler`, whose
//! `schedule()` returns a `StepPlan` and whose `update()` returns numpy
//! arrays of token events.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::kv::prefix_cache::events::CacheEvent;
use crate::py::convert::{extract_tokens, finish_reason_arg};
use crate::py::step_plan::StepPlan;
use crate::py::structured::Grammar;
use crate::sched::request::{RequestParams, DEFAULT_MAX_TOKENS};
use crate::sched::scheduler::{
    defaults, DraftMethod, Policy, Scheduler as CoreScheduler, SchedulerConfig, SpeculativeConfig,
    TokenEvent,
};

/// The continuous-batching scheduler (see `rust/sched/scheduler/`). Sizes
/// left out default to `sched::scheduler::defaults` (Python's `EngineConfig`
/// owns them; the engine always passes them).
#[pyclass(module = "kvpage._core")]
pub struct Scheduler {
    inner: CoreScheduler,
    events: Vec<TokenEvent>,
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size = defaults::BLOCK_SIZE, max_num_seqs = defaults::MAX_NUM_SEQS,
        max_num_batched_tokens = defaults::MAX_NUM_BATCHED_TOKENS,
        max_model_len = defaults::MAX_MODEL_LEN, enable_chunked_prefill = true,
        long_prefill_token_threshold = 0,
        enable_prefix_caching = true, scheduling_policy = "fcfs", eos_token_ids = None,
        sliding_window = None, group_shared_prefills = true, num_speculative_tokens = 0, prompt_lookup_min = 2,
        prompt_lookup_max = 4, speculative_max_running = 8, speculative_method = "ngram",
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
        sliding_window: Option<u32>,
        group_shared_prefills: bool,
        num_speculative_tokens: usize,
        prompt_lookup_min: usize,
        prompt_lookup_max: usize,
        speculative_max_running: usize,
        speculative_method: &str,
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
            group_shared_prefills,
            policy: Policy::parse(scheduling_policy)?,
            eos_token_ids: eos_token_ids.unwrap_or_default(),
            sliding_window,
            speculative: SpeculativeConfig {
                method: DraftMethod::parse(speculative_method)?,
                num_speculative_tokens,
                prompt_lookup_min,
                prompt_lookup_max,
                max_running: speculative_max_running,
                ..SpeculativeConfig::default()
            },
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
    /// `max_cached_tokens`: the prefix cache supplies at most that many
    /// leading prompt tokens (later positions are computed, e.g. to score them).
    /// Only scheduling facts come here: sampling knobs belong to the runner.
    #[pyo3(signature = (
        prompt_token_ids, *, n = 1, max_tokens = Some(DEFAULT_MAX_TOKENS), min_tokens = 0,
        ignore_eos = false,
        stop_token_ids = None, priority = 0, cache_salt = None, max_cached_tokens = None,
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
        max_cached_tokens: Option<usize>,
    ) -> PyResult<u64> {
        let prompt = extract_tokens(prompt_token_ids)?;
        let params = RequestParams {
            n,
            max_tokens: max_tokens.unwrap_or(u32::MAX),
            min_tokens,
            ignore_eos,
            stop_token_ids: stop_token_ids.unwrap_or_default(),
        };
        let handle = self
            .inner
            .add_request(&prompt, params, priority, cache_salt)?;
        if let Some(limit) = max_cached_tokens {
            self.inner.limit_prefix_reuse(handle, limit)?;
        }
        Ok(handle)
    }

    /// Plan the next step (an empty plan when there is nothing to run).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<StepPlan> {
        let plan = self.inner.schedule()?;
        StepPlan::from_core(py, plan)
    }

    /// Never draft tokens for this request (speculative decoding): for
    /// sampling that needs every earlier token on the device (penalties).
    fn disable_speculation(&mut self, handle: u64) -> PyResult<()> {
        Ok(self.inner.disable_speculation(handle)?)
    }

    /// Decode steps (1..=max_steps) the plan awaiting its update may run in
    /// one device call (multi-step scheduling; see `sched/scheduler/lookahead.rs`).
    fn lookahead_steps(&self, max_steps: usize) -> usize {
        self.inner.lookahead_steps(max_steps)
    }

    /// The next step of a lookahead: the running sequences' next decode
    /// tokens, nobody admitted (call after `update` of the previous step).
    fn schedule_continuation(&mut self, py: Python<'_>) -> PyResult<StepPlan> {
        let plan = self.inner.schedule_continuation()?;
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

    /// Speculative method `draft_model`: the samples that will draft at the
    /// next `schedule()` if given tokens, as `(handle, sample_index,
    /// max_tokens)` (empty when speculation does not apply).
    fn draft_requests(&self) -> Vec<(u64, u32, usize)> {
        self.inner.draft_requests()
    }

    /// Speculative method `draft_model`: tokens a draft model proposes to
    /// follow a sample as it stands now; the next `schedule()` drafts at most
    /// its limit of them, and drops the proposal either way.
    fn propose_drafts(
        &mut self,
        handle: u64,
        sample_index: u32,
        drafts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let drafts = extract_tokens(drafts)?;
        Ok(self.inner.propose_drafts(handle, sample_index, &drafts)?)
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

    /// Record the prefix cache's events from now on (`take_kv_events`).
    fn enable_kv_events(&mut self) {
        self.inner.set_kv_events_enabled(true);
    }

    /// The prefix cache's events since the last call, oldest first, as
    /// tuples: `("stored", hash, parent_hash | None, token_ids, salt | None)`,
    /// `("removed", hash)`, `("cleared",)`; hashes are unsigned 64-bit.
    fn take_kv_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for event in self.inner.take_kv_events() {
            let item = match event {
                CacheEvent::Stored {
                    hash,
                    parent,
                    tokens,
                    salt,
                } => ("stored", hash, parent, tokens, salt)
                    .into_pyobject(py)?
                    .into_any(),
                CacheEvent::Removed { hash } => ("removed", hash).into_pyobject(py)?.into_any(),
                CacheEvent::Cleared => ("cleared",).into_pyobject(py)?.into_any(),
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// The chained hash of every block the prefix cache holds (unsigned
    /// 64-bit, in no order): what this engine could reuse, for a cache-aware
    /// router to compare with `prefix_block_hashes` of a prompt.
    fn cached_block_hashes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_vec(py, self.inner.kv().cached_block_hashes())
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

    /// The sliding window the KV cache drops blocks by (None: full attention,
    /// and always None under the static policy).
    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        self.inner.kv().sliding_window()
    }

    /// KV blocks held by live sequences, with the cached blocks kept alive
    /// for them (the numerator of `kv_cache_usage_perc`).
    #[getter]
    fn num_referenced_blocks(&self) -> usize {
        self.inner.kv().num_referenced_blocks()
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
        d.set_item("prefill_waits", s.prefill_waits)?;
        d.set_item("num_aborted_requests", s.num_aborted_requests)?;
        d.set_item("spec_decode_num_drafts", s.num_drafts)?;
        d.set_item("spec_decode_num_draft_tokens", s.num_draft_tokens)?;
        d.set_item("spec_decode_num_accepted_tokens", s.num_accepted_tokens)?;
        Ok(d)
    }

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}
