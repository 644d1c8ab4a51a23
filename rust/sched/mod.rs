//! Scheduling: which tokens of which sequences run in each step.
//!
//! - [`request`]: requests and their sequences as the scheduler sees them,
//!   and the id spaces (request index, handle, seq, seat, KV `SeqId`), each
//!   with its one owner.
//! - [`scheduler`]: the continuous-batching scheduler. Every `schedule()`
//!   decides which tokens of which sequences run in one step, and `update()`
//!   applies the sampled tokens, checks stop conditions and frees finished
//!   sequences. It also holds the `static` policy (the measurable baseline)
//!   and carries each constrained sequence's grammar matcher.
//! - [`step_plan`]: everything the model runner needs to execute one step,
//!   as flat int32 arrays; the single place the format is documented.
//!
//! Invariants (see `Scheduler::check_invariants`):
//! - every live sequence is in exactly one of waiting, running or (static)
//!   the ghost set; running ones hold a page table covering `num_computed`
//!   tokens, waiting ones hold none and have `num_computed == 0`;
//! - `running` is sorted by (priority, arrival, seq) and never exceeds
//!   `max_num_seqs`;
//! - every block is accounted for by the KV manager's invariants, and when
//!   no request is live, every block is free or cached-unreferenced;
//! - each seat is either free or held by exactly one running sequence; the
//!   scheduler is the only owner of seats;
//! - a live sequence's matcher has consumed exactly its generated tokens.

#[cfg(test)]
mod lookahead_tests;
#[cfg(test)]
mod reference_model_tests;
pub mod request;
pub mod scheduler;
#[cfg(test)]
mod scheduler_regression_tests;
#[cfg(test)]
mod scheduler_tests;
pub mod step_plan;
