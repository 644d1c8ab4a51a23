"""The OpenAI-compatible HTTP server.

This file owns:

* ``build_app``: the FastAPI app over an ``AsyncLLMEngine`` with
  ``/v1/completions`` and ``/v1/chat/completions`` (SSE streaming and not,
  ``n``, several prompts, logprobs, usage with cached prompt tokens, ``echo`` and
  vLLM's ``prompt_logprobs``: :mod:`kvpage.echo`),
  ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text);
* an ASGI guard for the API key (``Authorization: Bearer``, compared in
  constant time; every route but ``/health``, and ``/metrics`` too unless
  ``public_metrics``) and the request-body size limit (413);
* mapping engine errors to OpenAI-style JSON errors (400, 401, 404, 413, 503,
  500) and ``RequestOutput`` deltas to OpenAI responses and chunks;
* aborting a request whose client went away (streaming or not);
* ``run_server``: load a model, serve it with uvicorn (on 127.0.0.1 unless
  told otherwise; with a bounded waiting queue) and, on SIGTERM or SIGINT,
  stop accepting, let running requests finish within a bounded grace period,
  check that every KV block is back in the pool, and return (the process
  exits 0).

Hostile input never reaches a 5xx: malformed, too deeply nested or otherwise
unparsable JSON, integers out of the engine's range and text that is not
valid Unicode are 400s; text is tokenized off the event loop, so a huge
prompt does not stall the streams of other clients.

Request bodies are validated by ``kvpage.protocol``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpage.async_engine import (
    AsyncLLMEngine,
    EngineClosedError,
    RequestFailedError,
    RequestStream,
)
from kvpage.echo import concat_logprobs, echo_logprobs, prompt_logprobs_json
from kvpage.engine import QueueFullError
from kvpage.engine_config import EngineConfig
from kvpage.outputs import CompletionOutput, Logprob, RequestOutput
from kvpage.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    refuse_not_implemented,
    validation_error,
    value_error,
)
from kvpage.sampling_params import SamplingParams
from kvpage.sse_events import DONE, ChunkTemplate, sse_event

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_GRACE_SECONDS = 30.0
OPEN_PATHS = frozenset({"/health", "/ping"})
"""Routes that need no API key."""
MAX_PROMPTS_PER_REQUEST = 1024
"""Most prompts one ``/v1/completions`` request may carry (each becomes an
engine request)."""
DEFAULT_WAITING_PER_SEQ = 4
"""``run_server`` bounds the waiting queue at this many requests per running
slot (at least ``_MIN_DEFAULT_WAITING``) unless ``max_num_waiting`` is set."""
_MIN_DEFAULT_WAITING = 64
_MIN_LOGPROB = -9999.0
"""JSON has no -inf: log-probabilities are clamped to this."""


# ---- errors -----------------------------------------------------------------


def _error_json(error: APIError) -> Response:
    # ASCII-escaped: a message quoting client text with a lone surrogate must
    # not fail to encode (which would turn a 4xx into a 500)
    return Response(json.dumps(error.body()), status_code=error.status,
                    media_type="application/json")


def _engine_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception from adding or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(503, f"the server is overloaded: {exc}", "service_unavailable_error",
                        code="queue_full")
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), "service_unavailable_error", code="shutting_down")
    if isinstance(exc, ValueError | OverflowError):  # an int out of the core's range
        return value_error(exc)
    return APIError(500, str(exc) or type(exc).__name__, "internal_server_error",
                    code="engine_error")


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """ASGI middleware: API-key check and request-body size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.api_key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"] not in self.open_paths \
                and not self._authorized(scope):
            await _send_error(send, APIError(
                401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                "authentication_error", code="invalid_api_key"))
            return
        too_large = APIError(413, f"the request body exceeds {self.max_body_bytes} bytes",
                             "invalid_request_error", code="request_too_large")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_body_bytes:
                    await _send_error(send, too_large)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, too_large)


# ---- helpers ----------------------------------------------------------------


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB if value < 0 or math.isnan(value) \
        else -_MIN_LOGPROB


