//! The step plan: everything the model runner needs to execute one step,
//! as flat arrays built in Rust. This is the single place the format is
//! documented (the Python side, `python/kvpage/runner/step_plan.py`, points
//! here); the Pallas kernels read exactly these arrays.
//!
//! ```text
//!   seq rows:      s0 (prefill chunk, 5 tokens)   s1 (decode)   s2 (decode)
//!   token_ids:     t t t t t                      t             t
//!   cu_q_lens:     0                              5             6            7
//!   kv_lens:       kv_len(s0)                     kv_len(s1)    kv_len(s2)
//!   logits_indices:        4 (only if the chunk ends the prompt) 5           6
//! ```
//!
//! Shapes: T tokens, S rows (scheduled sequences), R sampled rows, C block
//! copies, F freed seats, N first-scheduled requests, P preemptions. Arrays
//! are unpadded (exactly these lengths); the runner pads T, S, R and W to its
//! bucket sizes.
//!
//! | field | dtype | shape | meaning |
//! |---|---|---|---|
//! | `token_ids` | int32 | [T] | the step's new tokens, flattened over rows |
//! | `positions` | int32 | [T] | absolute position of each token in its sequence |
//! | `slot_mapping` | int32 | [T] | where token i's K/V goes: `block * block_size + offset`; the scratch slot `num_blocks * block_size` for rows whose writes are discarded |
//! | `cu_q_lens` | int32 | [S+1] | row s owns tokens `cu_q_lens[s]..cu_q_lens[s+1]` of the flat arrays |
//! | `kv_lens` | int32 | [S] | each row's KV length after this step (what attention reads) |
//! | `row_request` | uint64 | [S] | request handle of each row |
//! | `block_tables` | int32 | [S, W] | physical block of each logical block; padded with the scratch block id `num_blocks`, which also stands for blocks dropped out of a sliding window (below); W >= the blocks of the widest row (the core gives exactly that; the runner pads to its `max_blocks`) |
//! | `logits_indices` | int32 | [R] | flat token index whose logits feed sampled row r |
//! | `copy_src`, `copy_dst` | int32 | [C] | copy-on-write whole-block copies to run before the step |
//! | `sample_request` | uint64 | [R] | request handle of row r |
//! | `sample_index` | int32 | [R] | sample index (0..n) of row r within its request |
//! | `sample_output_len` | int32 | [R] | the sample's output length so far |
//! | `sample_suppress_stop` | bool | [R] | EOS/stop tokens must be suppressed (min_tokens not reached); the sampling knobs themselves live in the runner's per-seat device table |
//! | `sample_rows` | int32 | [R] | the seat of row r: its sample's row of the runner's sampling table (`0..max_num_seqs`) |
//! | `sample_new_seat` | bool | [R] | the seat was bound to this sample at this row: the engine loads the sample's sampling parameters into it before the step |
//! | `freed_seats` | int32 | [F] | seats released since the previous plan (finished, aborted, preempted); freed before any seat of this plan is bound |
//! | `first_scheduled` | uint64 | [N] | requests whose first row is in this plan |
//! | `first_scheduled_cached` | int32 | [N] | their prompt tokens served from the prefix cache |
//! | `preempted`, `preempted_index` | uint64, int32 | [P] | (request handle, sample index) of sequences preempted while building this plan |
//! | `num_tokens`, `num_seqs`, `num_sampled` | int | scalar | T, S, R |
//! | `num_prefill_tokens`, `num_decode_tokens` | int | scalar | the T tokens split into prefill (rows of several tokens or inside the prompt) and decode (one-token rows past the prompt); static ghost rows count in neither |
//! | `decode_only` | bool | scalar | every row has exactly one query token: the runner may use its decode-specialized attention |
//! | `token_bitmask` | int32 | [R, ceil(vocab / 32)] | optional, not built by the core: the allowed tokens of each sampled row (structured outputs), from `Scheduler::fill_token_bitmask` (bit t % 32 of word t / 32 allows token t); absent or None allows every token |
//!
//! The runner reads `token_ids`, `positions`, `slot_mapping`, `cu_q_lens`,
//! `kv_lens`, `block_tables`, `logits_indices`, `sample_rows`, `copy_src`,
//! `copy_dst`, `num_seqs`, `num_tokens`, `decode_only` and, with LoRA adapters,
//! `row_request` (`StepPlanLike` in `python/kvpage/runner/step_plan.py`) and,
//! when present, `token_bitmask`; the other fields are the engine's.
//!
//! Invariants: a seat appears at most once in `sample_rows`; a seat in
//! `sample_rows` is held by that row's sample until `update` or an abort
//! frees it; `sample_new_seat[r]` is true exactly on the first sampled row
//! of a sample since it was (re)admitted.
//!
//! With n > 1, the row that completes a prompt appears n times in
//! `logits_indices` (same flat index), once per forked sample.
//!
//! Sliding window (`SchedulerConfig::sliding_window = Some(window)`, set
//! only when every attention layer slides with the same `window`; not to
//! be confused with the table width W above): a query at
//! position `p` reads only keys at `j` with `p - window < j <= p`. A row whose
//! first query is at `start` (its `positions[cu_q_lens[s]]`) reads nothing
//! below `start - window + 1`; the KV cache drops the blocks that lie entirely
//! before that as the sequence advances, so in `block_tables` an entry `b`
//! with `(b + 1) * block_size <= start - window + 1` may be the scratch block id
//! `num_blocks` (the block went back to the pool) or a block that still
//! holds older KV: either way the kernels must not read it. Every entry
//! from block `(start - window + 1) / block_size` on (all of them when
//! `start < window`) is a real block holding the row's KV, as without a window.
//! `kv_lens` stays the absolute length (the window is the kernels' to
//! apply), and `slot_mapping` never names a dropped block. The `static`
//! policy runs without a window (it reserves whole lengths up front).

