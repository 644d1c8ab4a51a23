"""The state behind the routes: one :class:`ServerState` per app.

It owns the served model names and cards, the prompt renderer
(:class:`kvpage.openai.prompts.PromptRenderer`: tokenizing and chat templates), the
server's one check of a request's length against the engine's ``max_model_len`` and
of ``top_logprobs`` against its ``max_logprobs`` (400s naming the field; the engine
validates again), adding a request's prompts to the engine (all or none) and the token
texts (cached per token id) that :mod:`kvpage.openai.logprobs` writes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request

from kvpage.engine.async_engine import AsyncLLMEngine, RequestStream
from kvpage.lora.request import LoRARequest
from kvpage.openai.errors import engine_error
from kvpage.openai.generation import Echo, Generation, Usage
from kvpage.openai.prompts import PromptRenderer
from kvpage.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    TokenizeRequest,
    bad_request,
)
from kvpage.sampling.params import SamplingParams


def server_state(request: Request) -> ServerState:
    """The server state behind the app handling ``request``."""
    return request.app.state.kvpage


class ServerState:
    """The state behind the routes."""

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str],
                 lora_modules: list[LoRARequest] | None = None) -> None:
        self.engine = engine
        self.base_model_names = model_names
        self.lora_modules = {r.lora_name: r for r in lora_modules or []}
        """Adapters clients name in ``model`` (``--lora-modules``)."""
        self.model_names = model_names + list(self.lora_modules)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.prompts = PromptRenderer(lambda: engine.tokenizer)

    # ---- request preparation --------------------------------------------

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                       f"{', '.join(map(repr, self.model_names))}", "invalid_request_error",
                       param="model", code="model_not_found")

    def model_card(self, name: str) -> dict[str, Any]:
        lora = self.lora_modules.get(name)
        root, parent = (self.model_names[0], None) if lora is None else \
            (lora.lora_path, self.model_names[0])
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvpage",
                "root": root, "parent": parent, "max_model_len": self.engine.max_model_len}

    @property
    def tokenizer(self) -> Any:
        return self.prompts.tokenizer

    async def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (:meth:`PromptRenderer.tokenize`)."""
        return await self.prompts.tokenize(text, param, add_special_tokens)

    async def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest,
                          ) -> tuple[str, list[int]]:
        """The text and token ids of ``body.messages`` (:meth:`PromptRenderer.chat_prompt`)."""
        return await self.prompts.chat_prompt(body)

    def check_top_logprobs(self, top_logprobs: int | None) -> None:
        """Chat's ``top_logprobs`` within 0..max_logprobs (a 400 naming it)."""
        if top_logprobs is None:
            return
        limit = self.engine.max_logprobs
        if not 0 <= top_logprobs <= limit:
            raise bad_request(f"top_logprobs must be between 0 and {limit} (max_logprobs), "
                              f"got {top_logprobs}", param="top_logprobs")

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> None:
        """A prompt of ``prompt_len`` tokens, and ``max_tokens`` more, within
        max_model_len (a 400 naming ``param`` or ``max_tokens``)."""
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise bad_request("the prompt is empty", param=param)
        if prompt_len > limit:
            raise bad_request(
                f"the prompt has {prompt_len} tokens but this model's maximum context length "
                f"(max_model_len) is {limit} tokens, prompt and output together",
                param=param, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise bad_request(
                f"the prompt has {prompt_len} tokens and {max_tokens} more were requested, "
                f"which exceeds this model's maximum context length (max_model_len) of "
                f"{limit} tokens", param="max_tokens", code="context_length_exceeded")

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached per id)."""
        text = self._token_text.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    async def start(self, prefix: str, model: str, prompts: list[dict[str, Any]],
                    params: SamplingParams, body: Any, num_logprobs: int | None,
                    echo: Echo | None = None) -> Generation:
        """Add one engine request per prompt; all or none."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                     for i in range(len(prompts))]
        results = await asyncio.gather(
            # A non-streaming request takes only its final output: the engine's
            # output streams assemble the whole texts and token ids.
            *(self.engine.add_request(rid, prompt, params, body.priority, body.cache_salt,
                                      final_only=not body.stream,
                                      lora_request=self.lora_modules.get(model))
              for rid, prompt in zip(ids, prompts, strict=True)),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for stream in streams:
                stream.abort()
            raise engine_error(failure)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage = Usage([len(p["prompt_token_ids"]) for p in prompts], [0] * len(prompts))
        prompt_ids = [list(p["prompt_token_ids"]) for p in prompts] \
            if body.return_token_ids else None
        if echo is not None:
            echo.scores = [None] * len(prompts)
            usage.count_completion = not echo.scores_only
        return Generation(request_id, int(time.time()), model, params.n, streams, usage,
                          num_logprobs, include_usage, prompt_ids, echo)
