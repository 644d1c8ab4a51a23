"""Where a step's wall time goes (:class:`StepTiming`, ``LLMEngine.timing``), and the
wait for a dispatched device call that measures it (:class:`DeviceWait`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpage.engine.context import EngineContext
    from kvpage.engine.outputs import EngineOutputs
    from kvpage.outputs import RequestOutput
    from kvpage.runner.protocol import PendingResult


class StepTiming:
    """Where a step's wall time goes: on the device (dispatch to result)
    versus the host gap between one step's result and the next dispatch,
    during which the device idles."""

    __slots__ = ("device_s", "host_gap_s", "steps")

    def __init__(self) -> None:
        self.device_s = 0.0
        self.host_gap_s = 0.0
        self.steps = 0

    def record_step(self, seconds: float) -> None:
        self.device_s += seconds
        self.steps += 1

    def record_host_gap(self, seconds: float) -> None:
        self.host_gap_s += seconds

    @property
    def device_idle_fraction(self) -> float:
        total = self.device_s + self.host_gap_s
        return self.host_gap_s / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "mean_device_ms": 1e3 * self.device_s / steps,
            "mean_host_gap_ms": 1e3 * self.host_gap_s / steps,
            "device_idle_fraction": self.device_idle_fraction,
        }


class DeviceWait:
    """Waits for each dispatched device call. With ``overlap_host_work`` the text of
    the previous step is made meanwhile, so the device does not wait for
    detokenization; outputs then trail the device by one call, or, with a ``sink``
    while a multi-step call runs, leave as soon as they are made."""

    __slots__ = ("_ctx", "_last_result_time", "_outputs", "sink", "timing")

    def __init__(self, ctx: EngineContext, outputs: EngineOutputs) -> None:
        self._ctx = ctx
        self._outputs = outputs
        self.timing = StepTiming()
        """``LLMEngine.timing`` (replaceable, e.g. a fresh one per benchmark run)."""
        self._last_result_time: float | None = None
        self.sink: Callable[[list[RequestOutput]], None] | None = None
        """Where the last call's outputs go the moment they are made while the device
        runs a multi-step call (``LLMEngine.set_overlapped_output_sink``); None, or a
        one-step call: into the step's list."""

    def wait(
        self, pending: PendingResult, outputs: list[RequestOutput], num_steps: int = 1
    ) -> Any:
        """The dispatched call's result; meanwhile (``overlap_host_work``) the last
        call's text goes to ``outputs``. Times the host gap before the call and the
        device time of each of its ``num_steps`` steps."""
        dispatched = self._ctx.runner.last_enqueue_time  # the device is busy from here
        if self._last_result_time is not None:
            self.timing.record_host_gap(dispatched - self._last_result_time)
        if self._ctx.config.overlap_host_work:
            made = self._outputs.process_text()
            if self.sink is not None and made and num_steps > 1:
                self.sink(made)
            else:
                outputs += made
        result = pending.result()
        self._last_result_time = time.perf_counter()
        for _ in range(num_steps):
            self.timing.record_step((self._last_result_time - dispatched) / num_steps)
        return result
