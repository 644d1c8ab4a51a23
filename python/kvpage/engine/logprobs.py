"""Sampled-token logprobs, for the requests that ask for them: recorded from each step's
runner output, attached to the completions of each output.

A request asks with ``SamplingParams.logprobs`` (k >= 0: the sampled token's logprob and
rank, plus the top k) and gets a dict per token; with ``logprobs_as_arrays`` (and
``logprobs=0``) it gets one float32 array per sample instead, no Python object per token.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING

import numpy as np

from kvpage.outputs import CompletionOutput, Logprob

if TYPE_CHECKING:
    from kvpage.engine.requests import Request, RequestTable
    from kvpage.runner.step_output import StepOutput


class SampledLogprobs:
    """Records the sampled tokens' logprobs of the requests in ``requests.logprobs``."""

    __slots__ = ("_requests",)

    def __init__(self, requests: RequestTable) -> None:
        self._requests = requests

    def register(self, request: Request, *, as_arrays: bool) -> None:
        """Start recording for a new request, if it asks for logprobs."""
        if as_arrays:
            request.logprob_arrays = {}
        elif request.params.logprobs is not None:
            request.logprobs = {}
        else:
            return
        self._requests.logprobs.add(request.handle)

    def record(
        self, handles: np.ndarray, samples: np.ndarray, tokens: np.ndarray, rows: np.ndarray,
        accepted: np.ndarray, out: StepOutput,
    ) -> None:
        """Each accepted token's logprob dict, for the requests that asked for them."""
        by_handle = self._requests.by_handle
        wanted = accepted & np.isin(handles, np.fromiter(self._requests.logprobs, np.uint64))
        for e in np.flatnonzero(wanted).tolist():
            request = by_handle[int(handles[e])]
            if request.logprob_arrays is not None:
                sample = int(samples[e])
                values = request.logprob_arrays.get(sample)
                if values is None:
                    values = request.logprob_arrays[sample] = array.array("f")
                values.append(out.logprobs[rows[e]])
                continue
            row, token = int(rows[e]), int(tokens[e])
            entry = {token: Logprob(float(out.logprobs[row]), int(out.ranks[row]))}
            k = request.params.logprobs or 0
            if k and out.top_token_ids is not None:
                top = zip(
                    out.top_token_ids[row][:k].tolist(),
                    out.top_logprobs[row][:k].tolist(),  # type: ignore[index]
                    strict=True,
                )
                for rank, (tid, lp) in enumerate(top, start=1):
                    entry.setdefault(int(tid), Logprob(float(lp), rank))
            assert request.logprobs is not None
            request.logprobs.setdefault(int(samples[e]), []).append(entry)

    @staticmethod
    def attach(request: Request, completions: list[CompletionOutput]) -> None:
        """Each completion's logprob dicts, for the tokens it carries."""
        assert request.logprobs is not None
        for completion in completions:
            entries = request.logprobs.get(completion.index, [])
            start = request.logprobs_sent.get(completion.index, 0) if request.delta else 0
            end = start + len(completion.token_ids)
            completion.logprobs = entries[start:end]
            request.logprobs_sent[completion.index] = end

    @staticmethod
    def attach_arrays(request: Request, completions: list[CompletionOutput]) -> None:
        """Each completion's logprobs as one float32 array (``logprobs_as_arrays``)."""
        assert request.logprob_arrays is not None
        for completion in completions:
            values = request.logprob_arrays.get(completion.index, array.array("f"))
            completion.logprob_array = np.frombuffer(values, np.float32).copy()
