//! The step plan: everything the model runner needs to execute one step,
//! as flat int32 arrays built in Rust. This is the single place the format
//! is documented; the Pallas kernels read exactly these arrays.
//!
//! ```text
//!   seq rows:      s0 (prefill chunk, 5 tokens)   s1 (decode)   s2 (decode)
//!   token_ids:     t t t t t                      t             t
//!   cu_q_lens:     0                              5             6            7
//!   kv_lens:       kv_len(s0)                     kv_len(s1)    kv_len(s2)
//!   logits_indices:        4 (only if the chunk ends the prompt) 5           6
//! ```
//!
//! | field | shape | meaning |
//! |---|---|---|
//! | `token_ids`, `positions` | [T] | the step's new tokens, flattened over rows |
//! | `slot_mapping` | [T] | where token i's K/V goes: `block * block_size + offset`; the scratch slot `num_blocks * block_size` for rows whose writes are discarded |
//! | `cu_q_lens` | [S+1] | start of each row's tokens in the flat arrays |
//! | `kv_lens` | [S] | each row's KV length after this step (what attention reads) |
//! | `row_request` | [S] | request handle of each row |
//! | `block_tables` | [S, W] | physical block of each logical block; padded with the scratch block id `num_blocks`; W = the widest row of this step |
//! | `logits_indices` | [R] | flat token index whose logits feed sampled row r |
//! | `copy_src`, `copy_dst` | [C] | copy-on-write block copies to run before the step |
//! | `sample_request`, `sample_index` | [R] | request handle and sample index (0..n) of row r |
//! | `sample_output_len`, `sample_suppress_stop` | [R] | the sample's output length so far, and whether EOS/stop tokens must be suppressed (min_tokens not reached); the sampling knobs themselves live in the runner's per-request device table |
//!
//! With n > 1, the row that completes a prompt appears R = n times in
//! `logits_indices` (same flat index), once per forked sample. Arrays are
//! unpadded; the runner pads T, S and R to its bucket sizes.

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
