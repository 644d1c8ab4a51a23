//! Where the host kernels' parallel work runs.
//!
//! Owns the [`Parallel`] trait: "run `work(0..units)`, return when every unit has
//! run". Kernels ([`crate::kernels::cpu_attention`]) split their work into units and never
//! spawn threads themselves, so the same kernel runs on XLA's intra-op pool when
//! XLA calls it ([`crate::kernels::xla_ffi`]) and on scoped threads in tests and benches
//! ([`ScopedThreads`]).
//!
//! Invariant: every unit runs exactly once before `run` returns, and a panicking
//! unit is reported as an error, never unwound through the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Runs units of work, possibly on several threads.
pub trait Parallel {
    /// Threads a call may use (the caller's included); 1 means sequential.
    fn threads(&self) -> usize;
    /// Run `work(unit)` for every unit in `0..units`; returns after all have run.
    fn run(&self, units: usize, work: &(dyn Fn(usize) + Sync)) -> Result<(), String>;
}

/// Scoped OS threads, one per unit beyond the caller's; for callers outside XLA.
/// `KVPAGE_CPU_ATTENTION_THREADS` caps them (default: every core).
pub struct ScopedThreads;

impl Parallel for ScopedThreads {
    fn threads(&self) -> usize {
        static THREADS: OnceLock<usize> = OnceLock::new();
        *THREADS.get_or_init(|| {
            std::env::var("KVPAGE_CPU_ATTENTION_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&n: &usize| n > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        })
    }

    fn run(&self, units: usize, work: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        let guarded = |unit: usize| catch_unwind(AssertUnwindSafe(|| work(unit))).is_ok();
        let all_ok = std::thread::scope(|scope| {
            let others: Vec<_> = (1..units)
                .map(|unit| scope.spawn(move || guarded(unit)))
                .collect();
            let mine = units == 0 || guarded(0);
            others
                .into_iter()
                .fold(mine, |ok, handle| handle.join().unwrap_or(false) && ok)
        });
        if all_ok {
            Ok(())
        } else {
            Err("a parallel unit panicked".into())
        }
    }
}

/// The calling thread only.
pub struct Sequential;

impl Parallel for Sequential {
    fn threads(&self) -> usize {
        1
    }

    fn run(&self, units: usize, work: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        for unit in 0..units {
            catch_unwind(AssertUnwindSafe(|| work(unit)))
                .map_err(|_| "a unit panicked".to_string())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn runs_every_unit_once(parallel: &dyn Parallel) {
        for units in [0, 1, 2, 7] {
            let counts: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            parallel
                .run(units, &|unit| {
                    counts[unit].fetch_add(1, Ordering::Relaxed);
                })
                .unwrap();
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn every_unit_runs_exactly_once() {
        runs_every_unit_once(&ScopedThreads);
        runs_every_unit_once(&Sequential);
    }

    #[test]
    fn a_panicking_unit_is_an_error_not_an_unwind() {
        let work = |unit: usize| assert_ne!(unit, 1, "unit 1 fails");
        assert!(ScopedThreads.run(3, &work).is_err());
        assert!(Sequential.run(3, &work).is_err());
    }
}
