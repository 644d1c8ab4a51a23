"""A validated request once it is added to the engine: one stream per prompt.

This file owns :class:`Generation` (the engine streams of one HTTP request and what
its response needs: id, model, ``n``, logprobs, usage), :class:`Usage` (token counts,
with the prompt tokens served from the prefix cache) and :class:`Echo` (what the
request asked of its prompts: ``echo``, ``prompt_logprobs``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvpage.engine.async_engine import RequestStream
from kvpage.outputs import Logprob, RequestOutput


@dataclass(slots=True)
class Usage:
    prompt_tokens: list[int]
    cached: list[int]
    completion_tokens: int = 0
    count_completion: bool = True
    """False for ``echo`` with ``max_tokens: 0`` (the one generated token is dropped)."""

    def add(self, index: int, output: RequestOutput) -> None:
        self.cached[index] = max(self.cached[index], output.num_cached_tokens)
        if self.count_completion:
            self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def json(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}


@dataclass(slots=True)
class Echo:
    """What a request asked of its prompt (``echo``, ``prompt_logprobs``) and the
    prompt logprobs of each of its prompts, as the engine delivers them."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str] | None  # set for echo
    prompt_logprobs_k: int | None  # vLLM's prompt_logprobs field
    scores_only: bool = False  # echo with max_tokens 0: drop what was generated
    scores: list[list[dict[int, Logprob] | None] | None] = field(default_factory=list)

    def take(self, index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.scores[index] = output.prompt_logprobs
        if self.scores_only:
            output.outputs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[],
                                                  cumulative_logprob=None)
                              for c in output.outputs]


@dataclass(slots=True)
class Generation:
    """A validated request, added to the engine: one stream per prompt."""

    request_id: str
    created: int
    model: str
    n: int
    streams: list[RequestStream]
    usage: Usage
    num_logprobs: int | None
    include_usage: bool
    prompt_token_ids: list[list[int]] | None = None
    """Set when the request asked for ``return_token_ids``."""
    echo: Echo | None = None

    def take(self, index: int, output: RequestOutput) -> None:
        """Take in ``output`` of prompt ``index``: its prompt logprobs (and, for
        ``echo`` with ``max_tokens: 0``, nothing generated) and its usage."""
        if self.echo is not None:
            self.echo.take(index, output)
        self.usage.add(index, output)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()