#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub token_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    pub cu_q_lens: Vec<i32>,
    pub kv_lens: Vec<i32>,
    /// Request handle of each row (static ghosts included).
    pub row_request: Vec<u64>,
    pub block_tables: Vec<i32>,
    pub block_table_width: usize,
    pub logits_indices: Vec<i32>,
    pub copy_src: Vec<i32>,
    pub copy_dst: Vec<i32>,
    pub sample_request: Vec<u64>,
    pub sample_index: Vec<i32>,
    pub sample_output_len: Vec<i32>,
    pub sample_suppress_stop: Vec<bool>,
    /// Seat (sampling-table row) of each sampled row.
    pub sample_rows: Vec<i32>,
    /// The row's seat was bound to its sample in this plan.
    pub sample_new_seat: Vec<bool>,
    /// Seats released since the previous plan.
    pub freed_seats: Vec<i32>,
    /// Handles of requests scheduled for the first time, and their prompt
    /// tokens found in the prefix cache.
    pub first_scheduled: Vec<u64>,
    pub first_scheduled_cached: Vec<i32>,
    /// Every row has exactly one query token.
    pub decode_only: bool,
    /// (request handle, sample index) of sequences preempted (back to
    /// waiting) while building this step.
    pub preempted: Vec<u64>,
    pub preempted_index: Vec<i32>,
    pub num_prefill_tokens: usize,
    pub num_decode_tokens: usize,
}

impl StepPlan {
    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.cu_q_lens.clear();
        self.kv_lens.clear();
        self.row_request.clear();
        self.block_tables.clear();
        self.block_table_width = 0;
        self.logits_indices.clear();
        self.copy_src.clear();
        self.copy_dst.clear();
        self.sample_request.clear();
        self.sample_index.clear();
        self.sample_output_len.clear();
        self.sample_suppress_stop.clear();
        self.sample_rows.clear();
        self.sample_new_seat.clear();
        self.freed_seats.clear();
        self.first_scheduled.clear();
        self.first_scheduled_cached.clear();
        self.decode_only = false;
        self.preempted.clear();
        self.preempted_index.clear();
        self.num_prefill_tokens = 0;
        self.num_decode_tokens = 0;
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.kv_lens.len()
    }

    pub fn num_sampled(&self) -> usize {
        self.logits_indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }
}
