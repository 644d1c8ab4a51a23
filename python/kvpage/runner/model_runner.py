"""The model runner: executes one scheduler step plan on the device per call.

This file owns :class:`ModelRunner`. Per step it pads the plan into one int32 buffer
(:mod:`kvpage.runner.step_inputs`), runs ONE ahead-of-time compiled function per bucket --
copy-on-write block copies, the forward pass over all tokens of the step (prefill chunks
and decodes together; K/V written at the slot mapping, paged attention, logits only at
sampled positions), sampling and the sampling-state update -- and returns the sampled
tokens with their log-probabilities. The KV pools and the sampling table are donated to
that function, so they are updated in place.

Every executable is compiled explicitly and counted in :attr:`ModelRunner.num_compilations`;
after :meth:`ModelRunner.warmup` that number stays fixed for any plan within the
configured limits.

Engine protocol::

    runner = ModelRunner(config, params, num_blocks, block_size, max_model_len)
    runner.warmup()
    runner.set_request(slot, sampling_params, prompt_token_ids)   # once per request slot
    out = runner.execute(plan)      # plan.sample_rows name request slots
    out.sampled_token_ids, out.logprobs, out.top_token_ids, ...
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.attention import get_attention_backend
from kvpage.model.config import ModelConfig
from kvpage.model.llama import forward
from kvpage.model.loader import params_from_pytree
from kvpage.model.params import Params
from kvpage.runner.buckets import normalize_buckets, pick_bucket, power_of_two_buckets
from kvpage.runner.kv_cache import (
    KVCacheSpec,
    KVPools,
    allocate_kv_cache,
    copy_blocks,
    num_blocks_for_memory,
)
from kvpage.runner.sampler import sample
from kvpage.runner.sampling_params import SamplingParams
from kvpage.runner.sampling_table import (
    SamplingTable,
    gather_inputs,
    init_sampling_table,
    params_to_rows,
    record_sampled,
    write_slot,
)
from kvpage.runner.step_inputs import PackedLayout, PaddingValues
from kvpage.runner.step_output import StepOutput
from kvpage.runner.step_plan import StepPlanLike

_COPY_CHUNK = 64  # block copies per call of the stand-alone copy executable

StepKey = tuple[int, int, bool]
"""(padded tokens, padded sequences, pure-decode variant)"""


class ModelRunner:
    """Owns the params, the paged KV pools and the per-slot sampling state on one device.

    Args:
        config: the model's :class:`ModelConfig`.
        params: parameter pytree (:mod:`kvpage.model.params` layout); validated and moved
            to ``device``. Swap later with :meth:`update_params`.
        num_blocks: KV blocks the Rust block pool manages (the device pool gets one more,
            the scratch block). ``None``: as many as fit in ``kv_memory_fraction`` of the
            device memory (GPU/TPU only).
        block_size: tokens per KV block.
        max_model_len: longest sequence (prompt + output); fixes the block-table width.
        attention_backend: ``None``/``"reference"`` or a ``pallas_kernels`` backend name.
        max_num_seqs: request slots of the sampling table; ``sample_rows`` index them.
        max_num_batched_tokens: most tokens in one step.
        token_buckets / seq_buckets: padded sizes for T and max(S, S');
            default powers of two from 16 / 8 up to the maxima.
        max_token_seq_ratio: a step padded to T tokens gets at least ``T / ratio`` padded
            sequence rows, which bounds the number of (T, S) bucket pairs to compile at
            the price of a few extra padded rows (cheap) in large steps.
        max_fused_copies: CoW copies executed inside the step; plans with more run them
            in a separate call before the step.
        kv_cache_dtype: dtype of the pools; default the params' dtype.
        max_logprobs: width of the top-N logprob lists (0 disables them).
        enable_penalties: keep per-slot token histories ([slots, vocab] on device) so
            presence/frequency/repetition penalties work.
        seed: base seed for requests without their own seed.
        validate_plans: range-check every plan on the host (cheap numpy checks).
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
        max_logprobs: int = 20,
        enable_penalties: bool = True,
        seed: int = 0,
        device: jax.Device | None = None,
        validate_plans: bool = True,
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
        self.config = config
        self.device = device or jax.local_devices()[0]
        self.backend = get_attention_backend(attention_backend)
        self.params: Params = params_from_pytree(config, params, dtype=None, device=self.device)
        param_dtype = str(jnp.dtype(self.params["embed_tokens"]["weight"].dtype))
        kv_dtype = kv_cache_dtype or param_dtype
        if num_blocks is None:
            num_blocks = num_blocks_for_memory(
                config, block_size, kv_memory_fraction, kv_dtype, self.device
            )
        self.kv_spec = KVCacheSpec.for_model(config, block_size, num_blocks, kv_dtype)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.max_fused_copies = max_fused_copies
        self.max_token_seq_ratio = max_token_seq_ratio
        self.enable_penalties = enable_penalties
        self.validate_plans = validate_plans

        self.token_buckets = normalize_buckets(
            token_buckets or power_of_two_buckets(16, max_num_batched_tokens), "token_buckets"
        )
        self.seq_buckets = normalize_buckets(
            seq_buckets or power_of_two_buckets(min(8, max_num_seqs), max_num_seqs),
            "seq_buckets",
        )
        self._padding = PaddingValues(
            scratch_slot=self.kv_spec.scratch_slot,
            scratch_block=self.kv_spec.scratch_block,
            dummy_sample_row=max_num_seqs,
            dropped_block=num_blocks + 1,
        )

        self.kv_pools: KVPools = allocate_kv_cache(self.kv_spec, self.device)
        self.sampling_table: SamplingTable = init_sampling_table(
            max_num_seqs, config.vocab_size, enable_penalties, self.device
        )
        self._slot_logprobs = np.zeros(max_num_seqs + 1, np.int32)
        self._base_key_seed = seed
        self._step_counter = 0

        self._step_executables: dict[StepKey, jax.stages.Compiled] = {}
        self._layouts: dict[tuple[int, int], tuple[PackedLayout, np.ndarray]] = {}
        self._write_slot_executable: jax.stages.Compiled | None = None
        self._copy_executable: jax.stages.Compiled | None = None
        self._num_compilations = 0

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        """Blocks for the Rust block pool (ids ``0 .. num_blocks - 1``; scratch excluded)."""
        return self.kv_spec.num_blocks

    @property
    def num_compilations(self) -> int:
        """Executables compiled so far (step buckets, slot writer, copy kernel)."""
        return self._num_compilations

    @property
    def compiled_buckets(self) -> list[StepKey]:
        """``(padded tokens, padded seqs, decode_only)`` of every compiled step."""
        return sorted(self._step_executables)

    def warmup_buckets(self) -> list[StepKey]:
        """The step variants :meth:`warmup` compiles.

        Each (token bucket t, seq bucket) pair a step can land in (a step has at most as
        many sequences as tokens, so only seq buckets reachable with S <= t) and, when
        the attention backend has a decode kernel, the pure-decode variant of each pair
        a decode-only step (T == S) can land in.
        """
        max_seqs = self.seq_buckets[-1]
        mixed = {
            (*self.padded_sizes(t, s), False)
            for t in self.token_buckets
            for s in range(1, min(t, max_seqs) + 1)
        }
        keys = sorted(mixed)
        if self.backend.decode_specialized:
            limit = min(self.token_buckets[-1], max_seqs)
            keys += sorted({(*self.padded_sizes(n, n), True) for n in range(1, limit + 1)})
        return keys

    def padded_sizes(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (token, sequence) buckets a step of this size runs in."""
        t_pad = pick_bucket(self.token_buckets, num_tokens, "num_tokens")
        floor = min(math.ceil(t_pad / self.max_token_seq_ratio), self.seq_buckets[-1])
        s_pad = pick_bucket(self.seq_buckets, max(num_seqs, 1, floor), "num_seqs")
        return t_pad, s_pad

    # ------------------------------------------------------------------ compilation
    def _layout(self, key: tuple[int, int]) -> tuple[PackedLayout, np.ndarray]:
        entry = self._layouts.get(key)
        if entry is None:
            layout = PackedLayout(key[0], key[1], self.max_fused_copies, self.max_blocks_per_seq)
            entry = (layout, layout.template(self._padding))
            self._layouts[key] = entry
        return entry

    def _make_step(self, layout: PackedLayout, decode_only: bool) -> Callable[..., Any]:
        config, backend = self.config, self.backend
        num_top, base_seed = self.max_logprobs, self._base_key_seed

        def step(
            params: Params, pools: KVPools, table: SamplingTable, packed: jax.Array
        ) -> tuple[Any, KVPools, SamplingTable]:
            arrays = layout.unpack(packed)
            if layout.num_copies:
                pools = copy_blocks(pools, arrays.copy_src, arrays.copy_dst)
            logits, pools = forward(
                params,
                config,
                arrays.token_ids,
                arrays.positions,
                pools,
                arrays.meta,
                arrays.logits_indices,
                backend,
                decode_only,
            )
            inputs = gather_inputs(table, arrays.sample_rows)
            step_key = jax.random.fold_in(jax.random.key(base_seed), arrays.step_counter)
            out = sample(logits, inputs, step_key, num_top, arrays.want_top_logprobs)
            valid = jnp.arange(layout.num_seqs) < arrays.num_sampled
            table = record_sampled(table, arrays.sample_rows, out.token_ids, valid)
            return out, pools, table

        return step

    def _lower_step(self, key: StepKey) -> jax.stages.Lowered:
        layout, _ = self._layout(key[:2])
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        jitted = jax.jit(self._make_step(layout, key[2]), donate_argnums=(1, 2))
        return jitted.lower(self.params, self.kv_pools, self.sampling_table, packed)

    def _compile_step(self, key: StepKey) -> jax.stages.Compiled:
        executable = self._lower_step(key).compile()
        self._step_executables[key] = executable
        self._num_compilations += 1
        return executable

    def _write_slot_fn(self) -> jax.stages.Compiled:
        if self._write_slot_executable is None:
            ids_len = self.max_model_len if self.enable_penalties else 1
            ids = jax.ShapeDtypeStruct((ids_len,), jnp.int32)
            lowered = jax.jit(write_slot, donate_argnums=(0,)).lower(
                self.sampling_table,
                jax.ShapeDtypeStruct((), jnp.int32),
                jax.ShapeDtypeStruct((self.sampling_table.floats.shape[1],), jnp.float32),
                jax.ShapeDtypeStruct((self.sampling_table.ints.shape[1],), jnp.int32),
                jax.ShapeDtypeStruct((2,), jnp.uint32),
                ids,
                ids,
            )
            self._write_slot_executable = lowered.compile()
            self._num_compilations += 1
        return self._write_slot_executable

    def _copy_fn(self) -> jax.stages.Compiled:
        if self._copy_executable is None:
            index = jax.ShapeDtypeStruct((_COPY_CHUNK,), jnp.int32)
            lowered = jax.jit(copy_blocks, donate_argnums=(0,)).lower(self.kv_pools, index, index)
            self._copy_executable = lowered.compile()
            self._num_compilations += 1
        return self._copy_executable

    def warmup(self, progress: bool = True, max_workers: int = 1) -> None:
        """Compile every bucket pair of :meth:`warmup_buckets` plus the helper executables.

        ``max_workers > 1`` compiles several buckets concurrently (XLA compiles outside
        the GIL).
        """
        from tqdm.auto import tqdm

        self._write_slot_fn()
        self._copy_fn()
        pending = [k for k in self.warmup_buckets() if k not in self._step_executables]
        bar = tqdm(total=len(pending), desc="compiling step buckets", disable=not progress)
        try:
            if max_workers <= 1:
                for key in pending:
                    bar.set_postfix(tokens=key[0], seqs=key[1])
                    self._compile_step(key)
                    bar.update(1)
                return
            lowered = {key: self._lower_step(key) for key in pending}
            with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
                futures = {pool.submit(low.compile): key for key, low in lowered.items()}
                for future in concurrent.futures.as_completed(futures):
                    self._step_executables[futures[future]] = future.result()
                    self._num_compilations += 1
                    bar.update(1)
        finally:
            bar.close()

    # ------------------------------------------------------------------ requests
    def set_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray = (),
        output_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """Bind request slot ``slot`` to ``params`` before its first sampled step.

        Call again on resume after preemption (with the tokens generated so far) or to
        change the parameters; it never recompiles. The histories feed the penalties,
        and ``len(output_token_ids)`` is the index of the next generated token (seeded keys).
        """
        if not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"slot {slot} out of range [0, {self.max_num_seqs})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"logprobs={params.logprobs} exceeds this runner's max_logprobs "
                f"{self.max_logprobs}"
            )
        if params.uses_penalties and not self.enable_penalties:
            raise ValueError("penalties requested but the runner has enable_penalties=False")
        prompt = np.asarray(prompt_token_ids, np.int32).reshape(-1)
        output = np.asarray(output_token_ids, np.int32).reshape(-1)
        if len(prompt) + len(output) > self.max_model_len:
            raise ValueError(
                f"prompt + output ({len(prompt) + len(output)} tokens) exceed max_model_len "
                f"{self.max_model_len}"
            )
        ids_len = self.max_model_len if self.enable_penalties else 1
        prompt_buf = np.full(ids_len, -1, np.int32)
        output_buf = np.full(ids_len, -1, np.int32)
        if self.enable_penalties:
            prompt_buf[: len(prompt)] = prompt
            output_buf[: len(output)] = output
        floats, ints, seed = params_to_rows(params, len(output))
        self.sampling_table = self._write_slot_fn()(
            self.sampling_table, np.int32(slot), floats, ints, seed, prompt_buf, output_buf
        )
        self._slot_logprobs[slot] = params.logprobs or 0

    def free_request(self, slot: int) -> None:
        """Forget a finished request's host-side flags (its device row is simply reused)."""
        self._slot_logprobs[slot] = 0

    # ------------------------------------------------------------------ params
    def update_params(self, params: Params) -> None:
        """Swap in new weights of identical structure, shapes and dtypes (no recompile)."""
        new = params_from_pytree(self.config, params, dtype=None, device=self.device)
        old_def = jax.tree_util.tree_structure(self.params)
        new_def = jax.tree_util.tree_structure(new)
        if old_def != new_def:
            raise ValueError("new params have a different tree structure")
        for old_leaf, new_leaf in zip(
            jax.tree_util.tree_leaves(self.params), jax.tree_util.tree_leaves(new), strict=True
        ):
            if old_leaf.shape != new_leaf.shape or old_leaf.dtype != new_leaf.dtype:
                raise ValueError(
                    f"new params change a leaf from {old_leaf.shape} {old_leaf.dtype} "
                    f"to {new_leaf.shape} {new_leaf.dtype}"
                )
        self.params = new

    # ------------------------------------------------------------------ execution
    def _check_plan(self, plan: StepPlanLike, num_sampled: int) -> None:
        t, s = int(plan.num_tokens), int(plan.num_seqs)
        if len(plan.token_ids) < t or len(plan.positions) < t or len(plan.slot_mapping) < t:
            raise ValueError("plan token arrays are shorter than num_tokens")
        if len(plan.cu_q_lens) < s + 1 or len(plan.kv_lens) < s:
            raise ValueError("plan sequence arrays are shorter than num_seqs")
        if int(plan.cu_q_lens[s]) != t or int(plan.cu_q_lens[0]) != 0:
            raise ValueError("cu_q_lens must start at 0 and end at num_tokens")
        if num_sampled > self.max_num_seqs:
            raise ValueError(
                f"{num_sampled} sampled rows exceed max_num_seqs={self.max_num_seqs}"
            )
        if len(plan.sample_rows) != num_sampled:
            raise ValueError("sample_rows and logits_indices differ in length")
        if len(plan.copy_src) != len(plan.copy_dst):
            raise ValueError("copy_src and copy_dst differ in length")
        limit_slot = self.kv_spec.scratch_slot
        if t and (plan.slot_mapping[:t].min() < 0 or plan.slot_mapping[:t].max() > limit_slot):
            raise ValueError("slot_mapping out of range")
        if num_sampled:
            li, rows = plan.logits_indices, plan.sample_rows
            if li.min() < 0 or li.max() >= t:
                raise ValueError("logits_indices out of range")
            if rows.min() < 0 or rows.max() >= self.max_num_seqs:
                raise ValueError("sample_rows out of range")
        if s:
            tables = np.asarray(plan.block_tables)[:s]
            if tables.min() < 0 or tables.max() > self.kv_spec.scratch_block:
                raise ValueError("block_tables out of range")
            if int(np.max(plan.kv_lens[:s])) > self.max_model_len:
                raise ValueError("a kv_len exceeds max_model_len")
        for ids in (plan.copy_src, plan.copy_dst):
            if len(ids) and (ids.min() < 0 or ids.max() >= self.kv_spec.num_blocks):
                raise ValueError("copy block ids out of range")

    def run_block_copies(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks ``src -> dst`` (all layers, K and V) outside a step."""
        src = np.asarray(src, np.int32)
        dst = np.asarray(dst, np.int32)
        copy = self._copy_fn()
        for start in range(0, len(src), _COPY_CHUNK):
            chunk_src = np.full(_COPY_CHUNK, self._padding.scratch_block, np.int32)
            chunk_dst = np.full(_COPY_CHUNK, self._padding.dropped_block, np.int32)
            n = min(_COPY_CHUNK, len(src) - start)
            chunk_src[:n] = src[start : start + n]
            chunk_dst[:n] = dst[start : start + n]
            self.kv_pools = copy(self.kv_pools, chunk_src, chunk_dst)

    def recover_device_state(self) -> bool:
        """After a failed step: if the donated KV pools or sampling table were
        consumed, allocate fresh ones and return True (every sequence's KV is
        then lost); otherwise return False."""
        leaves = jax.tree_util.tree_leaves((self.kv_pools, self.sampling_table))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        self.kv_pools = allocate_kv_cache(self.kv_spec, self.device)
        self.sampling_table = init_sampling_table(
            self.max_num_seqs, self.config.vocab_size, self.enable_penalties, self.device
        )
        self._slot_logprobs[:] = 0
        return True

    def execute(self, plan: StepPlanLike) -> StepOutput:
        """Run one step plan; returns the tokens sampled at ``plan.logits_indices``.

        ``plan.sample_rows`` name request slots bound with :meth:`set_request`.
        """
        return self.dispatch(plan).result()

    def dispatch(self, plan: StepPlanLike) -> PendingStep:
        """Enqueue one step on the device and return at once (JAX dispatch is
        asynchronous); ``result()`` waits for the sampled tokens. The host can
        do other work, such as detokenizing the previous step, in between."""
        num_sampled = len(plan.logits_indices)
        if self.validate_plans:
            self._check_plan(plan, num_sampled)
        num_tokens, num_seqs = int(plan.num_tokens), int(plan.num_seqs)
        # Sampled rows share the sequence bucket; with n > 1 there are more
        # sampled rows (one per forked sample) than sequence rows.
        t_pad, s_pad = self.padded_sizes(num_tokens, max(num_seqs, num_sampled))
        decode_only = (
            self.backend.decode_specialized
            and num_tokens == num_seqs
            and bool(np.all(np.diff(plan.cu_q_lens[: num_seqs + 1]) == 1))
        )
        fuse_copies = len(plan.copy_src) <= self.max_fused_copies
        if not fuse_copies:
            self.run_block_copies(plan.copy_src, plan.copy_dst)
        layout, template = self._layout((t_pad, s_pad))
        want_top = self.max_logprobs > 0 and bool(
            num_sampled and self._slot_logprobs[plan.sample_rows].max() > 0
        )
        packed = layout.pack(
            plan, template, self.block_size, self._step_counter, want_top, fuse_copies
        )
        key = (t_pad, s_pad, decode_only)
        executable = self._step_executables.get(key) or self._compile_step(key)
        out, self.kv_pools, self.sampling_table = executable(
            self.params, self.kv_pools, self.sampling_table, packed
        )
        self._step_counter += 1
        return PendingStep(out, num_sampled, want_top)


class PendingStep:
    """A dispatched step whose sampled tokens are still on the device."""

    __slots__ = ("_out", "_num_sampled", "_want_top")

    def __init__(self, out: Any, num_sampled: int, want_top: bool) -> None:
        self._out = out
        self._num_sampled = num_sampled
        self._want_top = want_top

    def result(self) -> StepOutput:
        """Wait for the step and copy its sampled rows to the host."""
        out, n = self._out, self._num_sampled
        if self._want_top:
            tokens, logprobs, ranks, top_ids, top_lps = jax.device_get(
                (out.token_ids, out.logprobs, out.ranks, out.top_token_ids, out.top_logprobs)
            )
            return StepOutput(tokens[:n], logprobs[:n], ranks[:n], top_ids[:n], top_lps[:n])
        tokens, logprobs, ranks = jax.device_get((out.token_ids, out.logprobs, out.ranks))
        return StepOutput(tokens[:n], logprobs[:n], ranks[:n])