async def _merged_batches(
    streams: Sequence[RequestStream],
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """(prompt index, output) pairs from several request streams, in batches of
    everything ready at once (each stream's outputs in order): when the handler
    is behind the engine, one wake-up and one send carry several steps."""
    if len(streams) == 1:
        stream = streams[0]
        while not stream.finished:
            yield [(0, output) for output in await stream.next_batch()]
        return
    queue: asyncio.Queue[tuple[int, list[RequestOutput] | BaseException | None]] = \
        asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            while not stream.finished:
                queue.put_nowait((index, await stream.next_batch()))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch: list[tuple[int, RequestOutput]] = []
            for index, item in items:
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                else:
                    batch.extend((index, output) for output in item)
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; cancel it and return None if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()


@dataclass(slots=True)
class _Usage:
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
class _Echo:
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
class _Generation:
    """A validated request, added to the engine: one stream per prompt."""

    request_id: str
    created: int
    model: str
    n: int
    streams: list[RequestStream]
    usage: _Usage
    num_logprobs: int | None
    include_usage: bool
    prompt_token_ids: list[list[int]] | None = None
    """Set when the request asked for ``return_token_ids``."""
    echo: _Echo | None = None

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


def _state(request: Request) -> _Server:
    """The server state behind the app handling ``request``."""
    return request.app.state.kvpage


class _Server:
    """The state behind the routes."""

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ---- request preparation --------------------------------------------

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                       f"{', '.join(map(repr, self.model_names))}", "invalid_request_error",
                       param="model", code="model_not_found")

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvpage",
                "root": self.model_names[0], "parent": None,
                "max_model_len": self.engine.max_model_len}

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request("the model has no tokenizer: send prompts as token ids")
        return tokenizer

    async def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, computed on a worker thread (a long text
        must not stall the event loop, which serves every other stream)."""
        _check_unicode(text, param)
        tokenizer = self.tokenizer
        ids = await asyncio.to_thread(tokenizer, text, add_special_tokens=add_special_tokens)
        return list(ids["input_ids"])

    async def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          continue_final_message: bool = False) -> str:
        """The chat template applied to ``messages`` (on a worker thread)."""
        for message in messages:
            for value in message.values():
                _check_unicode(value, "messages")
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request("the model has no chat template; use /v1/completions")
        try:
            extra = {"continue_final_message": True} if continue_final_message else {}
            return await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, tokenize=False,
                add_generation_prompt=add_generation_prompt, **extra)
        except ImportError as exc:  # jinja2 missing: the server's fault, not the client's
            raise APIError(500, f"chat templates need jinja2 (install kvpage[serve]): {exc}",
                           "internal_server_error", code="missing_dependency") from None
        except Exception as exc:  # a template may reject a conversation
            raise bad_request(f"the chat template failed on these messages: {exc}",
                              param="messages") from None

    def check_top_logprobs(self, top_logprobs: int | None) -> None:
        """Chat's ``top_logprobs`` within 0..max_logprobs (a 400 naming it)."""
        if top_logprobs is None:
            return
        config = getattr(self.engine.engine, "config", None)
        limit = getattr(config, "max_logprobs", 20)
        if not 0 <= top_logprobs <= limit:
            raise bad_request(f"top_logprobs must be between 0 and {limit} (max_logprobs), "
                              f"got {top_logprobs}", param="top_logprobs")

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise bad_request("the prompt is empty", param=param)
        if prompt_len >= limit:
            raise bad_request(
                f"the prompt has {prompt_len} tokens but this model's maximum context length "
                f"(max_model_len) is {limit} tokens, prompt and output together",
                param=param, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise bad_request(
                f"the prompt has {prompt_len} tokens and {max_tokens} more were requested, "
                f"which exceeds this model's maximum context length (max_model_len) of "
                f"{limit} tokens", param="max_tokens", code="context_length_exceeded")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    async def start(self, prefix: str, model: str, prompts: list[dict[str, Any]],
                    params: SamplingParams, body: Any, num_logprobs: int | None,
                    echo: _Echo | None = None) -> _Generation:
        """Add one engine request per prompt; all or none."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                     for i in range(len(prompts))]
        results = await asyncio.gather(
            # A non-streaming request takes only its final output: the engine's
            # output streams assemble the whole texts and token ids.
            *(self.engine.add_request(rid, prompt, params, body.priority, body.cache_salt,
                                      final_only=not body.stream)
              for rid, prompt in zip(ids, prompts, strict=True)),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for stream in streams:
                stream.abort()
            raise _engine_error(failure)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage = _Usage([len(p["prompt_token_ids"]) for p in prompts], [0] * len(prompts))
        prompt_ids = [list(p["prompt_token_ids"]) for p in prompts] \
            if getattr(body, "return_token_ids", False) else None
        if echo is not None:
            echo.scores = [None] * len(prompts)
            usage.count_completion = not echo.scores_only
        return _Generation(request_id, int(time.time()), model, params.n, streams, usage,
                           num_logprobs, include_usage, prompt_ids, echo)

    def echoed_logprobs(self, gen: _Generation, index: int,
                        generated: dict[str, Any] | None) -> dict[str, Any] | None:
        """The legacy ``logprobs`` of choice ``index`` with the prompt's in front."""
        echo, prompt = gen.echo, index // gen.n
        if echo is None or gen.num_logprobs is None or echo.scores[prompt] is None:
            return generated
        head = echo_logprobs(echo.prompt_ids[prompt], echo.scores[prompt], gen.num_logprobs,
                             self.token_text, _finite)
        return concat_logprobs(head, generated)

    def prompt_logprobs_field(self, gen: _Generation, prompt: int) -> Any:
        echo = gen.echo
        if echo is None or echo.prompt_logprobs_k is None or echo.scores[prompt] is None:
            return None
        return prompt_logprobs_json(echo.prompt_ids[prompt], echo.scores[prompt],
                                    echo.prompt_logprobs_k, self.token_text, _finite)

    # ---- logprobs -------------------------------------------------------

    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]],
                            k: int, offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(_finite(entry[token_id].logprob))
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            top.append({self.token_text(t): _finite(lp.logprob) for t, lp in ranked
                        if t == token_id or (lp.rank is not None and lp.rank <= k)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]],
                      k: int) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token_text(token_id)
            ranked = sorted(((t, lp) for t, lp in entry.items()
                             if lp.rank is not None and lp.rank <= k),
                            key=lambda kv: kv[1].rank or 0)
            content.append({
                "token": text, "logprob": _finite(entry[token_id].logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.token_text(t), "logprob": _finite(lp.logprob),
                                  "bytes": list(self.token_text(t).encode())}
                                 for t, lp in ranked],
            })
        return {"content": content}


