"""From engine streams to SSE: the plumbing that completions and chat share.

This file owns reading a generation's streams (:func:`merged_batches`: several
prompts' streams merged, in batches of everything ready at once, so that a handler
behind the engine sends several steps in one write), :func:`choice_deltas` (the
deltas worth sending, per choice, counting usage on the way), :func:`sse_stream`
(a streamed response around the endpoint's own chunks: the usage chunk, ``[DONE]``,
the error event that ends a failed stream) and :class:`SSEResponse`, which aborts
the request however the stream ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpage.engine.async_engine import EngineClosedError, RequestFailedError, RequestStream
from kvpage.openai.errors import engine_error
from kvpage.openai.generation import Generation
from kvpage.openai.sse_events import DONE, sse_event
from kvpage.outputs import CompletionOutput, RequestOutput

Delta = tuple[int, CompletionOutput, bool]
"""(choice index, completion delta, wants logprobs)."""


async def merged_batches(
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


async def choice_deltas(gen: Generation) -> AsyncIterator[list[Delta]]:
    """(choice index, completion delta, wants logprobs) for every delta worth
    sending, across all prompts and samples, in batches of what is ready at once
    (one send each); counts usage on the way and drops anything after a choice's
    final delta."""
    done: set[int] = set()
    async for batch in merged_batches(gen.streams):
        deltas = []
        for i, out in batch:
            gen.take(i, out)
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


async def sse_stream(gen: Generation, fixed: dict[str, Any],
                     encode: Callable[[list[Delta]], bytes],
                     head: Iterable[bytes] = ()) -> AsyncIterator[bytes]:
    """The events of a streamed response: ``head``, then one write per batch of
    deltas (``encode``: the endpoint's chunks), the usage chunk (``fixed``, no
    choices) if the request asked for it and ``[DONE]``. A request the engine
    fails ends with its error event, then ``[DONE]``; the request is aborted
    however the stream ends."""
    try:
        for event in head:
            yield event
        async for deltas in choice_deltas(gen):
            yield encode(deltas)
        if gen.include_usage:
            yield sse_event({**fixed, "choices": [], "usage": gen.usage.json()})
        yield DONE
    except (RequestFailedError, EngineClosedError) as exc:
        yield sse_event(engine_error(exc).body())
        yield DONE
    finally:
        gen.abort()


class SSEResponse(StreamingResponse):
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
