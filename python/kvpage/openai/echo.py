"""``echo`` and ``prompt_logprobs`` in OpenAI / vLLM response shapes.

This file owns how a request's prompt logprobs (``RequestOutput.prompt_logprobs``,
scored in the prefill's forward pass: :mod:`kvpage.outputs.prompt_logprobs`) appear in HTTP
responses:

* ``/v1/completions`` with ``echo: true`` and ``logprobs: n``: the choice's legacy
  ``logprobs`` object covers the prompt tokens first, then the generated ones (OpenAI
  and vLLM): the first prompt token's ``token_logprobs`` and ``top_logprobs`` entries
  are null (nothing predicts it);
* vLLM's ``prompt_logprobs: k`` request extra: a ``prompt_logprobs`` list per choice
  (completions) or per response (chat): null, then per prompt token
  ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token
  and the ``k`` most likely tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpage.outputs import Logprob

PromptLogprobs = Sequence[dict[int, Logprob] | None]
TokenText = Callable[[int], str]
Finite = Callable[[float], float]


def _kept(entry: dict[int, Logprob], token_id: int, k: int) -> list[tuple[int, Logprob]]:
    """The prompt token and the top-``k`` of one entry, best first."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
    return [(t, lp) for t, lp in ranked if t == token_id or (lp.rank is not None and lp.rank <= k)]


def echo_logprobs(
    prompt_token_ids: Sequence[int],
    prompt_logprobs: PromptLogprobs,
    k: int,
    token_text: TokenText,
    finite: Finite,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of the prompt tokens (offsets from 0)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(finite(entry[token_id].logprob))
        top.append({token_text(t): finite(lp.logprob) for t, lp in _kept(entry, token_id, k)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def concat_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
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


def prompt_logprobs_json(
    prompt_token_ids: Sequence[int],
    prompt_logprobs: PromptLogprobs,
    k: int,
    token_text: TokenText,
    finite: Finite,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` response field, cut to the request's ``k``."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
        if entry is None:
            result.append(None)
            continue
        result.append({
            str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                     "decoded_token": token_text(t)}
            for t, lp in _kept(entry, token_id, k)
        })
    return result
