"""The HTTP entry of a kvpage application on Ray Serve: :class:`KvpageIngress`.

Every request is forwarded unchanged (method, path, query, headers, body) to one
replica (:class:`kvpage.ray.replica.KvpageReplica`), whose app answers it, and the
answer is streamed back as it comes. For ``/v1/completions`` and
``/v1/chat/completions`` the ingress first renders the prompt's token ids with the
model's tokenizer and chat template (:class:`kvpage.openai.prompts.PromptRenderer`, the
code the replica itself runs), so the router can match them against what each replica's
engine caches (:mod:`kvpage.ray.router`). A body the ingress cannot render is forwarded
all the same, with no token ids: the replica answers with the error it deserves.

A replica that fails before answering (its actor died) costs the client nothing: the
request goes to another replica. One that fails mid-answer ends the response, with an
SSE error event first when it was a stream (the client sees an error, never a hang).
"""

# no `from __future__ import annotations`: Ray Serve rebuilds the routes, and FastAPI
# must see `request: Request` as a class, not a string

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError

from kvpage.ray.metrics_merge import merge_metrics
from kvpage.ray.replica import REPLICA_HEADER, ForwardedRequest
from kvpage.ray.router import PROMPT_TOKEN_IDS_KWARG, REPLICA_INDEX_KWARG

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")

MAX_REPLICAS_SCRAPED = 256

ATTEMPTS = 2
"""Replicas tried for a request whose replica fails before its first byte."""

# Module names the routes use are defined above the class: Ray Serve rebuilds the
# routes when it wraps the class, with the module's names as they were then.


def _replica_lost(when: str) -> dict[str, Any]:
    return {"error": {"message": f"the replica serving this request failed {when}; "
                      "retry it", "type": "service_unavailable_error", "param": None,
                      "code": "replica_failed"}}

ingress_app = FastAPI(title="kvpage on Ray", docs_url=None, redoc_url=None, openapi_url=None)


def load_routing_tokenizer(model: str) -> Any:
    """The model's tokenizer (GGUF file or HF directory); None if it has none."""
    from pathlib import Path

    from kvpage.model.gguf_metadata import is_gguf

    path = Path(model)
    if is_gguf(path):
        from kvpage.model.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        from kvpage.engine.loading import load_tokenizer

        return load_tokenizer(path)
    return None


@serve.ingress(ingress_app)
class KvpageIngress:
    """The ingress deployment's class (:func:`kvpage.ray.application.build_app`)."""

    def __init__(self, replicas: Any, model: str) -> None:
        from kvpage.openai.prompts import PromptRenderer

        self.replicas = replicas.options(stream=True)
        tokenizer = load_routing_tokenizer(model)
        self.prompts = PromptRenderer(lambda: tokenizer)

    async def routing_tokens(self, path: str, body: bytes) -> tuple[list[int] | None, Any]:
        """The prompt's token ids (None: not a generation request, or not renderable)
        and its text or messages (for text-matching routers)."""
        from kvpage.openai.protocol import ChatCompletionRequest, CompletionRequest

        try:
            raw = json.loads(body)
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(raw)
                _, ids = await self.prompts.chat_prompt(chat)
                return ids, [{"role": m.role, "content": m.text()} for m in chat.messages]
            completion = CompletionRequest.model_validate(raw)
            prompt = completion.prompt
            if isinstance(prompt, str):
                ids = await self.prompts.tokenize(
                    prompt, "prompt", add_special_tokens=completion.add_special_tokens
                    is not False)
                return ids, prompt
            if prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)  # type: ignore[arg-type]
                return ids, " ".join(map(str, ids))  # text routers match the ids' digits
        except Exception:  # routing hint only: the replica reports what is wrong
            pass
        return None, None

    @ingress_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every replica's ``/metrics``, each sample labelled with its replica (asked
        of the ``k``-th replica for k = 0, 1, ... until one answers twice; with a router
        other than kvpage's, the replicas that happened to answer)."""
        forwarded = ForwardedRequest(method="GET", path="/metrics",
                                     headers=list(request.headers.items()))
        forwarded.prompt = "/metrics"
        texts: dict[str, str] = {}
        for index in range(MAX_REPLICAS_SCRAPED):
            stream = self.replicas.handle_http.remote(forwarded, **{REPLICA_INDEX_KWARG: index})
            head = await stream.__anext__()
            body = b"".join([chunk async for chunk in stream])
            if head["status"] != 200:  # e.g. 401 without the API key: answered as it is
                return Response(body, status_code=head["status"], headers=dict(head["headers"]))
            replica = dict(head["headers"])[REPLICA_HEADER]
            if replica in texts:
                break
            texts[replica] = body.decode()
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        token_ids, text = (await self.routing_tokens(path, body)) if (
            request.method == "POST" and path in GENERATION_PATHS) else (None, None)
        forwarded = ForwardedRequest(
            method=request.method, path=path, query_string=request.url.query.encode(),
            headers=[(k, v) for k, v in request.headers.items() if k.lower() != "host"],
            body=body)
        if isinstance(text, list):
            forwarded.messages = text
        else:
            forwarded.prompt = text if isinstance(text, str) else path
        for attempt in range(ATTEMPTS):
            stream = self.replicas.handle_http.remote(
                forwarded, **{PROMPT_TOKEN_IDS_KWARG: token_ids})
            try:
                head = await stream.__anext__()
                break
            except RayError as exc:  # its replica died before answering: nothing was sent
                logger.warning("%s %s: replica failed before answering (%s)%s",
                               request.method, path, type(exc).__name__,
                               ", retrying" if attempt + 1 < ATTEMPTS else "")
        else:
            return JSONResponse(_replica_lost("before answering"), status_code=503)
        headers = {k: v for k, v in head["headers"]
                   if k.lower() not in ("content-length", "transfer-encoding")}
        event_stream = headers.get("content-type", "").startswith("text/event-stream")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except RayError:  # the replica died mid-answer: say so, then end
                logger.warning("%s %s: replica failed mid-answer", request.method, path)
                if event_stream:
                    error = json.dumps(_replica_lost("mid-stream"))
                    yield f"data: {error}\n\n".encode()
            finally:
                stream.cancel()  # the client went away: the replica aborts the request

        return StreamingResponse(chunks(), status_code=head["status"], headers=headers)
