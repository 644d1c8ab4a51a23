"""Output streams in Python: the twin of the Rust core's ``OutputStreams``
(``rust/output/output_streams.rs``), with the same methods and outputs, for tokenizers
the Rust core cannot load (:func:`kvpage.outputs.detokenizer.rust_token_decoder` returns
None). Its text comes from :class:`IncrementalDetokenizer`, which produces the
Rust detokenizer's text character for character; ``tests/outputs/test_detokenizer_rust.py``
holds the two twins to the same outputs.

The engine drives either with three bulk calls a step: ``push`` (the scheduler's
update events), ``detokenize`` (text and stop strings; returns the samples a stop
string finished) and ``take_outputs`` (what is new, request by request). A
finished sample's text is what ``decode`` gives for its tokens, an incomplete last
character included (as U+FFFD); as in vLLM, the text of a stop token that finished
it (EOS or a stop token id: ``stop_token_ids``) is left out unless
``include_stop_str_in_output`` (its id stays in the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpage._core import FINISH_REASONS
from kvpage.outputs.detokenizer import IncrementalDetokenizer

MODES = ("delta", "cumulative", "final")

OutputTuple = tuple[int, bool, float | None, float | None, list[Any]]
"""``(handle, done, first_token_time, last_token_time, completions)``: what both
twins' ``take_outputs`` return, each completion made by the ``completion_output``
type they were given (``kvpage.outputs.CompletionOutput`` in the engine)."""


@dataclass(slots=True)
class _SampleStream:
    text: IncrementalDetokenizer | None
    tokens: list[int] = field(default_factory=list)
    fed: int = 0
    sent_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish: str | None = None
    stop: int | str | None = None
    versions: list[tuple[int, int]] = field(default_factory=list)
    stop_token_hidden: bool = False
    """The last token is a stop token that finished the sample; its text is left out."""


@dataclass(slots=True)
class _RequestStreams:
    mode: str
    report_logprob: bool
    text: dict[str, Any] | None
    samples: list[_SampleStream | None]
    num_finished: int = 0
    closed: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    dirty: bool = False

    def done(self) -> bool:
        return self.closed or self.num_finished == len(self.samples)

    def new_sample(self) -> _SampleStream:
        if self.text is None:
            return _SampleStream(None)
        spec = dict(self.text)
        tokenizer, prompt = spec.pop("tokenizer"), spec.pop("prompt_token_ids")
        del spec["stop_token_ids"]
        return _SampleStream(IncrementalDetokenizer(tokenizer, prompt, **spec))

    def hides_stop_token(self, token: int) -> bool:
        """A sample that finishes with "stop" on ``token`` shows no text for it."""
        return (
            self.text is not None
            and not self.text["include_stop_str_in_output"]
            and token in self.text["stop_token_ids"]
        )


class PythonOutputStreams:
    """Every live request's output streams (see the module docs)."""

    def __init__(self, completion_output: Any) -> None:
        self._completion_output = completion_output
        self._requests: dict[int, _RequestStreams] = {}
        self._dirty: list[int] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, handle: int) -> bool:
        return handle in self._requests

    def add_request(
        self,
        handle: int,
        n: int,
        mode: str,
        *,
        logprobs: bool = False,
        decoder: Any = None,
        prompt_token_ids: Any = None,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        stop_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """``decoder``: the Hugging Face tokenizer (None: no text); ``stop_token_ids``:
        EOS and the request's stop token ids (see the module docs)."""
        if mode not in MODES:
            raise ValueError(f"output mode must be 'delta', 'cumulative' or 'final', got {mode!r}")
        if n < 1:
            raise ValueError("a request needs at least one sample")
        if handle in self._requests:
            raise ValueError(f"request handle {handle} already has output streams")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        text = None
        if decoder is not None:
            text = {
                "tokenizer": decoder,
                "prompt_token_ids": list(prompt_token_ids or ()),
                "stop": tuple(stop),
                "include_stop_str_in_output": include_stop_str_in_output,
                "skip_special_tokens": skip_special_tokens,
                "stop_token_ids": frozenset(stop_token_ids),
            }
        self._requests[handle] = _RequestStreams(mode, logprobs, text, [None] * n)

    def _mark_dirty(self, handle: int, request: _RequestStreams) -> None:
        if not request.dirty:
            request.dirty = True
            self._dirty.append(handle)

    def push(
        self,
        handles: np.ndarray,
        sample_indices: np.ndarray,
        tokens: np.ndarray,
        finish_codes: np.ndarray,
        stop_tokens: np.ndarray,
        logprobs: np.ndarray,
        now: float,
        version: int,
    ) -> np.ndarray:
        """Append a step's sampled tokens; returns which entries were taken."""
        accepted = np.zeros(len(handles), bool)
        rows = zip(
            handles.tolist(), sample_indices.tolist(), tokens.tolist(), finish_codes.tolist(),
            stop_tokens.tolist(), logprobs.tolist(), strict=True,
        )
        for i, (handle, index, token, code, stop_token, logprob) in enumerate(rows):
            request = self._requests.get(handle)
            if request is None:
                continue
            if not 0 <= index < len(request.samples):
                raise ValueError(
                    f"sample index {index} of request {handle} is out of range "
                    f"(n = {len(request.samples)})"
                )
            sample = request.samples[index]
            if sample is None:
                sample = request.samples[index] = request.new_sample()
            if sample.finish is not None:
                continue
            accepted[i] = True
            if not sample.versions or sample.versions[-1][1] != version:
                sample.versions.append((len(sample.tokens), version))
            sample.tokens.append(token)
            if sample.text is None:
                sample.fed = len(sample.tokens)
            sample.cumulative_logprob += logprob
            if code:
                sample.finish = FINISH_REASONS[code]
                if stop_token:
                    sample.stop = token
                sample.stop_token_hidden = (
                    sample.finish == "stop" and request.hides_stop_token(token)
                )
                request.num_finished += 1
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            self._mark_dirty(handle, request)
        return accepted

    def detokenize(self) -> list[tuple[int, int]]:
        """Text of every pending token, and of a finished sample the text held back
        (an incomplete last character); the samples a stop string finished."""
        stopped: list[tuple[int, int]] = []
        for handle in self._dirty:
            self._detokenize_request(handle, self._requests[handle], stopped)
        return stopped

    @staticmethod
    def _detokenize_request(
        handle: int, request: _RequestStreams, stopped: list[tuple[int, int]]
    ) -> None:
        for index, sample in enumerate(request.samples):
            if sample is None or sample.text is None:
                continue
            text = sample.text
            if text.stop_reason is not None:
                continue  # stopped in an earlier call
            shown = len(sample.tokens) - sample.stop_token_hidden  # fed without its text
            while sample.fed < shown and text.stop_reason is None:
                text.add_token(sample.tokens[sample.fed])
                sample.fed += 1
            if sample.finish is not None and text.stop_reason is None:
                sample.fed = len(sample.tokens)
                text.finish()
            if text.stop_reason is None:
                continue
            if sample.fed < len(sample.tokens):
                sample.stop_token_hidden = False  # dropped with the tokens after the stop
            del sample.tokens[sample.fed :]
            sample.versions = [v for v in sample.versions if v[0] < sample.fed]
            if sample.finish is None:
                request.num_finished += 1
                stopped.append((handle, index))
            sample.finish = "stop"
            sample.stop = text.stop_reason

    def finish_request(self, handle: int, reason: str) -> bool:
        """End a request from outside ("abort", "error"): every unfinished sample
        (those never started too) gets ``reason``, pending text is made (a stop
        string it contains still wins); its next output is its last."""
        if reason not in FINISH_REASONS.values():
            raise ValueError(f"unknown finish reason {reason!r}")
        request = self._requests.get(handle)
        if request is None:
            return False
        for index, sample in enumerate(request.samples):
            if sample is None:
                sample = request.samples[index] = request.new_sample()
            if sample.finish is None:
                sample.finish = reason
                request.num_finished += 1
        self._detokenize_request(handle, request, [])
        request.closed = True
        self._mark_dirty(handle, request)
        return True

    def take_outputs(self) -> list[OutputTuple]:
        outputs = []
        dirty, self._dirty = self._dirty, []
        for handle in dirty:
            request = self._requests[handle]
            request.dirty = False
            if request.mode == "final" and not request.done():
                continue
            outputs.append(self._output(handle, request))
        return outputs

    def take_request(self, handle: int) -> OutputTuple | None:
        request = self._requests.get(handle)
        if request is None:
            return None
        if request.dirty:
            request.dirty = False
            self._dirty.remove(handle)
        return self._output(handle, request)

    def remove(self, handle: int) -> bool:
        if self._requests.pop(handle, None) is None:
            return False
        if handle in self._dirty:
            self._dirty.remove(handle)
        return True

    def _output(self, handle: int, request: _RequestStreams) -> OutputTuple:
        done = request.done()
        samples = []
        for index, s in enumerate(request.samples):
            if s is None:
                continue
            if request.mode == "delta":
                start = s.sent_tokens
                text = s.text.take_delta(s.finish is not None or done) if s.text else ""
            else:
                start, text = 0, s.text.text if s.text else ""
            s.sent_tokens = s.fed
            cumulative = s.cumulative_logprob if request.report_logprob else None
            samples.append(self._completion_output(
                index, text, s.tokens[start : s.fed], cumulative, None, s.finish, s.stop,
                list(s.versions),
            ))
        if done:
            del self._requests[handle]
        return handle, done, request.first_token_time, request.last_token_time, samples

    def check_invariants(self) -> None:
        for handle, request in self._requests.items():
            finished = 0
            for s in request.samples:
                if s is None:
                    continue
                if not s.sent_tokens <= s.fed <= len(s.tokens):
                    raise ValueError(f"request {handle}: sent/fed/tokens out of order")
                if s.stop_token_hidden and s.finish is None:
                    raise ValueError(f"request {handle}: a hidden stop token, unfinished")
                finished += s.finish is not None
            if finished != request.num_finished:
                raise ValueError(f"request {handle}: num_finished out of date")
            if self._dirty.count(handle) != int(request.dirty):
                raise ValueError(f"request {handle}: dirty list out of date")
