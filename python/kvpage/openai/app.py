"""The OpenAI-compatible FastAPI app: :func:`build_app` and its routes.

The app over an ``AsyncLLMEngine`` serves ``/v1/completions`` and
``/v1/chat/completions`` (SSE streaming and not, ``n``, several prompts, logprobs,
usage with cached prompt tokens, ``echo`` and vLLM's ``prompt_logprobs``),
``/v1/models``, vLLM's ``/tokenize``, ``/detokenize``, render routes
(:mod:`kvpage.openai.render`) and ``/kv_event_sources``, ``/health`` (and
``/ping``), ``/version`` and ``/metrics`` (Prometheus text), behind the API-key and
body-size guard (:mod:`kvpage.openai.guard`), with every error an OpenAI-style JSON
error (:mod:`kvpage.openai.errors`). A request whose client went away is aborted,
streaming or not.

Hostile input never reaches a 5xx: malformed, too deeply nested or otherwise
unparsable JSON, integers out of the engine's range and text that is not valid
Unicode are 400s; text is tokenized off the event loop, so a huge prompt does not
stall the streams of other clients. :mod:`kvpage.openai.run` serves the app.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvpage.engine.async_engine import AsyncLLMEngine
from kvpage.lora.request import LoRARequest
from kvpage.openai import chat, completions, render, tokenization
from kvpage.openai.errors import add_error_handlers, error_response
from kvpage.openai.guard import DEFAULT_MAX_BODY_BYTES, OPEN_PATHS, Guard
from kvpage.openai.protocol import APIError
from kvpage.openai.state import ServerState, server_state


def build_app(
    async_engine: AsyncLLMEngine,
    *,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    public_metrics: bool = False,
    lora_modules: Sequence[LoRARequest] = (),
) -> FastAPI:
    """The OpenAI-compatible app over a running ``AsyncLLMEngine``.

    ``served_model_name``: the name(s) clients must use in ``model`` (the
    first is reported in responses when a request names none). With
    ``api_key``, every route but ``/health`` (and ``/metrics`` when
    ``public_metrics``) needs ``Authorization: Bearer <api_key>``. Bodies over
    ``max_body_bytes`` get 413. ``lora_modules``: adapters clients may name in ``model``
    (listed by ``/v1/models`` with the base model as parent). The app does not shut the
    engine down.
    """
    names = [served_model_name] if isinstance(served_model_name, str) \
        else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    # Routes find their state through the request (app.state.kvpage), never through a
    # closure: FastAPI caches endpoint functions process-wide, and a closure over the
    # engine would pin its compiled executables after the app is gone.
    app = FastAPI(title="kvpage", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvpage = ServerState(async_engine, names, list(lora_modules))
    open_paths = OPEN_PATHS | {"/metrics"} if public_metrics else OPEN_PATHS
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       open_paths=open_paths)
    add_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not server_state(request).engine.is_running:
            return error_response(APIError(503, "the engine is not running",
                                           "service_unavailable_error", code="engine_dead"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = server_state(request).engine.metrics.render()
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
        srv = server_state(request)
        return JSONResponse({"object": "list",
                             "data": [srv.model_card(n) for n in srv.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        srv = server_state(request)
        return JSONResponse(srv.model_card(srv.model_name(model_id)))

    @app.get("/kv_event_sources")
    async def kv_event_sources(request: Request) -> JSONResponse:
        # vLLM's discovery route: {data-parallel rank: KV events config}, {} when off.
        engine = server_state(request).engine.engine
        config = engine.config.kv_events_config if engine.kv_events is not None else None
        return JSONResponse({} if config is None else {"0": asdict(config)})

    app.post("/tokenize")(tokenization.tokenize)
    app.post("/v1/completions/render")(render.completions_render)
    app.post("/v1/chat/completions/render")(render.chat_render)
    app.post("/detokenize")(tokenization.detokenize)
    app.post("/v1/completions")(completions.completions)
    app.post("/v1/chat/completions")(chat.chat_completions)
    return app
