"""The runner's interface: what the engine calls to run a step.

:class:`StepRunner` is the whole contract between ``kvpage.engine`` and a runner.
:class:`kvpage.runner.model_runner.ModelRunner` (JAX, on a device) implements it, and so
do the stand-ins of the benchmarks and tests (``kvpage.bench.host.InstantRunner``, the
fault-injecting runners of ``tests/engine``). The engine reads nothing else of a
runner, and a runner knows nothing of the engine: the plan it runs comes from the Rust
scheduler (``kvpage._core.StepPlan``, documented in ``rust/sched/step_plan.rs``).

Id spaces a runner sees (stated once, here):

* a **seat** is a row of the device sampling table, ``0 <= seat < max_num_seqs``; the
  scheduler binds a seat to a request when it is first sampled (``plan.sample_new_seat``)
  and frees it when the request leaves (``plan.freed_seats``); a plan's ``sample_rows``
  are seats;
* a **block** is a page of the KV pool, ``0 <= block < num_blocks``;
* a **slot** is one token's place in the KV pool, ``block * block_size + offset``
  (``plan.slot_mapping``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from kvpage._core import StepPlan
    from kvpage.runner.background_compiler import BackgroundCompiler
    from kvpage.sampling.device_params import DeviceSamplingParams


class PendingResult(Protocol):
    """A dispatched device call; ``result()`` blocks until its outputs are on the host."""

    def result(self) -> Any: ...


@runtime_checkable
class StepRunner(Protocol):
    """Runs the steps the scheduler plans. Not thread-safe: one engine thread calls it."""

    num_scheduler_steps: int
    """Most decode steps one device call may run (1: multi-step decode off)."""
    multi_step_max_rows: int
    """Multi-step decode applies to plain decode steps of at most this many rows."""
    last_enqueue_time: float
    """``time.perf_counter()`` when the last call was handed to the device."""
    last_bitmask_overlapped: bool
    """Whether the last step's grammar masks were computed while the device ran."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool (the scheduler's block pool has exactly as many)."""
        ...

    @property
    def background_compiler(self) -> BackgroundCompiler | None:
        """The background warm-up, when one was started."""
        ...

    # ---- start-up -----------------------------------------------------------
    def warmup(self, progress: bool = True) -> None:
        """Compile every step executable now."""
        ...

    def start_background_compile(self) -> BackgroundCompiler | None:
        """Compile the step executables on a background thread; steps meanwhile run in
        a larger bucket that is compiled."""
        ...

    # ---- seats ----------------------------------------------------------------
    def set_request(
        self,
        seat: int,
        params: DeviceSamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray = (),
        output_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """Write a request's sampling parameters (and token histories) to ``seat``
        before its first sampled step, or again on resume after preemption."""
        ...

    def free_request(self, seat: int) -> None:
        """Forget the host-side state of a seat whose request left."""
        ...

    # ---- weights and recovery ---------------------------------------------------
    def update_params(self, params: Any) -> int:
        """Swap in new weights of the same structure, shapes and dtypes."""
        ...

    def recover_device_state(self) -> bool:
        """After a failed step: rebuild device state the failure may have consumed
        (donated buffers). True when something was rebuilt."""
        ...

    # ---- steps ------------------------------------------------------------------
    def dispatch(
        self,
        plan: StepPlan,
        prompt_targets: np.ndarray | None = None,
        token_bitmask_fn: Callable[[], np.ndarray] | None = None,
    ) -> PendingResult:
        """Enqueue one step; its ``result()`` is a :class:`StepOutput`."""
        ...

    def multi_step_ready(self, num_rows: int) -> bool:
        """Whether multi-step decode of ``num_rows`` rows is compiled."""
        ...

    def prepare_multi_step(self, num_rows: int) -> None:
        """Ask for multi-step decode of ``num_rows`` rows to be compiled (in the
        background where a warm-up runs)."""
        ...

    def dispatch_multi_step(self, plan: StepPlan, num_steps: int) -> PendingResult:
        """Enqueue ``plan`` and ``num_steps - 1`` decode steps after it in one call;
        its ``result()`` is a list of :class:`StepOutput`, one per step."""
        ...


__all__ = ["PendingResult", "StepRunner"]
