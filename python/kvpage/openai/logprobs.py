"""Logprobs in OpenAI / vLLM response shapes: the one place tokens are ranked.

This file owns how sampled logprobs (``CompletionOutput.logprobs``) and prompt
logprobs (``RequestOutput.prompt_logprobs``, scored in the prefill's forward pass:
:mod:`kvpage.outputs.prompt_logprobs`) appear in HTTP responses. Every shape shows
the entries :func:`top_ranked` picks (ranks 1..k, best first); JSON has no -inf, so
log-probabilities are clamped (:func:`finite`).

* ``/v1/completions``: the legacy ``logprobs`` object (:func:`legacy_logprobs`:
  tokens, their logprobs, the top ``k`` with the token itself, text offsets). With
  ``echo: true`` and ``logprobs: n`` it covers the prompt tokens first, then the
  generated ones (OpenAI and vLLM; :func:`echoed_logprobs`): the first prompt
  token's ``token_logprobs`` and ``top_logprobs`` entries are null (nothing
  predicts it);
* ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs"}]}`` (:func:`chat_logprobs`);
* vLLM's ``prompt_logprobs: k`` request extra (:func:`prompt_logprobs_field`): a list
  per choice (completions) or per response (chat): null, then per prompt token
  ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token
  and the ``k`` most likely tokens.

Token texts come from the caller's ``token_text`` (the server caches them per id).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvpage.openai.generation import Generation
from kvpage.outputs import Logprob

TokenText = Callable[[int], str]
Entries = Sequence[dict[int, Logprob] | None]
"""One entry per token (``None``: a prompt's first token, which nothing predicts)."""

MIN_LOGPROB = -9999.0
"""JSON has no -inf: log-probabilities are clamped to this."""


def finite(value: float) -> float:
    """``value`` clamped to ``[MIN_LOGPROB, -MIN_LOGPROB]`` where it is not finite
    (NaN as -inf)."""
    return value if math.isfinite(value) else MIN_LOGPROB if value < 0 or math.isnan(value) \
        else -MIN_LOGPROB


def top_ranked(entry: dict[int, Logprob], k: int,
               token_id: int | None = None) -> list[tuple[int, Logprob]]:
    """The tokens of ``entry`` ranked 1..``k``, best first, and ``token_id`` too
    (wherever it ranks) when given."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
    return [(t, lp) for t, lp in ranked if t == token_id or (lp.rank is not None and lp.rank <= k)]


def legacy_logprobs(token_ids: Sequence[int], entries: Entries, k: int, token_text: TokenText,
                    offset: int = 0, *, strict: bool = False) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``token_ids``, text offsets from
    ``offset`` (``strict``: as many entries as tokens, as a prompt's)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=strict):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(finite(entry[token_id].logprob))
        top.append({token_text(t): finite(lp.logprob)
                    for t, lp in top_ranked(entry, k, token_id)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                  token_text: TokenText) -> dict[str, Any]:
    """Chat's ``logprobs`` of ``token_ids``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(token_id)
        content.append({
            "token": text, "logprob": finite(entry[token_id].logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [{"token": token_text(t), "logprob": finite(lp.logprob),
                              "bytes": list(token_text(t).encode())}
                             for t, lp in top_ranked(entry, k)],
        })
    return {"content": content}


def _concat(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """``first`` then ``second`` (whose text offsets start at 0: shifted past ``first``)."""
    if second is None:
        return first
    shift = sum(map(len, first["tokens"]))
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]],
    }


def echoed_logprobs(gen: Generation, index: int, generated: dict[str, Any] | None,
                    token_text: TokenText) -> dict[str, Any] | None:
    """The legacy ``logprobs`` of choice ``index`` with its prompt's in front
    (``generated`` as it is when the request has no prompt scores)."""
    echo, prompt = gen.echo, index // gen.n
    if echo is None or gen.num_logprobs is None or echo.scores[prompt] is None:
        return generated
    head = legacy_logprobs(echo.prompt_ids[prompt], echo.scores[prompt], gen.num_logprobs,
                           token_text, strict=True)
    return _concat(head, generated)


def prompt_logprobs_field(gen: Generation, prompt: int,
                          token_text: TokenText) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` response field of prompt ``prompt``, cut to the
    request's ``k`` (None when the request did not ask for it)."""
    echo = gen.echo
    if echo is None or echo.prompt_logprobs_k is None or echo.scores[prompt] is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(echo.prompt_ids[prompt], echo.scores[prompt], strict=True):
        if entry is None:
            result.append(None)
            continue
        result.append({
            str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                     "decoded_token": token_text(t)}
            for t, lp in top_ranked(entry, echo.prompt_logprobs_k, token_id)
        })
    return result