def _stream_error(exc: BaseException) -> bytes:
    error = _engine_error(exc)
    return sse_event(error.body())


class _SSEResponse(StreamingResponse):
    """An SSE stream that runs ``on_close`` however it ends (finished, client
    gone, cancelled), even if the event generator never started."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ---- streaming ----------------------------------------------------------------


async def _choice_deltas(gen: _Generation) -> AsyncIterator[list[tuple[int, Any, bool]]]:
    """(choice index, completion delta, wants logprobs) for every delta worth
    sending, across all prompts and samples, in batches of what is ready at once
    (one send each); counts usage on the way and drops anything after a choice's
    final delta."""
    done: set[int] = set()
    async for batch in _merged_batches(gen.streams):
        deltas = []
        for i, out in batch:
            if gen.echo is not None:
                gen.echo.take(i, out)
            gen.usage.add(i, out)
            for c in out.outputs:
                index = i * gen.n + c.index
                wants_logprobs = gen.num_logprobs is not None and bool(c.logprobs)
                if index in done or not (c.text or c.finish_reason or wants_logprobs):
                    continue
                if c.finish_reason is not None:
                    done.add(index)
                deltas.append((index, c, wants_logprobs))
        if deltas:
            yield deltas


# ---- completions --------------------------------------------------------------


async def _completion_events(srv: _Server, gen: _Generation) -> AsyncIterator[bytes]:
    template = ChunkTemplate({"id": gen.request_id, "object": "text_completion",
                              "created": gen.created, "model": gen.model},
                             ("index", "text", "logprobs", "finish_reason", "stop_reason"))
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    try:
        async for deltas in _choice_deltas(gen):
            events = []
            for index, c, wants_logprobs in deltas:
                logprobs = None
                if wants_logprobs:
                    logprobs = srv.completion_logprobs(c.token_ids, c.logprobs,
                                                       gen.num_logprobs, offsets.get(index, 0))
                text = c.text
                echo = gen.echo
                if echo is not None and echo.prompt_texts is not None and index not in echoed:
                    # vLLM's streaming echo: the prompt comes with each choice's first chunk
                    echoed.add(index)
                    text = echo.prompt_texts[index // gen.n] + text
                    if gen.num_logprobs is not None:
                        logprobs = srv.echoed_logprobs(gen, index, logprobs)
                if logprobs is not None:
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                events.append(template.event(index, text, logprobs, c.finish_reason,
                                             c.stop_reason))
            yield b"".join(events)
        if gen.include_usage:
            yield sse_event({"id": gen.request_id, "object": "text_completion",
                             "created": gen.created, "model": gen.model, "choices": [],
                             "usage": gen.usage.json()})
        yield DONE
    except (RequestFailedError, EngineClosedError) as exc:
        yield _stream_error(exc)
        yield DONE
    finally:
        gen.abort()


async def _collect(gen: _Generation) -> list[CompletionOutput]:
    """Every choice's final output (the streams of a non-streaming request
    yield one ``RequestOutput`` each, the finished one)."""
    choices: list[CompletionOutput | None] = [None] * (len(gen.streams) * gen.n)
    try:
        async for batch in _merged_batches(gen.streams):
            for i, out in batch:
                if gen.echo is not None:
                    gen.echo.take(i, out)
                gen.usage.add(i, out)
                for c in out.outputs:
                    choices[i * gen.n + c.index] = c
    finally:
        gen.abort()
    missing = [index for index, c in enumerate(choices) if c is None]
    if missing:
        raise RuntimeError(f"the engine finished without outputs for choices {missing}")
    return [c for c in choices if c is not None]


def _completion_body(srv: _Server, gen: _Generation,
                     choices: list[CompletionOutput]) -> dict[str, Any]:
    result = []
    for index, choice in enumerate(choices):
        logprobs = None
        if gen.num_logprobs is not None:
            logprobs = srv.completion_logprobs(choice.token_ids, choice.logprobs,
                                               gen.num_logprobs, 0)
        text = choice.text
        echo = gen.echo
        if echo is not None and echo.prompt_texts is not None:
            text = echo.prompt_texts[index // gen.n] + text
            logprobs = srv.echoed_logprobs(gen, index, logprobs)
        result.append({"index": index, "text": text, "logprobs": logprobs,
                       "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        if echo is not None and echo.prompt_logprobs_k is not None:
            result[-1]["prompt_logprobs"] = srv.prompt_logprobs_field(gen, index // gen.n)
        if gen.prompt_token_ids is not None:
            result[-1]["prompt_token_ids"] = gen.prompt_token_ids[index // gen.n]
            result[-1]["token_ids"] = choice.token_ids
    return {"id": gen.request_id, "object": "text_completion", "created": gen.created,
            "model": gen.model, "choices": result, "usage": gen.usage.json()}


# ---- chat completions ---------------------------------------------------------


async def _chat_events(srv: _Server, gen: _Generation) -> AsyncIterator[bytes]:
    fixed = {"id": gen.request_id, "object": "chat.completion.chunk", "created": gen.created,
             "model": gen.model}
    template = ChunkTemplate(fixed, ("index", "delta", "logprobs", "finish_reason",
                                     "stop_reason"))

    try:
        for index in range(len(gen.streams) * gen.n):
            yield sse_event({**fixed, "choices": [{
                "index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}]})
        async for deltas in _choice_deltas(gen):
            events = []
            for index, c, wants_logprobs in deltas:
                logprobs = None
                if wants_logprobs:
                    logprobs = srv.chat_logprobs(c.token_ids, c.logprobs, gen.num_logprobs)
                events.append(template.event(index, {"content": c.text} if c.text else {},
                                             logprobs, c.finish_reason, c.stop_reason))
            yield b"".join(events)
        if gen.include_usage:
            yield sse_event({**fixed, "choices": [], "usage": gen.usage.json()})
        yield DONE
    except (RequestFailedError, EngineClosedError) as exc:
        yield _stream_error(exc)
        yield DONE
    finally:
        gen.abort()


def _chat_body(srv: _Server, gen: _Generation, choices: list[CompletionOutput]) -> dict[str, Any]:
    result = []
    for index, choice in enumerate(choices):
        logprobs = None
        if gen.num_logprobs is not None:
            logprobs = srv.chat_logprobs(choice.token_ids, choice.logprobs, gen.num_logprobs)
        result.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                       "logprobs": logprobs, "finish_reason": choice.finish_reason,
                       "stop_reason": choice.stop_reason})
        if gen.prompt_token_ids is not None:
            result[-1]["token_ids"] = choice.token_ids
    response = {"id": gen.request_id, "object": "chat.completion", "created": gen.created,
                "model": gen.model, "choices": result, "usage": gen.usage.json()}
    if gen.echo is not None and gen.echo.prompt_logprobs_k is not None:
        response["prompt_logprobs"] = srv.prompt_logprobs_field(gen, 0)
    if gen.prompt_token_ids is not None:
        response["prompt_token_ids"] = gen.prompt_token_ids[0]
    return response


async def _respond(
    request: Request,
    srv: _Server,
    gen: _Generation,
    stream: bool,
    events: Callable[[_Server, _Generation], AsyncIterator[bytes]],
    body: Callable[[_Server, _Generation, list[CompletionOutput]], dict[str, Any]],
) -> Response:
    """An SSE stream, or the whole answer once every choice finished (499 if
    the client left first; the request is aborted either way)."""
    if stream:
        return _SSEResponse(events(srv, gen), gen.abort)
    try:
        choices = await _unless_disconnected(request, _collect(gen))
    except (RequestFailedError, EngineClosedError) as exc:
        return _error_json(_engine_error(exc))
    finally:
        gen.abort()
    if choices is None:
        return Response(status_code=499)
    return JSONResponse(body(srv, gen, choices))


# ---- the app ------------------------------------------------------------------


def _check_unicode(text: str, param: str) -> None:
    """400 for text that is not valid Unicode: JSON can spell lone surrogates
    (``"\\ud800"``), which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position "
                          f"{exc.start}", param=param) from None


