"""A request's prompt as token ids: :class:`PromptRenderer`.

It owns tokenizing text and applying the chat template, both on a worker thread (a
huge prompt must not stall the event loop, which serves every other stream), with
the 400s a client's text or conversation can earn. The server's routes use it
through :class:`kvpage.openai.state.ServerState`; a gateway that routes on token ids
(:mod:`kvpage.ray.ingress`) uses the same one, so it sees the tokens the engine will.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvpage.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    TokenizeRequest,
    bad_request,
    check_unicode,
)


class PromptRenderer:
    """Text and conversations to token ids with the tokenizer ``get_tokenizer()``
    returns (None: the model has none)."""

    def __init__(self, get_tokenizer: Callable[[], Any]) -> None:
        self._get_tokenizer = get_tokenizer

    @property
    def tokenizer(self) -> Any:
        tokenizer = self._get_tokenizer()
        if tokenizer is None:
            raise bad_request("the model has no tokenizer: send prompts as token ids")
        return tokenizer

    async def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, computed on a worker thread."""
        check_unicode(text, param)
        tokenizer = self.tokenizer
        ids = await asyncio.to_thread(tokenizer, text, add_special_tokens=add_special_tokens)
        return list(ids["input_ids"])

    async def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest,
                          ) -> tuple[str, list[int]]:
        """The text and token ids of ``body.messages`` through the chat template
        (both on a worker thread)."""
        messages = [{"role": m.role, "content": m.text()} for m in body.messages or ()]
        text = await self.render_chat(messages, body.add_generation_prompt,
                                      body.continue_final_message)
        # the template has the special tokens: added only when asked
        ids = await self.tokenize(text, "messages",
                                  add_special_tokens=bool(body.add_special_tokens))
        return text, ids

    async def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          continue_final_message: bool) -> str:
        """The chat template applied to ``messages`` (on a worker thread)."""
        for message in messages:
            for value in message.values():
                check_unicode(value, "messages")
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request("the model has no chat template; use /v1/completions")
        try:
            extra = {"continue_final_message": True} if continue_final_message else {}
            return await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, tokenize=False,
                add_generation_prompt=add_generation_prompt, **extra)
        except ImportError as exc:  # jinja2 missing: the server's fault, not the client's
            raise APIError(500, f"chat templates need jinja2 (install kvpage[serve]): {exc}",
                           "internal_server_error", code="missing_dependency") from None
        except Exception as exc:  # a template may reject a conversation
            raise bad_request(f"the chat template failed on these messages: {exc}",
                              param="messages") from None
