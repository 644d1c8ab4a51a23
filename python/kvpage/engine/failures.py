"""Failures inside a step fail the requests they touch, and only those: a step that
raised fails the requests it carried, non-finite logits fail their own request. Each
failed request ends with an output whose ``error`` says why; its blocks return."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvpage._core import StepPlan
    from kvpage.engine.context import EngineContext
    from kvpage.engine.outputs import EngineOutputs
    from kvpage.engine.requests import Request, RequestTable
    from kvpage.outputs import RequestOutput

logger = logging.getLogger("kvpage.engine.llm_engine")

NON_FINITE = "the model produced non-finite logits for this request"


class Failures:
    __slots__ = ("_ctx", "_outputs", "_requests")

    def __init__(
        self, ctx: EngineContext, requests: RequestTable, outputs: EngineOutputs
    ) -> None:
        self._ctx = ctx
        self._requests = requests
        self._outputs = outputs

    def fail_step(self, plan: StepPlan, exc: Exception) -> list[RequestOutput]:
        """A step raised: finish the requests it carried with an error, close
        the step in the scheduler, and drop the prefix cache (blocks cached
        for this step were never written). If the device KV pools were lost,
        every running request is failed and the pools are rebuilt."""
        ctx = self._ctx
        message = f"the engine failed this request: {type(exc).__name__}: {exc}"
        # Not the request's fault (requests are validated on entry): a bug, logged whole.
        logger.error("step failed: %s", message, exc_info=exc)
        handles = set(plan.row_request.tolist()) | set(plan.sample_request.tolist())
        if ctx.runner.recover_device_state():  # every KV on the device is gone
            handles |= {
                r.handle
                for r in self._requests.values()
                if r.metrics.first_scheduled_time is not None
            }
        by_handle = self._requests.by_handle
        outputs = [self.fail_request(by_handle[h], message) for h in handles if h in by_handle]
        if ctx.scheduler.awaiting_update:
            ctx.scheduler.update(np.zeros(plan.num_sampled, np.int32))
        ctx.scheduler.reset_prefix_cache()
        ctx.counters["failed_steps"] = ctx.counters.get("failed_steps", 0) + 1
        return outputs

    def fail_request(self, request: Request, message: str) -> RequestOutput:
        """Finish every sample of one request with an error; blocks return."""
        self._ctx.scheduler.finish_request(request.handle, "error")
        request.error = message
        return self._outputs.end(request, "error")

    def fail_non_finite(self, handles: np.ndarray, logprobs: np.ndarray) -> list[RequestOutput]:
        """Fail the requests whose sampled token has a NaN/inf logprob (NaN/inf logits)."""
        finite = np.isfinite(logprobs)
        if finite.all():
            return []
        outputs = []
        by_handle = self._requests.by_handle
        for handle in dict.fromkeys(handles[~finite].tolist()):
            request = by_handle.get(handle)
            if request is not None:
                outputs.append(self.fail_request(request, NON_FINITE))
        # Their cached blocks may hold the bad values: never reuse them.
        self._ctx.scheduler.reset_prefix_cache()
        return outputs
