"""Multi-step decode on the runner: which row counts get it, its executables, its calls.

This file owns :class:`MultiStepDecode`: the sequence buckets that run several decode
steps in one device call (:meth:`~MultiStepDecode.buckets`), building their
executables (the math: :mod:`kvpage.runner.multi_step`; compiled through the runner's
:class:`~kvpage.runner.step_executables.StepExecutables`, counted with its others), when
they are ready, and :meth:`~MultiStepDecode.dispatch`, which enqueues such a call.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.runner.background_compiler import BackgroundCompiler
from kvpage.runner.multi_step import make_multi_step
from kvpage.runner.pending import PendingMultiStep
from kvpage.runner.step_executables import StepExecutables
from kvpage.runner.step_plan import StepPlanLike
from kvpage.sampling.token_bitmask import bitmask_words

if TYPE_CHECKING:
    from kvpage.runner.runner_state import RunnerState


class MultiStepDecode:
    """Several decode steps per device call for one :class:`ModelRunner`."""

    def __init__(self, runner: RunnerState, executables: StepExecutables) -> None:
        self._r: RunnerState = weakref.proxy(runner)
        self._exec = executables
        self._compilers: dict[int, BackgroundCompiler] = {}

    def multi_step_fn(self, num_seqs: int) -> jax.stages.Compiled:
        """The multi-step decode executable of sequence bucket ``num_seqs`` for up to
        ``num_scheduler_steps`` steps (:mod:`kvpage.runner.multi_step`), compiled on
        first use."""

        max_steps = self._r.num_scheduler_steps

        def build() -> jax.stages.Compiled:
            layout, _ = self._exec.layout((num_seqs, num_seqs))
            rep = self._r.placement.replicated
            pool = self._r.placement.abstract(self._r.kv_pools[0], self._r.placement.pool_sharding)
            pool_sh = (self._r.placement.pool_sharding, self._r.placement.pool_sharding)
            pools = [pool] * self._r.config.num_layers
            vocab = self._r.config.vocab_size
            args = (
                self._r.placement.abstract(self._r.params),
                pools,
                self._r.placement.abstract(self._r.sampling_table),
                jax.ShapeDtypeStruct((num_seqs, bitmask_words(vocab)), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
            )
            table = self._r.placement.shardings(self._r.sampling_table)
            fn = make_multi_step(
                self._r.config,
                layout,
                self._r.backend,
                self._r.placement.logits_of(),
                self._r.max_logprobs,
                self._r.seed,
                self._r.block_size,
                max_steps,
            )
            compiled = self._exec.compile(
                self._piece(num_seqs),
                fn,
                (1, 2),
                args,
                (self._r.placement.param_shardings, [pool_sh] * len(pools), table, rep, rep, rep),
                (rep, [pool_sh] * len(pools), table),
            )
            self._exec.count_compiles(1)
            return compiled

        return self._exec.cache.get_or_build(("multi", num_seqs, max_steps), build)

    def _piece(self, num_seqs: int) -> tuple[str, int, int]:
        return ("multi", num_seqs, self._r.num_scheduler_steps)

    def buckets(self) -> list[int]:
        """The sequence buckets that get a multi-step executable."""
        if self._r.num_scheduler_steps <= 1 or self._r.mesh is not None or self._r.stacked:
            return []
        rows = min(self._r.multi_step_max_rows, self._r.seq_buckets[-1])
        limit = self._exec.padded_sizes(rows, rows)[1]
        return [s for s in self._r.seq_buckets if s <= limit]

    def prepare(self, num_rows: int) -> None:
        """Under ``warmup="background"``, compile the multi-step executable for
        ``num_rows`` rows on a background thread: next on the step buckets' compiler
        while it still compiles (steps of this size are the traffic now; the buckets it
        has not reached wait one compile), else on its own thread. A stored executable
        (:mod:`kvpage.runner.executable_store`) is loaded at once on its own thread.
        Without warmup nothing compiles ahead of use, so steps run one per call;
        ``warmup="full"`` built it already."""
        _, s_pad = self._exec.padded_sizes(num_rows, num_rows)
        if s_pad not in self.buckets() or s_pad in self._compilers:
            return
        background = self._exec.background_compiler
        if background is None:
            return
        stored = self._exec.store is not None and self._exec.store.has(self._piece(s_pad))
        if not stored and self._exec.build_next(
            self._piece(s_pad), lambda: self.multi_step_fn(s_pad)
        ):
            self._compilers[s_pad] = background
            return
        self._compilers[s_pad] = BackgroundCompiler(self, "multi_step_fn", [s_pad])

    def compile(self, num_rows: int) -> bool:
        """Compile the multi-step executable for ``num_rows`` rows now; False when that
        row count runs one step per call."""
        _, s_pad = self._exec.padded_sizes(num_rows, num_rows)
        if s_pad not in self.buckets():
            return False
        self.multi_step_fn(s_pad)
        return True

    def ready(self, num_rows: int) -> bool:
        """Whether a pure-decode step of ``num_rows`` rows can run several steps in one
        call now (the executable is compiled; never compiles)."""
        _, s_pad = self._exec.padded_sizes(num_rows, num_rows)
        if s_pad not in self.buckets():
            return False
        return self._exec.cache.get(("multi", s_pad, self._r.num_scheduler_steps)) is not None

    def dispatch(self, plan: StepPlanLike, num_steps: int) -> PendingMultiStep:
        """Enqueue ``num_steps`` (``2 <= num_steps <= num_scheduler_steps``) decode steps
        of ``plan`` in one device call (:mod:`kvpage.runner.multi_step`; the caller
        checked its promises). ``result()`` returns each step's sampled rows, in
        ``plan``'s row order."""
        self._exec.note_step()
        num_sampled = len(plan.logits_indices)
        self._r.check(plan, num_sampled)
        if not 1 <= num_steps <= self._r.num_scheduler_steps:
            raise ValueError(
                f"num_steps must be in 1..{self._r.num_scheduler_steps}; got {num_steps}"
            )
        rows = int(plan.num_seqs)
        if not (int(plan.num_tokens) == rows == num_sampled and len(plan.copy_src) == 0):
            raise ValueError("a multi-step plan must be pure decode with no block copies")
        _, s_pad = self._exec.padded_sizes(rows, rows)
        layout, template = self._exec.layout((s_pad, s_pad))
        want_top = self._r.seats.want_top(plan.sample_rows)
        lora = self._r.lora
        packed_host = layout.pack(
            plan, template, self._r.block_size, self._r.step_counter, want_top, True,
            None if lora is None else lora.row_slots(plan.row_request, rows),
        )
        try:
            outs, self._r.kv_pools, self._r.sampling_table = self.multi_step_fn(s_pad)(
                self._r.params, self._r.kv_pools, self._r.sampling_table,
                self._r.steps.token_bitmask_input(None, s_pad), packed_host, np.int32(num_steps),
            )
        except Exception as exc:
            self._r.raise_if_params_deleted(exc)
            raise
        self._r.last_enqueue_time = time.perf_counter()
        self._r.step_counter += num_steps
        return PendingMultiStep(outs, num_sampled, num_steps, want_top)
