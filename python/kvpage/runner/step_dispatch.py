"""One step on the device: the plan packed, then the bucket's pieces enqueued in turn.

This file owns :class:`StepDispatch`, the single-step path of
:meth:`ModelRunner.dispatch <kvpage.runner.model_runner.ModelRunner.dispatch>`: it pads
the plan to its bucket (falling back to a larger compiled one while the background
compiler works: :meth:`StepExecutables.bucket_for
<kvpage.runner.step_executables.StepExecutables.bucket_for>`), packs it into one int32
buffer (:mod:`kvpage.runner.step_inputs`) sent in one transfer, and enqueues embed, the
layer groups (copy-on-write block copies, K/V written at the slot mapping, paged
attention), select (the sampled rows' hidden states; the prompt-scoring variant when
``prompt_targets`` are given) and head (lm_head, sampling, the sampling-table update):
:mod:`kvpage.runner.layered_step`. The KV pools and the sampling table are donated, so
they are updated in place. It also owns the grammar-mask input of a step
(:meth:`~StepDispatch.token_bitmask_input`) and the stand-alone block copies of plans
with more copies than a step fuses (:meth:`~StepDispatch.run_block_copies`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from kvpage.runner.layered_step import embed_weight, head_params
from kvpage.runner.pending import PendingStep
from kvpage.runner.placement import Placement
from kvpage.runner.step_executables import COPY_CHUNK, StepExecutables
from kvpage.runner.step_plan import StepPlanLike
from kvpage.sampling.token_bitmask import ALLOW_ALL, bitmask_words, pad_bitmask

if TYPE_CHECKING:
    from kvpage.runner.runner_state import RunnerState


class StepDispatch:
    """Enqueues single steps for one :class:`~kvpage.runner.model_runner.ModelRunner`
    (held weakly), whose params, pools, sampling table and counters it reads and updates."""

    def __init__(
        self, runner: RunnerState, executables: StepExecutables, placement: Placement
    ) -> None:
        self._r: RunnerState = weakref.proxy(runner)
        self._exec = executables
        self._place = placement
        self._allow_all_masks: dict[int, jax.Array] = {}
        self._layer_indices = [
            jax.device_put(np.int32(i), placement.replicated)
            for i in range(runner.config.num_layers)
        ] if runner.stacked else []
        """Layer indices on the device (stacked params: each group's first layer)."""

    def dispatch(
        self,
        plan: StepPlanLike,
        prompt_targets: np.ndarray | None = None,
        token_bitmask_fn: Callable[[], np.ndarray | None] | None = None,
    ) -> PendingStep:
        """:meth:`ModelRunner.dispatch <kvpage.runner.model_runner.ModelRunner.dispatch>`."""
        r, ex = self._r, self._exec
        num_sampled = len(plan.logits_indices)
        r.check(plan, num_sampled)
        num_tokens, num_seqs = int(plan.num_tokens), int(plan.num_seqs)
        # Sampled rows share the sequence bucket; with n > 1 there are more
        # sampled rows (one per forked sample) than sequence rows.
        t_pad, s_pad = ex.padded_sizes(num_tokens, max(num_seqs, num_sampled))
        decode_only = bool(plan.decode_only) and ex.has_decode_variant(s_pad)
        (t_pad, s_pad, _), bucket = ex.bucket_for((t_pad, s_pad, decode_only))
        fuse_copies = len(plan.copy_src) <= r.max_fused_copies
        if not fuse_copies:
            self.run_block_copies(plan.copy_src, plan.copy_dst)
        layout, template = ex.layout((t_pad, s_pad))
        want_top = r.seats.want_top(plan.sample_rows)
        packed_host = layout.pack(
            plan, template, r.block_size, r.step_counter, want_top, fuse_copies,
            None if r.lora is None else r.lora.row_slots(plan.row_request, num_seqs),
        )
        targets = None
        if prompt_targets is not None:
            targets = np.full(t_pad, -1, np.int32)
            targets[:num_tokens] = np.asarray(prompt_targets, np.int32)[:num_tokens]
            if targets.max() >= r.config.vocab_size:
                raise ValueError("prompt_targets hold a token id outside the vocabulary")
        try:
            # One transfer; every piece of the step reads the same device buffer.
            place = self._place
            packed = jax.device_put(place.host_input(packed_host), place.replicated)
            params = r.params
            hidden = bucket.embed(embed_weight(params), packed)
            pools = r.kv_pools
            for start, count, kind in r.layer_plan.groups:
                end = start + count
                if r.stacked:
                    hidden, pools[start:end] = bucket.layers[kind](
                        params["layers"], self._layer_indices[start], pools[start:end], hidden,
                        packed,
                    )
                else:
                    hidden, pools[start:end] = bucket.layers[kind](
                        params["layers"][start:end], pools[start:end], hidden, packed
                    )
            head = head_params(r.config, params)
            scores = None
            if targets is not None:
                scored = ex.scored_select_fn((t_pad, s_pad))
                rows, info, scores = scored(head, hidden, packed, place.host_input(targets))
            else:
                rows, info = bucket.select(hidden, packed)
            r.last_enqueue_time = time.perf_counter()
            if token_bitmask_fn is not None:
                masks = token_bitmask_fn()  # host work while the layers run
                r.last_bitmask_overlapped = not rows.is_ready()
            else:
                masks = getattr(plan, "token_bitmask", None)
            out, r.sampling_table = ex.head_fn(s_pad)(
                head, rows, info, r.sampling_table, self.token_bitmask_input(masks, s_pad)
            )
        except Exception as exc:
            r.raise_if_params_deleted(exc)
            raise
        r.step_counter += 1
        return PendingStep(out, num_sampled, want_top, scores, num_tokens)

    def token_bitmask_input(self, bitmask: np.ndarray | None, rows: int) -> Any:
        """The step's grammar bitmask: the plan's rows padded to ``rows``, or (no
        constrained row) an allow-all mask kept on the device, so unconstrained steps
        transfer nothing extra."""
        vocab = self._r.config.vocab_size
        if bitmask is not None:
            return self._place.host_input(pad_bitmask(bitmask, rows, vocab))
        cached = self._allow_all_masks.get(rows)
        if cached is None:
            words = bitmask_words(vocab)
            cached = jax.device_put(
                self._place.host_input(np.full((rows, words), ALLOW_ALL, np.int32)),
                self._place.replicated,
            )
            self._allow_all_masks[rows] = cached
        return cached

    def run_block_copies(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks ``src -> dst`` (all layers, K and V) outside a step, in
        chunks of :data:`COPY_CHUNK` (padded with scratch-to-dropped copies)."""
        r = self._r
        src = np.asarray(src, np.int32)
        dst = np.asarray(dst, np.int32)
        copy = self._exec.copy_fn()
        for start in range(0, len(src), COPY_CHUNK):
            chunk_src = np.full(COPY_CHUNK, r.padding.scratch_block, np.int32)
            chunk_dst = np.full(COPY_CHUNK, r.padding.dropped_block, np.int32)
            n = min(COPY_CHUNK, len(src) - start)
            chunk_src[:n] = src[start : start + n]
            chunk_dst[:n] = dst[start : start + n]
            host = self._place.host_input
            chunk_src, chunk_dst = host(chunk_src), host(chunk_dst)
            for i, pool in enumerate(r.kv_pools):
                r.kv_pools[i] = copy(pool, chunk_src, chunk_dst)
