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


class _TextStream(Protocol):
    def aiter_text(self) -> AsyncIterator[str]: ...


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Lines as the SSE format defines them: ended by CRLF, LF or CR only (not
    by the other characters ``str.splitlines`` and httpx's ``aiter_lines``
    break at, such as U+2028 or U+0085, which may stand raw in JSON text)."""
    buffer = ""
    after_cr = False  # the previous chunk ended with CR: a leading LF completes a CRLF
    async for chunk in chunks:
        if not chunk:
            continue
        if after_cr and chunk.startswith("\n"):
            chunk = chunk[1:]
        after_cr = chunk.endswith("\r")
        buffer += chunk
        lines = buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        buffer = lines.pop()
        for line in lines:
            yield line
    if buffer:
        yield buffer


class SSEEvents:
    """``async for event in SSEEvents(response)``; then ``.done``."""

    def __init__(self, response: _TextStream) -> None:
        self._response = response
        self.done = False

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._events()

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        async for line in sse_lines(self._response.aiter_text()):
            if not line.startswith("data:"):
                continue
            payload = line[5:].removeprefix(" ")
            if payload == "[DONE]":
                self.done = True
                return
            yield json.loads(payload)
