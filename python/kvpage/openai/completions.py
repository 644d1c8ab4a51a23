"""``/v1/completions``: one or several prompts (text or token ids), ``n`` samples each.

This file owns the endpoint (prompts tokenized off the event loop, at most
``MAX_PROMPTS_PER_REQUEST`` of them, each checked against the context length),
its SSE chunks (``text_completion`` objects; with ``echo`` the prompt comes with
each choice's first chunk, as vLLM streams it) and its whole-answer body (legacy
``logprobs`` with text offsets, ``echo``, vLLM's ``prompt_logprobs`` and
``return_token_ids``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response

from kvpage.openai.generation import Echo, Generation
from kvpage.openai.logprobs import echoed_logprobs, legacy_logprobs, prompt_logprobs_field
from kvpage.openai.protocol import CompletionRequest, bad_request, parse_body
from kvpage.openai.respond import respond
from kvpage.openai.sse_events import ChunkTemplate
from kvpage.openai.state import ServerState, server_state
from kvpage.openai.streaming import Delta, sse_stream
from kvpage.outputs import CompletionOutput

MAX_PROMPTS_PER_REQUEST = 1024
"""Most prompts one ``/v1/completions`` request may carry (each becomes an
engine request)."""


def completion_events(srv: ServerState, gen: Generation) -> AsyncIterator[bytes]:
    """A chunk per choice delta; with ``echo`` the prompt comes with each choice's
    first chunk (vLLM's streaming echo), text offsets running on across chunks."""
    fixed = {"id": gen.request_id, "object": "text_completion", "created": gen.created,
             "model": gen.model}
    template = ChunkTemplate(fixed, ("index", "text", "logprobs", "finish_reason",
                                     "stop_reason"))
    offsets: dict[int, int] = {}
    echoed: set[int] = set()

    def encode(deltas: list[Delta]) -> bytes:
        events = []
        for index, c, wants_logprobs in deltas:
            logprobs = None
            if wants_logprobs:
                logprobs = legacy_logprobs(c.token_ids, c.logprobs, gen.num_logprobs,
                                           srv.token_text, offsets.get(index, 0))
            text = c.text
            echo = gen.echo
            if echo is not None and echo.prompt_texts is not None and index not in echoed:
                echoed.add(index)
                text = echo.prompt_texts[index // gen.n] + text
                if gen.num_logprobs is not None:
                    logprobs = echoed_logprobs(gen, index, logprobs, srv.token_text)
            if logprobs is not None:
                offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
            events.append(template.event(index, text, logprobs, c.finish_reason,
                                         c.stop_reason))
        return b"".join(events)

    return sse_stream(gen, fixed, encode)


def completion_body(srv: ServerState, gen: Generation,
                    choices: list[CompletionOutput]) -> dict[str, Any]:
    result = []
    for index, choice in enumerate(choices):
        logprobs = None
        if gen.num_logprobs is not None:
            logprobs = legacy_logprobs(choice.token_ids, choice.logprobs, gen.num_logprobs,
                                       srv.token_text)
        text = choice.text
        echo = gen.echo
        if echo is not None and echo.prompt_texts is not None:
            text = echo.prompt_texts[index // gen.n] + text
            logprobs = echoed_logprobs(gen, index, logprobs, srv.token_text)
        result.append({"index": index, "text": text, "logprobs": logprobs,
                       "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        if echo is not None and echo.prompt_logprobs_k is not None:
            result[-1]["prompt_logprobs"] = prompt_logprobs_field(gen, index // gen.n,
                                                                  srv.token_text)
        if gen.prompt_token_ids is not None:
            result[-1]["prompt_token_ids"] = gen.prompt_token_ids[index // gen.n]
            result[-1]["token_ids"] = choice.token_ids
    return {"id": gen.request_id, "object": "text_completion", "created": gen.created,
            "model": gen.model, "choices": result, "usage": gen.usage.json()}


async def tokenized_prompts(srv: ServerState, body: CompletionRequest,
                            explicit_max_tokens: int | None) -> list[dict[str, Any]]:
    """The request's prompts (text tokenized off the event loop, or token ids), each
    ``{"prompt": text | None, "prompt_token_ids": ids}``, checked against the context."""
    raw = body.prompt
    if isinstance(raw, str):
        raw_prompts: list[str | list[int]] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        raw_prompts = [list(raw)]  # type: ignore[arg-type]
    else:
        raw_prompts = list(raw)  # type: ignore[arg-type]
    if not raw_prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(raw_prompts) > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"prompt holds {len(raw_prompts)} prompts; one request may "
                          f"carry at most {MAX_PROMPTS_PER_REQUEST}", param="prompt")
    prompts = []
    for p in raw_prompts:
        ids = await srv.tokenize(p, "prompt", add_special_tokens=body.add_special_tokens
                                 is not False) if isinstance(p, str) else list(p)
        srv.check_length(len(ids), explicit_max_tokens, "prompt")
        prompts.append({"prompt": p if isinstance(p, str) else None,
                        "prompt_token_ids": ids})
    return prompts


async def completions(request: Request) -> Response:
    """The ``/v1/completions`` route."""
    srv = server_state(request)
    body = await parse_body(request, CompletionRequest)
    model = srv.model_name(body.model)
    body.check_supported()
    explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
    prompts = await tokenized_prompts(srv, body, explicit)
    params = body.sampling_params(body.engine_max_tokens, body.logprobs,
                                  body.engine_prompt_logprobs)
    echo = None
    if body.echo or body.prompt_logprobs is not None:
        texts = None
        if body.echo:
            texts = [p["prompt"] if p["prompt"] is not None else
                     await asyncio.to_thread(srv.tokenizer.decode, p["prompt_token_ids"])
                     for p in prompts]
        echo = Echo([p["prompt_token_ids"] for p in prompts], texts, body.prompt_logprobs,
                    body.scores_only)
    gen = await srv.start("cmpl", model, prompts, params, body, body.logprobs, echo)
    return await respond(request, srv, gen, body.stream, completion_events, completion_body)
