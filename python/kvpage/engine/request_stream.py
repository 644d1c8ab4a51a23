"""The client side of a request served by ``AsyncLLMEngine``: its ``RequestOutput``s as
an async iterator (:class:`RequestStream`), the errors that end it, and the hand-over of
items from the engine thread to the event loops (one call into a loop per step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from kvpage.outputs import RequestOutput


class StreamOwner(Protocol):
    """What a stream needs of the engine that feeds it (``AsyncLLMEngine``)."""

    def abort(self, request_id: str) -> None: ...


class EngineClosedError(RuntimeError):
    """The engine no longer accepts requests (shutting down or stopped)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (an exception inside a step)."""


class RequestStream:
    """The ``RequestOutput`` deltas of one request, as an async iterator.

    Iteration ends after the output with ``finished=True``; it raises
    ``RequestFailedError`` / ``EngineClosedError`` when the engine fails the
    request. Each output carries only what is new since the previous one
    (``delta=True`` in ``LLMEngine.add_request``).
    """

    def __init__(self, engine: StreamOwner, request_id: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._held: BaseException | None = None  # an error behind a batch, raised next
        self._done = False  # consumer side: the last item was taken
        self._closed = False  # producer side (engine thread): the last item was sent

    @property
    def finished(self) -> bool:
        """True once the final output (or an error) has been taken."""
        return self._done

    def abort(self) -> None:
        """Abort the request unless it already ended (thread-safe, idempotent)."""
        if not self._done:
            self._engine.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item: RequestOutput | BaseException
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self._queue.get()
        return self._take(item)

    async def next_batch(self) -> list[RequestOutput]:
        """The next output and every later one already delivered, in order (at
        least one): a consumer that fell behind the engine catches up in one
        wake-up, and a server writes them in one send. Raises as iteration does
        (``StopAsyncIteration`` once ``finished``); an error queued behind
        outputs is raised by the next call."""
        batch = [await self.__anext__()]
        while not self._done and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._held = item
                break
            batch.append(self._take(item))
        return batch

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def _accept(self, item: RequestOutput | BaseException) -> bool:
        """Engine thread: whether ``item`` is to be delivered (nothing is after
        the end)."""
        if self._closed:
            return False
        if isinstance(item, BaseException) or item.finished:
            self._closed = True
        return True

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Deliver one item from the engine thread; ignores anything after the end."""
        if self._accept(item):
            call_in_loop(self._loop, self._queue.put_nowait, item)


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def put_all(batch: list[tuple[asyncio.Queue[Any], RequestOutput | BaseException]]) -> None:
    """On the event loop: one step's items, into their streams' queues."""
    for queue, item in batch:
        queue.put_nowait(item)


def settle_all(settled: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    """On the event loop: whether each added request was accepted."""
    for future, error in settled:
        if future.done():  # the caller gave up (cancelled)
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
