//! Requests and their sequences, as the scheduler sees them.
//!
//! A request owns `n` sequences (parallel samples). It enters with one
//! sequence; when that sequence's prompt is fully computed the scheduler forks
//! it into `n` copy-on-write children, so the prompt is prefilled once.
//! Preempted sequences return to the waiting queue and recompute their
//! prompt plus generated tokens (mostly from the prefix cache).
//!
//! # Id spaces
//!
//! Five kinds of integer name a request, a sequence or what it holds; each
//! has one owner. This table is their one description:
//!
//! | id | type | owner | names | lifetime |
//! |---|---|---|---|---|
//! | request index | `u32` | `Scheduler::requests` | an entry of the request registry | reused once the request's records are dropped |
//! | handle | `u64` | `Scheduler::add_request` | a request across the FFI: `generation << 32 \| request index`; the engine keys its `_Request`s by it | never reused (the generation bumps) |
//! | seq | `u32` | `Scheduler::seqs` | an entry of the sequence registry: one sample (sequence) of a request; `(handle, sample_index)` names it across the FFI | reused after its request is dropped |
//! | seat | `u32` in `0..max_num_seqs` | the scheduler's seat pool | a row of the runner's sampling table (`StepPlan::sample_rows`), held by a running sequence from its first sampled row until it finishes or is preempted | reused at once; freed seats are listed in the next plan |
//! | KV `SeqId` | `u64` | `KvCacheManager` | one page table: `generation << 32 \| index` of its entry in the manager's table registry | while the sequence holds KV (a stale id is an error, not an alias) |
//!
//! The engine's string `request_id` maps to a handle in `python/kvpage/engine/llm_engine.py`;
//! nothing else crosses the boundary.

use crate::grammar::structured_output::GrammarMatcher;
use crate::kv::kv_cache::SeqId;

/// Why a sequence stopped. Codes cross the FFI boundary as `u8`; this enum
/// is the one definition (Python reads `kvpage._core.FINISH_REASONS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FinishReason {
    /// EOS or a stop token (or a stop string, reported by the engine).
    Stop = 1,
    /// `max_tokens` or `max_model_len` reached.
    Length = 2,
    /// Aborted by the caller.
    Abort = 3,
    /// Failed inside a step (reported by the engine).
    Error = 4,
}

impl FinishReason {
    /// Every reason, for the table exported to Python.
    pub const ALL: [FinishReason; 4] = [Self::Stop, Self::Length, Self::Abort, Self::Error];

    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "stop" => Some(Self::Stop),
            "length" => Some(Self::Length),
            "abort" => Some(Self::Abort),
            "error" => Some(Self::Error),
            _ => None,
        }
    }
}

/// What the scheduler needs to know of a request: its stop conditions and
/// sample count. The sampling knobs (temperature, top-p, seeds, penalties)
/// belong to the model runner's device sampling table, not to scheduling.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestParams {
    pub n: u32,
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
}

/// `max_tokens` when a request names none: the one default of the engine
/// (Python's `SamplingParams` reads it as `kvpage._core.DEFAULT_MAX_TOKENS`).
/// vLLM's 16 cuts most answers short.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

impl Default for RequestParams {
    fn default() -> Self {
        Self {
            n: 1,
            max_tokens: DEFAULT_MAX_TOKENS,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    Waiting,
    Running,
    Finished(FinishReason),
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub request: u32,
    pub sample_index: u32,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    /// Leading tokens whose KV is computed or scheduled in an issued step.
    pub num_computed: usize,
    /// The page table, while the sequence holds KV.
    pub kv: Option<SeqId>,
    pub state: SeqState,
    /// Children still to fork when the prompt completes (n - 1, once).
    pub forks_pending: u32,
    /// Prompt tokens found in the prefix cache at first admission.
    pub num_cached_tokens: usize,
    /// Admitted (given KV) at least once: a re-admission after preemption
    /// must not report its own recomputed blocks as cache hits.
    pub admitted: bool,
    /// Structured outputs: the grammar state after this sample's generated
    /// tokens (`grammar/structured_output.rs`); None when unconstrained.
    pub grammar: Option<GrammarMatcher>,
    /// The seat (sampling-table row) held from the first sampled row after
    /// admission until the sequence finishes or is preempted.
    pub seat: Option<u32>,
    /// Speculative decoding (`scheduler/speculation.rs`): the tokens drafted
    /// for the step awaiting its update (else empty), and how many to draft.
    pub draft: Vec<u32>,
    pub spec_k: u32,
    /// Drafts in a row of which nothing was kept, and the decode steps left
    /// before it drafts again (`scheduler/speculation.rs`).
    pub spec_misses: u32,
    pub spec_cooldown: u32,
    /// Its stream in the suffix drafter's index, once it drafted.
    pub stream: Option<u64>,
}

impl Sequence {
    pub fn num_output_tokens(&self, prompt_len: usize) -> usize {
        self.tokens.len() - prompt_len
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub handle: u64,
    pub priority: i64,
    pub arrival: u64,
    pub params: RequestParams,
    pub salt: Option<String>,
    /// The prefix cache may supply at most this many leading tokens
    /// (`usize::MAX`: no limit); scoring requests need their later positions
    /// computed, not reused.
    pub reuse_limit: usize,
    pub prompt_len: usize,
    pub seqs: Vec<u32>,
    pub num_unfinished: u32,
    /// A row of the request was in an issued plan (reported once through
    /// `StepPlan::first_scheduled`).
    pub scheduled: bool,
    /// Its sequences may draft tokens (`scheduler/speculation.rs`).
    pub speculate: bool,
}
