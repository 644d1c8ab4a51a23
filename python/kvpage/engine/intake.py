"""Request intake: a new request's prompt token ids, its checks against the engine's
limits (a ``ValueError`` naming what is wrong, nothing queued), and its admission to
the scheduler and to each stage of the engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpage.engine.requests import Request
from kvpage.lora.request import LoRARequest
from kvpage.lora.slots import LoRASlotsFullError
from kvpage.outputs import RequestMetrics
from kvpage.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvpage._core import Grammar
    from kvpage.engine.context import EngineContext
    from kvpage.engine.logprobs import SampledLogprobs
    from kvpage.engine.outputs import EngineOutputs
    from kvpage.engine.requests import RequestTable
    from kvpage.engine.scoring import PromptScoring
    from kvpage.engine.structured import StructuredOutputs

PromptType = str | dict[str, Any] | Sequence[int]


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_num_waiting``: shed load (HTTP 503)."""


def prompt_ids(prompt: PromptType, tokenizer: Any) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of a prompt: a text (tokenized), a dict with
    ``prompt_token_ids`` (and optionally its ``prompt``) or ``prompt``, or token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
        return prompt, list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt_ids(prompt["prompt"], tokenizer)
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return None, list(prompt)


class RequestIntake:
    """``LLMEngine.add_request``: check a request, then queue it."""

    __slots__ = ("_ctx", "_logprobs", "_outputs", "_requests", "_scoring", "_structured")

    def __init__(
        self, ctx: EngineContext, requests: RequestTable, outputs: EngineOutputs,
        logprobs: SampledLogprobs, scoring: PromptScoring, structured: StructuredOutputs,
    ) -> None:
        self._ctx = ctx
        self._requests = requests
        self._outputs = outputs
        self._logprobs = logprobs
        self._scoring = scoring
        self._structured = structured

    def add(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None,
        priority: int, cache_salt: str | None, *, delta: bool, final_only: bool,
        arrival_time: float | None, score_from: int | None, logprobs_as_arrays: bool,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """See ``LLMEngine.add_request``."""
        params = params or SamplingParams()
        self._check_room(request_id, priority)
        text, ids = prompt_ids(prompt, self._ctx.tokenizer)
        grammar = self._check(ids, params, score_from, logprobs_as_arrays)
        lora = self._requests.lora
        if lora_request is not None:
            if lora is None:
                raise ValueError("a LoRA request needs an engine built with enable_lora=True")
            lora.add_adapter(lora_request)  # loads and checks it; nothing queued yet
            # An adapter's KV differs from the base model's: its own prefix-cache space.
            cache_salt = lora.cache_salt(lora_request) + (f"/{cache_salt}" if cache_salt else "")
        handle = self._ctx.scheduler.add_request(
            np.asarray(ids, np.int64),
            n=params.n,
            max_tokens=params.max_tokens,  # None: until max_model_len; the core clamps
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            stop_token_ids=params.stop_token_ids,
            priority=priority,
            cache_salt=self._scoring.cache_salt(params, cache_salt, score_from),
            # With score_from, position score_from - 1 is computed (it scores score_from).
            max_cached_tokens=None if score_from is None else score_from - 1,
        )
        if lora_request is not None:
            assert lora is not None
            try:
                lora.acquire(handle, lora_request)
            except (ValueError, LoRASlotsFullError):
                self._ctx.scheduler.abort_request(handle)
                raise
        if grammar is not None:
            self._structured.constrain(handle, grammar)
        if params.uses_penalties:
            # Penalties count every earlier token on the device: drafts would be missing.
            self._ctx.scheduler.disable_speculation(handle)
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        streams = self._outputs.open(handle, ids, params, delta=delta, final_only=final_only)
        request = Request(request_id, handle, text, ids, params, metrics, streams, delta)
        self._logprobs.register(request, as_arrays=logprobs_as_arrays)
        self._requests.add(request)
        self._scoring.register(request, score_from)
        self._ctx.counters["prompt_tokens"] += len(ids)

    def _check_room(self, request_id: str, priority: int) -> None:
        """The request fits the engine: a valid priority, a new id, room in the queue."""
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must fit in a signed 64-bit integer, got {priority}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        bound = self._ctx.config.max_num_waiting
        if bound is not None and self._ctx.scheduler.num_requests_waiting >= bound:
            raise QueueFullError(f"the waiting queue is full ({bound} requests); retry later")

    def _check(
        self, ids: list[int], params: SamplingParams, score_from: int | None,
        logprobs_as_arrays: bool,
    ) -> Grammar | None:
        """Check the prompt and what the request asks for against the engine's limits;
        returns its compiled grammar, if it has one."""
        vocab = self._ctx.model_config.vocab_size
        if any((not isinstance(t, int | np.integer)) or t < 0 or t >= vocab for t in ids):
            bad = next(t for t in ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        self._ctx.config.check_logprobs(params.logprobs, params.prompt_logprobs)
        grammar = None
        if params.structured_outputs is not None:  # compile errors: ValueError, nothing queued
            grammar = self._structured.compile(params.structured_outputs)
        if score_from is not None and (
            params.prompt_logprobs is None or not 1 <= score_from < len(ids)
        ):
            raise ValueError(
                f"score_from must index a prompt token after the first (1 <= score_from "
                f"< {len(ids)}) and needs prompt_logprobs, got {score_from}"
            )
        if logprobs_as_arrays and params.logprobs != 0:
            raise ValueError("logprobs_as_arrays needs SamplingParams(logprobs=0)")
        return grammar
