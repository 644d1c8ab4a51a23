"""One step of one bucket as a loop over ONE compiled decoder layer.

This file owns how a step is cut into executables so that compile time does not grow
with the model's depth. Every decoder layer of a Llama-family model has the same shapes,
so the runner compiles a layer once per bucket and calls it once per layer, each call
donating that layer's KV pool (updated in place). For a bucket -- ``T`` padded tokens,
``S`` padded sequences, the pure-decode variant or not -- the pieces are::

    embed   (embed weight, packed)                        -> hidden [T, h]
    layer   (layer params, (k, v) pool, hidden, packed)   -> (hidden, pool)     per layer
    logits  (head params, hidden, packed[, targets])      -> (logits [S, V], info[, scores])
    finish  (sampling table, info, logits, bitmask)       -> (sampled, table)   keyed by S

``info`` is the sampler's share of the packed step inputs (:class:`SampleInfo`), so the
sampler -- the costliest piece to compile -- is keyed by ``S`` alone and shared by every
token bucket. The host enqueues the pieces in order; dispatch is asynchronous, so it
queues layer ``i + 1`` while the device runs layer ``i`` (on CPU about 45 us a call
against ~0.7 ms of work per SmolLM2 layer at one row: benches/RESULTS.md, "Cold start").
Grammar masks computed on the host slot in between ``logits`` and ``finish``, so their
host work overlaps the forward pass with no separate executable.

Invariants:

* The math is :func:`kvpage.model.llama.forward`'s, layer by layer (greedy parity with the
  all-layers-in-one trace is exact: same ops, same order).
* ``layer`` never sees more than one layer's weights and KV pool: its HLO, and so its
  compile time, is independent of ``num_layers``.
* A stacked parameter layout (leaves with a leading ``num_layers`` axis, as scan-based
  training code keeps them) runs the same layer with a device scalar index, reading the
  layer's slice inside the executable: no copy of the tree is made on update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvpage.model.attention import AttentionBackend
from kvpage.model.config import ModelConfig
from kvpage.model.llama import KVPool, decoder_layer, embed_tokens
from kvpage.model.params import Params
from kvpage.runner.kv_cache import KVPools
from kvpage.runner.prompt_logprobs import score_prompt_tokens
from kvpage.runner.sampler import sample
from kvpage.runner.sampling_table import SamplingTable, gather_inputs, record_sampled
from kvpage.runner.step_inputs import PackedLayout


class StepBucket(NamedTuple):
    """The compiled pieces of one bucket (its sampler is keyed by ``S`` and kept apart)."""

    embed: Any
    layer: Any
    logits: Any


def head_params(config: ModelConfig, params: Params) -> Params:
    """The sub-tree of ``params`` the logits piece reads (no copy)."""
    keys = ["norm", "embed_tokens" if config.tie_word_embeddings else "lm_head"]
    return {k: params[k] for k in keys}


def embed_weight(params: Params) -> jax.Array:
    return params["embed_tokens"]["weight"]


def is_stacked(params: Params) -> bool:
    """Whether ``params["layers"]`` is the stacked layout (one dict of ``[L, ...]`` leaves)."""
    return isinstance(params["layers"], Mapping)


class SampleInfo(NamedTuple):
    """The sampler's inputs from the packed step buffer, as one int32 ``[S + 3]`` array
    (``logits`` writes it, ``finish`` reads it)."""

    sample_rows: jax.Array  # [S]
    num_sampled: jax.Array  # scalar
    step_counter: jax.Array  # scalar
    want_top_logprobs: jax.Array  # scalar bool

    @staticmethod
    def pack(layout: PackedLayout, packed: jax.Array) -> jax.Array:
        a = layout.unpack(packed)
        scalars = jnp.stack(
            [a.num_sampled, a.step_counter, a.want_top_logprobs.astype(jnp.int32)]
        )
        return jnp.concatenate([a.sample_rows, scalars])

    @staticmethod
    def unpack(info: jax.Array, num_seqs: int) -> SampleInfo:
        return SampleInfo(
            info[:num_seqs], info[num_seqs], info[num_seqs + 1], info[num_seqs + 2] != 0
        )


def make_embed(layout: PackedLayout) -> Callable[[jax.Array, jax.Array], jax.Array]:
    def embed(weight: jax.Array, packed: jax.Array) -> jax.Array:
        return embed_tokens({"embed_tokens": {"weight": weight}}, layout.unpack(packed).token_ids)

    return embed


def make_layer(
    config: ModelConfig,
    layout: PackedLayout,
    backend: AttentionBackend,
    decode_only: bool,
    copy_blocks: Callable[[KVPools, jax.Array, jax.Array], KVPools],
    stacked: bool,
) -> Callable[..., tuple[jax.Array, KVPool]]:
    """The layer piece: this step's fused copy-on-write block copies in this layer's pool,
    then :func:`decoder_layer`. With ``stacked`` it takes ``(layers, index, pool, hidden,
    packed)`` and slices layer ``index`` of the stacked tree inside the executable."""

    def run(layer: Any, pool: KVPool, hidden: jax.Array, packed: jax.Array) -> Any:
        a = layout.unpack(packed)
        if layout.num_copies:
            pool = copy_blocks([pool], a.copy_src, a.copy_dst)[0]
        return decoder_layer(
            config, layer, hidden, a.positions, pool, a.meta, backend, decode_only
        )

    if not stacked:
        return run

    def run_stacked(
        layers: Any, index: jax.Array, pool: KVPool, hidden: jax.Array, packed: jax.Array
    ) -> Any:
        layer = jax.tree_util.tree_map(
            lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), layers
        )
        return run(layer, pool, hidden, packed)

    return run_stacked


def make_logits(
    config: ModelConfig,
    layout: PackedLayout,
    logits_of: Callable[[Params, jax.Array], jax.Array],
    num_top: int,
    score_prompts: bool,
) -> Callable[..., Any]:
    """The logits piece: final norm and lm_head at the sampled rows (``logits_of``, which
    may constrain shardings), plus :class:`SampleInfo`. ``score_prompts``: it also takes
    the int32 ``[T]`` prompt targets and returns their :class:`PromptScores` third
    (:mod:`kvpage.runner.prompt_logprobs`)."""

    def logits(head: Params, hidden: jax.Array, packed: jax.Array, *targets: jax.Array) -> Any:
        a = layout.unpack(packed)
        rows = jnp.take(hidden, a.logits_indices, axis=0)
        out = logits_of(head, rows).astype(jnp.float32), SampleInfo.pack(layout, packed)
        if score_prompts:
            scores = score_prompt_tokens(
                hidden, targets[0], lambda h: logits_of(head, h), max(num_top, 1)
            )
            return (*out, scores)
        return out

    return logits


def make_finish(num_seqs: int, num_top: int, base_seed: int) -> Callable[..., Any]:
    """The sampling piece of a bucket of ``num_seqs`` padded rows: sample with the grammar
    bitmask and record the tokens in the sampling table (donated)."""

    def finish(
        table: SamplingTable, info: jax.Array, logits: jax.Array, token_bitmask: jax.Array
    ) -> tuple[Any, SamplingTable]:
        s = SampleInfo.unpack(info, num_seqs)
        inputs = gather_inputs(table, s.sample_rows)
        step_key = jax.random.fold_in(jax.random.key(base_seed), s.step_counter)
        out = sample(logits, inputs, step_key, num_top, s.want_top_logprobs, token_bitmask)
        valid = jnp.arange(num_seqs) < s.num_sampled
        return out, record_sampled(table, s.sample_rows, out.token_ids, valid)

    return finish