async def _parse(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("the request body is not valid JSON: it is nested too deeply",
                          code="invalid_json") from None
    except ValueError as exc:  # bad JSON or UTF-8, an integer of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    refuse_not_implemented(data, getattr(model, "NOT_IMPLEMENTED", {}))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None


def build_app(
    async_engine: AsyncLLMEngine,
    *,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    public_metrics: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app over a running ``AsyncLLMEngine``.

    ``served_model_name``: the name(s) clients must use in ``model`` (the
    first is reported in responses when a request names none). With
    ``api_key``, every route but ``/health`` (and ``/metrics`` when
    ``public_metrics``) needs ``Authorization: Bearer <api_key>``. Bodies over
    ``max_body_bytes`` get 413. The app does not shut the engine down.
    """
    names = [served_model_name] if isinstance(served_model_name, str) \
        else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    # Routes find their state through the request (app.state.kvpage), never through a
    # closure: FastAPI caches endpoint functions process-wide, and a closure over the
    # engine would pin its compiled executables after the app is gone.
    app = FastAPI(title="kvpage", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvpage = _Server(async_engine, names)
    open_paths = OPEN_PATHS | {"/metrics"} if public_metrics else OPEN_PATHS
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       open_paths=open_paths)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _error_json(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error")
        return _error_json(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path, exc_info=exc)
        return _error_json(APIError(500, f"internal error: {type(exc).__name__}",
                                    "internal_server_error"))

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not _state(request).engine.is_running:
            return _error_json(APIError(503, "the engine is not running",
                                        "service_unavailable_error", code="engine_dead"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = _state(request).engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(request: Request) -> Response:
        return await health(request)

    @app.get("/version")
    async def version() -> JSONResponse:
        from kvpage import __version__

        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        srv = _state(request)
        return JSONResponse({"object": "list",
                             "data": [srv.model_card(n) for n in srv.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        srv = _state(request)
        return JSONResponse(srv.model_card(srv.model_name(model_id)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        srv = _state(request)
        body = await _parse(request, TokenizeRequest)
        srv.model_name(body.model)
        body.check_supported()
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = await srv.render_chat(messages, body.add_generation_prompt,
                                         body.continue_final_message)
            special = bool(body.add_special_tokens)  # the template has them
            ids = await srv.tokenize(text, "messages", add_special_tokens=special)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await srv.tokenize(body.prompt or "", "prompt", add_special_tokens=special)
        strs = [srv.token_text(t) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": srv.engine.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        srv = _state(request)
        body = await _parse(request, DetokenizeRequest)
        srv.model_name(body.model)
        tokenizer = srv.tokenizer
        vocab = len(tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is out of range [0, {vocab})",
                              param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        srv = _state(request)
        body = await _parse(request, CompletionRequest)
        model = srv.model_name(body.model)
        body.check_supported()
        raw = body.prompt
        if isinstance(raw, str):
            raw_prompts: list[str | list[int]] = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            raw_prompts = [list(raw)]  # type: ignore[arg-type]
        else:
            raw_prompts = list(raw)  # type: ignore[arg-type]
        if not raw_prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(raw_prompts) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(f"prompt holds {len(raw_prompts)} prompts; one request may "
                              f"carry at most {MAX_PROMPTS_PER_REQUEST}", param="prompt")
        explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
        prompts = []
        for p in raw_prompts:
            ids = await srv.tokenize(p, "prompt", add_special_tokens=body.add_special_tokens
                                     is not False) if isinstance(p, str) else list(p)
            srv.check_length(len(ids), explicit, "prompt")
            prompts.append({"prompt": p if isinstance(p, str) else None,
                            "prompt_token_ids": ids})
        params = body.sampling_params(body.engine_max_tokens, body.logprobs,
                                      body.engine_prompt_logprobs)
        echo = None
        if body.echo or body.prompt_logprobs is not None:
            texts = None
            if body.echo:
                texts = [p["prompt"] if p["prompt"] is not None else
                         await asyncio.to_thread(srv.tokenizer.decode, p["prompt_token_ids"])
                         for p in prompts]
            echo = _Echo([p["prompt_token_ids"] for p in prompts], texts, body.prompt_logprobs,
                         body.scores_only)
        gen = await srv.start("cmpl", model, prompts, params, body, body.logprobs, echo)
        return await _respond(request, srv, gen, body.stream, _completion_events,
                              _completion_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        srv = _state(request)
        body = await _parse(request, ChatCompletionRequest)
        model = srv.model_name(body.model)
        body.check_supported()
        srv.check_top_logprobs(body.top_logprobs)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = await srv.render_chat(messages, body.add_generation_prompt,
                                     body.continue_final_message)
        ids = await srv.tokenize(text, "messages",
                                 add_special_tokens=bool(body.add_special_tokens))
        srv.check_length(len(ids), body.output_limit, "messages")
        params = body.sampling_params(body.output_limit, body.num_logprobs)
        echo = None if body.prompt_logprobs is None else _Echo([ids], None,
                                                               body.prompt_logprobs)
        gen = await srv.start("chatcmpl", model, [{"prompt": text, "prompt_token_ids": ids}],
                              params, body, body.num_logprobs, echo)
        return await _respond(request, srv, gen, body.stream, _chat_events, _chat_body)

    return app


# ---- running it ---------------------------------------------------------------


class _UvicornServer:
    """uvicorn's Server, with signal handling of our own: the first SIGTERM or
    SIGINT stops the engine accepting work and starts uvicorn's graceful
    shutdown (bounded by ``timeout_graceful_shutdown``); a second SIGINT
    forces it. Unlike uvicorn's own handling, the signal is not re-raised
    afterwards, so the process can exit 0."""

    def __init__(self, config: Any, on_signal: Callable[[], None]) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield from outer._capture(self)

        self.server = Server(config)
        self._on_signal = on_signal

    def _capture(self, server: Any) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(signum: int, frame: Any) -> None:
            logger.info("received %s: finishing running requests, then exiting",
                        signal.Signals(signum).name)
            self._on_signal()
            if server.should_exit and signum == signal.SIGINT:
                server.force_exit = True
            server.should_exit = True

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self) -> None:
        self.server.run()


def run_server(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    engine_config: EngineConfig | None = None,
    *,
    served_model_name: str | Sequence[str] | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    public_metrics: bool | None = None,
    metrics_prefix: str = "kvpage",
) -> None:
    """Serve the model in ``model_dir`` until SIGTERM/SIGINT; then stop
    accepting, let running requests finish for up to ``grace_seconds``, abort
    the rest, check the engine's KV pool and return.

    ``engine_config.model`` is set to ``model_dir``; an unset
    ``max_num_waiting`` becomes ``DEFAULT_WAITING_PER_SEQ * max_num_seqs`` (at
    least 64), so that past capacity the server answers 503 instead of
    queueing without bound. ``api_key`` defaults to the ``KVPAGE_API_KEY``
    environment variable; without either the API is open.
    ``public_metrics`` (default: the ``KVPAGE_PUBLIC_METRICS`` environment
    variable is 1) serves ``/metrics`` without the key. ``served_model_name``
    defaults to ``model_dir`` as given. ``metrics_prefix`` "vllm" names the
    Prometheus series ``vllm:*`` (vLLM's dashboards work unchanged).
    """
    import uvicorn

    from kvpage.extras import SERVE_MODULES, require

    require("kvpage serve", SERVE_MODULES)

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = dataclasses.replace(engine_config or EngineConfig(), model=str(model_dir))
    if config.max_num_waiting is None:
        config = dataclasses.replace(config, max_num_waiting=max(
            _MIN_DEFAULT_WAITING, DEFAULT_WAITING_PER_SEQ * config.max_num_seqs))
    if public_metrics is None:
        public_metrics = os.environ.get("KVPAGE_PUBLIC_METRICS", "") == "1"
    if api_key is None:
        api_key = os.environ.get("KVPAGE_API_KEY") or None
    names = served_model_name or str(model_dir)
    first = names if isinstance(names, str) else names[0]
    logger.info("loading %s", model_dir)
    engine = AsyncLLMEngine.from_config(config, model_name=first, metrics_prefix=metrics_prefix)
    signalled: list[float] = []

    def on_signal() -> None:
        engine.stop_accepting()
        if not signalled:  # at the end of the grace period, end what still runs
            signalled.append(time.monotonic())
            timer = threading.Timer(grace_seconds, engine.abort_all)
            timer.daemon = True
            timer.start()

    try:
        app = build_app(engine, served_model_name=names, api_key=api_key,
                        max_body_bytes=max_body_bytes, public_metrics=public_metrics)
        # uvicorn's own bound only matters if aborted streams fail to close
        uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=math.ceil(grace_seconds) + 5,
                                   lifespan="off")
        _UvicornServer(uv_config, on_signal).run()
    finally:
        spent = time.monotonic() - signalled[0] if signalled else 0.0
        engine.shutdown(max(0.0, grace_seconds - spent))
        check_engine_at_exit(engine)
    logger.info("server stopped")


def check_engine_at_exit(engine: AsyncLLMEngine) -> bool:
    """After ``shutdown``: log whether every KV block is back in the pool and
    the engine's invariants hold (``LLMEngine.check_invariants``); returns
    that. Skipped (False) while the engine thread still runs."""
    if engine.is_running:
        logger.error("engine state at exit: not checked, the engine thread still runs")
        return False
    inner = engine.engine
    try:
        check = getattr(inner, "check_invariants", None)
        if check is not None:
            check()
        stats = inner.get_stats()
    except Exception as exc:
        logger.error("engine state at exit: invariants violated: %s", exc)
        return False
    usage = float(stats.get("kv_cache_usage_perc", 0.0))
    unfinished = int(stats.get("num_unfinished_requests", 0))
    ok = usage == 0.0 and unfinished == 0
    log = logger.info if ok else logger.error
    log("engine state at exit: %d unfinished requests, KV cache usage %.2f%%, %s",
        unfinished, 100.0 * usage,
        "all KV blocks free, invariants hold" if ok else "KV blocks still held")
    return ok
