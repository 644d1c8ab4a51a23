"""One step of one bucket as a loop over one compiled group of decoder layers.

This file owns how a step is cut into executables so that compile time does not grow
with the model's depth. Every decoder layer of a dense Llama-family checkpoint has the
same shapes, so the runner compiles a group of G layers (:data:`LAYERS_PER_CALL`) once per
bucket and calls it once per group, each call donating those layers' KV pools (updated in
place). Layers that differ in structure (a K-quant mixture file's formats) get one piece
per distinct group kind (:func:`layer_plan`).
For a bucket -- ``T`` padded tokens, ``S`` padded sequences, the pure-decode variant or
not -- the pieces are::

    embed   (embed weight, packed)                    -> hidden [T, h]
    layers  (G layers' params and pools, hidden, packed) -> (hidden, pools)  once per group
    select  (hidden, packed)                          -> (rows [S, h], info)
    head    (head params, rows, info, table, bitmask) -> (sampled, table)   keyed by S

``info`` is the sampler's share of the packed step inputs (:class:`SampleInfo`), so the
head -- lm_head and sampler, the costliest piece to compile -- is keyed by ``S`` alone
and shared by every token bucket. A step that scores prompt tokens runs a ``select``
that also projects every token through the lm_head (compiled on first use). The host
enqueues the pieces in order; dispatch is asynchronous, so it queues group ``i + 1`` while
the device runs group ``i`` (benches/RESULTS.md, "Cold start").
Grammar masks are computed on the host between ``select`` and ``head``, so their
host work overlaps the layers with no separate executable.

Invariants:

* The math is :func:`kvpage.model.decoder.forward`'s, layer by layer (greedy parity with the
  all-layers-in-one trace is exact: same ops, same order).
* ``layers`` never sees more than ``max(LAYERS_PER_CALL)`` layers' weights and KV pools:
  its HLO, and so its compile time, is independent of ``num_layers``.
* A layer piece is only called with layers whose structure it was traced with: the
  groups of a step (:func:`layer_plan`) share a piece only when their layers'
  :func:`layer_signature` tuples are equal.
* A stacked parameter layout (leaves with a leading ``num_layers`` axis, as scan-based
  training code keeps them) runs the same group with a device scalar index of its first
  layer, reading the layers' slices inside the executable: no copy of the tree is made on
  update.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvpage.model.attention import AttentionBackend
from kvpage.model.config import ModelConfig
from kvpage.model.decoder import KVPool, decoder_layer, embed_tokens
from kvpage.model.linear_kernels import live_rows, lora_slots
from kvpage.model.params import Params
from kvpage.runner.kv_cache import KVPools
from kvpage.runner.prompt_scoring import score_prompt_tokens
from kvpage.runner.step_inputs import PackedLayout
from kvpage.sampling.sampler import sample
from kvpage.sampling.table import SamplingTable, gather_inputs, record_sampled
from kvpage.sampling.verification import draft_rows, kept_rows


class StepBucket(NamedTuple):
    """The compiled pieces of one bucket (its sampler is keyed by ``S`` and kept apart)."""

    embed: Any
    layers: dict[int, Any]
    """Group kind (:class:`LayerPlan`) -> the compiled piece running that kind's layers."""
    select: Any


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
    """The sampler's inputs from the packed step buffer, as one int32 ``[3 S + 3]`` array
    (``logits`` writes it, ``finish`` reads it): each sampled row's seat, its offset and
    draft when it verifies drafted tokens (:mod:`kvpage.sampling.verification`)."""

    sample_rows: jax.Array  # [S]
    offsets: jax.Array  # [S]
    drafts: jax.Array  # [S]
    num_sampled: jax.Array  # scalar
    step_counter: jax.Array  # scalar
    want_top_logprobs: jax.Array  # scalar bool

    @staticmethod
    def pack(layout: PackedLayout, packed: jax.Array) -> jax.Array:
        a = layout.unpack(packed)
        offsets, drafts = draft_rows(
            a.token_ids, a.logits_indices, a.sample_rows, a.num_sampled
        )
        scalars = jnp.stack(
            [a.num_sampled, a.step_counter, a.want_top_logprobs.astype(jnp.int32)]
        )
        return jnp.concatenate([a.sample_rows, offsets, drafts, scalars])

    @staticmethod
    def unpack(info: jax.Array, num_seqs: int) -> SampleInfo:
        s = num_seqs
        return SampleInfo(
            info[:s], info[s : 2 * s], info[2 * s : 3 * s], info[3 * s], info[3 * s + 1],
            info[3 * s + 2] != 0,
        )


