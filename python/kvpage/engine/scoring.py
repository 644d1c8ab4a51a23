"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token scored under
the model, from the same forward passes that prefill the prompt
(:mod:`kvpage.outputs.prompt_logprobs`).

A scored prompt's positions must all be computed, so its request bypasses the prefix
cache (a private cache salt) -- unless it scores only from ``score_from`` on, when the
cache may supply the positions before it (a shared prompt computed once for all the
completions scored after it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpage.outputs.prompt_logprobs import PromptLogprobsRecord, step_prompt_targets

if TYPE_CHECKING:
    from kvpage._core import StepPlan
    from kvpage.engine.context import EngineContext
    from kvpage.engine.requests import Request, RequestTable
    from kvpage.outputs.prompt_logprobs import PromptLogprobs
    from kvpage.runner.step_output import StepOutput
    from kvpage.sampling.params import SamplingParams


class PromptScoring:
    """Scores the prompts of the requests in ``requests.scoring``, step by step."""

    __slots__ = ("_ctx", "_private_salts", "_requests")

    def __init__(self, ctx: EngineContext, requests: RequestTable) -> None:
        self._ctx = ctx
        self._requests = requests
        self._private_salts = 0

    def cache_salt(
        self, params: SamplingParams, cache_salt: str | None, score_from: int | None
    ) -> str | None:
        """The salt a new request is cached under: a private one, which no other request
        shares, when every position of its prompt is to be computed and scored."""
        if (
            params.prompt_logprobs is None
            or not self._ctx.config.enable_prefix_caching
            or score_from is not None
        ):
            return cache_salt
        self._private_salts += 1
        return f"{cache_salt or ''}\x00prompt_logprobs#{self._private_salts}"

    def register(self, request: Request, score_from: int | None) -> None:
        """Start scoring a new request's prompt, if it asks for prompt logprobs."""
        params = request.params
        if params.prompt_logprobs is None:
            return
        request.prompt_scores = PromptLogprobsRecord(
            request.prompt_token_ids, params.prompt_logprobs, score_from or 1
        )
        request.score_from = score_from
        if not request.prompt_scores.complete:
            self._requests.scoring[request.handle] = request

    def rows(self, plan: StepPlan) -> dict[int, PromptLogprobsRecord]:
        """Plan rows whose request still has prompt tokens to score."""
        scoring = self._requests.scoring
        if not scoring:
            return {}
        rows = {}
        for row, handle in enumerate(plan.row_request.tolist()):
            request = scoring.get(handle)
            if request is not None and request.prompt_scores is not None:
                rows[row] = request.prompt_scores
        return rows

    @staticmethod
    def targets(plan: StepPlan, rows: dict[int, PromptLogprobsRecord]) -> np.ndarray | None:
        """The runner's ``prompt_targets`` for the scored ``rows`` (None: none)."""
        if not rows:
            return None
        return step_prompt_targets(plan.num_tokens, plan.positions, plan.cu_q_lens, rows)

    def record(
        self, plan: StepPlan, rows: dict[int, PromptLogprobsRecord], out: StepOutput
    ) -> None:
        """Each scored row's logprobs from the step's output; completed prompts leave."""
        cu = plan.cu_q_lens
        for row, record in rows.items():
            record.record(out, plan.positions, int(cu[row]), int(cu[row + 1]))
        scoring = self._requests.scoring
        for handle, request in list(scoring.items()):
            if request.prompt_scores is None or request.prompt_scores.complete:
                del scoring[handle]


def take_prompt_logprobs(
    request: Request,
) -> tuple[PromptLogprobs | None, np.ndarray | None]:
    """``(prompt_logprobs, scored)`` for a request's next output, once its prompt is
    scored: the whole prompt's, or (``score_from``) those from there on; a delta
    output carries them once."""
    scores = request.prompt_scores
    if scores is None or not scores.complete:
        return None, None
    prompt_logprobs: PromptLogprobs | None = None
    scored: np.ndarray | None = None
    if request.score_from is not None:
        scored = scores.logprobs_from(request.score_from)
    elif not (request.delta and request.prompt_logprobs_sent):
        prompt_logprobs = scores.build()
    request.prompt_logprobs_sent = True
    return prompt_logprobs, scored
