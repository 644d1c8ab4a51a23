"""``/v1/chat/completions``: messages through the model's chat template, ``n`` samples.

This file owns the endpoint (the template rendered and tokenized off the event
loop, ``top_logprobs`` checked against ``max_logprobs``), its SSE chunks
(``chat.completion.chunk`` objects: a first chunk per choice with the assistant
role, then content deltas) and its whole-answer body (``message``, chat-shaped
``logprobs``, vLLM's ``prompt_logprobs`` and ``return_token_ids``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response

from kvpage.openai.generation import Echo, Generation
from kvpage.openai.logprobs import chat_logprobs, prompt_logprobs_field
from kvpage.openai.protocol import ChatCompletionRequest, parse_body
from kvpage.openai.respond import respond
from kvpage.openai.sse_events import ChunkTemplate, sse_event
from kvpage.openai.state import ServerState, server_state
from kvpage.openai.streaming import Delta, sse_stream
from kvpage.outputs import CompletionOutput


def chat_events(srv: ServerState, gen: Generation) -> AsyncIterator[bytes]:
    """A first chunk per choice with the assistant role, then content deltas."""
    fixed = {"id": gen.request_id, "object": "chat.completion.chunk", "created": gen.created,
             "model": gen.model}
    template = ChunkTemplate(fixed, ("index", "delta", "logprobs", "finish_reason",
                                     "stop_reason"))
    head = (sse_event({**fixed, "choices": [{
        "index": index, "delta": {"role": "assistant", "content": ""},
        "logprobs": None, "finish_reason": None}]})
        for index in range(len(gen.streams) * gen.n))

    def encode(deltas: list[Delta]) -> bytes:
        events = []
        for index, c, wants_logprobs in deltas:
            logprobs = None
            if wants_logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, gen.num_logprobs,
                                         srv.token_text)
            events.append(template.event(index, {"content": c.text} if c.text else {},
                                         logprobs, c.finish_reason, c.stop_reason))
        return b"".join(events)

    return sse_stream(gen, fixed, encode, head)


def chat_body(srv: ServerState, gen: Generation,
              choices: list[CompletionOutput]) -> dict[str, Any]:
    result = []
    for index, choice in enumerate(choices):
        logprobs = None
        if gen.num_logprobs is not None:
            logprobs = chat_logprobs(choice.token_ids, choice.logprobs, gen.num_logprobs,
                                     srv.token_text)
        result.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                       "logprobs": logprobs, "finish_reason": choice.finish_reason,
                       "stop_reason": choice.stop_reason})
        if gen.prompt_token_ids is not None:
            result[-1]["token_ids"] = choice.token_ids
    response = {"id": gen.request_id, "object": "chat.completion", "created": gen.created,
                "model": gen.model, "choices": result, "usage": gen.usage.json()}
    if gen.echo is not None and gen.echo.prompt_logprobs_k is not None:
        response["prompt_logprobs"] = prompt_logprobs_field(gen, 0, srv.token_text)
    if gen.prompt_token_ids is not None:
        response["prompt_token_ids"] = gen.prompt_token_ids[0]
    return response


async def chat_completions(request: Request) -> Response:
    """The ``/v1/chat/completions`` route."""
    srv = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    model = srv.model_name(body.model)
    body.check_supported()
    srv.check_top_logprobs(body.top_logprobs)
    text, ids = await srv.chat_prompt(body)
    srv.check_length(len(ids), body.output_limit, "messages")
    params = body.sampling_params(body.output_limit, body.num_logprobs)
    echo = None if body.prompt_logprobs is None else Echo([ids], None, body.prompt_logprobs)
    gen = await srv.start("chatcmpl", model, [{"prompt": text, "prompt_token_ids": ids}],
                          params, body, body.num_logprobs, echo)
    return await respond(request, srv, gen, body.stream, chat_events, chat_body)