def make_embed(layout: PackedLayout, config: ModelConfig
               ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    def embed(weight: jax.Array, packed: jax.Array) -> jax.Array:
        return embed_tokens(
            {"embed_tokens": {"weight": weight}}, layout.unpack(packed).token_ids, config
        )

    return embed


LAYERS_PER_CALL = (3, 4, 2)
"""Decoder layers per compiled call, the first that divides the model's depth (else the
first, with a shorter last call). One call costs ~0.15 ms of fixed overhead on XLA:CPU
(SmolLM2 at one row: 30 one-layer calls 21.8 ms a step, one 30-layer executable 17.4 ms,
ten 3-layer calls 17.1 ms), so three layers a call recover it while compile time stays
independent of depth (a 3-layer piece compiles in ~1.2 s, a 30-layer step took 4.5 s)."""


class LayerGroup(NamedTuple):
    """One layer call of a step: layers ``start .. start + count`` run by the compiled
    piece of group kind ``kind`` (an index into :attr:`LayerPlan.kinds`)."""

    start: int
    count: int
    kind: int


class LayerPlan(NamedTuple):
    """How a step's decoder layers are cut into calls, and which calls share a piece.

    Layers may differ in structure: a GGUF "K-quant mixture" file (Q4_K_M, Q5_K_M) stores
    ``ffn_down`` as Q6_K in some layers and Q4_K in others, and ``v_proj`` in different
    formats too; [models] brings sliding/full and dense/MoE layers. A compiled piece is
    only valid for the layer structures it was traced with, so each group carries the
    tuple of its layers' :func:`layer_signature` and groups with equal tuples share one
    piece (``kinds[k]`` is the first group of kind ``k``, the one the piece is traced
    from)."""

    groups: list[LayerGroup]
    kinds: list[LayerGroup]


def layer_signature(layer: Any, layer_type: str) -> Hashable:
    """What a compiled layer piece depends on: the layer's attention kind (sliding or
    full), its pytree structure (which names each weight's quantized format, and says
    dense MLP or experts) and every leaf's shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(layer)
    return layer_type, treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def _cut(signatures: Sequence[Hashable], size: int) -> LayerPlan:
    n = len(signatures)
    kind_of: dict[tuple[Hashable, ...], int] = {}
    groups, kinds = [], []
    for start in range(0, n, size):
        count = min(size, n - start)
        key = tuple(signatures[start:start + count])
        kind = kind_of.setdefault(key, len(kind_of))
        group = LayerGroup(start, count, kind)
        if kind == len(kinds):
            kinds.append(group)
        groups.append(group)
    return LayerPlan(groups, kinds)


def _compiled_layers(plan: LayerPlan) -> int:
    """Layers traced per bucket: the compile cost of a plan."""
    return sum(group.count for group in plan.kinds)


def layer_plan(signatures: Sequence[Hashable]) -> LayerPlan:
    """The layer calls of a step, given each layer's :func:`layer_signature`.

    Alike layers (every dense checkpoint) are cut as before: groups of the first size of
    :data:`LAYERS_PER_CALL` that divides the depth, one piece per distinct group length.
    When layers differ, a size is kept only if the pieces it needs trace no more layers
    per bucket than alike layers would (``max(LAYERS_PER_CALL)``, or the default cut's
    own cost when its last group is shorter): sizes are tried in the order of
    :data:`LAYERS_PER_CALL`, then one layer a call, which needs one piece per distinct
    layer structure and always qualifies. Qwen2.5-0.5B Q4_K_M (two layer structures in
    an irregular pattern) runs 24 one-layer calls from two pieces, where three-layer
    groups would need four pieces (12 layers traced per bucket)."""
    n = len(signatures)
    if n == 0:
        return LayerPlan([], [])
    default = next((g for g in LAYERS_PER_CALL if n % g == 0), LAYERS_PER_CALL[0])
    default = max(1, min(default, n))
    alike = _cut([None] * n, default)
    budget = max(_compiled_layers(alike), max(LAYERS_PER_CALL))
    dividing = [g for g in LAYERS_PER_CALL if n % g == 0 and g != default]
    for size in [default, *dividing]:
        plan = _cut(signatures, min(size, n))
        if _compiled_layers(plan) <= budget:
            return plan
    return _cut(signatures, 1)


def layer_groups(num_layers: int) -> list[tuple[int, int]]:
    """``(first layer, number of layers)`` of each layer call of a step of alike layers."""
    return [(g.start, g.count) for g in layer_plan([None] * num_layers).groups]


def make_layers(
    config: ModelConfig,
    layout: PackedLayout,
    backend: AttentionBackend,
    decode_only: bool,
    copy_blocks: Callable[[KVPools, jax.Array, jax.Array], KVPools],
    layer_types: Sequence[str],
    stacked: bool,
) -> Callable[..., tuple[jax.Array, list[KVPool]]]:
    """The layer piece: ``len(layer_types)`` consecutive layers of those attention kinds,
    each doing this step's fused copy-on-write block copies in its pool, then
    :func:`decoder_layer`. Takes ``(layers,
    pools, hidden, packed)`` with ``count``-long lists of layer params and pools; with
    ``stacked`` it takes ``(stacked layers, first index, pools, hidden, packed)`` and
    slices its layers from the stacked tree inside the executable."""

    def run(layers: Any, pools: list[KVPool], hidden: jax.Array, packed: jax.Array) -> Any:
        a = layout.unpack(packed)
        out = []
        with lora_slots(a.lora_slots):  # None without LoRA: adapters are ignored
            for layer, pool, layer_type in zip(layers, pools, layer_types, strict=True):
                if layout.num_copies:
                    pool = copy_blocks([pool], a.copy_src, a.copy_dst)[0]
                hidden, pool = decoder_layer(
                    config, layer, hidden, a.positions, pool, a.meta, backend, decode_only,
                    layer_type,
                )
                out.append(pool)
        return hidden, out

    if not stacked:
        return run

    def run_stacked(
        stacked_layers: Any, first: jax.Array, pools: list[KVPool], hidden: jax.Array,
        packed: jax.Array,
    ) -> Any:
        layers = [
            jax.tree_util.tree_map(
                lambda leaf, i=i: jax.lax.dynamic_index_in_dim(leaf, first + i, keepdims=False),
                stacked_layers,
            )
            for i in range(len(layer_types))
        ]
        return run(layers, pools, hidden, packed)

    return run_stacked


def make_select(
    layout: PackedLayout,
    logits_of: Callable[[Params, jax.Array], jax.Array],
    num_top: int,
    score_prompts: bool,
) -> Callable[..., Any]:
    """The select piece: the last-layer hidden states of the sampled rows, and
    :class:`SampleInfo`. Takes ``(hidden, packed)``; with ``score_prompts`` it takes
    ``(head params, hidden, packed, targets)`` and also returns the :class:`PromptScores`
    of the int32 ``[T]`` prompt targets (:mod:`kvpage.runner.prompt_scoring`)."""

    def select(hidden: jax.Array, packed: jax.Array) -> tuple[jax.Array, jax.Array]:
        rows = jnp.take(hidden, layout.unpack(packed).logits_indices, axis=0)
        return rows, SampleInfo.pack(layout, packed)

    if not score_prompts:
        return select

    def select_and_score(
        head: Params, hidden: jax.Array, packed: jax.Array, targets: jax.Array
    ) -> Any:
        scores = score_prompt_tokens(
            hidden, targets, lambda h: logits_of(head, h), max(num_top, 1)
        )
        return (*select(hidden, packed), scores)

    return select_and_score


def make_head(
    num_seqs: int,
    logits_of: Callable[[Params, jax.Array], jax.Array],
    num_top: int,
    base_seed: int,
) -> Callable[..., Any]:
    """The head piece of a bucket of ``num_seqs`` padded rows: final norm and lm_head at
    the selected rows, then sampling with the grammar bitmask, recording the tokens in the
    sampling table (donated). One executable: logits and sampler apart cost SmolLM2 up to
    60 % more at 4 rows (16.1 vs 9.8 ms) than fused."""

    def head(
        params: Params, rows: jax.Array, info: jax.Array, table: SamplingTable,
        token_bitmask: jax.Array,
    ) -> tuple[Any, SamplingTable]:
        s = SampleInfo.unpack(info, num_seqs)
        with live_rows(num_seqs, s.num_sampled):  # rows past num_sampled are padding
            logits = logits_of(params, rows).astype(jnp.float32)
        inputs = gather_inputs(table, s.sample_rows)
        # A draft's row samples the token at its seat's next index plus its offset.
        inputs = inputs._replace(step=inputs.step + s.offsets)
        step_key = jax.random.fold_in(jax.random.key(base_seed), s.step_counter)
        out = sample(logits, inputs, step_key, num_top, s.want_top_logprobs, token_bitmask)
        valid = jnp.arange(num_seqs) < s.num_sampled
        valid &= kept_rows(s.offsets, s.drafts, out.token_ids)
        return out, record_sampled(table, s.sample_rows, out.token_ids, valid)

    return head
