//! Scheduling: which tokens of which sequences run in each step.
//!
//! - [`request`]: requests and their sequences as the scheduler sees them,
//!   and the table of id spaces, each with its one owner.
//! - [`scheduler`]: the continuous-batching scheduler. Every `schedule()`
//!   decides which tokens of which sequences run in one step, and `update()`
//!   applies the sampled tokens, checks stop conditions and frees finished
//!   sequences. It also holds the `static` policy (the measurable baseline)
//!   and carries each constrained sequence's grammar matcher.
//! - [`ngram_drafter`]: prompt-lookup drafts for speculative decoding
//!   (the scheduler verifies them: `scheduler/speculation.rs`).
//! - [`suffix_drafter`]: drafts from recent sequences' text (the `suffix`
//!   method), an index the scheduler owns.
//! - [`step_plan`]: everything the model runner needs to execute one step,
//!   as flat arrays; the single place the format is documented.
//!
//! Invariants: listed once, at the top of [`scheduler`] (`scheduler/mod.rs`),
//! and checked by `Scheduler::check_invariants`; the plan's own are in
//! [`step_plan`].

#[cfg(test)]
mod lookahead_tests;
pub mod ngram_drafter;
#[cfg(test)]
mod reference_model_tests;
pub mod request;
pub mod scheduler;
#[cfg(test)]
mod scheduler_regression_tests;
#[cfg(test)]
mod scheduler_tests;
#[cfg(test)]
mod speculation_tests;
pub mod step_plan;
pub mod suffix_drafter;
