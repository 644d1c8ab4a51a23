"""Array outputs for RL loops: :class:`RolloutBatch` (``LLM.rollout``) and the scoring of
given completions (``LLM.score``).

An RL step samples many completions, then needs per sample the token ids, the logprob
of each token under the distribution it was drawn from, and the lengths, as arrays;
later it needs ``log p(completion | prompt)`` under other weights (reference or old
policy). This file turns the engine's requests into those arrays. Sampled logprobs are
collected by the engine as one float32 buffer per sample (``logprobs_as_arrays``), so
no Python object is made per token; scoring runs prompt + completion through the
engine's compiled prefill with ``score_from``, so a prompt shared by several
completions is computed once (the prefix cache) and only completion positions are
projected and scored.

Invariant: rows of a :class:`RolloutBatch` are ``(prompt i, sample j)`` in input order,
``token_ids[r, :lengths[r]]`` are the generated tokens without the stop token that
ended the sample, and every padded entry is ``pad_id`` / 0.0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpage.outputs import RequestOutput
from kvpage.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Samples of a rollout as padded arrays (one row per sample)."""

    token_ids: np.ndarray
    """int32 ``[rows, max_len]``: generated tokens, stop token excluded, ``pad_id`` after."""
    logprobs: np.ndarray
    """float32 ``[rows, max_len]``: each token's logprob in ``logprobs_mode``, 0 after."""
    lengths: np.ndarray
    """int32 ``[rows]``: tokens of each sample (without the stop token)."""
    prompt_index: np.ndarray
    """int32 ``[rows]``: the prompt each row was sampled from."""
    prompt_token_ids: list[np.ndarray]
    """int32 token ids of each prompt."""
    finish_reasons: list[str]
    params_version: int
    """The weights version every token of the batch was sampled with."""

    def completions(self) -> list[np.ndarray]:
        """Each row's tokens as its own array (views, no copy)."""
        return [self.token_ids[r, : n] for r, n in enumerate(self.lengths.tolist())]


def build_rollout_batch(
    outputs: Sequence[RequestOutput], pad_id: int, params_version: int
) -> RolloutBatch:
    """Pack finished requests (``logprobs_as_arrays``) into a :class:`RolloutBatch`."""
    rows: list[tuple[int, Any]] = []
    for i, out in enumerate(outputs):
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        rows.extend((i, c) for c in sorted(out.outputs, key=lambda c: c.index))
    lengths = np.zeros(len(rows), np.int32)
    for r, (_, c) in enumerate(rows):
        n = len(c.token_ids)
        if c.finish_reason == "stop" and isinstance(c.stop_reason, int) and n:
            n -= 1  # the stop token that ended the sample
        lengths[r] = n
    width = int(lengths.max()) if len(rows) else 0
    token_ids = np.full((len(rows), width), pad_id, np.int32)
    logprobs = np.zeros((len(rows), width), np.float32)
    for r, (_, c) in enumerate(rows):
        n = int(lengths[r])
        token_ids[r, :n] = c.token_ids[:n]
        if c.logprob_array is not None:
            logprobs[r, :n] = c.logprob_array[:n]
    return RolloutBatch(
        token_ids=token_ids,
        logprobs=logprobs,
        lengths=lengths,
        prompt_index=np.asarray([i for i, _ in rows], np.int32),
        prompt_token_ids=[np.asarray(o.prompt_token_ids, np.int32) for o in outputs],
        finish_reasons=[c.finish_reason or "" for _, c in rows],
        params_version=params_version,
    )


def rollout_sampling_params(params: SamplingParams) -> SamplingParams:
    """``params`` asking for the sampled token's logprob only (arrays, not dicts)."""
    return dataclasses.replace(params, logprobs=0)


SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
"""What a scoring request samples: one greedy token (the engine's steps always sample;
the token is dropped) and the raw logprobs of the prompt tokens."""
