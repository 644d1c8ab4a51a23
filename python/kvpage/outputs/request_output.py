"""What generation returns: vLLM's ``RequestOutput`` / ``CompletionOutput``
shapes, plus per-request timing metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token and its rank in the distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. In streaming deltas, ``text`` and
    ``token_ids`` hold only what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    """None while running, else "stop", "length", "abort" or "error"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sample, if any."""
    params_versions: list[tuple[int, int]] = field(default_factory=list)
    """(start token index, params version) ranges: which weights produced which tokens."""
    logprob_array: np.ndarray | None = None
    """float32 ``[len(token_ids)]``: each token's logprob, for requests that asked for
    arrays instead of dicts (``LLM.rollout``); in the ``logprobs_mode`` of the request."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: None for the first prompt token, then
    per prompt token a dict token id -> Logprob (the prompt token and the top-k). In
    streaming deltas it comes once, with the first output."""
    prompt_logprob_array: np.ndarray | None = None
    """For a request added with ``score_from``: float32 logprobs of prompt tokens
    ``score_from:`` (``LLM.score``), instead of ``prompt_logprobs``."""
