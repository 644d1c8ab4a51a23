"""The model runner: runs the scheduler's step plans on the device(s).

This file owns :class:`ModelRunner`, the facade the engine drives (its interface:
:class:`kvpage.runner.protocol.StepRunner`) and the state it holds: the params, the paged
KV pools and the sampling table (one row per seat). A step
(:meth:`ModelRunner.dispatch`) packs the plan into one int32 buffer
(:mod:`kvpage.runner.step_inputs`), then runs the bucket's compiled pieces in turn:
embed, the layer groups (copy-on-write block copies, K/V written at the slot mapping,
paged attention), select (the sampled rows' hidden states) and head (lm_head, sampling
and the sampling-state update) -- :mod:`kvpage.runner.layered_step`. The pools and the
sampling table are donated, so they are updated in place. Grammar masks computed by
``token_bitmask_fn`` are computed on the host between select and head, while the layers
run. Small pure-decode batches may run several steps in one call
(:meth:`ModelRunner.dispatch_multi_step`, :mod:`kvpage.runner.multi_step`).

Collaborators, one job each: :class:`~kvpage.runner.placement.Placement` (shardings),
:class:`~kvpage.runner.step_executables.StepExecutables` (bucket policy, building and
caching every executable, warm-up), :func:`~kvpage.runner.plan_check.check_plan` and
:mod:`kvpage.runner.pending` (the dispatched calls' results).

With ``tensor_parallel_size=N`` (or an explicit ``mesh``) the same step runs over N devices
(:mod:`kvpage.runner.tensor_parallel`): params split Megatron-style, KV pools split by KV
head, the attention kernel per shard under ``shard_map``; the packed step inputs, the
sampling table and the sampled outputs are replicated, so every device (and host) sees the
same tokens.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from kvpage.model.attention import get_attention_backend
from kvpage.model.config import ModelConfig
from kvpage.model.params import Params, check_same_layout, validate_params
from kvpage.runner.background_compiler import BackgroundCompiler
from kvpage.runner.buckets import (
    default_buckets,
    normalize_buckets,
)
from kvpage.runner.kv_cache import (
    KVPools,
    allocate_kv_cache,
    pool_bytes_on,
)
from kvpage.runner.kv_cache_sizing import size_kv_cache
from kvpage.runner.layered_step import (
    embed_weight,
    head_params,
    is_stacked,
    layer_plan,
    layer_signature,
)
from kvpage.runner.multi_step import (
    MULTI_STEP_MAX_ROWS,
    default_scheduler_steps,
)
from kvpage.runner.multi_step_decode import MultiStepDecode
from kvpage.runner.pending import PendingMultiStep, PendingStep
from kvpage.runner.placement import Placement
from kvpage.runner.plan_check import check_plan
from kvpage.runner.step_executables import COPY_CHUNK, StepExecutables
from kvpage.runner.step_inputs import PaddingValues
from kvpage.runner.step_output import StepOutput
from kvpage.runner.step_plan import StepPlanLike
from kvpage.runner.tensor_parallel import (
    check_tensor_parallel,
    make_mesh,
    mesh_size,
    place,
    shard_attention_backend,
)
from kvpage.sampling.device_params import DeviceSamplingParams
from kvpage.sampling.table import (
    SamplingTable,
    init_sampling_table,
    seat_row,
)
from kvpage.sampling.token_bitmask import ALLOW_ALL, bitmask_words, pad_bitmask


class ModelRunner:
    """Owns the params, the paged KV pools and the per-seat sampling state on the device(s).

    Args:
        config: the model's :class:`ModelConfig`.
        params: parameter pytree (:mod:`kvpage.model.params` layout); validated and placed
            on ``device`` (or sharded over the mesh). Leaves that are already there, as jax
            arrays of the right sharding, are adopted as they are (no copy). Swap later
            with :meth:`update_params`.
        num_blocks: KV blocks the Rust block pool manages (the device pool gets one more,
            the scratch block). ``None``: decided by
            :func:`kvpage.runner.kv_cache_sizing.decide_num_blocks` from
            ``kv_cache_memory`` or the device's (host's) memory.
        block_size: tokens per KV block.
        max_model_len: longest sequence (prompt + output); fixes the block-table width.
        attention_backend: ``None``/``"reference"`` or a ``kvpage.kernels`` backend name.
        max_num_seqs: seats of the sampling table; ``sample_rows`` index them.
        max_num_batched_tokens: most tokens in one step.
        token_buckets / seq_buckets: padded sizes for T and max(S, S'); default powers
            of two up to the maxima (policy: :mod:`kvpage.runner.buckets`).
        max_token_seq_ratio: a step padded to T tokens gets at least ``T / ratio`` padded
            sequence rows, which bounds the number of (T, S) bucket pairs to compile at
            the price of a few extra padded rows (cheap) in large steps.
        max_fused_copies: CoW copies executed inside the step; plans with more run them
            in a separate call before the step.
        kv_cache_dtype: dtype of the pools; None or ``"auto"``: :func:`resolve_kv_cache_dtype`.
        kv_memory_fraction: share of an accelerator's memory for params + cache + steps
            (``gpu_memory_utilization``).
        kv_cache_memory: bytes for the KV cache (overrides the memory-based sizing).
        max_logprobs: width of the top-N logprob lists (0 disables them).
        enable_penalties: keep per-seat token histories ([seats, vocab] on device) so
            presence/frequency/repetition penalties work.
        seed: base seed for requests without their own seed.
        validate_plans: range-check every plan on the host (cheap numpy checks).
        tensor_parallel_size: shard the model over this many devices (the first N of
            :func:`jax.devices`); must divide the query and KV head counts.
        mesh: an explicit mesh with a ``"tp"`` axis instead (overrides the size).
        num_scheduler_steps: most decode steps one device call may run
            (:mod:`kvpage.runner.multi_step`); 1 runs every step on its own; None:
            :func:`default_scheduler_steps`.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        num_blocks: int | None,
        block_size: int,
        max_model_len: int,
        attention_backend: str | None = None,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        token_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
        max_token_seq_ratio: int = 16,
        max_fused_copies: int = 8,
        kv_cache_dtype: str | None = None,
        kv_memory_fraction: float = 0.9,
        kv_cache_memory: int | None = None,
        max_logprobs: int = 20,
        enable_penalties: bool = True,
        seed: int = 0,
        device: jax.Device | None = None,
        validate_plans: bool = True,
        tensor_parallel_size: int = 1,
        mesh: Mesh | None = None,
        num_scheduler_steps: int | None = None,
    ) -> None:
        if max_model_len <= 0 or block_size <= 0:
            raise ValueError("max_model_len and block_size must be positive")
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        if config.sliding_window is not None and max_model_len > config.sliding_window:
            raise ValueError(
                f"sliding-window attention is not implemented: max_model_len {max_model_len} "
                f"must not exceed the model's sliding_window {config.sliding_window}"
            )
        if mesh is None and tensor_parallel_size > 1:
            check_tensor_parallel(config, tensor_parallel_size)
            mesh = make_mesh(tensor_parallel_size)
        tp = mesh_size(mesh) if mesh is not None else 1
        check_tensor_parallel(config, tp)
        self.config = config
        self.mesh = mesh
        self.tensor_parallel_size = tp
        self.device = device or (
            mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
        )
        self.backend = get_attention_backend(attention_backend)
        validate_params(config, params)
        if mesh is not None:
            self.backend = shard_attention_backend(self.backend, mesh)
        self.placement = Placement(config, params, mesh, self.device)
        self.params: Params
        self.params, self.last_update_copies = place(params, self.placement.param_shardings)
        self.kv_spec, self.kv_cache_decision = size_kv_cache(
            config, self.params, kv_cache_dtype, block_size, tp, self.device,
            num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            memory_utilization=kv_memory_fraction,
        )
        num_blocks = self.kv_spec.num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.max_fused_copies = max_fused_copies
        self.max_token_seq_ratio = max_token_seq_ratio
        self.enable_penalties = enable_penalties
        self.validate_plans = validate_plans
        if num_scheduler_steps is None:
            num_scheduler_steps = default_scheduler_steps(self.device.platform, mesh, params)
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1; got {num_scheduler_steps}")
        self.num_scheduler_steps = num_scheduler_steps
        self.multi_step_max_rows = MULTI_STEP_MAX_ROWS
        """Decode steps of up to this many rows may run several steps per call."""

        platform = self.device.platform
        self.token_buckets = normalize_buckets(
            token_buckets or default_buckets(platform, max_num_batched_tokens, "tokens"),
            "token_buckets",
        )
        self.seq_buckets = normalize_buckets(
            seq_buckets or default_buckets(platform, max_num_seqs, "seqs"), "seq_buckets"
        )
        self.padding = PaddingValues(
            scratch_slot=self.kv_spec.scratch_slot,
            scratch_block=self.kv_spec.scratch_block,
            dummy_sample_row=max_num_seqs,
            dropped_block=num_blocks + 1,
        )

        self.kv_pools: KVPools = allocate_kv_cache(self.kv_spec, self.placement.pool_sharding)
        self.sampling_table: SamplingTable = init_sampling_table(
            max_num_seqs, config.vocab_size, enable_penalties, self.placement.replicated
        )
        self.seat_logprobs = np.zeros(max_num_seqs + 1, np.int32)
        """Top logprobs asked for by the request at each seat (0: none)."""
        self.seed = seed
        self.step_counter = 0

        self._allow_all_masks: dict[int, jax.Array] = {}
        self.last_enqueue_time = 0.0
        """``time.perf_counter()`` when the last step's device work was enqueued (with
        overlapped masks: the forward pass, before the masks are computed)."""
        self.last_bitmask_overlapped = False
        """Whether the forward pass was still running when the last step's
        ``token_bitmask_fn`` returned (its host work hidden behind the device)."""
        self.stacked = is_stacked(self.params)
        self.layer_plan = layer_plan(
            [None] * config.num_layers if self.stacked
            else [layer_signature(layer) for layer in self.params["layers"]]
        )
        self._layer_indices = [
            jax.device_put(np.int32(i), self.placement.replicated) for i in range(config.num_layers)
        ] if self.stacked else []
        # Executables of earlier starts are not used with a mesh, whose executables are
        # placed on several devices.
        self.executables = StepExecutables(self, self.placement, use_store=mesh is None)
        self.multi_step = MultiStepDecode(self, self.executables)

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        """Blocks for the Rust block pool (ids ``0 .. num_blocks - 1``; scratch excluded)."""
        return self.kv_spec.num_blocks

    @property
    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of KV pools (all layers, K and V) held on the first device of the mesh."""
        return pool_bytes_on(self.kv_pools, self.device)

    # ------------------------------------------------------------------ start-up
    # (the StepRunner protocol; the rest of the bucket and warm-up API is
    # ``self.executables``, of multi-step decode ``self.multi_step``)
    @property
    def background_compiler(self) -> BackgroundCompiler | None:
        return self.executables.background_compiler

    def warmup(self, progress: bool = True, max_workers: int = 1) -> None:
        """Compile every executable a step may need (``warmup="full"``)."""
        multi = [functools.partial(self.multi_step.multi_step_fn, s)
                 for s in self.multi_step.buckets()]
        self.executables.warmup(progress, max_workers, multi)

    def start_background_compile(self) -> BackgroundCompiler:
        return self.executables.start_background_compile()

    def multi_step_ready(self, num_rows: int) -> bool:
        return self.multi_step.ready(num_rows)

    def prepare_multi_step(self, num_rows: int) -> None:
        self.multi_step.prepare(num_rows)

    def dispatch_multi_step(self, plan: StepPlanLike, num_steps: int) -> PendingMultiStep:
        return self.multi_step.dispatch(plan, num_steps)

    # ------------------------------------------------------------------ requests
    def set_request(
        self,
        seat: int,
        params: DeviceSamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray = (),
        output_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """Bind ``seat`` to a request's ``params`` before its first sampled step.

        Call again on resume after preemption (with the tokens generated so far) or to
        change the parameters; it never recompiles. The histories feed the penalties,
        and ``len(output_token_ids)`` is the index of the next generated token (seeded keys).
        """
        if not 0 <= seat < self.max_num_seqs:
            raise ValueError(f"seat {seat} out of range [0, {self.max_num_seqs})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"logprobs={params.logprobs} exceeds this runner's max_logprobs "
                f"{self.max_logprobs}"
            )
        if params.uses_penalties and not self.enable_penalties:
            raise ValueError("penalties requested but the runner has enable_penalties=False")
        row = seat_row(
            seat, params, prompt_token_ids, output_token_ids, self.max_model_len,
            self.enable_penalties, self.config.vocab_size,
        )
        host = self.placement.host_input
        self.sampling_table = self.executables.write_seat_fn()(
            self.sampling_table, *(host(value) for value in row)
        )
        self.seat_logprobs[seat] = params.logprobs or 0

    def free_request(self, seat: int) -> None:
        """Forget a finished request's host-side flags (its device row is simply reused)."""
        self.seat_logprobs[seat] = 0

    # ------------------------------------------------------------------ params
    def update_params(self, params: Params) -> int:
        """Swap in new weights of identical tree structure, shapes and dtypes.

        Nothing recompiles and the KV pools stay as they are (their contents now
        describe the old weights: the caller decides what to drop). Leaves that already
        are jax arrays with this runner's sharding (one device, or the tensor-parallel
        layout of :func:`~kvpage.runner.tensor_parallel.shard_params`) are adopted as they
        are; others are transferred (device to device where possible). Raises ValueError naming the
        first mismatch, before anything changes: the old params stay live. Returns the
        number of leaves that had to be transferred (0: nothing was copied).
        """
        validate_params(self.config, params)
        check_same_layout(self.params, params)
        self.params, self.last_update_copies = place(params, self.placement.param_shardings)
        return self.last_update_copies

    # ------------------------------------------------------------------ execution
    def run_block_copies(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks ``src -> dst`` (all layers, K and V) outside a step."""
        src = np.asarray(src, np.int32)
        dst = np.asarray(dst, np.int32)
        copy = self.executables.copy_fn()
        for start in range(0, len(src), COPY_CHUNK):
            chunk_src = np.full(COPY_CHUNK, self.padding.scratch_block, np.int32)
            chunk_dst = np.full(COPY_CHUNK, self.padding.dropped_block, np.int32)
            n = min(COPY_CHUNK, len(src) - start)
            chunk_src[:n] = src[start : start + n]
            chunk_dst[:n] = dst[start : start + n]
            host = self.placement.host_input
            chunk_src, chunk_dst = host(chunk_src), host(chunk_dst)
            for i, pool in enumerate(self.kv_pools):
                self.kv_pools[i] = copy(pool, chunk_src, chunk_dst)

    def recover_device_state(self) -> bool:
        """After a failed step: if the donated KV pools or sampling table were
        consumed, allocate fresh ones and return True (every sequence's KV is
        then lost); otherwise return False."""
        leaves = jax.tree_util.tree_leaves((self.kv_pools, self.sampling_table))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        self.kv_pools = allocate_kv_cache(self.kv_spec, self.placement.pool_sharding)
        self.sampling_table = init_sampling_table(
            self.max_num_seqs, self.config.vocab_size, self.enable_penalties,
            self.placement.replicated,
        )
        self.seat_logprobs[:] = 0
        return True

    def execute(
        self, plan: StepPlanLike, prompt_targets: np.ndarray | None = None
    ) -> StepOutput:
        """Run one step plan; returns the tokens sampled at ``plan.logits_indices``.

        ``plan.sample_rows`` are seats bound with :meth:`set_request`.
        """
        return self.dispatch(plan, prompt_targets).result()

    def dispatch(
        self,
        plan: StepPlanLike,
        prompt_targets: np.ndarray | None = None,
        token_bitmask_fn: Callable[[], np.ndarray | None] | None = None,
    ) -> PendingStep:
        """Enqueue one step on the device and return at once (JAX dispatch is
        asynchronous); ``result()`` waits for the sampled tokens. The host can
        do other work, such as detokenizing the previous step, in between.

        ``prompt_targets`` (int32 ``[num_tokens]``, -1 = none; see
        :func:`kvpage.runner.prompt_logprobs.prompt_targets`) asks for the
        log-probability of each target token under the distribution at that step
        token, from this same forward pass; the result then carries
        ``prompt_logprobs`` and friends.

        Grammar masks come either with the plan (``plan.token_bitmask``) or from
        ``token_bitmask_fn``: then the forward pass is enqueued first and the function
        runs on the host while the device computes it; sampling is enqueued with its
        result (two executables instead of one). A step that also scores prompt tokens
        computes its masks first (one executable, no overlap)."""
        num_sampled = len(plan.logits_indices)
        self.check(plan, num_sampled)
        num_tokens, num_seqs = int(plan.num_tokens), int(plan.num_seqs)
        # Sampled rows share the sequence bucket; with n > 1 there are more
        # sampled rows (one per forked sample) than sequence rows.
        t_pad, s_pad = self.executables.padded_sizes(num_tokens, max(num_seqs, num_sampled))
        decode_only = bool(plan.decode_only) and self.executables.has_decode_variant(s_pad)
        (t_pad, s_pad, _), bucket = self.executables.bucket_for((t_pad, s_pad, decode_only))
        fuse_copies = len(plan.copy_src) <= self.max_fused_copies
        if not fuse_copies:
            self.run_block_copies(plan.copy_src, plan.copy_dst)
        layout, template = self.executables.layout((t_pad, s_pad))
        want_top = self.max_logprobs > 0 and bool(
            num_sampled and self.seat_logprobs[plan.sample_rows].max() > 0
        )
        packed_host = layout.pack(
            plan, template, self.block_size, self.step_counter, want_top, fuse_copies
        )
        targets = None
        if prompt_targets is not None:
            targets = np.full(t_pad, -1, np.int32)
            targets[:num_tokens] = np.asarray(prompt_targets, np.int32)[:num_tokens]
            if targets.max() >= self.config.vocab_size:
                raise ValueError("prompt_targets hold a token id outside the vocabulary")
        try:
            # One transfer; every piece of the step reads the same device buffer.
            place = self.placement
            packed = jax.device_put(place.host_input(packed_host), place.replicated)
            params = self.params
            hidden = bucket.embed(embed_weight(params), packed)
            pools = self.kv_pools
            for start, count, kind in self.layer_plan.groups:
                end = start + count
                if self.stacked:
                    hidden, pools[start:end] = bucket.layers[kind](
                        params["layers"], self._layer_indices[start], pools[start:end], hidden,
                        packed,
                    )
                else:
                    hidden, pools[start:end] = bucket.layers[kind](
                        params["layers"][start:end], pools[start:end], hidden, packed
                    )
            head = head_params(self.config, params)
            scores = None
            if targets is not None:
                scored = self.executables.scored_select_fn((t_pad, s_pad))
                rows, info, scores = scored(head, hidden, packed, place.host_input(targets))
            else:
                rows, info = bucket.select(hidden, packed)
            self.last_enqueue_time = time.perf_counter()
            if token_bitmask_fn is not None:
                masks = token_bitmask_fn()  # host work while the layers run
                self.last_bitmask_overlapped = not rows.is_ready()
            else:
                masks = getattr(plan, "token_bitmask", None)
            out, self.sampling_table = self.executables.head_fn(s_pad)(
                head, rows, info, self.sampling_table, self.token_bitmask_input(masks, s_pad)
            )
        except Exception as exc:
            self.raise_if_params_deleted(exc)
            raise
        self.step_counter += 1
        return PendingStep(out, num_sampled, want_top, scores, num_tokens)

    def check(self, plan: StepPlanLike, num_sampled: int) -> None:
        """Range-check ``plan`` (:func:`check_plan`) unless ``validate_plans`` is off."""
        if self.validate_plans:
            check_plan(plan, num_sampled, self.kv_spec, self.max_num_seqs, self.max_model_len)

    def raise_if_params_deleted(self, exc: Exception) -> None:
        """A step failed: say so plainly when it was because the params were donated."""
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.params)):
            raise RuntimeError(
                "the runner's params were deleted (donated to a training step?): pass "
                "the new params to update_params before generating again"
            ) from exc

    def token_bitmask_input(self, bitmask: np.ndarray | None, rows: int) -> Any:
        """The step's grammar bitmask: the plan's rows padded to ``rows``, or (no
        constrained row) an allow-all mask kept on the device, so unconstrained steps
        transfer nothing extra."""
        if bitmask is not None:
            return self.placement.host_input(pad_bitmask(bitmask, rows, self.config.vocab_size))
        cached = self._allow_all_masks.get(rows)
        if cached is None:
            words = bitmask_words(self.config.vocab_size)
            cached = jax.device_put(
                self.placement.host_input(np.full((rows, words), ALLOW_ALL, np.int32)),
                self.placement.replicated,
            )
            self._allow_all_masks[rows] = cached
        return cached

