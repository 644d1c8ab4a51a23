"""The ASGI guard in front of every route: API key and request-body size.

With an API key, every route but ``OPEN_PATHS`` (and ``/metrics`` too when the app
makes it public) needs ``Authorization: Bearer <key>``, compared in constant time
(401 otherwise). A body over the limit is a 413, whether its ``content-length``
says so or it only turns out so while it is read.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpage.openai.errors import send_error
from kvpage.openai.protocol import APIError

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = frozenset({"/health", "/ping"})
"""Routes that need no API key."""


class _BodyTooLarge(Exception):
    pass


class Guard:
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
            await send_error(send, APIError(
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
                    await send_error(send, too_large)
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
                await send_error(send, too_large)
