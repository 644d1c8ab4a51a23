"""The engine's record of each live request (:class:`Request`) and the table of them
(:class:`RequestTable`).

A request is in the table from ``add_request`` until its last output is made (it
finished, was aborted or failed); the table also keeps the subsets a step looks up
fast (requests with logprobs, with a prompt being scored, with a grammar).
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpage._core import OutputStreams
    from kvpage.lora.slots import LoRASlots
    from kvpage.outputs import Logprob, RequestMetrics
    from kvpage.outputs.output_streams import PythonOutputStreams
    from kvpage.outputs.prompt_logprobs import PromptLogprobsRecord
    from kvpage.sampling.params import SamplingParams


@dataclass(slots=True)
class Request:
    request_id: str
    handle: int
    """The scheduler's id of the request (``rust/sched/request.rs``)."""
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    streams: OutputStreams | PythonOutputStreams
    """The output streams holding this request's samples."""
    delta: bool
    logprobs: dict[int, list[dict[int, Logprob]]] | None = None
    """Per sample index, each output token's logprob dict (with ``params.logprobs``)."""
    logprobs_sent: dict[int, int] = field(default_factory=dict)
    """Per sample index, logprob dicts already handed out (delta outputs)."""
    logprob_arrays: dict[int, array.array] | None = None
    """Instead of ``logprobs`` (``logprobs_as_arrays``): per sample index, the sampled
    tokens' logprobs as float32 values, no Python object per token."""
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_scores: PromptLogprobsRecord | None = None
    """The prompt's logprobs, filled step by step (with ``params.prompt_logprobs``)."""
    prompt_logprobs_sent: bool = False
    score_from: int | None = None


class RequestTable:
    """The live requests, by ``request_id`` and by scheduler ``handle``."""

    __slots__ = ("_by_id", "by_handle", "constrained", "logprobs", "lora", "scoring")

    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}
        self.by_handle: dict[int, Request] = {}
        self.logprobs: set[int] = set()
        """Handles of the requests that asked for sampled-token logprobs."""
        self.scoring: dict[int, Request] = {}
        """The requests whose prompt still has tokens to score, by handle."""
        self.constrained: set[int] = set()
        """Handles of the requests that follow a grammar."""
        self.lora: LoRASlots | None = None
        """The engine's LoRA slots (``enable_lora``): a removed request unpins its slot."""

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __getitem__(self, request_id: str) -> Request:
        return self._by_id[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def values(self) -> Iterator[Request]:
        return iter(self._by_id.values())

    def add(self, request: Request) -> None:
        self._by_id[request.request_id] = request
        self.by_handle[request.handle] = request

    def remove(self, request: Request) -> None:
        """Forget a request whose last output is being made."""
        self._by_id.pop(request.request_id, None)
        self.by_handle.pop(request.handle, None)
        self.constrained.discard(request.handle)
        self.scoring.pop(request.handle, None)
        self.logprobs.discard(request.handle)
        if self.lora is not None:
            self.lora.release(request.handle)
