//! The invariants of [`super::cpu_attention`]'s module docs, checked before
//! any element is read: buffer sizes against the shape, the options' ranges,
//! each query row's table row (`AttentionOptions::table_rows`), its `kv_len`
//! and every page id the row's window reads. The kernels call
//! [`validate_with`] first; a bad plan is an error naming the first
//! violation, never an out-of-bounds read.

use crate::kernels::cpu_attention::{AttentionOptions, DecodeShape};

/// Check the invariants in [`super::cpu_attention`]'s module docs; `Err` names the
/// first violation.
pub fn validate<T>(
    shape: &DecodeShape,
    q: &[f32],
    k_pages: &[T],
    v_pages: &[T],
    kv_lens: &[i32],
    block_tables: &[i32],
    out: &[f32],
) -> Result<(), String> {
    let plain = AttentionOptions::default();
    validate_with(
        shape,
        &plain,
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        out,
    )
}

/// [`validate`] for a call with `options`: also the options' own ranges, and only
/// the table entries of blocks the window touches.
#[allow(clippy::too_many_arguments)]
pub fn validate_with<T>(
    shape: &DecodeShape,
    options: &AttentionOptions,
    q: &[f32],
    k_pages: &[T],
    v_pages: &[T],
    kv_lens: &[i32],
    block_tables: &[i32],
    out: &[f32],
) -> Result<(), String> {
    let s = shape;
    if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(format!(
            "q_heads {} is not a multiple of kv_heads {}",
            s.q_heads, s.kv_heads
        ));
    }
    if s.block_size == 0 || s.head_dim == 0 {
        return Err("block_size and head_dim must be positive".into());
    }
    let q_len = s.rows * s.q_heads * s.head_dim;
    let pool_len = s.kv_heads * s.pages * s.block_size * s.head_dim;
    let sizes = [
        ("q", q.len(), q_len),
        ("out", out.len(), q_len),
        ("k_pages", k_pages.len(), pool_len),
        ("v_pages", v_pages.len(), pool_len),
        ("kv_lens", kv_lens.len(), s.rows),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(format!("{name} has {got} elements, its shape says {want}"));
        }
    }
    let table_rows = match options.table_rows {
        None => s.rows,
        Some(rows) => {
            if rows.len() != s.rows {
                return Err(format!(
                    "table_rows has {} elements, rows is {}",
                    rows.len(),
                    s.rows
                ));
            }
            if s.table_width == 0 || !block_tables.len().is_multiple_of(s.table_width) {
                return Err(format!(
                    "block_tables has {} elements, not whole rows of {}",
                    block_tables.len(),
                    s.table_width
                ));
            }
            block_tables.len() / s.table_width
        }
    };
    if block_tables.len() != table_rows * s.table_width {
        return Err(format!(
            "block_tables has {} elements, its shape says {}",
            block_tables.len(),
            table_rows * s.table_width
        ));
    }
    if let Some(rows) = options.table_rows {
        if let Some(&bad) = rows.iter().find(|&&r| r < 0 || r as usize >= table_rows) {
            return Err(format!(
                "table row {bad} outside the {table_rows} rows of block_tables"
            ));
        }
    }
    if options.sliding_window == Some(0) {
        return Err("sliding_window must be at least 1".into());
    }
    if let Some(cap) = options.soft_cap {
        if !(cap > 0.0 && cap.is_finite()) {
            return Err(format!("soft_cap {cap} must be positive and finite"));
        }
    }
    if let Some(sinks) = options.sinks {
        if sinks.len() != s.q_heads {
            return Err(format!(
                "sinks has {} elements, q_heads is {}",
                sinks.len(),
                s.q_heads
            ));
        }
    }
    for row in 0..s.rows {
        let kv_len = kv_lens[row];
        if kv_len < 0 || kv_len as usize > s.table_width * s.block_size {
            return Err(format!(
                "row {row}: kv_len {kv_len} outside 0..={}",
                s.table_width * s.block_size
            ));
        }
        let first = options.window_start(kv_len as usize) / s.block_size;
        let table =
            &block_tables[options.table_row(row) * s.table_width..][..s.blocks_of(kv_len as usize)];
        if let Some(&page) = table[first..]
            .iter()
            .find(|&&p| p < 0 || p as usize >= s.pages)
        {
            return Err(format!(
                "row {row}: page id {page} outside the pool of {} pages",
                s.pages
            ));
        }
    }
    Ok(())
}
