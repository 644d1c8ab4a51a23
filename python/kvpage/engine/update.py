"""The update stage of a step: the scheduler applies the sampled tokens, and its events
(each new token of each sample, with its finish code) go to the output streams, the
logprob records and the counters; non-finite logits fail their requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvpage.engine.context import EngineContext
    from kvpage.engine.failures import Failures
    from kvpage.engine.logprobs import SampledLogprobs
    from kvpage.engine.outputs import EngineOutputs
    from kvpage.engine.requests import RequestTable
    from kvpage.outputs import RequestOutput
    from kvpage.runner.step_output import StepOutput


class StepUpdate:
    __slots__ = ("_ctx", "_failures", "_logprobs", "_outputs", "_requests")

    def __init__(
        self, ctx: EngineContext, requests: RequestTable, outputs: EngineOutputs,
        logprobs: SampledLogprobs, failures: Failures,
    ) -> None:
        self._ctx = ctx
        self._requests = requests
        self._outputs = outputs
        self._logprobs = logprobs
        self._failures = failures

    def apply(self, out: StepOutput) -> list[RequestOutput]:
        """Apply one step's sampled tokens; returns the outputs of requests failed here
        (the others' outputs come with their text, ``EngineOutputs.process_text``)."""
        ctx = self._ctx
        events = ctx.scheduler.update(out.sampled_token_ids)
        handles, samples, tokens, codes, rows, stop_tokens = events
        ctx.counters["steps"] += 1
        logprobs = np.asarray(out.logprobs, np.float32)[rows]
        outputs = self._failures.fail_non_finite(handles, logprobs)
        accepted = self._outputs.push(handles, samples, tokens, codes, stop_tokens, logprobs)
        ctx.counters["generation_tokens"] += int(np.count_nonzero(accepted))
        if self._requests.logprobs:
            self._logprobs.record(handles, samples, tokens, rows, accepted, out)
        return outputs
