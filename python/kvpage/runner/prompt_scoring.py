"""Scoring prompt tokens in the prefill's forward pass (vLLM's ``prompt_logprobs``).

This file owns the scoring of prompt positions. A step that carries prompt tokens of a
request asking for prompt logprobs runs a variant of the step executable that, besides
sampling, projects the last-layer hidden state of EVERY token of the step through the
lm_head and scores it against the *next prompt token* (the "target") that the host
supplies per token:

    targets[i] = prompt[positions[i] + 1]   for prompt positions of such requests,
                 -1                         everywhere else (decodes, other requests,
                                            the last prompt position, padding).

The hidden state at position ``p`` predicts token ``p + 1``, so a prefill chunk covering
positions ``[a, b)`` scores prompt tokens ``a + 1 .. b``; token ``b`` belongs to the
next chunk but the host knows it, so the target of the chunk's last position is simply
``prompt[b]`` and chunked prefill needs no state carried between steps.

The log-softmax is taken in float32 over the vocabulary, ``lax.map``-ped over row
chunks so that a long prefill never materializes a ``[T, vocab]`` logits matrix at once;
a chunk holding no target (other requests' tokens) skips the projection. The price is
one lm_head projection per scored prompt token (on CPU, SmolLM2: about +50 % prefill
time when every token scores; benches/prompt_logprobs_cost.py, benches/RESULTS.md).
Plain steps never run any of this: the runner compiles the variant separately, on first
use, per bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.row_reductions import log_softmax

SCORE_CHUNK_ROWS = 128
"""Rows of hidden states projected through the lm_head at once."""


class PromptScores(NamedTuple):
    """Per step token (device arrays, padded to the step's token bucket)."""

    logprobs: jax.Array  # f32 [T] log p(target | prefix); 0 where target < 0
    ranks: jax.Array  # i32 [T] 1 + number of tokens strictly more likely than the target
    top_token_ids: jax.Array  # i32 [T, K] best first
    top_logprobs: jax.Array  # f32 [T, K]


def score_prompt_tokens(
    hidden: jax.Array,
    targets: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    num_top: int,
    chunk_rows: int = SCORE_CHUNK_ROWS,
) -> PromptScores:
    """Score ``targets`` under the distributions of ``hidden`` rows (inside jit).

    ``logits_fn`` maps ``[rows, hidden]`` to float32 logits ``[rows, vocab]`` (the model's
    final norm and lm_head). ``num_top`` >= 1 is the width of the top lists.
    """
    num_rows = hidden.shape[0]
    chunk = min(chunk_rows, num_rows)
    num_chunks = -(-num_rows // chunk)
    padded = num_chunks * chunk
    if padded != num_rows:
        hidden = jnp.pad(hidden, ((0, padded - num_rows), (0, 0)))
        targets = jnp.pad(targets, (0, padded - num_rows), constant_values=-1)

    def project(rows: jax.Array, wanted: jax.Array) -> tuple[jax.Array, ...]:
        logprobs = log_softmax(logits_fn(rows).astype(jnp.float32))
        safe = jnp.maximum(wanted, 0)
        chosen = jnp.take_along_axis(logprobs, safe[:, None], axis=-1)[:, 0]
        ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32)
        top_values, top_ids = jax.lax.top_k(logprobs, num_top)
        valid = wanted >= 0
        return (
            jnp.where(valid, chosen, 0.0),
            jnp.where(valid, ranks, 0),
            top_ids.astype(jnp.int32),
            top_values,
        )

    def skip(rows: jax.Array, wanted: jax.Array) -> tuple[jax.Array, ...]:
        n = rows.shape[0]
        return (
            jnp.zeros(n, jnp.float32),
            jnp.zeros(n, jnp.int32),
            jnp.zeros((n, num_top), jnp.int32),
            jnp.zeros((n, num_top), jnp.float32),
        )

    def score(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        # chunks without a target (other requests' tokens) skip the vocabulary projection
        rows, wanted = args
        return jax.lax.cond(jnp.any(wanted >= 0), project, skip, rows, wanted)

    outs = jax.lax.map(
        score,
        (hidden.reshape(num_chunks, chunk, -1), targets.reshape(num_chunks, chunk)),
    )
    logprobs, ranks, top_ids, top_values = (
        o.reshape(padded, *o.shape[2:])[:num_rows] for o in outs
    )
    return PromptScores(logprobs, ranks, top_ids, top_values)


def prompt_targets(
    num_tokens: int,
    positions: np.ndarray,
    cu_q_lens: np.ndarray,
    row_prompts: dict[int, np.ndarray],
) -> np.ndarray | None:
    """The ``[num_tokens]`` int32 target array of one step (host side), or None when no
    token of the step scores a prompt token.

    ``row_prompts`` maps a sequence row of the plan to the full prompt (token ids) of a
    request that asked for prompt logprobs. Positions past the prompt (a preempted
    request recomputing its output tokens) get no target.
    """
    targets: np.ndarray | None = None
    for row, prompt in row_prompts.items():
        start, end = int(cu_q_lens[row]), int(cu_q_lens[row + 1])
        pos = positions[start:end].astype(np.int64)
        scored = pos + 1 < len(prompt)
        if not scored.any():
            continue
        if targets is None:
            targets = np.full(num_tokens, -1, np.int32)
        segment = targets[start:end]
        segment[scored] = prompt[pos[scored] + 1]
    return targets
