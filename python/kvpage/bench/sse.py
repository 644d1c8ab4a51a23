"""The one reader of OpenAI-style server-sent event streams in the benchmarks.

``data: {...}`` lines carry JSON events until ``data: [DONE]``; other lines
(comments, blank separators) are skipped. :class:`SSEEvents` yields the events
and records whether the terminating ``[DONE]`` arrived, which a client must check:
a stream that ends without it was cut off.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol


class _LineStream(Protocol):
    def aiter_lines(self) -> AsyncIterator[str]: ...


class SSEEvents:
    """``async for event in SSEEvents(response)``; then ``.done``."""

    def __init__(self, response: _LineStream) -> None:
        self._response = response
        self.done = False

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._events()

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        async for line in self._response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                self.done = True
                return
            yield json.loads(payload)
