"""What the device sampler reads of one request, with vLLM-compatible meanings.

This file owns :class:`DeviceSamplingParams`: the sampler's knobs only. Users write
the public :class:`kvpage.SamplingParams` (validated, with the scheduler's stop
conditions too), which hands the runner one of these
(``SamplingParams.device_params``). The runner copies these numbers into a device
table row (see :mod:`kvpage.sampling.table`), so changing them never changes
a compiled shape.
"""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_EPSILON = 1e-5
"""Temperatures below this are greedy (argmax)."""

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""What ``logprobs`` report (vLLM's names), by code: ``raw_*`` are the model's logits (or
their log-softmax) before anything else; ``processed_*`` come after penalties, grammar
masks, min_tokens, temperature, min-p, top-k and top-p: the distribution the token was
drawn from (greedy rows: the logits argmax was taken over)."""


@dataclass(slots=True)
class DeviceSamplingParams:
    """How to pick each next token of one request.

    * ``temperature``: 0 (or < 1e-5) means greedy; otherwise logits are divided by it.
    * ``top_k``: keep the ``k`` most likely tokens (ties at the boundary kept); 0 or -1 = off.
    * ``top_p``: keep the smallest top set whose probability reaches ``top_p``; 1 = off.
    * ``min_p``: drop tokens whose probability is below ``min_p`` x the top probability.
    * ``seed``: when set, the request's ``i``-th generated token is drawn with a key derived
      from ``(seed, i)`` only, so results do not depend on the rest of the batch.
    * ``presence_penalty`` / ``frequency_penalty``: subtracted from the logit of tokens
      already generated (once / once per occurrence); prompt tokens do not count.
    * ``repetition_penalty``: tokens in the prompt or the output get positive logits
      divided and negative logits multiplied by it; 1 = off.
    * ``logprobs``: None = no top list; ``n`` = also return the ``n`` most likely tokens
      with their log-probabilities. The sampled token's log-probability is always returned.
      ``logprobs_mode`` (a code into :data:`LOGPROBS_MODES`) says which values they are.
    * ``min_tokens`` / ``stop_token_ids``: while fewer than ``min_tokens`` tokens have been
      generated, the tokens in ``stop_token_ids`` (the caller includes EOS unless it ignores
      it) cannot be sampled.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs_mode: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0 <= self.logprobs_mode < len(LOGPROBS_MODES):
            raise ValueError(f"logprobs_mode must be a code into {LOGPROBS_MODES}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
