"""Dispatched device calls whose outputs are still on the device.

This file owns :class:`PendingStep` (one step, from :meth:`ModelRunner.dispatch`) and
:class:`PendingMultiStep` (several decode steps in one call, from
:meth:`ModelRunner.dispatch_multi_step`): ``result()`` waits for the call and copies the
sampled rows (and prompt scores) to the host as :class:`StepOutput`.
"""

from __future__ import annotations

from typing import Any

import jax

from kvpage.runner.prompt_scoring import PromptScores
from kvpage.runner.step_output import StepOutput


class PendingStep:
    """A dispatched step whose sampled tokens are still on the device."""

    __slots__ = ("_out", "_num_sampled", "_want_top", "_scores", "_num_tokens")

    def __init__(
        self,
        out: Any,
        num_sampled: int,
        want_top: bool,
        scores: PromptScores | None = None,
        num_tokens: int = 0,
    ) -> None:
        self._out = out
        self._num_sampled = num_sampled
        self._want_top = want_top
        self._scores = scores
        self._num_tokens = num_tokens

    def result(self) -> StepOutput:
        """Wait for the step and copy its sampled rows to the host."""
        out, n = self._out, self._num_sampled
        if self._want_top:
            tokens, logprobs, ranks, top_ids, top_lps = jax.device_get(
                _local(
                    (out.token_ids, out.logprobs, out.ranks, out.top_token_ids, out.top_logprobs)
                )
            )
            result = StepOutput(tokens[:n], logprobs[:n], ranks[:n], top_ids[:n], top_lps[:n])
        else:
            tokens, logprobs, ranks = jax.device_get(
                _local((out.token_ids, out.logprobs, out.ranks))
            )
            result = StepOutput(tokens[:n], logprobs[:n], ranks[:n])
        if self._scores is not None:
            t = self._num_tokens
            lps, rks, top_ids, top_lps = jax.device_get(_local(tuple(self._scores)))
            result.prompt_logprobs = lps[:t]
            result.prompt_ranks = rks[:t]
            result.prompt_top_token_ids = top_ids[:t]
            result.prompt_top_logprobs = top_lps[:t]
        return result


class PendingMultiStep:
    """Dispatched multi-step decode: each step's sampled tokens, still on the device."""

    __slots__ = ("_outs", "_num_sampled", "_num_steps", "_want_top")

    def __init__(self, outs: Any, num_sampled: int, num_steps: int, want_top: bool) -> None:
        self._outs = outs
        self._num_sampled = num_sampled
        self._num_steps = num_steps
        self._want_top = want_top

    def result(self) -> list[StepOutput]:
        """Wait for the call and copy each step's sampled rows to the host."""
        out, n, k = self._outs, self._num_sampled, self._num_steps
        names = ["token_ids", "logprobs", "ranks"]
        if self._want_top:
            names += ["top_token_ids", "top_logprobs"]
        arrays = jax.device_get(_local(tuple(getattr(out, name) for name in names)))
        return [StepOutput(*(a[step, :n] for a in arrays)) for step in range(k)]


def _local(arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Replicated outputs as arrays this process can read (its first local copy)."""
    return tuple(a if a.is_fully_addressable else a.addressable_data(0) for a in arrays)
