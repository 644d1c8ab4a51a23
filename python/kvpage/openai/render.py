"""vLLM's render routes: a request's prompt token ids, without generating.

``POST /v1/completions/render`` takes a ``/v1/completions`` body and answers
``[{"token_ids": [...], "prompt": text | null}]``, one entry per prompt;
``POST /v1/chat/completions/render`` takes a ``/v1/chat/completions`` body and answers
``{"token_ids": [...], "prompt": rendered template}``. A cache-aware gateway
(``vllm-router --policy kv_aware``) asks a worker for them to match a text request's
tokens against the blocks each worker's KV-cache events say it holds
(:mod:`kvpage.engine.kv_events`), so it needs no tokenizer of its own. The same checks
as generation apply (model name, context length, unsupported fields), so a request
that renders is one the worker would accept.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from kvpage.openai.completions import tokenized_prompts
from kvpage.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvpage.openai.state import server_state


async def completions_render(request: Request) -> JSONResponse:
    """The ``/v1/completions/render`` route."""
    srv = server_state(request)
    body = await parse_body(request, CompletionRequest)
    srv.model_name(body.model)
    body.check_supported()
    explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
    prompts = await tokenized_prompts(srv, body, explicit)
    return JSONResponse([{"token_ids": p["prompt_token_ids"], "prompt": p["prompt"]}
                         for p in prompts])


async def chat_render(request: Request) -> JSONResponse:
    """The ``/v1/chat/completions/render`` route."""
    srv = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    srv.model_name(body.model)
    body.check_supported()
    text, ids = await srv.chat_prompt(body)
    srv.check_length(len(ids), body.output_limit, "messages")
    return JSONResponse({"token_ids": ids, "prompt": text})
