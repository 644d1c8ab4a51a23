"""vLLM's ``/tokenize`` and ``/detokenize``.

``/tokenize`` takes a ``prompt``, or chat ``messages`` rendered with the model's
template, and answers the token ids (and, if asked, their texts) with the model's
context length; ``/detokenize`` answers the text of token ids (400 for an id outside
the vocabulary). Both tokenize off the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from kvpage.openai.protocol import DetokenizeRequest, TokenizeRequest, bad_request, parse_body
from kvpage.openai.state import server_state


async def tokenize(request: Request) -> JSONResponse:
    """The ``/tokenize`` route."""
    srv = server_state(request)
    body = await parse_body(request, TokenizeRequest)
    srv.model_name(body.model)
    body.check_supported()
    if body.messages is not None:
        _, ids = await srv.chat_prompt(body)
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await srv.tokenize(body.prompt or "", "prompt", add_special_tokens=special)
    strs = [srv.token_text(t) for t in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": srv.engine.max_model_len,
                         "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> JSONResponse:
    """The ``/detokenize`` route."""
    srv = server_state(request)
    body = await parse_body(request, DetokenizeRequest)
    srv.model_name(body.model)
    tokenizer = srv.tokenizer
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is out of range [0, {vocab})",
                          param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})
