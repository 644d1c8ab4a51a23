"""Errors as OpenAI-style JSON responses.

This file owns the HTTP side of ``APIError`` (:mod:`kvpage.openai.protocol`): its JSON
response, in FastAPI or straight on the ASGI ``send``; the mapping of engine
exceptions to 400, 503 and 500; and the app's exception handlers (``APIError``,
Starlette's 404/405, and anything unhandled as a 500).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from kvpage.engine.async_engine import EngineClosedError
from kvpage.engine.llm_engine import QueueFullError
from kvpage.lora.slots import LoRASlotsFullError
from kvpage.openai.protocol import APIError, value_error

logger = logging.getLogger(__name__)


def error_response(error: APIError) -> Response:
    # ASCII-escaped: a message quoting client text with a lone surrogate must
    # not fail to encode (which would turn a 4xx into a 500)
    return Response(json.dumps(error.body()), status_code=error.status,
                    media_type="application/json")


def engine_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception from adding or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(503, f"the server is overloaded: {exc}", "service_unavailable_error",
                        code="queue_full")
    if isinstance(exc, LoRASlotsFullError):
        return APIError(503, str(exc), "service_unavailable_error", code="lora_slots_full")
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), "service_unavailable_error", code="shutting_down")
    if isinstance(exc, ValueError | OverflowError):  # an int out of the core's range
        return value_error(exc)
    return APIError(500, str(exc) or type(exc).__name__, "internal_server_error",
                    code="engine_error")


async def send_error(send: Send, error: APIError) -> None:
    """``error`` as the whole response, sent on a raw ASGI ``send``."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app raises becomes an OpenAI-style JSON error."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error")
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path, exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       "internal_server_error"))
