"""What a client is handed: each request's output streams and the ``RequestOutput``s
made from them.

The streams -- in the Rust core (``OutputStreams``, ``rust/output/output_streams.rs``),
or their Python twin (:class:`PythonOutputStreams`) for tokenizers the Rust core cannot
load -- own each sample's output tokens, text, stop strings, cumulative logprob, finish
and what was already sent. Each step they are fed the scheduler's update events
(:meth:`EngineOutputs.push`), asked for text and stop strings and for the new outputs
(:meth:`EngineOutputs.process_text`): a few calls a step, no token handled one at a
time in Python. A request's last output retires it from the engine.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpage._core import OutputStreams, TokenDecoder
from kvpage.engine.scoring import take_prompt_logprobs
from kvpage.outputs import CompletionOutput, RequestOutput
from kvpage.outputs.detokenizer import _PROMPT_CONTEXT_TOKENS, rust_token_decoder
from kvpage.outputs.output_streams import OutputTuple, PythonOutputStreams

if TYPE_CHECKING:
    from kvpage.engine.context import EngineContext
    from kvpage.engine.logprobs import SampledLogprobs
    from kvpage.engine.requests import Request, RequestTable
    from kvpage.sampling.params import SamplingParams

Streams = OutputStreams | PythonOutputStreams


class EngineOutputs:
    """The output streams of the live requests, and the outputs made from them."""

    def __init__(
        self, ctx: EngineContext, requests: RequestTable, logprobs: SampledLogprobs
    ) -> None:
        self._ctx = ctx
        self._requests = requests
        self._logprobs = logprobs
        self.rust_detokenization = True
        """Stream outputs through the Rust core's ``OutputStreams`` when it can load the
        tokenizer (False: through their Python twin); read when a request is added."""
        self._streams = OutputStreams(CompletionOutput)
        self.python_streams: PythonOutputStreams | None = None
        """Streams of requests whose tokenizer the Rust core cannot load."""
        # Loaded now (~0.5 s for a 49k vocabulary), not on the first request.
        tokenizer = ctx.tokenizer
        self._token_decoder: tuple[Any, TokenDecoder | None] = (
            tokenizer, None if tokenizer is None else rust_token_decoder(tokenizer)
        )
        self.finished_counts: dict[str, int] = {}
        """Finished samples by finish reason (``abort`` for a sample with none)."""

    @property
    def token_decoder(self) -> TokenDecoder | None:
        """The Rust decoder of the tokenizer (reloaded if the tokenizer is replaced):
        new requests stream through the Rust core's output streams, every sample of a
        step in one call. None: through their Python twin, for tokenizers the Rust core
        cannot load, or with ``rust_detokenization`` off."""
        tokenizer = self._ctx.tokenizer
        if not self.rust_detokenization or tokenizer is None:
            return None
        source, decoder = self._token_decoder
        if source is not tokenizer:
            decoder = rust_token_decoder(tokenizer)
            self._token_decoder = (tokenizer, decoder)
        return decoder

    def open(
        self, handle: int, prompt: list[int], params: SamplingParams, *, delta: bool,
        final_only: bool,
    ) -> Streams:
        """Open a new request's output streams: in the Rust core, unless its tokenizer
        can only detokenize in Python."""
        mode = "final" if final_only else "delta" if delta else "cumulative"
        decoder: Any = self.token_decoder
        tokenizer = self._ctx.tokenizer
        streams: Streams = self._streams
        if decoder is None and tokenizer is not None:
            if self.python_streams is None:
                self.python_streams = PythonOutputStreams(CompletionOutput)
            streams, decoder = self.python_streams, tokenizer
        text: dict[str, Any] = {}
        if decoder is not None:
            text = {
                "decoder": decoder,
                "prompt_token_ids": prompt[-_PROMPT_CONTEXT_TOKENS:],
                "stop": list(params.stop_strings),
                "include_stop_str_in_output": params.include_stop_str_in_output,
                "skip_special_tokens": params.skip_special_tokens,
                # A sample these finish shows no text for them (vLLM's rule).
                "stop_token_ids": sorted({*self._ctx.eos_token_ids, *params.stop_token_ids}),
            }
        streams.add_request(handle, params.n, mode, logprobs=params.logprobs is not None, **text)
        return streams

    def push(
        self, handles: np.ndarray, samples: np.ndarray, tokens: np.ndarray, codes: np.ndarray,
        stop_tokens: np.ndarray, logprobs: np.ndarray,
    ) -> np.ndarray:
        """Hand a step's sampled tokens (the scheduler's update events) to the streams;
        returns which were accepted (a failed request's streams are gone). Text comes
        later, in :meth:`process_text`."""
        step = (
            handles, samples, tokens, codes, stop_tokens, logprobs, time.monotonic(),
            self._ctx.params_version,
        )
        accepted = self._streams.push(*step)
        if self.python_streams:
            accepted |= self.python_streams.push(*step)
        return accepted

    def process_text(self) -> list[RequestOutput]:
        """Text and stop strings of every new token, then the outputs of every
        request that progressed: one call each into the output streams."""
        outputs = []
        by_handle = self._requests.by_handle
        finish_sample = self._ctx.scheduler.finish_sample
        for streams in (self._streams, self.python_streams):
            if not streams:
                continue
            for handle, index in streams.detokenize():
                finish_sample(handle, index, "stop")
            for taken in streams.take_outputs():
                outputs.append(self._output(by_handle[taken[0]], taken))
        return outputs

    def end(self, request: Request, reason: str) -> RequestOutput:
        """The last output of a request ended from outside (abort, error)."""
        request.streams.finish_request(request.handle, reason)
        taken = request.streams.take_request(request.handle)
        assert taken is not None and taken[1], "a live request has streams"
        return self._output(request, taken)

    def _output(self, request: Request, taken: OutputTuple) -> RequestOutput:
        """A ``RequestOutput`` from what the request's streams handed out."""
        _, done, first_token_time, last_token_time, completions = taken
        metrics = request.metrics
        metrics.first_token_time = first_token_time
        metrics.last_token_time = last_token_time
        if request.logprobs is not None:
            self._logprobs.attach(request, completions)
        elif request.logprob_arrays is not None:
            self._logprobs.attach_arrays(request, completions)
        if done:
            self._retire(request, completions)
        prompt_logprobs = scored = None
        if request.prompt_scores is not None:
            prompt_logprobs, scored = take_prompt_logprobs(request)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, completions, done,
            metrics, request.num_cached_tokens, request.error, prompt_logprobs, scored,
        )

    def _retire(self, request: Request, completions: list[CompletionOutput]) -> None:
        """Forget a request whose last output is being made."""
        request.finished = True
        request.metrics.finished_time = time.monotonic()
        self._requests.remove(request)
        for completion in completions:
            key = completion.finish_reason or "abort"
            self.finished_counts[key] = self.finished_counts.get(key, 0) + 1
