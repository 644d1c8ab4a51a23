"""The model runner: executes one scheduler step plan on the device per call.

This file owns :class:`ModelRunner`. Per step it pads the plan into one int32 buffer
(:mod:`kvpage.runner.step_inputs`), runs ONE ahead-of-time compiled function per bucket --
copy-on-write block copies, the forward pass over all tokens of the step (prefill chunks
and decodes together; K/V written at the slot mapping, paged attention, logits only at
sampled positions), sampling and the sampling-state update -- and returns the sampled
tokens with their log-probabilities. The KV pools and the sampling table are donated to
that function, so they are updated in place. A step with structured-output rows whose
grammar masks are computed during the step runs as two executables instead (forward,
then sampling with the masks; see :meth:`ModelRunner.dispatch`), compiled on first use.

Every executable is compiled explicitly and counted in :attr:`ModelRunner.num_compilations`;
after :meth:`ModelRunner.warmup` that number stays fixed for any plan within the
configured limits.

With ``tensor_parallel_size=N`` (or an explicit ``mesh``) the same step runs over N devices
(:mod:`kvpage.runner.tensor_parallel`): params split Megatron-style, KV pools split by KV head, the
attention kernel per shard under ``shard_map``; the packed step inputs, the sampling table
and the sampled outputs are replicated, so every device (and host) sees the same tokens.

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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from kvpage.model.attention import get_attention_backend
from kvpage.model.config import ModelConfig
from kvpage.model.linear_kernels import host_matmuls
from kvpage.model.llama import compute_logits
from kvpage.model.params import Params, validate_params
from kvpage.runner.background_compiler import BackgroundCompiler
from kvpage.runner.buckets import (
    background_order,
    default_buckets,
    normalize_buckets,
    pick_bucket,
    pick_fallback,
)
from kvpage.runner.executable_cache import ExecutableCache
from kvpage.runner.executable_store import ExecutableStore
from kvpage.runner.executable_store import signature as store_signature
from kvpage.runner.kv_cache import (
    KVCacheSpec,
    KVPools,
    allocate_kv_cache,
    copy_blocks,
    resolve_kv_cache_dtype,
)
from kvpage.runner.kv_cache_sizing import KVCacheDecision, decide_num_blocks
from kvpage.runner.layered_step import (
    StepBucket,
    embed_weight,
    head_params,
    is_stacked,
    layer_plan,
    layer_signature,
    make_embed,
    make_head,
    make_layers,
    make_select,
)
from kvpage.runner.multi_step import (
    MULTI_STEP_MAX_ROWS,
    default_scheduler_steps,
    make_multi_step,
)
from kvpage.runner.prompt_logprobs import PromptScores
from kvpage.runner.step_inputs import PackedLayout, PaddingValues
from kvpage.runner.step_output import StepOutput
from kvpage.runner.step_plan import StepPlanLike
from kvpage.runner.tensor_parallel import (
    TP_AXIS,
    check_tensor_parallel,
    make_mesh,
    mesh_size,
    param_shardings,
    place,
    shard_attention_backend,
)
from kvpage.sampling.device_params import DeviceSamplingParams
from kvpage.sampling.table import (
    SamplingTable,
    init_sampling_table,
    params_to_rows,
    stop_mask_row,
    write_slot,
)
from kvpage.sampling.token_bitmask import ALLOW_ALL, bitmask_words, pad_bitmask

_COPY_CHUNK = 64  # block copies per call of the stand-alone copy executable

StepKey = tuple[int, int, bool]
"""(padded tokens, padded sequences, pure-decode variant)"""


class ModelRunner:
    """Owns the params, the paged KV pools and the per-slot sampling state on the device(s).

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
        max_num_seqs: request slots of the sampling table; ``sample_rows`` index them.
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
        enable_penalties: keep per-slot token histories ([slots, vocab] on device) so
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
            self._replicated: jax.sharding.Sharding = NamedSharding(mesh, PartitionSpec())
            self._pool_sharding: jax.sharding.Sharding = NamedSharding(mesh, PartitionSpec(TP_AXIS))
            self._param_shardings: Any = param_shardings(config, params, mesh)
        else:
            self._replicated = self._pool_sharding = SingleDeviceSharding(self.device)
            self._param_shardings = jax.tree_util.tree_map(lambda _: self._replicated, params)
        self._multiprocess = mesh is not None and not all(
            d.process_index == jax.process_index() for d in mesh.devices.flat
        )
        self.params: Params
        self.params, self.last_update_copies = place(params, self._param_shardings)
        param_dtype = str(jnp.dtype(self.params["embed_tokens"]["weight"].dtype))
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.params, self.device.platform)
        unit = KVCacheSpec.for_model(config, block_size, 1, kv_dtype, tp)
        self.kv_cache_decision: KVCacheDecision = decide_num_blocks(
            config,
            bytes_per_block=unit.bytes_per_block // tp,  # this device's share of the heads
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            itemsize=jnp.dtype(param_dtype).itemsize,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            memory_utilization=kv_memory_fraction,
            device=self.device,
        )
        num_blocks = self.kv_cache_decision.num_blocks
        self.kv_spec = KVCacheSpec.for_model(config, block_size, num_blocks, kv_dtype, tp)
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
        self._multi_step_compilers: dict[int, BackgroundCompiler] = {}

        platform = self.device.platform
        self.token_buckets = normalize_buckets(
            token_buckets or default_buckets(platform, max_num_batched_tokens, "tokens"),
            "token_buckets",
        )
        self.seq_buckets = normalize_buckets(
            seq_buckets or default_buckets(platform, max_num_seqs, "seqs"), "seq_buckets"
        )
        self._padding = PaddingValues(
            scratch_slot=self.kv_spec.scratch_slot,
            scratch_block=self.kv_spec.scratch_block,
            dummy_sample_row=max_num_seqs,
            dropped_block=num_blocks + 1,
        )

        self.kv_pools: KVPools = allocate_kv_cache(self.kv_spec, self._pool_sharding)
        self.sampling_table: SamplingTable = init_sampling_table(
            max_num_seqs, config.vocab_size, enable_penalties, self._replicated
        )
        self._slot_logprobs = np.zeros(max_num_seqs + 1, np.int32)
        self._base_key_seed = seed
        self._step_counter = 0

        self._allow_all_masks: dict[int, jax.Array] = {}
        self.last_enqueue_time = 0.0
        """``time.perf_counter()`` when the last step's device work was enqueued (with
        overlapped masks: the forward pass, before the masks are computed)."""
        self.last_bitmask_overlapped = False
        """Whether the forward pass was still running when the last step's
        ``token_bitmask_fn`` returned (its host work hidden behind the device)."""
        self._executables = ExecutableCache()
        """Step buckets, samplers and helpers (:mod:`kvpage.runner.layered_step`)."""
        self._background: BackgroundCompiler | None = None
        self.fallback_steps = 0
        """Steps that ran in a larger compiled bucket while theirs was being compiled."""
        self._layouts: dict[tuple[int, int], tuple[PackedLayout, np.ndarray]] = {}
        self._count_lock = threading.Lock()
        self._num_compilations = 0
        self._stacked = is_stacked(self.params)
        self._layer_plan = layer_plan(
            [None] * config.num_layers if self._stacked
            else [layer_signature(layer) for layer in self.params["layers"]]
        )
        self._layer_indices = [
            jax.device_put(np.int32(i), self._replicated) for i in range(config.num_layers)
        ] if self._stacked else []
        self._store = (
            ExecutableStore.for_compilation_cache(self.trace_inputs(), self.device)
            if mesh is None else None
        )
        """Executables of earlier starts (:mod:`kvpage.runner.executable_store`); not
        used with a mesh, whose executables are placed on several devices."""

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
    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of KV pools (all layers, K and V) held on the first device of the mesh."""
        first = self.device
        return sum(
            shard.data.nbytes
            for pool in self.kv_pools
            for pages in pool
            for shard in pages.addressable_shards
            if shard.device == first
        )

    @property
    def max_step_executables(self) -> int:
        """The most step executables this configuration can compile (every bucket pair
        a step can land in; see :mod:`kvpage.runner.buckets`)."""
        return len(self.warmup_buckets())

    @property
    def compiled_buckets(self) -> list[StepKey]:
        """``(padded tokens, padded seqs, decode_only)`` of every compiled step."""
        return sorted(k[1:] for k in self._executables.ready_keys() if k[0] == "bucket")

    @property
    def compiled_scoring_buckets(self) -> list[tuple[int, int]]:
        """``(padded tokens, padded seqs)`` of every compiled prompt-logprobs variant."""
        return sorted(k[1:] for k in self._executables.ready_keys() if k[0] == "scored")

    @property
    def background_compiler(self) -> BackgroundCompiler | None:
        return self._background

    def warmup_buckets(self) -> list[StepKey]:
        """The step variants :meth:`warmup` compiles.

        Each (token bucket t, seq bucket) pair a step can land in (a step has at most as
        many sequences as tokens, so only seq buckets reachable with S <= t) and, when
        the attention backend has a decode kernel or the layers run as one host call
        (:meth:`_has_decode_variant`), the pure-decode variant of each pair a decode-only
        step (T == S) can land in.
        """
        max_seqs = self.seq_buckets[-1]
        mixed = {
            (*self.padded_sizes(t, s), False)
            for t in self.token_buckets
            for s in range(1, min(t, max_seqs) + 1)
        }
        keys = sorted(mixed)
        limit = min(self.token_buckets[-1], max_seqs)
        decode = {(*self.padded_sizes(n, n), True) for n in range(1, limit + 1)}
        return keys + sorted(k for k in decode if self._has_decode_variant(k[1]))

    def _has_decode_variant(self, padded_seqs: int) -> bool:
        """Whether pure-decode steps of this sequence bucket get executables of their own
        (the attention backend has a decode kernel)."""
        return self.backend.decode_specialized

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
            entry = self._layouts.setdefault(key, (layout, layout.template(self._padding)))
        return entry

    def _copy_blocks(self, pools: KVPools, src: jax.Array, dst: jax.Array) -> KVPools:
        """:func:`copy_blocks`, per KV-head shard when the pools are sharded."""
        if self.mesh is None:
            return copy_blocks(pools, src, dst)
        pages = jax.tree_util.tree_map(lambda _: PartitionSpec(TP_AXIS), pools)
        mapped = jax.shard_map(
            copy_blocks,
            mesh=self.mesh,
            in_specs=(pages, PartitionSpec(), PartitionSpec()),
            out_specs=pages,
            check_vma=False,
        )
        return mapped(pools, src, dst)

    def _shardings(self, tree: Any, sharding: jax.sharding.Sharding | None = None) -> Any:
        """``sharding`` (default: replicated) for every leaf of ``tree``."""
        target = sharding or self._replicated
        return jax.tree_util.tree_map(lambda _: target, tree)

    def _jit(
        self,
        fn: Callable[..., Any],
        donate: tuple[int, ...],
        args: tuple[Any, ...],
        in_shardings: tuple[Any, ...],
        out_shardings: Any,
    ) -> jax.stages.Lowered:
        """Lower ``fn`` with explicit shardings on a mesh; plain ``jax.jit`` without one
        (and then small linear layers may run on the host kernel: ``linear_kernels``)."""
        if self.mesh is None:
            with host_matmuls():
                return jax.jit(fn, donate_argnums=donate).lower(*args)
        jitted = jax.jit(
            fn, donate_argnums=donate, in_shardings=in_shardings, out_shardings=out_shardings
        )
        return jitted.lower(*args)

    def _compile(
        self,
        piece: tuple[Any, ...],
        fn: Callable[..., Any],
        donate: tuple[int, ...],
        args: tuple[Any, ...],
        in_shardings: tuple[Any, ...],
        out_shardings: Any,
    ) -> jax.stages.Compiled:
        """:meth:`_jit` then compile, or the executable of ``piece`` kept by an earlier
        start (:mod:`kvpage.runner.executable_store`: no trace, no lowering)."""
        store = self._store
        if store is not None and (found := store.load(piece, args)) is not None:
            return found
        compiled = self._jit(fn, donate, args, in_shardings, out_shardings).compile()
        if store is not None:
            store.save(piece, compiled)
        return compiled

    def trace_inputs(self) -> dict[str, Any]:
        """Everything of this runner that its traces depend on (the executable store's
        key, with :func:`~kvpage.runner.executable_store.code_fingerprint`)."""
        return {
            "config": self.config,
            "params": store_signature(self._abstract(self.params)),
            "kv_spec": self.kv_spec,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_logprobs": self.max_logprobs,
            "max_fused_copies": self.max_fused_copies,
            "enable_penalties": self.enable_penalties,
            "seed": self._base_key_seed,
            "backend": (self.backend.name, self.backend.decode_specialized),
            "layer_plan": self._layer_plan,
            "sampling_table": store_signature(self.sampling_table),
            "padding": self._padding,
            "device": (self.device.platform, self.device.id),
        }

    def _abstract(self, tree: Any, sharding: Any = None) -> Any:
        """``tree``'s leaves as ShapeDtypeStructs (lowering never touches live buffers,
        which the engine thread may be donating meanwhile). ``sharding``: one sharding
        for every leaf, or None to keep each leaf's own."""
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=sharding if sharding is not None else x.sharding
            ),
            tree,
        )

    def _logits_of(self) -> Callable[[Params, jax.Array], jax.Array]:
        """Final norm + lm_head; with a mesh, each device projects its vocab rows and the
        logits are then replicated (every device samples the same full rows)."""
        config = self.config
        if self.mesh is None:
            return lambda head, rows: compute_logits(head, config, rows)
        replicated = self._replicated
        vocab_split = None
        if config.vocab_size % self.tensor_parallel_size == 0:
            vocab_split = NamedSharding(self.mesh, PartitionSpec(None, TP_AXIS))

        def logits_of(head: Params, rows: jax.Array) -> jax.Array:
            logits = compute_logits(head, config, rows)
            if vocab_split is not None:
                logits = jax.lax.with_sharding_constraint(logits, vocab_split)
            return jax.lax.with_sharding_constraint(logits, replicated)

        return logits_of

    def _build_bucket(self, key: StepKey) -> StepBucket:
        """Compile bucket ``key``'s embed, layer-group and select pieces (and its head, keyed
        by the sequence bucket, if new): :mod:`kvpage.runner.layered_step`."""
        t, s, decode_only = key
        layout, _ = self._layout((t, s))
        rep = self._replicated
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep)
        params = self._abstract(self.params)
        shardings = self._param_shardings
        hidden = jax.ShapeDtypeStruct(
            (t, self.config.hidden_size), embed_weight(params).dtype, sharding=rep
        )
        pool = self._abstract(self.kv_pools[0], self._pool_sharding)
        pool_sh = (self._pool_sharding, self._pool_sharding)
        embed = self._compile(
            ("embed", t, s), make_embed(layout), (), (embed_weight(params), packed),
            (embed_weight(shardings), rep), rep,
        )
        layers = {}
        for kind, (start, count, _) in enumerate(self._layer_plan.kinds):
            fn = make_layers(
                self.config, layout, self.backend, decode_only, self._copy_blocks, count,
                self._stacked,
            )
            pools = [pool] * count
            pools_sh = [pool_sh] * count
            if self._stacked:
                index = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
                layers[kind] = self._compile(
                    ("layers", *key, kind), fn, (2,),
                    (params["layers"], index, pools, hidden, packed),
                    (shardings["layers"], rep, pools_sh, rep, rep), (rep, pools_sh),
                )
            else:
                end = start + count
                layers[kind] = self._compile(
                    ("layers", *key, kind), fn, (1,),
                    (params["layers"][start:end], pools, hidden, packed),
                    (shardings["layers"][start:end], pools_sh, rep, rep), (rep, pools_sh),
                )
        select = self._compile_select(layout, score_prompts=False)
        self._count_compiles(2 + len(layers))
        self._head_fn(s)
        return StepBucket(embed, layers, select)

    def _compile_select(self, layout: PackedLayout, score_prompts: bool) -> jax.stages.Compiled:
        rep = self._replicated
        hidden = jax.ShapeDtypeStruct(
            (layout.num_tokens, self.config.hidden_size),
            embed_weight(self._abstract(self.params)).dtype, sharding=rep,
        )
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep)
        args: tuple[Any, ...] = (hidden, packed)
        shardings: tuple[Any, ...] = (rep, rep)
        if score_prompts:
            head = head_params(self.config, self._abstract(self.params))
            targets = jax.ShapeDtypeStruct((layout.num_tokens,), jnp.int32, sharding=rep)
            args = (head, *args, targets)
            shardings = (head_params(self.config, self._param_shardings), *shardings, rep)
        fn = make_select(layout, self._logits_of(), self.max_logprobs, score_prompts)
        piece = ("select", layout.num_tokens, layout.num_seqs, score_prompts)
        return self._compile(piece, fn, (), args, shardings, rep)

    def _head_fn(self, num_seqs: int) -> jax.stages.Compiled:
        """lm_head and sampler of sequence bucket ``num_seqs`` (shared by every token
        bucket)."""

        def build() -> jax.stages.Compiled:
            rep = self._replicated
            vocab = self.config.vocab_size
            params = self._abstract(self.params)
            args = (
                head_params(self.config, params),
                jax.ShapeDtypeStruct(
                    (num_seqs, self.config.hidden_size), embed_weight(params).dtype,
                    sharding=rep,
                ),
                jax.ShapeDtypeStruct((num_seqs + 3,), jnp.int32, sharding=rep),
                self._abstract(self.sampling_table),
                jax.ShapeDtypeStruct((num_seqs, bitmask_words(vocab)), jnp.int32, sharding=rep),
            )
            table = self._shardings(self.sampling_table)
            head_sh = head_params(self.config, self._param_shardings)
            fn = make_head(num_seqs, self._logits_of(), self.max_logprobs, self._base_key_seed)
            compiled = self._compile(
                ("head", num_seqs), fn, (3,), args, (head_sh, rep, rep, table, rep),
                (rep, table),
            )
            self._count_compiles(1)
            return compiled

        return self._executables.get_or_build(("head", num_seqs), build)

    def _scored_select_fn(self, key: tuple[int, int]) -> jax.stages.Compiled:
        """The prompt-logprobs variant of bucket ``key``'s select piece (compiled on first
        use; never by :meth:`warmup`, so servers whose clients never ask for prompt
        logprobs never pay)."""

        def build() -> jax.stages.Compiled:
            compiled = self._compile_select(self._layout(key)[0], score_prompts=True)
            self._count_compiles(1)
            return compiled

        return self._executables.get_or_build(("scored", *key), build)

    def _count_compiles(self, n: int) -> None:
        with self._count_lock:
            self._num_compilations += n

    def bucket(self, key: StepKey) -> StepBucket:
        """Bucket ``key``'s executables, compiled now if needed (or awaited from the
        background compiler when it is building them)."""
        return self._executables.get_or_build(("bucket", *key), lambda: self._build_bucket(key))

    def _bucket_for(self, key: StepKey) -> tuple[StepKey, StepBucket]:
        """The bucket a step of bucket ``key`` runs in: its own once compiled; while the
        background compiler has not reached it, a compiled one at most
        ``FALLBACK_MAX_RATIO`` times larger (and ``key`` is compiled next); else its own,
        compiled now."""
        ready = self._executables.get(("bucket", *key))
        if ready is not None:
            return key, ready
        background = self._background
        if background is not None and not self._executables.is_pending(("bucket", *key)):
            fallback = pick_fallback(
                key, [k[1:] for k in self._executables.ready_keys() if k[0] == "bucket"]
            )
            if fallback is not None:
                background.promote(key)
                self.fallback_steps += 1
                return fallback, self._executables.get(("bucket", *fallback))
        return key, self.bucket(key)

    def _write_slot_fn(self) -> jax.stages.Compiled:
        def build() -> jax.stages.Compiled:
            ids_len = self.max_model_len if self.enable_penalties else 1
            rep = self._replicated
            ids = jax.ShapeDtypeStruct((ids_len,), jnp.int32, sharding=rep)
            table = self._shardings(self.sampling_table)
            args = (
                self._abstract(self.sampling_table),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct(
                    (self.sampling_table.floats.shape[1],), jnp.float32, sharding=rep
                ),
                jax.ShapeDtypeStruct((self.sampling_table.ints.shape[1],), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
                ids,
                ids,
                jax.ShapeDtypeStruct((self.config.vocab_size,), jnp.bool_, sharding=rep),
            )
            compiled = self._compile(
                ("write_slot",), write_slot, (0,), args, (table,) + (rep,) * 7, table
            )
            self._count_compiles(1)
            return compiled

        return self._executables.get_or_build("write_slot", build)

    def _copy_fn(self) -> jax.stages.Compiled:
        """Whole-block copies in one layer's pool (called per layer)."""

        def build() -> jax.stages.Compiled:
            index = jax.ShapeDtypeStruct((_COPY_CHUNK,), jnp.int32, sharding=self._replicated)
            pool = self._abstract(self.kv_pools[0], self._pool_sharding)
            pool_sh = (self._pool_sharding, self._pool_sharding)
            compiled = self._compile(
                ("copy",),
                lambda pool, src, dst: self._copy_blocks([pool], src, dst)[0],
                (0,),
                (pool, index, index),
                (pool_sh, self._replicated, self._replicated),
                pool_sh,
            )
            self._count_compiles(1)
            return compiled

        return self._executables.get_or_build("copy", build)

    def warmup(self, progress: bool = True, max_workers: int = 1) -> None:
        """Compile every bucket of :meth:`warmup_buckets` plus the helper executables
        (``warmup="full"``). ``max_workers > 1`` compiles several buckets concurrently
        (XLA compiles outside the GIL)."""
        from tqdm.auto import tqdm

        self._write_slot_fn()
        self._copy_fn()
        pending = [k for k in self.warmup_buckets() if k not in self.compiled_buckets]
        bar = tqdm(total=len(pending), desc="compiling step buckets", disable=not progress)
        try:
            if max_workers <= 1:
                for key in pending:
                    bar.set_postfix(tokens=key[0], seqs=key[1])
                    self.bucket(key)
                    bar.update(1)
                for num_seqs in self.multi_step_buckets():
                    self._multi_step_fn(num_seqs)
                return
            with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
                for _ in pool.map(self.bucket, pending):
                    bar.update(1)
                list(pool.map(self._multi_step_fn, self.multi_step_buckets()))
        finally:
            bar.close()

    def start_background_compile(self) -> BackgroundCompiler:
        """Compile the helpers now and every bucket of :meth:`warmup_buckets` on a
        background thread, most useful first (``warmup="background"``); steps meanwhile
        run as :meth:`_bucket_for` says."""
        self._write_slot_fn()
        self._copy_fn()
        if self._background is None:
            self._background = BackgroundCompiler(
                self, "bucket", background_order(self.warmup_buckets())
            )
        return self._background

    def stop_background_compile(self) -> None:
        if self._background is not None:
            self._background.stop()

    # ------------------------------------------------------------------ requests
    def set_request(
        self,
        slot: int,
        params: DeviceSamplingParams,
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
        host = self._host_input
        self.sampling_table = self._write_slot_fn()(
            self.sampling_table,
            host(np.asarray(slot, np.int32)),
            host(floats),
            host(ints),
            host(seed),
            host(prompt_buf),
            host(output_buf),
            host(stop_mask_row(params, self.config.vocab_size)),
        )
        self._slot_logprobs[slot] = params.logprobs or 0

    def free_request(self, slot: int) -> None:
        """Forget a finished request's host-side flags (its device row is simply reused)."""
        self._slot_logprobs[slot] = 0

    # ------------------------------------------------------------------ params
    def update_params(self, params: Params) -> int:
        """Swap in new weights of identical tree structure, shapes and dtypes.

        Nothing recompiles and the KV pools stay as they are (their contents now
        describe the old weights: the caller decides what to drop). Leaves that already
        are jax arrays with this runner's sharding (one device, or the tensor-parallel
        layout of :func:`~kvpage.runner.tensor_parallel.shard_params`) are adopted as they are;
        others
        are transferred (device to device where possible). Raises ValueError naming the
        first mismatch, before anything changes: the old params stay live. Returns the
        number of leaves that had to be transferred (0: nothing was copied).
        """
        validate_params(self.config, params)
        old_def = jax.tree_util.tree_structure(self.params)
        new_def = jax.tree_util.tree_structure(params)
        if old_def != new_def:
            raise ValueError(
                f"new params have a different tree structure: expected {old_def}, got {new_def}"
            )
        old_leaves = jax.tree_util.tree_leaves_with_path(self.params)
        for (path, old_leaf), new_leaf in zip(
            old_leaves, jax.tree_util.tree_leaves(params), strict=True
        ):
            shape, dtype = tuple(np.shape(new_leaf)), jnp.dtype(new_leaf.dtype)
            if old_leaf.shape != shape or old_leaf.dtype != dtype:
                raise ValueError(
                    f"new params change {jax.tree_util.keystr(path)} from "
                    f"{old_leaf.shape} {old_leaf.dtype} to {shape} {dtype}"
                )
        self.params, self.last_update_copies = place(params, self._param_shardings)
        return self.last_update_copies

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
        if plan.decode_only and not (t == s and np.all(np.diff(plan.cu_q_lens[: s + 1]) == 1)):
            raise ValueError("decode_only plan has a row with other than one query token")
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
            chunk_src, chunk_dst = self._host_input(chunk_src), self._host_input(chunk_dst)
            for i, pool in enumerate(self.kv_pools):
                self.kv_pools[i] = copy(pool, chunk_src, chunk_dst)

    def recover_device_state(self) -> bool:
        """After a failed step: if the donated KV pools or sampling table were
        consumed, allocate fresh ones and return True (every sequence's KV is
        then lost); otherwise return False."""
        leaves = jax.tree_util.tree_leaves((self.kv_pools, self.sampling_table))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        self.kv_pools = allocate_kv_cache(self.kv_spec, self._pool_sharding)
        self.sampling_table = init_sampling_table(
            self.max_num_seqs, self.config.vocab_size, self.enable_penalties, self._replicated
        )
        self._slot_logprobs[:] = 0
        return True

    def execute(
        self, plan: StepPlanLike, prompt_targets: np.ndarray | None = None
    ) -> StepOutput:
        """Run one step plan; returns the tokens sampled at ``plan.logits_indices``.

        ``plan.sample_rows`` name request slots bound with :meth:`set_request`.
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
        if self.validate_plans:
            self._check_plan(plan, num_sampled)
        num_tokens, num_seqs = int(plan.num_tokens), int(plan.num_seqs)
        # Sampled rows share the sequence bucket; with n > 1 there are more
        # sampled rows (one per forked sample) than sequence rows.
        t_pad, s_pad = self.padded_sizes(num_tokens, max(num_seqs, num_sampled))
        decode_only = bool(plan.decode_only) and self._has_decode_variant(s_pad)
        (t_pad, s_pad, _), bucket = self._bucket_for((t_pad, s_pad, decode_only))
        fuse_copies = len(plan.copy_src) <= self.max_fused_copies
        if not fuse_copies:
            self.run_block_copies(plan.copy_src, plan.copy_dst)
        layout, template = self._layout((t_pad, s_pad))
        want_top = self.max_logprobs > 0 and bool(
            num_sampled and self._slot_logprobs[plan.sample_rows].max() > 0
        )
        packed_host = layout.pack(
            plan, template, self.block_size, self._step_counter, want_top, fuse_copies
        )
        targets = None
        if prompt_targets is not None:
            targets = np.full(t_pad, -1, np.int32)
            targets[:num_tokens] = np.asarray(prompt_targets, np.int32)[:num_tokens]
            if targets.max() >= self.config.vocab_size:
                raise ValueError("prompt_targets hold a token id outside the vocabulary")
        try:
            # One transfer; every piece of the step reads the same device buffer.
            packed = jax.device_put(self._host_input(packed_host), self._replicated)
            params = self.params
            hidden = bucket.embed(embed_weight(params), packed)
            pools = self.kv_pools
            for start, count, kind in self._layer_plan.groups:
                end = start + count
                if self._stacked:
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
                scored = self._scored_select_fn((t_pad, s_pad))
                rows, info, scores = scored(head, hidden, packed, self._host_input(targets))
            else:
                rows, info = bucket.select(hidden, packed)
            self.last_enqueue_time = time.perf_counter()
            if token_bitmask_fn is not None:
                masks = token_bitmask_fn()  # host work while the layers run
                self.last_bitmask_overlapped = not rows.is_ready()
            else:
                masks = getattr(plan, "token_bitmask", None)
            out, self.sampling_table = self._head_fn(s_pad)(
                head, rows, info, self.sampling_table, self._token_bitmask_input(masks, s_pad)
            )
        except Exception as exc:
            self._raise_if_params_deleted(exc)
            raise
        self._step_counter += 1
        return PendingStep(out, num_sampled, want_top, scores, num_tokens)

    def _multi_step_fn(self, num_seqs: int) -> jax.stages.Compiled:
        """The multi-step decode executable of sequence bucket ``num_seqs`` for up to
        ``num_scheduler_steps`` steps (:mod:`kvpage.runner.multi_step`), compiled on
        first use."""

        max_steps = self.num_scheduler_steps

        def build() -> jax.stages.Compiled:
            layout, _ = self._layout((num_seqs, num_seqs))
            rep = self._replicated
            pool = self._abstract(self.kv_pools[0], self._pool_sharding)
            pool_sh = (self._pool_sharding, self._pool_sharding)
            pools = [pool] * self.config.num_layers
            vocab = self.config.vocab_size
            args = (
                self._abstract(self.params),
                pools,
                self._abstract(self.sampling_table),
                jax.ShapeDtypeStruct((num_seqs, bitmask_words(vocab)), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
            )
            table = self._shardings(self.sampling_table)
            fn = make_multi_step(
                self.config, layout, self.backend, self._logits_of(), self.max_logprobs,
                self._base_key_seed, self.block_size, max_steps,
            )
            compiled = self._compile(
                ("multi", num_seqs, max_steps), fn, (1, 2), args,
                (self._param_shardings, [pool_sh] * len(pools), table, rep, rep, rep),
                (rep, [pool_sh] * len(pools), table),
            )
            self._count_compiles(1)
            return compiled

        return self._executables.get_or_build(("multi", num_seqs, max_steps), build)

    def multi_step_buckets(self) -> list[int]:
        """The sequence buckets that get a multi-step executable."""
        if self.num_scheduler_steps <= 1 or self.mesh is not None or self._stacked:
            return []
        rows = min(self.multi_step_max_rows, self.seq_buckets[-1])
        limit = self.padded_sizes(rows, rows)[1]
        return [s for s in self.seq_buckets if s <= limit]

    def prepare_multi_step(self, num_rows: int) -> None:
        """Under ``warmup="background"``, compile the multi-step executable for
        ``num_rows`` rows on a background thread once the step buckets are built (a
        step asks again later while they are not). Without warmup nothing compiles
        ahead of use, so steps run one per call; ``warmup="full"`` built it already."""
        _, s_pad = self.padded_sizes(num_rows, num_rows)
        if s_pad not in self.multi_step_buckets() or s_pad in self._multi_step_compilers:
            return
        background = self._background
        if background is None or not background.wait(0):
            return
        self._multi_step_compilers[s_pad] = BackgroundCompiler(
            self, "_multi_step_fn", [s_pad]
        )

    def compile_multi_step(self, num_rows: int) -> bool:
        """Compile the multi-step executable for ``num_rows`` rows now; False when that
        row count runs one step per call."""
        _, s_pad = self.padded_sizes(num_rows, num_rows)
        if s_pad not in self.multi_step_buckets():
            return False
        self._multi_step_fn(s_pad)
        return True

    def multi_step_ready(self, num_rows: int) -> bool:
        """Whether a pure-decode step of ``num_rows`` rows can run several steps in one
        call now (the executable is compiled; never compiles)."""
        _, s_pad = self.padded_sizes(num_rows, num_rows)
        if s_pad not in self.multi_step_buckets():
            return False
        return self._executables.get(("multi", s_pad, self.num_scheduler_steps)) is not None

    def dispatch_multi_step(self, plan: StepPlanLike, num_steps: int) -> PendingMultiStep:
        """Enqueue ``num_steps`` (``2 <= num_steps <= num_scheduler_steps``) decode steps
        of ``plan`` in one device call (:mod:`kvpage.runner.multi_step`; the caller
        checked its promises). ``result()`` returns each step's sampled rows, in
        ``plan``'s row order."""
        num_sampled = len(plan.logits_indices)
        if self.validate_plans:
            self._check_plan(plan, num_sampled)
        if not 1 <= num_steps <= self.num_scheduler_steps:
            raise ValueError(
                f"num_steps must be in 1..{self.num_scheduler_steps}; got {num_steps}"
            )
        rows = int(plan.num_seqs)
        if not (int(plan.num_tokens) == rows == num_sampled and len(plan.copy_src) == 0):
            raise ValueError("a multi-step plan must be pure decode with no block copies")
        _, s_pad = self.padded_sizes(rows, rows)
        layout, template = self._layout((s_pad, s_pad))
        want_top = self.max_logprobs > 0 and bool(self._slot_logprobs[plan.sample_rows].max() > 0)
        packed_host = layout.pack(
            plan, template, self.block_size, self._step_counter, want_top, True
        )
        try:
            outs, self.kv_pools, self.sampling_table = self._multi_step_fn(s_pad)(
                self.params, self.kv_pools, self.sampling_table,
                self._token_bitmask_input(None, s_pad), packed_host, np.int32(num_steps),
            )
        except Exception as exc:
            self._raise_if_params_deleted(exc)
            raise
        self.last_enqueue_time = time.perf_counter()
        self._step_counter += num_steps
        return PendingMultiStep(outs, num_sampled, num_steps, want_top)

    def _raise_if_params_deleted(self, exc: Exception) -> None:
        """A step failed: say so plainly when it was because the params were donated."""
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.params)):
            raise RuntimeError(
                "the runner's params were deleted (donated to a training step?): pass "
                "the new params to update_params before generating again"
            ) from exc

    def _token_bitmask_input(self, bitmask: np.ndarray | None, rows: int) -> Any:
        """The step's grammar bitmask: the plan's rows padded to ``rows``, or (no
        constrained row) an allow-all mask kept on the device, so unconstrained steps
        transfer nothing extra."""
        if bitmask is not None:
            return self._host_input(pad_bitmask(bitmask, rows, self.config.vocab_size))
        cached = self._allow_all_masks.get(rows)
        if cached is None:
            words = bitmask_words(self.config.vocab_size)
            cached = jax.device_put(
                self._host_input(np.full((rows, words), ALLOW_ALL, np.int32)), self._replicated
            )
            self._allow_all_masks[rows] = cached
        return cached

    def _host_input(self, value: np.ndarray) -> Any:
        """A host array as a step input: as is on one process; with a mesh spanning
        several processes, a replicated global array (every process passes the same)."""
        if not self._multiprocess:
            return value
        return jax.make_array_from_process_local_data(self._replicated, value, value.shape)


