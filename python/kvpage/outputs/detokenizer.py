"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE and SentencePiece:
a character may span tokens, and a token's leading space depends on what
precedes it. So each sequence decodes a sliding window: the text of
``ids[prefix:read]`` is already emitted, the text of ``ids[prefix:]`` minus
it is new, and new text ending in U+FFFD (an incomplete UTF-8 sequence) is
held back until the next token completes it. While the sample runs, the output
never ends in a cut-off multi-byte character; when it ends first,
:meth:`IncrementalDetokenizer.finish` releases the held-back text as ``decode``
renders it (with the U+FFFD), so a finished sample's text is what ``decode``
gives for its ids (up to a stop string).

Stop strings are searched in the text as it grows; on a match the text is
cut before the stop string (or after it, with ``include_stop_str_in_output``).
While streaming, the last ``len(longest stop) - 1`` characters are held back,
so a client never receives text that a later stop match removes.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvpage._core import TokenDecoder

logger = logging.getLogger("kvpage.outputs.detokenizer")

_PROMPT_CONTEXT_TOKENS = 6
"""Prompt tokens decoded with the output so leading spaces come out right."""


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _fast_decoder(tokenizer: Decoder) -> Decoder:
    """The Rust ``tokenizers`` object behind a Hugging Face fast tokenizer
    decodes ~10x faster than the Python wrapper; use it when the wrapper adds
    nothing (no clean-up of tokenization spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer
    return backend


def rust_token_decoder(tokenizer: object) -> TokenDecoder | None:
    """The Rust core's decoder for ``tokenizer`` (``kvpage._core.OutputStreams``
    then produces exactly this module's text, for all samples of a step in one
    call), or None when only :class:`IncrementalDetokenizer` can: a tokenizer
    without a ``tokenizers`` backend, or one whose Python wrapper cleans up
    tokenization spaces."""
    to_str = getattr(_fast_decoder(tokenizer), "to_str", None)  # type: ignore[arg-type]
    if to_str is None:
        return None
    try:
        return TokenDecoder(to_str())
    except ValueError as err:
        logger.warning("detokenizing in Python: the Rust core cannot load the tokenizer: %s", err)
        return None


class IncrementalDetokenizer:
    """The growing text of one sample, with stop-string detection."""

    __slots__ = (
        "_tokenizer",
        "_ids",
        "_prefix",
        "_read",
        "_skip_special",
        "_stops",
        "_include_stop",
        "_holdback",
        "text",
        "emitted",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = _fast_decoder(tokenizer)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._skip_special = skip_special_tokens
        self._stops = stop
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        """Output text so far (cut at a stop string once one matched)."""
        self.emitted = 0
        """Characters of ``text`` already handed out by ``take_delta``."""
        self.stop_reason: str | None = None
        """The stop string that matched, if any."""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; returns True when a stop string matched."""
        if self.stop_reason is not None:
            return True
        self._ids.append(token_id)
        return self._advance(finished=False)

    def finish(self) -> bool:
        """The sample ended (no more tokens come): release the text held back
        waiting for the rest of a character, as ``decode`` renders it (an
        incomplete UTF-8 character as U+FFFD). Returns True when a stop string
        matched, in that text or before. Cheap when nothing is held back."""
        if self.stop_reason is not None:
            return True
        if self._read == len(self._ids):
            return False  # nothing held back
        return self._advance(finished=True)

    def _advance(self, finished: bool) -> bool:
        """Decode the window and append its new text: only once it is complete
        (something new, not ending in U+FFFD), unless ``finished``."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        new = len(full_text) > len(prefix_text)
        if not finished and (not new or full_text.endswith("\ufffd")):
            return False  # nothing complete yet
        old_len = len(self.text)
        if new:
            self.text += full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> bool:
        if not self._stops:
            return False
        start = max(0, old_len - self._holdback)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        self.stop_reason = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out. Until ``finished``, the tail that could
        still be the start of a stop string is held back."""
        end = len(self.text) if finished or not self._stops else len(self.text) - self._holdback
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
