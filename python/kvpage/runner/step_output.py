"""What one executed step hands back to the engine (host numpy arrays)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class StepOutput:
    """Results for the ``S'`` sampled rows of a plan, in ``plan.logits_indices`` order.

    ``logprobs`` / ``ranks`` describe the sampled token under the raw model distribution.
    ``top_token_ids`` / ``top_logprobs`` (``[S', max_logprobs]``, best first) are present only
    when some sampled row's request asked for logprobs; each row should be cut to its own
    request's ``logprobs`` count.

    The ``prompt_*`` arrays (``[T]`` / ``[T, K]``, one entry per token of the step) are
    present only when the step was dispatched with prompt targets
    (:mod:`kvpage.runner.prompt_scoring`): the log-probability and rank of each token's
    target, and the top-``K`` list of its distribution; entries without a target are
    meaningless.
    """

    sampled_token_ids: np.ndarray  # int32 [S']
    logprobs: np.ndarray  # float32 [S']
    ranks: np.ndarray  # int32 [S']
    top_token_ids: np.ndarray | None = None  # int32 [S', K]
    top_logprobs: np.ndarray | None = None  # float32 [S', K]
    prompt_logprobs: np.ndarray | None = None  # float32 [T]
    prompt_ranks: np.ndarray | None = None  # int32 [T]
    prompt_top_token_ids: np.ndarray | None = None  # int32 [T, K]
    prompt_top_logprobs: np.ndarray | None = None  # float32 [T, K]

    def take(self, rows: list[int]) -> StepOutput:
        """The sampled-row results at ``rows`` (host indices into this step's rows)."""
        index = np.asarray(rows, np.intp)

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[index]

        return StepOutput(
            self.sampled_token_ids[index], self.logprobs[index], self.ranks[index],
            pick(self.top_token_ids), pick(self.top_logprobs),
        )
