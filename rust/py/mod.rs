//! PyO3 bindings: `kvpage._core`. A thin layer: argument conversion, numpy
//! arrays out, typed errors in. No logic lives here.
//!
//! The binding depends on the core, never the other way, and its files form
//! a tree: `convert` (shared argument conversions) and `errors`
//! (`KVPageError`) are leaves; each bound concept has its own file: `kv`
//! (`BlockPool`, `KVCacheManager`), `step_plan` (`StepPlan`), `scheduler`
//! (`Scheduler`), `structured` (`GrammarVocab`, `Grammar`), `detokenizer`
//! (`TokenDecoder`) and `output_streams` (`OutputStreams`). This file only
//! registers them as `kvpage._core`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::sched::request::{FinishReason, DEFAULT_MAX_TOKENS};

mod convert;
mod detokenizer;
mod errors;
mod kv;
mod output_streams;
mod quant;
mod scheduler;
mod step_plan;
mod structured;

use errors::KVPageError;
use kv::{BlockPool, KVCacheManager};
use scheduler::Scheduler;
use step_plan::StepPlan;
use structured::{Grammar, GrammarVocab};

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
    m.add_function(wrap_pyfunction!(kv::prefix_block_hashes, m)?)?;
    detokenizer::register(m)?;
    output_streams::register(m)?;
    quant::register(m)?;
    Ok(())
}