class PendingStep:
    """A dispatched step whose sampled tokens are still on the device."""

    __slots__ = ("_out", "_num_sampled", "_want_top", "_scores", "_num_tokens")

    def __init__(
        self,
        out: Any,
        num_sampled: int,
        want_top: bool,
        scores: PromptScores | None = None,
        num_tokens: int = 0,
    ) -> None:
        self._out = out
        self._num_sampled = num_sampled
        self._want_top = want_top
        self._scores = scores
        self._num_tokens = num_tokens

    def result(self) -> StepOutput:
        """Wait for the step and copy its sampled rows to the host."""
        out, n = self._out, self._num_sampled
        if self._want_top:
            tokens, logprobs, ranks, top_ids, top_lps = jax.device_get(
                _local(
                    (out.token_ids, out.logprobs, out.ranks, out.top_token_ids, out.top_logprobs)
                )
            )
            result = StepOutput(tokens[:n], logprobs[:n], ranks[:n], top_ids[:n], top_lps[:n])
        else:
            tokens, logprobs, ranks = jax.device_get(
                _local((out.token_ids, out.logprobs, out.ranks))
            )
            result = StepOutput(tokens[:n], logprobs[:n], ranks[:n])
        if self._scores is not None:
            t = self._num_tokens
            lps, rks, top_ids, top_lps = jax.device_get(_local(tuple(self._scores)))
            result.prompt_logprobs = lps[:t]
            result.prompt_ranks = rks[:t]
            result.prompt_top_token_ids = top_ids[:t]
            result.prompt_top_logprobs = top_lps[:t]
        return result


class PendingMultiStep:
    """Dispatched multi-step decode: each step's sampled tokens, still on the device."""

    __slots__ = ("_outs", "_num_sampled", "_num_steps", "_want_top")

    def __init__(self, outs: Any, num_sampled: int, num_steps: int, want_top: bool) -> None:
        self._outs = outs
        self._num_sampled = num_sampled
        self._num_steps = num_steps
        self._want_top = want_top

    def result(self) -> list[StepOutput]:
        """Wait for the call and copy each step's sampled rows to the host."""
        out, n, k = self._outs, self._num_sampled, self._num_steps
        names = ["token_ids", "logprobs", "ranks"]
        if self._want_top:
            names += ["top_token_ids", "top_logprobs"]
        arrays = jax.device_get(_local(tuple(getattr(out, name) for name in names)))
        return [StepOutput(*(a[step, :n] for a in arrays)) for step in range(k)]


def _local(arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Replicated outputs as arrays this process can read (its first local copy)."""
    return tuple(a if a.is_fully_addressable else a.addressable_data(0) for a in arrays)
