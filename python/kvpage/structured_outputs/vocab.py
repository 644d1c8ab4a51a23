"""The bytes each token id stands for, from a Hugging Face tokenizer.

The Rust grammar engine matches grammars over bytes, so it needs every token's exact
byte string (not its decoded text, which loses partial UTF-8 sequences):

* byte-level BPE (GPT-2 style, ``ByteLevel`` decoder): each character of the token maps
  back to one byte through GPT-2's byte-to-unicode table;
* SentencePiece with byte fallback: ``<0xNN>`` is the byte ``NN``; ``▁`` is a space;
* special tokens become ``b"\\xff" + name`` (never matched by a grammar; EOS is passed
  separately), and ids past the tokenizer (embedding padding) ``b""`` (never allowed).
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

SPECIAL_MARKER = b"\xff"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (printable bytes map to themselves, the
    rest to code points from 256 up, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


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
    byte_of = _unicode_to_byte()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    count = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(count)))
    out = [b""] * vocab_size
    for token_id, piece in enumerate(pieces):
        if piece is None:
            continue
        entry = added.get(token_id)
        if token_id in special_ids or (entry is not None and getattr(entry, "special", False)):
            out[token_id] = SPECIAL_MARKER + piece.encode("utf-8")
        elif entry is not None:  # added plain-text token: its content verbatim
            out[token_id] = str(getattr(entry, "content", piece)).encode("utf-8")
        elif kind == "byte_level" and all(c in byte_of for c in piece):
            out[token_id] = bytes(byte_of[c] for c in piece)
        elif kind == "byte_fallback":
            match = _BYTE_TOKEN.match(piece)
            out[token_id] = (
                bytes([int(match.group(1), 16)])
                if match
                else piece.replace("\u2581", " ").encode("utf-8")
            )
        else:
            out[token_id] = tokenizer.convert_tokens_to_string([piece]).encode("utf-8")
    return out
