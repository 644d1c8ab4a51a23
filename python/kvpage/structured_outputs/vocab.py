"""The bytes each token id stands for, from a Hugging Face tokenizer.

The Rust grammar engine matches grammars over bytes, so it needs every token's exact
byte string (not its decoded text, which loses partial UTF-8 sequences):

* byte-level BPE (GPT-2 style, ``ByteLevel`` decoder): each character of the token maps
  back to one byte through GPT-2's byte-to-unicode table -- added tokens too, as
  ``tokenizer.decode`` does (an added ``"café"`` is ``b"caf\\xe9"``, decoded ``"caf\\ufffd"``);
  a token with any other character is its UTF-8. The Rust core computes this
  (``kvpage._core.byte_level_token_bytes``), the same function its detokenizer decodes
  with, so the grammar's bytes and the output text never disagree;
* SentencePiece with byte fallback: ``<0xNN>`` is the byte ``NN``; ``▁`` is a space;
* special tokens become ``b"\\xff" + name`` (never matched by a grammar; EOS is passed
  separately), and ids past the tokenizer (embedding padding) ``b""`` (never allowed).

Added tokens that are not special go through the same rule as the rest of the
vocabulary: ``decode`` passes them through the tokenizer's decoder too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvpage._core import byte_level_token_bytes

SPECIAL_MARKER = b"\xff"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def decoder_kind(tokenizer: Any) -> str:
    """``"byte_level"``, ``"byte_fallback"`` (SentencePiece) or ``"text"`` (decode each
    token on its own: exact for tokens that are whole UTF-8 characters)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "byte_fallback" if getattr(tokenizer, "sp_model", None) is not None else "text"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in decoders if isinstance(d, dict)}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types:
        return "byte_fallback"
    return "text"


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Bytes of token ids ``0 .. vocab_size - 1`` (see the module docstring)."""
    kind = decoder_kind(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    count = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(count)))
    out = [b""] * vocab_size
    plain = []  # (id, piece) of the byte-level tokens that are not special
    for token_id, piece in enumerate(pieces):
        if piece is None:
            continue
        entry = added.get(token_id)
        if token_id in special_ids or (entry is not None and getattr(entry, "special", False)):
            out[token_id] = SPECIAL_MARKER + piece.encode("utf-8")
        elif kind == "byte_level":
            plain.append((token_id, piece))
        elif kind == "byte_fallback":
            match = _BYTE_TOKEN.match(piece)
            out[token_id] = (
                bytes([int(match.group(1), 16)])
                if match
                else piece.replace("\u2581", " ").encode("utf-8")
            )
        else:
            out[token_id] = tokenizer.convert_tokens_to_string([piece]).encode("utf-8")
    if plain:
        ids, strings = zip(*plain, strict=True)
        for token_id, data in zip(ids, byte_level_token_bytes(list(strings)), strict=True):
            out[token_id] = data
    return out
