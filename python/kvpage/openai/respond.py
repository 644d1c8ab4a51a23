"""Answering a generation: an SSE stream, or the whole answer at the end.

:func:`respond` is the one place completions and chat answer from: with ``stream``
an :class:`~kvpage.openai.streaming.SSEResponse` over the endpoint's events;
otherwise every choice's final output (:func:`collect`), turned into the endpoint's
JSON body, or 499 when the client went away first. The request is aborted in the
engine either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from kvpage.engine.async_engine import EngineClosedError, RequestFailedError
from kvpage.openai.errors import engine_error, error_response
from kvpage.openai.generation import Generation
from kvpage.openai.protocol import CLIENT_CLOSED_REQUEST
from kvpage.openai.state import ServerState
from kvpage.openai.streaming import SSEResponse, merged_batches
from kvpage.outputs import CompletionOutput

T = TypeVar("T")


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


async def collect(gen: Generation) -> list[CompletionOutput]:
    """Every choice's final output (the streams of a non-streaming request
    yield one ``RequestOutput`` each, the finished one)."""
    choices: list[CompletionOutput | None] = [None] * (len(gen.streams) * gen.n)
    try:
        async for batch in merged_batches(gen.streams):
            for i, out in batch:
                gen.take(i, out)
                for c in out.outputs:
                    choices[i * gen.n + c.index] = c
    finally:
        gen.abort()
    missing = [index for index, c in enumerate(choices) if c is None]
    if missing:
        raise RuntimeError(f"the engine finished without outputs for choices {missing}")
    return [c for c in choices if c is not None]


async def respond(
    request: Request,
    srv: ServerState,
    gen: Generation,
    stream: bool,
    events: Callable[[ServerState, Generation], AsyncIterator[bytes]],
    body: Callable[[ServerState, Generation, list[CompletionOutput]], dict[str, Any]],
) -> Response:
    """An SSE stream, or the whole answer once every choice finished (499 if
    the client left first; the request is aborted either way)."""
    if stream:
        return SSEResponse(events(srv, gen), gen.abort)
    try:
        choices = await _unless_disconnected(request, collect(gen))
    except (RequestFailedError, EngineClosedError) as exc:
        return error_response(engine_error(exc))
    finally:
        gen.abort()
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(body(srv, gen, choices))
