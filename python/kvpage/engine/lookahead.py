"""Multi-step decode (:mod:`kvpage.runner.multi_step`): a plain decode step of few rows
runs with the next ``num_steps - 1`` decode steps in one device call, so the host's
dispatch is paid once per call; the scheduler then replays those steps
(``schedule_continuation``) and each one's tokens are applied as a step's are."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvpage._core import StepPlan
    from kvpage.engine.context import EngineContext
    from kvpage.engine.failures import Failures
    from kvpage.engine.outputs import EngineOutputs
    from kvpage.engine.plan_reader import PlanReader
    from kvpage.engine.requests import RequestTable
    from kvpage.engine.timing import DeviceWait
    from kvpage.engine.update import StepUpdate
    from kvpage.outputs import RequestOutput


class MultiStepDecode:
    __slots__ = (
        "_ctx", "_device", "_failures", "_outputs", "_plan", "_plans", "_requests", "_update",
    )

    def __init__(
        self, ctx: EngineContext, requests: RequestTable, plans: PlanReader, device: DeviceWait,
        update: StepUpdate, outputs: EngineOutputs, failures: Failures,
    ) -> None:
        self._ctx = ctx
        self._requests = requests
        self._plans = plans
        self._device = device
        self._update = update
        self._outputs = outputs
        self._failures = failures
        self._plan: StepPlan | None = None
        """The plan whose tokens are being applied (a failure fails its rows)."""

    def steps(self, plan: StepPlan) -> int:
        """Decode steps this plan may run in one device call: more than 1 only for a
        plain decode step of few rows whose executable is compiled (else its compile is
        requested)."""
        runner = self._ctx.runner
        steps = runner.num_scheduler_steps
        rows = int(plan.num_seqs)
        if steps <= 1 or not plan.decode_only or rows > runner.multi_step_max_rows:
            return 1
        if self._requests.scoring or plan.sample_new_seat.any():
            return 1
        if not runner.multi_step_ready(rows):
            runner.prepare_multi_step(rows)
            return 1
        return int(self._ctx.scheduler.lookahead_steps(steps))

    def run(
        self, plan: StepPlan, num_steps: int, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        """Run ``plan`` and the next ``num_steps - 1`` decode steps in one device call,
        then apply each step's tokens as the scheduler replays those steps. Rows that
        finished meanwhile drop out; their later tokens are discarded. Returns
        ``outputs`` with this call's outputs appended."""
        try:
            return self._run(plan, num_steps, outputs)
        except Exception as exc:  # fail the rows of the step being applied
            assert self._plan is not None
            return outputs + self._failures.fail_step(self._plan, exc)

    def _run(
        self, plan: StepPlan, num_steps: int, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        ctx = self._ctx
        scheduler = ctx.scheduler
        self._plan = plan
        pending = ctx.runner.dispatch_multi_step(plan, num_steps)
        steps = self._device.wait(pending, outputs, num_steps)
        ctx.counters["multi_step_calls"] = ctx.counters.get("multi_step_calls", 0) + 1
        device_row = {int(seat): row for row, seat in enumerate(plan.sample_rows.tolist())}
        out = steps[0]
        for k in range(num_steps):
            if k > 0:
                if not scheduler.num_requests_running:
                    break
                plan = self._plan = scheduler.schedule_continuation()
                self._plans.read(plan)
                if plan.num_tokens == 0:
                    scheduler.update(np.zeros(0, np.int32))
                    break
                out = steps[k].take([device_row[int(seat)] for seat in plan.sample_rows])
            outputs += self._update.apply(out)
        if not ctx.config.overlap_host_work:
            outputs += self._outputs.process_text()
        return outputs
