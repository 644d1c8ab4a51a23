//! Typed errors of the core. Each becomes a Python exception (`KVPageError`
//! or `ValueError`) whose message names the offending value.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    #[error("block id {block} is out of range for a pool of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    #[error("block {block} is already free (refcount 0): double free")]
    DoubleFree { block: u32 },
    #[error("block {block} is free: cannot add a reference to it")]
    IncrefFreeBlock { block: u32 },
    #[error("out of KV blocks: requested {requested}, only {available} can be had")]
    OutOfBlocks { requested: usize, available: usize },
    #[error("unknown sequence id {seq}")]
    UnknownSequence { seq: u64 },
    #[error("sequence {seq} must be empty for this operation (it holds {num_tokens} tokens)")]
    SequenceNotEmpty { seq: u64, num_tokens: usize },
    #[error(
        "sequence {seq} has {num_tokens} tokens with KV slots, but {given} token ids were given"
    )]
    TokenCountMismatch {
        seq: u64,
        num_tokens: usize,
        given: usize,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("invariant violated: {0}")]
    InvariantViolated(String),
}

pub type KvResult<T> = Result<T, KvError>;

/// `vec![value; len]`, but an allocation failure is an error instead of an
/// abort (pool sizes come from users).
pub fn try_filled_vec<T: Clone>(len: usize, value: T, what: &str) -> KvResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        KvError::InvalidArgument(format!(
            "cannot allocate {what} for {len} entries: out of memory"
        ))
    })?;
    v.resize(len, value);
    Ok(v)
}
