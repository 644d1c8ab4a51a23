"""Building a runner's executables: the step buckets, their pieces, and the helpers.

This file owns :class:`StepExecutables`: the bucket policy a step lands in
(:meth:`~StepExecutables.padded_sizes`, :mod:`kvpage.runner.buckets`), the builders of
every executable a step runs (embed, layer groups, select, head + sampler, the
prompt-scoring select, the seat writer, the block copier, multi-step decode:
:mod:`kvpage.runner.layered_step`, :mod:`kvpage.runner.multi_step`), their cache and the
store of earlier starts (:mod:`kvpage.runner.executable_store`), the full warm-up, and the
background warm-up with its fallback to a larger compiled bucket.

It compiles the shapes of the runner it serves (params, pools, sampling table: read as
abstract shapes, never as live buffers) and holds that runner weakly.

Invariant: every executable is compiled once, by :meth:`~StepExecutables._compile`, and
counted in :attr:`~StepExecutables.num_compilations`; after :meth:`~StepExecutables.warmup`
that number stays fixed for any plan within the configured limits.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.linear_kernels import batch_invariant, host_matmuls
from kvpage.runner.background_compiler import BackgroundCompiler
from kvpage.runner.buckets import background_order, pick_bucket, pick_fallback
from kvpage.runner.executable_cache import ExecutableCache
from kvpage.runner.executable_store import ExecutableStore
from kvpage.runner.executable_store import signature as store_signature
from kvpage.runner.layered_step import (
    StepBucket,
    embed_weight,
    head_params,
    make_embed,
    make_head,
    make_layers,
    make_select,
)
from kvpage.runner.placement import Placement
from kvpage.runner.step_inputs import PackedLayout
from kvpage.sampling.table import write_seat
from kvpage.sampling.token_bitmask import bitmask_words

if TYPE_CHECKING:
    from kvpage.runner.runner_state import RunnerState

COPY_CHUNK = 64  # block copies per call of the stand-alone copy executable

StepKey = tuple[int, int, bool]
"""(padded tokens, padded sequences, pure-decode variant)"""


SERVING_GAP_S = 0.2
"""A runner that stepped this recently is serving: the background compiler leaves its
stored buckets to be loaded by the steps that need them (:meth:`StepExecutables.serving`)."""


class StepExecutables:
    """Every executable of one :class:`~kvpage.runner.model_runner.ModelRunner`."""

    def __init__(self, runner: RunnerState, placement: Placement, use_store: bool) -> None:
        self._r: RunnerState = weakref.proxy(runner)
        self._place = placement
        self.cache = ExecutableCache()
        """Step buckets, samplers and helpers, by key."""
        self._background: BackgroundCompiler | None = None
        self._queued_builds: dict[Hashable, Callable[[], Any]] = {}
        """Builders :meth:`build_next` put at the head of the background queue."""
        self.fallback_steps = 0
        self._last_step = -math.inf
        """When the last step was dispatched (:meth:`note_step`, ``time.monotonic``)."""
        """Steps that ran in a larger compiled bucket while theirs was being compiled."""
        self._layouts: dict[tuple[int, int], tuple[PackedLayout, np.ndarray]] = {}
        self._count_lock = threading.Lock()
        self._num_compilations = 0
        self.store = (
            ExecutableStore.for_compilation_cache(self.trace_inputs(), placement.device)
            if use_store
            else None
        )
        """Executables of earlier starts (:mod:`kvpage.runner.executable_store`)."""

    @property
    def num_compilations(self) -> int:
        """Executables compiled so far (step buckets, seat writer, copy kernel)."""
        return self._num_compilations

    @property
    def max_step_executables(self) -> int:
        """The most step executables this configuration can compile (every bucket pair
        a step can land in; see :mod:`kvpage.runner.buckets`)."""
        return len(self.warmup_buckets())

    @property
    def compiled_buckets(self) -> list[StepKey]:
        """``(padded tokens, padded seqs, decode_only)`` of every compiled step."""
        return sorted(k[1:] for k in self.cache.ready_keys() if k[0] == "bucket")

    @property
    def compiled_scoring_buckets(self) -> list[tuple[int, int]]:
        """``(padded tokens, padded seqs)`` of every compiled prompt-logprobs variant."""
        return sorted(k[1:] for k in self.cache.ready_keys() if k[0] == "scored")

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
        max_seqs = self._r.seq_buckets[-1]
        mixed = {
            (*self.padded_sizes(t, s), False)
            for t in self._r.token_buckets
            for s in range(1, min(t, max_seqs) + 1)
        }
        keys = sorted(mixed)
        limit = min(self._r.token_buckets[-1], max_seqs)
        decode = {(*self.padded_sizes(n, n), True) for n in range(1, limit + 1)}
        return keys + sorted(k for k in decode if self.has_decode_variant(k[1]))

    def has_decode_variant(self, padded_seqs: int) -> bool:
        """Whether pure-decode steps of this sequence bucket get executables of their own
        (the attention backend has a decode kernel)."""
        return self._r.backend.decode_specialized

    def padded_sizes(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (token, sequence) buckets a step of this size runs in."""
        t_pad = pick_bucket(self._r.token_buckets, num_tokens, "num_tokens")
        floor = min(math.ceil(t_pad / self._r.max_token_seq_ratio), self._r.seq_buckets[-1])
        s_pad = pick_bucket(self._r.seq_buckets, max(num_seqs, 1, floor), "num_seqs")
        return t_pad, s_pad

    def layout(self, key: tuple[int, int]) -> tuple[PackedLayout, np.ndarray]:
        entry = self._layouts.get(key)
        if entry is None:
            layout = PackedLayout(
                key[0], key[1], self._r.max_fused_copies, self._r.max_blocks_per_seq,
                lora=self._r.lora is not None,
            )
            entry = self._layouts.setdefault(key, (layout, layout.template(self._r.padding)))
        return entry

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
        if self._r.mesh is None:
            with host_matmuls(), batch_invariant(self._r.batch_invariant):
                return jax.jit(fn, donate_argnums=donate).lower(*args)
        jitted = jax.jit(
            fn, donate_argnums=donate, in_shardings=in_shardings, out_shardings=out_shardings
        )
        return jitted.lower(*args)

    def compile(
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
        def lower(named: Callable[..., Any]) -> jax.stages.Lowered:
            return self._jit(named, donate, args, in_shardings, out_shardings)

        if self.store is None:
            return lower(fn).compile()
        return self.store.compile(piece, fn, args, lower)

    def trace_inputs(self) -> dict[str, Any]:
        """Everything of this runner that its traces depend on (the executable store's
        key, with :func:`~kvpage.runner.executable_store.code_fingerprint`)."""
        return {
            "config": self._r.config,
            "params": store_signature(self._place.abstract(self._r.params)),
            "kv_spec": self._r.kv_spec,
            "block_size": self._r.block_size,
            "max_model_len": self._r.max_model_len,
            "max_num_seqs": self._r.max_num_seqs,
            "max_logprobs": self._r.max_logprobs,
            "max_fused_copies": self._r.max_fused_copies,
            "enable_penalties": self._r.enable_penalties,
            "seed": self._r.seed,
            "backend": (self._r.backend.name, self._r.backend.decode_specialized),
            "layer_plan": self._r.layer_plan,
            "sampling_table": store_signature(self._r.sampling_table),
            "padding": self._r.padding,
            "batch_invariant": self._r.batch_invariant,
            "device": (self._r.device.platform, self._r.device.id),
        }

    def _build_bucket(self, key: StepKey) -> StepBucket:
        """Compile bucket ``key``'s embed, layer-group and select pieces (and its head, keyed
        by the sequence bucket, if new): :mod:`kvpage.runner.layered_step`."""
        t, s, decode_only = key
        layout, _ = self.layout((t, s))
        rep = self._place.replicated
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep)
        params = self._place.abstract(self._r.params)
        shardings = self._place.param_shardings
        hidden = jax.ShapeDtypeStruct(
            (t, self._r.config.hidden_size), embed_weight(params).dtype, sharding=rep
        )
        pool = self._place.abstract(self._r.kv_pools[0], self._place.pool_sharding)
        pool_sh = (self._place.pool_sharding, self._place.pool_sharding)
        embed = self.compile(
            ("embed", t, s),
            make_embed(layout, self._r.config),
            (),
            (embed_weight(params), packed),
            (embed_weight(shardings), rep),
            rep,
        )
        layers = {}
        for kind, (start, count, _) in enumerate(self._r.layer_plan.kinds):
            fn = make_layers(
                self._r.config,
                layout,
                self._r.backend,
                decode_only,
                self._place.copy_blocks,
                [self._r.config.layer_type(i) for i in range(start, start + count)],
                self._r.stacked,
            )
            pools = [pool] * count
            pools_sh = [pool_sh] * count
            if self._r.stacked:
                index = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
                layers[kind] = self.compile(
                    ("layers", *key, kind),
                    fn,
                    (2,),
                    (params["layers"], index, pools, hidden, packed),
                    (shardings["layers"], rep, pools_sh, rep, rep),
                    (rep, pools_sh),
                )
            else:
                end = start + count
                layers[kind] = self.compile(
                    ("layers", *key, kind),
                    fn,
                    (1,),
                    (params["layers"][start:end], pools, hidden, packed),
                    (shardings["layers"][start:end], pools_sh, rep, rep),
                    (rep, pools_sh),
                )
        select = self._compile_select(layout, score_prompts=False)
        self.count_compiles(2 + len(layers))
        self.head_fn(s)
        return StepBucket(embed, layers, select)

    def _compile_select(self, layout: PackedLayout, score_prompts: bool) -> jax.stages.Compiled:
        rep = self._place.replicated
        hidden = jax.ShapeDtypeStruct(
            (layout.num_tokens, self._r.config.hidden_size),
            embed_weight(self._place.abstract(self._r.params)).dtype,
            sharding=rep,
        )
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep)
        args: tuple[Any, ...] = (hidden, packed)
        shardings: tuple[Any, ...] = (rep, rep)
        if score_prompts:
            head = head_params(self._r.config, self._place.abstract(self._r.params))
            targets = jax.ShapeDtypeStruct((layout.num_tokens,), jnp.int32, sharding=rep)
            args = (head, *args, targets)
            shardings = (head_params(self._r.config, self._place.param_shardings), *shardings, rep)
        fn = make_select(layout, self._place.logits_of(), self._r.max_logprobs, score_prompts)
        piece = ("select", layout.num_tokens, layout.num_seqs, score_prompts)
        return self.compile(piece, fn, (), args, shardings, rep)

    def head_fn(self, num_seqs: int) -> jax.stages.Compiled:
        """lm_head and sampler of sequence bucket ``num_seqs`` (shared by every token
        bucket)."""

        def build() -> jax.stages.Compiled:
            rep = self._place.replicated
            vocab = self._r.config.vocab_size
            params = self._place.abstract(self._r.params)
            args = (
                head_params(self._r.config, params),
                jax.ShapeDtypeStruct(
                    (num_seqs, self._r.config.hidden_size),
                    embed_weight(params).dtype,
                    sharding=rep,
                ),
                jax.ShapeDtypeStruct((3 * num_seqs + 3,), jnp.int32, sharding=rep),
                self._place.abstract(self._r.sampling_table),
                jax.ShapeDtypeStruct((num_seqs, bitmask_words(vocab)), jnp.int32, sharding=rep),
            )
            table = self._place.shardings(self._r.sampling_table)
            head_sh = head_params(self._r.config, self._place.param_shardings)
            fn = make_head(num_seqs, self._place.logits_of(), self._r.max_logprobs, self._r.seed)
            compiled = self.compile(
                ("head", num_seqs),
                fn,
                (3,),
                args,
                (head_sh, rep, rep, table, rep),
                (rep, table),
            )
            self.count_compiles(1)
            return compiled

        return self.cache.get_or_build(("head", num_seqs), build)

    def scored_select_fn(self, key: tuple[int, int]) -> jax.stages.Compiled:
        """The prompt-logprobs variant of bucket ``key``'s select piece (compiled on first
        use; never by :meth:`warmup`, so servers whose clients never ask for prompt
        logprobs never pay)."""

        def build() -> jax.stages.Compiled:
            compiled = self._compile_select(self.layout(key)[0], score_prompts=True)
            self.count_compiles(1)
            return compiled

        return self.cache.get_or_build(("scored", *key), build)

    def count_compiles(self, n: int) -> None:
        with self._count_lock:
            self._num_compilations += n

    def bucket(self, key: StepKey) -> StepBucket:
        """Bucket ``key``'s executables, compiled now if needed (or awaited from the
        background compiler when it is building them)."""
        return self.cache.get_or_build(("bucket", *key), lambda: self._build_bucket(key))

    def build(self, key: Hashable) -> Any:
        """What the background compiler builds for ``key``: a builder queued by
        :meth:`build_next`, else step bucket ``key``."""
        queued = self._queued_builds.pop(key, None)
        return queued() if queued is not None else self.bucket(key)

    def build_next(self, key: Hashable, build: Callable[[], Any]) -> bool:
        """Have the background compiler run ``build`` next, ahead of the buckets it has
        not reached (a shape the traffic asks for now: multi-step decode); False when
        there is none still compiling (the caller builds it its own way)."""
        background = self._background
        if background is None or not background.compiles_left:
            return False
        self._queued_builds[key] = build
        if background.promote(key):
            return True
        del self._queued_builds[key]
        return False

    def stored(self, key: StepKey) -> bool:
        """Whether bucket ``key``'s layer groups, the pieces that take long to compile,
        are in the executable store (then building it is a load, ~0.1 s)."""
        store = self.store
        return store is not None and all(
            store.has(("layers", *key, kind)) for kind in range(len(self._r.layer_plan.kinds))
        )

    def serving(self) -> bool:
        """Whether a step ran in the last :data:`SERVING_GAP_S` seconds."""
        return time.monotonic() - self._last_step < SERVING_GAP_S

    def note_step(self) -> None:
        """A step is being dispatched now (:meth:`serving`)."""
        self._last_step = time.monotonic()

    def bucket_for(self, key: StepKey) -> tuple[StepKey, StepBucket]:
        """The bucket a step of bucket ``key`` runs in: its own once compiled or when it
        is stored (loaded now); while the background compiler has not reached it, a
        compiled one at most ``FALLBACK_MAX_RATIO`` times larger (and ``key`` is compiled
        next); else its own, compiled now."""
        self.note_step()
        ready = self.cache.get(("bucket", *key))
        if ready is not None:
            return key, ready
        background = self._background
        if (background is not None and not self.cache.is_pending(("bucket", *key))
                and not self.stored(key)):
            fallback = pick_fallback(
                key, [k[1:] for k in self.cache.ready_keys() if k[0] == "bucket"]
            )
            if fallback is not None:
                background.promote(key)
                self.fallback_steps += 1
                return fallback, self.cache.get(("bucket", *fallback))
        return key, self.bucket(key)

    def write_seat_fn(self) -> jax.stages.Compiled:
        def build() -> jax.stages.Compiled:
            ids_len = self._r.max_model_len if self._r.enable_penalties else 1
            rep = self._place.replicated
            ids = jax.ShapeDtypeStruct((ids_len,), jnp.int32, sharding=rep)
            table = self._place.shardings(self._r.sampling_table)
            args = (
                self._place.abstract(self._r.sampling_table),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct(
                    (self._r.sampling_table.floats.shape[1],), jnp.float32, sharding=rep
                ),
                jax.ShapeDtypeStruct(
                    (self._r.sampling_table.ints.shape[1],), jnp.int32, sharding=rep
                ),
                jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
                ids,
                ids,
                jax.ShapeDtypeStruct((self._r.config.vocab_size,), jnp.bool_, sharding=rep),
            )
            compiled = self.compile(
                ("write_seat",), write_seat, (0,), args, (table,) + (rep,) * 7, table
            )
            self.count_compiles(1)
            return compiled

        return self.cache.get_or_build("write_seat", build)

    def copy_fn(self) -> jax.stages.Compiled:
        """Whole-block copies in one layer's pool (called per layer)."""

        def build() -> jax.stages.Compiled:
            index = jax.ShapeDtypeStruct((COPY_CHUNK,), jnp.int32, sharding=self._place.replicated)
            pool = self._place.abstract(self._r.kv_pools[0], self._place.pool_sharding)
            pool_sh = (self._place.pool_sharding, self._place.pool_sharding)
            compiled = self.compile(
                ("copy",),
                lambda pool, src, dst: self._place.copy_blocks([pool], src, dst)[0],
                (0,),
                (pool, index, index),
                (pool_sh, self._place.replicated, self._place.replicated),
                pool_sh,
            )
            self.count_compiles(1)
            return compiled

        return self.cache.get_or_build("copy", build)

    def warmup(
        self,
        progress: bool = True,
        max_workers: int = 1,
        extra: Sequence[Callable[[], Any]] = (),
    ) -> None:
        """Compile every bucket of :meth:`warmup_buckets`, the helper executables and
        ``extra`` builders (multi-step decode) (``warmup="full"``). ``max_workers > 1``
        compiles several at once (XLA compiles outside the GIL)."""
        from tqdm.auto import tqdm

        self.write_seat_fn()
        self.copy_fn()
        pending = [k for k in self.warmup_buckets() if k not in self.compiled_buckets]
        bar = tqdm(total=len(pending), desc="compiling step buckets", disable=not progress)
        try:
            if max_workers <= 1:
                for key in pending:
                    bar.set_postfix(tokens=key[0], seqs=key[1])
                    self.bucket(key)
                    bar.update(1)
                for build in extra:
                    build()
                return
            with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
                for _ in pool.map(self.bucket, pending):
                    bar.update(1)
                list(pool.map(lambda build: build(), extra))
        finally:
            bar.close()

    def start_background_compile(self) -> BackgroundCompiler:
        """Compile the helpers now and every bucket of :meth:`warmup_buckets` on a
        background thread, most useful first (``warmup="background"``); steps meanwhile
        run as :meth:`bucket_for` says."""
        self.write_seat_fn()
        self.copy_fn()
        if self._background is None:
            self._background = BackgroundCompiler(
                self, "build", background_order(self.warmup_buckets()),
                deferrable=self.stored, busy_name="serving",
            )
        return self._background

    def stop_background_compile(self) -> None:
        if self._background is not None:
            self._background.stop()
