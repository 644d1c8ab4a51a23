"""Host side of ``SamplingParams.prompt_logprobs``: which step tokens score which prompt
tokens, and the per-request record that becomes ``RequestOutput.prompt_logprobs``.

The device side (the scoring inside the prefill's forward pass) is
:mod:`kvpage.runner.prompt_scoring`.

Prefix caching: a request that asks for prompt logprobs **bypasses the prefix cache**.
A cached prefix's KV was written by an earlier request, but its logits were never kept,
so its positions would have no logprobs; recomputing them would cost the same forward
pass the cache exists to skip. The engine therefore gives such a request a private
``cache_salt`` (a root of the radix tree no other request shares, dropped once its
blocks are evicted), so every prompt position is computed, and scored, by this request.
Its blocks stay out of everyone else's way: they are evictable as soon as it finishes.

Preemption (recompute) replays the prefill; positions already scored keep their first
value (identical weights give identical numbers), and positions past the prompt (the
replayed output tokens) are never scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpage.outputs import Logprob
from kvpage.runner.prompt_scoring import prompt_targets
from kvpage.runner.step_output import StepOutput

PromptLogprobs = list[dict[int, Logprob] | None]
"""vLLM's shape: ``None`` for the first prompt token (nothing predicts it), then for
each later prompt token a dict ``token_id -> Logprob`` holding the prompt token itself
(with its rank) and the ``k`` most likely tokens (ranks 1..k)."""


class PromptLogprobsRecord:
    """Scores of one request's prompt tokens, filled chunk by chunk as the prefill runs."""

    __slots__ = ("prompt", "k", "_logprobs", "_ranks", "_top_ids", "_top_lps", "_missing",
                 "_built")

    def __init__(self, prompt_token_ids: Sequence[int], k: int, score_from: int = 1) -> None:
        n = len(prompt_token_ids)
        self.prompt = np.asarray(prompt_token_ids, np.int64)
        self.k = k
        self._logprobs = np.zeros(n, np.float32)
        self._ranks = np.zeros(n, np.int32)
        self._top_ids = np.zeros((n, k), np.int32)
        self._top_lps = np.zeros((n, k), np.float32)
        self._missing = np.ones(n, bool)
        self._missing[:score_from] = False  # the first prompt token is never scored
        self._built: PromptLogprobs | None = None

    @property
    def complete(self) -> bool:
        return not self._missing.any()

    def record(self, out: StepOutput, positions: np.ndarray, start: int, end: int) -> None:
        """Take the scores of step tokens ``start:end`` (one sequence row of the plan, at
        ``positions``) from a step dispatched with this request's targets."""
        if out.prompt_logprobs is None:
            raise RuntimeError("the step ran without prompt scoring")
        pos = positions[start:end].astype(np.int64)
        rows = np.nonzero(pos + 1 < len(self.prompt))[0]
        if not len(rows):
            return
        scored = pos[rows] + 1
        fresh = self._missing[scored]
        rows, scored = rows[fresh] + start, scored[fresh]
        self._logprobs[scored] = out.prompt_logprobs[rows]
        self._ranks[scored] = out.prompt_ranks[rows]
        if self.k:
            self._top_ids[scored] = out.prompt_top_token_ids[rows, : self.k]
            self._top_lps[scored] = out.prompt_top_logprobs[rows, : self.k]
        self._missing[scored] = False

    def logprobs_from(self, start: int) -> np.ndarray:
        """float32 logprobs of prompt tokens ``start:`` (a copy; once complete)."""
        if not self.complete:
            raise RuntimeError("prompt logprobs are not complete yet")
        return self._logprobs[start:].copy()

    def build(self) -> PromptLogprobs:
        """The vLLM-shaped list (built once, when complete)."""
        if not self.complete:
            raise RuntimeError("prompt logprobs are not complete yet")
        if self._built is None:
            result: PromptLogprobs = [None]
            lps, ranks = self._logprobs.tolist(), self._ranks.tolist()
            top_ids, top_lps = self._top_ids.tolist(), self._top_lps.tolist()
            for j in range(1, len(self.prompt)):
                token = int(self.prompt[j])
                entry = {token: Logprob(lps[j], ranks[j])}
                for rank, (tid, lp) in enumerate(zip(top_ids[j], top_lps[j], strict=True), 1):
                    entry.setdefault(tid, Logprob(lp, rank))
                result.append(entry)
            self._built = result
        return self._built


def step_prompt_targets(
    num_tokens: int,
    positions: np.ndarray,
    cu_q_lens: np.ndarray,
    row_records: dict[int, PromptLogprobsRecord],
) -> np.ndarray | None:
    """The runner's ``prompt_targets`` for one step: for every plan row whose request is
    in ``row_records``, each token at position ``p`` targets prompt token ``p + 1``."""
    return prompt_targets(
        num_tokens, positions, cu_q_lens, {row: r.prompt for row, r in row_records.items()}
    )
