//! The per-head extras of paged decode attention that both of its loops share
//! (the generic one in `cpu_attention.rs` and the AVX2 one in
//! `cpu_attention_avx2.rs`): where a row's window starts, Gemma 2's score
//! soft-cap, and gpt-oss sink logits joining the softmax denominator. Both
//! loops depend on this file; it depends on neither.

/// What one KV head's query group needs beyond plain attention: the row's first
/// visible position, the soft cap and the group's sinks (`[group]`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadOptions<'a> {
    pub start: usize,
    pub soft_cap: Option<f32>,
    pub sinks: Option<&'a [f32]>,
}

impl HeadOptions<'_> {
    pub(crate) fn sink(&self, g: usize) -> Option<f32> {
        self.sinks.map(|sinks| sinks[g])
    }
}

/// `scores[i] = cap * tanh(scores[i] / cap)`.
#[inline(always)]
pub(crate) fn soft_cap(scores: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    scores.iter_mut().for_each(|s| *s = cap * (*s * inv).tanh());
}

/// Normalise one query head's accumulator `out` by its softmax denominator `sum`
/// (scores' running max `max`), with the head's sink logit in the denominator if any.
#[inline(always)]
pub(crate) fn finish(out: &mut [f32], max: f32, sum: f32, sink: Option<f32>) {
    let scale = match sink {
        None => 1.0 / sum,
        Some(sink) => {
            let new_max = max.max(sink);
            let alpha = (max - new_max).exp();
            alpha / (sum * alpha + (sink - new_max).exp())
        }
    };
    out.iter_mut().for_each(|a| *a *= scale);
}
