//! PyO3 bindings of [`crate::kv`]: the raw `BlockPool` and the
//! `KVCacheManager` (page tables, copy-on-write, prefix cache).

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::KvError;
use crate::kv::block_pool::{BlockId, BlockPool as CoreBlockPool};
use crate::kv::kv_cache::{BlockCopy, KvCacheManager as CoreKvCacheManager, SeqId};
use crate::py::convert::extract_tokens;

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
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true, sliding_window = None))]
    fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        sliding_window: Option<u32>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: CoreKvCacheManager::new_with_window(
                num_blocks,
                block_size,
                enable_prefix_caching,
                sliding_window,
            )?,
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

    /// Sliding window: the next query of `seq` is at `next_position`; drop
    /// its references to the blocks entirely before that query's window
    /// (their table entries become `num_blocks`). Returns how many were
    /// dropped (always 0 without a window).
    fn slide_window(&mut self, seq: SeqId, next_position: usize) -> PyResult<usize> {
        Ok(self.inner.slide_window(seq, next_position)?)
    }

    /// Leading blocks of `seq` dropped out of the sliding window.
    fn num_dropped_blocks(&self, seq: SeqId) -> PyResult<usize> {
        Ok(self.inner.num_dropped_blocks(seq)?)
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

    /// The sliding window in tokens, None for full attention.
    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        self.inner.sliding_window()
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
        dict.set_item("detached_blocks", s.detached_blocks)?;
        Ok(dict)
    }

    /// Raise KVPageError describing the first violated invariant, if any.
    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}

/// The chained hashes of the full blocks of `token_ids` (a partial last block
/// has none) under `salt`'s tree: equal to the entries of
/// `Scheduler.cached_block_hashes()` of an engine that caches that prefix.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, salt=None))]
pub(crate) fn prefix_block_hashes<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
    salt: Option<&str>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive"));
    }
    let tokens = extract_tokens(token_ids)?;
    let hashes = crate::kv::prefix_cache::events::prefix_block_hashes(&tokens, block_size, salt);
    Ok(PyArray1::from_vec(py, hashes))
}
