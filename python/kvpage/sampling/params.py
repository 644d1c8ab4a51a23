"""The public ``SamplingParams``: vLLM's names and meanings, validated.

Invalid values raise ``ValueError`` naming the field and its allowed range.
The engine splits one of these into the scheduler's stop conditions and the
device sampler's knobs (``kvpage.sampling.device_params``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage._core import DEFAULT_MAX_TOKENS  # the one default, owned by the Rust core
from kvpage.sampling.device_params import LOGPROBS_MODES, DeviceSamplingParams
from kvpage.structured_outputs.params import StructuredOutputsParams

MAX_N = 64
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256


@dataclass(slots=True)
class SamplingParams:
    """How to generate the completion(s) of one prompt.

    Fields and meanings follow vLLM: ``n`` samples per prompt; ``temperature``
    0 is greedy; ``top_p``, ``top_k`` (0 or -1 = off), ``min_p``; ``seed`` makes
    a request's samples independent of the rest of the batch; ``max_tokens``
    (None = up to ``max_model_len``), ``min_tokens`` (EOS and stop tokens are
    suppressed before that); ``stop`` strings (excluded from the text unless
    ``include_stop_str_in_output``); ``stop_token_ids`` (the text of the stop token,
    or EOS, that ends a sample is likewise left out unless
    ``include_stop_str_in_output``; its id stays in ``token_ids``); ``ignore_eos``;
    ``logprobs`` (top-N per token, the sampled one always included);
    ``logprobs_mode``: what those values are (``raw_logprobs``, the default,
    ``raw_logits``, ``processed_logprobs`` or ``processed_logits``; processed means
    after penalties, grammar, temperature, min-p, top-k and top-p: the distribution
    the token was drawn from, which is what an RL loss wants at temperature != 1;
    prompt logprobs stay raw);
    ``prompt_logprobs`` (top-N per prompt token, the prompt token always included;
    scored in the prefill's own forward pass, and such a request bypasses the prefix
    cache: see :mod:`kvpage.outputs.prompt_logprobs`);
    presence / frequency / repetition penalties; ``skip_special_tokens``;
    ``structured_outputs`` (or its older name ``guided_decoding``): a
    :class:`~kvpage.structured_outputs.StructuredOutputsParams` (or a dict of its fields)
    constraining the output to a JSON schema, regex, choice or grammar; a sample whose
    constraint is complete finishes with ``"stop"``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def finite(value: object) -> bool:
            return (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check("n", integer(self.n) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]")
        check(
            "temperature",
            finite(self.temperature) and 0 <= self.temperature <= 100,
            "a finite number in [0, 100]",
        )
        check("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        check(
            "top_k",
            integer(self.top_k) and -1 <= self.top_k < 2**31,
            "-1, 0 (off) or a positive integer",
        )
        check("min_p", finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]")
        check(
            "seed",
            self.seed is None or (integer(self.seed) and 0 <= self.seed < 2**63),
            "None or an integer in [0, 2**63)",
        )
        check(
            "max_tokens",
            self.max_tokens is None or (integer(self.max_tokens) and self.max_tokens >= 1),
            "None or an integer >= 1",
        )
        check("logprobs_mode", self.logprobs_mode in LOGPROBS_MODES, f"one of {LOGPROBS_MODES}")
        check("min_tokens", integer(self.min_tokens) and self.min_tokens >= 0, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        check(
            "logprobs",
            self.logprobs is None or (integer(self.logprobs) and self.logprobs >= 0),
            "None or an integer >= 0 (the engine's max_logprobs bounds it)",
        )
        check(
            "prompt_logprobs",
            self.prompt_logprobs is None
            or (integer(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "None or an integer >= 0 (the engine's max_logprobs bounds it)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            check(
                name, finite(getattr(self, name)) and -2 <= getattr(self, name) <= 2, "in [-2, 2]"
            )
        check(
            "repetition_penalty",
            finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "in (0, 2]",
        )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(
            "stop",
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop)
            and len(stop) <= MAX_STOP_STRINGS,
            f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_STRING_CHARS} characters",
        )
        self.stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        check(
            "stop_token_ids",
            all(integer(t) and 0 <= t < 2**31 for t in ids),
            "a list of non-negative token ids",
        )
        self.stop_token_ids = ids
        structured = StructuredOutputsParams.coerce(self.structured_outputs, "structured_outputs")
        guided = StructuredOutputsParams.coerce(self.guided_decoding, "guided_decoding")
        if structured is not None and guided is not None and structured != guided:
            raise ValueError(
                "structured_outputs and guided_decoding (its older name) differ: set one"
            )
        self.structured_outputs = self.guided_decoding = structured or guided

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def device_params(self, eos_token_ids: Sequence[int] = ()) -> DeviceSamplingParams:
        """The knobs the device sampler needs for this request. Before ``min_tokens``
        tokens, the device masks the stop tokens: ``stop_token_ids`` and, unless
        ``ignore_eos``, ``eos_token_ids``."""
        stop: set[int] = set()
        if self.min_tokens > 0:
            stop.update(self.stop_token_ids)
            if not self.ignore_eos:
                stop.update(eos_token_ids)
        return DeviceSamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            logprobs_mode=LOGPROBS_MODES.index(self.logprobs_mode),
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(sorted(stop)),
        )
