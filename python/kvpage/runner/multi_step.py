"""Several decode steps in one device call (``num_scheduler_steps``).

This file owns the multi-step decode executable: for a pure-decode bucket of ``S`` rows it
runs the whole step -- embed, every decoder layer, select, lm_head and sampler -- inside a
device loop of up to ``max_steps`` iterations, feeding each iteration's sampled tokens to
the next one without a trip to the host. One call replaces ``max_steps`` steps' worth of
host dispatches (13 executable calls a step for SmolLM2), which is most of a one-row
step's host time on a small CPU.

The loop runs ``num_steps`` iterations (a device scalar, ``1 <= num_steps <= max_steps``)
and returns every iteration's sampler output stacked on a leading ``max_steps`` axis
(rows past ``num_steps`` hold garbage). Between iterations each live row advances by one
token: its input token becomes the one just sampled, its position, KV length and step
counter grow by one, and its slot is looked up in its block table. The caller (the
engine, through :meth:`Scheduler.lookahead_steps`) promises that:

* the step is pure decode, one token and one sampled row per sequence, in row order
  (``logits_indices[i] == i``), with no block copies;
* every row's next ``num_steps - 1`` positions fall in blocks its table already holds,
  so the loop never needs the host to allocate;
* no row is constrained by a grammar (its mask would need the host between tokens).

Tokens sampled after a row finished (EOS, max_tokens, a stop string) are computed and
then dropped by the host; they write KV only into the row's own blocks, past its length.

Invariants:

* Iteration ``k`` computes exactly what the one-step bucket would for the plan the
  scheduler makes ``k`` steps later (same pieces, same inputs; the sampler's step key
  folds in ``step_counter + k``), so greedy tokens equal the step-by-step engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvpage.model.attention import AttentionBackend
from kvpage.model.config import ModelConfig
from kvpage.model.params import Params
from kvpage.runner.layered_step import (
    embed_weight,
    head_params,
    is_stacked,
    make_embed,
    make_head,
    make_layers,
    make_select,
)
from kvpage.runner.step_inputs import PackedLayout

MULTI_STEP_MAX_ROWS = 4
"""Decode steps of up to this many rows run several steps per call. A step's host
dispatch costs ~5-6 ms on a 2-core CPU: a third of a one-row SmolLM2 step, a few
percent of a 32-row one, which is not worth another ~20 s compile per bucket."""

DEFAULT_CPU_STEPS = 8
"""Decode steps per call on CPU: the host's share of a token falls to 1/8; a finished
row wastes at most 7 tokens of compute; a request that arrives meanwhile waits at most
8 steps (~0.1 s) for the next plan."""


def default_scheduler_steps(platform: str, mesh: Any, params: Params) -> int:
    """``num_scheduler_steps`` when not given: :data:`DEFAULT_CPU_STEPS` on one CPU device
    with the per-layer parameter list, else 1 (a GPU's dispatch is asynchronous and
    cheap next to its steps; the stacked layout and meshes are not supported)."""
    if platform == "cpu" and mesh is None and not is_stacked(params):
        return DEFAULT_CPU_STEPS
    return 1


def advance_packed(layout: PackedLayout, packed: jax.Array, sampled: jax.Array,
                   block_size: int) -> jax.Array:
    """The packed inputs of the next decode step: each live row's token is the one it
    just sampled, one position further, with its KV one longer."""
    o = layout.offsets
    a = layout.unpack(packed)
    s = layout.num_seqs
    live = jnp.arange(s) < a.meta.num_seqs[0]
    tokens = jnp.where(live, sampled[:s].astype(jnp.int32), a.token_ids[:s])
    positions = a.positions[:s] + live.astype(jnp.int32)
    kv_lens = a.meta.kv_lens + live.astype(jnp.int32)
    blocks = jnp.take_along_axis(
        a.meta.block_tables, (positions // block_size)[:, None], axis=1
    )[:, 0]
    slots = jnp.where(live, blocks * block_size + positions % block_size, a.meta.slot_mapping[:s])
    packed = packed.at[o[0] : o[0] + s].set(tokens)
    packed = packed.at[o[1] : o[1] + s].set(positions)
    packed = packed.at[o[2] : o[2] + s].set(slots)
    packed = packed.at[o[4] : o[5]].set(kv_lens)
    counter = layout.step_counter_offset
    return packed.at[counter].set((packed[counter] + 1) & 0x7FFFFFFF)


def _no_copies(pools: Any, src: jax.Array, dst: jax.Array) -> Any:
    """Multi-step plans carry no block copies (the packed copy slots are all padding)."""
    return pools


def make_multi_step(
    config: ModelConfig,
    layout: PackedLayout,
    backend: AttentionBackend,
    logits_of: Callable[[Params, jax.Array], jax.Array],
    num_top: int,
    base_seed: int,
    block_size: int,
    max_steps: int,
) -> Callable[..., Any]:
    """The multi-step piece of decode bucket ``layout`` (``num_tokens == num_seqs``).
    Takes ``(params, pools, table, bitmask, packed, num_steps)``; returns ``(outputs
    stacked [max_steps, ...], pools, table)``."""
    if layout.num_tokens != layout.num_seqs:
        raise ValueError("multi-step decode needs a pure-decode bucket (tokens == seqs)")
    embed = make_embed(layout, config)
    layers = make_layers(
        config, layout, backend, True, _no_copies,
        [config.layer_type(i) for i in range(config.num_layers)], stacked=False,
    )
    select = make_select(layout, logits_of, num_top, score_prompts=False)
    head = make_head(layout.num_seqs, logits_of, num_top, base_seed)

    def one_step(params: Params, pools: list[Any], table: Any, bitmask: jax.Array,
                 packed: jax.Array) -> tuple[Any, list[Any], Any]:
        hidden = embed(embed_weight(params), packed)
        hidden, pools = layers(params["layers"], pools, hidden, packed)
        rows, info = select(hidden, packed)
        out, table = head(head_params(config, params), rows, info, table, bitmask)
        return out, pools, table

    def run(params: Params, pools: list[Any], table: Any, bitmask: jax.Array,
            packed: jax.Array, num_steps: jax.Array) -> tuple[Any, list[Any], Any]:
        # The step is traced once, in the loop body (compile time of one step).
        shapes = jax.eval_shape(one_step, params, pools, table, bitmask, packed)[0]
        outs = jax.tree_util.tree_map(
            lambda x: jnp.zeros((max_steps, *x.shape), x.dtype), shapes
        )

        def body(k: jax.Array, carry: Any) -> Any:
            packed, pools, table, outs = carry
            out, pools, table = one_step(params, pools, table, bitmask, packed)
            outs = jax.tree_util.tree_map(lambda o, x: o.at[k].set(x), outs, out)
            packed = advance_packed(layout, packed, out.token_ids, block_size)
            return packed, pools, table, outs

        _, pools, table, outs = jax.lax.fori_loop(
            0, num_steps, body, (packed, pools, table, outs)
        )
        return outs, pools, table

    return run
