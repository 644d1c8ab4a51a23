"""Token bytes for the grammar engine from Hugging Face tokenizers: byte-level BPE
(GPT-2 style) and SentencePiece-style byte fallback, special and padding ids; on
SmolLM2 and a Qwen-style tokenizer, every token's bytes are what ``tokenizer.decode``
and the Rust detokenizer show for it, added tokens included."""

from __future__ import annotations

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from kvpage._core import GrammarVocab
from kvpage.model.tiny_model import build_tokenizer
from kvpage.outputs.detokenizer import rust_token_decoder
from kvpage.structured_outputs.vocab import SPECIAL_MARKER, decoder_kind, token_bytes
from text_tokenizers import REAL, tokenizer_named


def test_byte_level_tokens_concatenate_to_the_text() -> None:
    tok = build_tokenizer()
    table = token_bytes(tok, len(tok) + 5)
    assert decoder_kind(tok) == "byte_level"
    for text in ['{"key": [1, 2.5, null]}', "naïve café ☕ 東京", "tabs\tand\nnewlines"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")
    assert table[tok.eos_token_id] == SPECIAL_MARKER + tok.eos_token.encode()
    assert table[len(tok):] == [b""] * 5  # embedding padding: never allowed


def test_byte_fallback_tokens() -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["\u2581hello", "\u2581wor", "ld", "\u2581"]:
        vocab[piece] = len(vocab)
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
    ])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  bos_token="<s>", eos_token="</s>")
    assert decoder_kind(tok) == "byte_fallback"
    table = token_bytes(tok, len(vocab))
    assert table[3 + 0xE2] == b"\xe2"
    assert table[vocab["\u2581hello"]] == b" hello"
    assert table[vocab["ld"]] == b"ld"
    assert table[2] == SPECIAL_MARKER + b"</s>"


# ---- one source of truth for a token's bytes, on SmolLM2 and a Qwen-style tokenizer


@pytest.mark.parametrize("name", REAL)
def test_byte_level_token_bytes_are_the_bytes_decode_shows(name: str) -> None:
    tok = tokenizer_named(name)
    tok.add_tokens(["café", "naïve", "😀x"])  # plain added tokens (SmolLM2 has none)
    table = token_bytes(tok, len(tok))
    decoder = rust_token_decoder(tok)
    assert decoder is not None and decoder.is_byte_level
    special = {*tok.all_special_ids, *(i for i, t in tok.added_tokens_decoder.items() if t.special)}
    assert all(table[i].startswith(SPECIAL_MARKER) for i in special)  # never in a grammar
    plain = [i for i in range(len(tok)) if i not in special]
    for token_id, text in zip(plain, tok.batch_decode([[i] for i in plain]), strict=True):
        assert table[token_id].decode("utf-8", "replace") == text, token_id
    # Non-ASCII added tokens of byte-table characters are those bytes, as decode has
    # them (not their UTF-8); one with another character is its UTF-8.
    cafe = tok.convert_tokens_to_ids("café")
    assert table[cafe] == b"caf\xe9"
    assert tok.decode([cafe]) == decoder.decode([cafe]) == "caf\ufffd"
    assert table[tok.convert_tokens_to_ids("😀x")] == "😀x".encode()
    # The grammar's bytes concatenate to what the detokenizers decode.
    ids = tok("Say café, naïve 😀x!", add_special_tokens=False)["input_ids"]
    assert cafe in ids
    joined = b"".join(table[i] for i in ids).decode("utf-8", "replace")
    assert joined == tok.decode(ids) == decoder.decode(ids)


@pytest.mark.parametrize("name", REAL)
def test_a_grammar_allows_no_added_token_whose_text_breaks_it(name: str) -> None:
    tok = tokenizer_named(name)
    tok.add_tokens(["café"])
    cafe = tok.convert_tokens_to_ids("café")
    vocab = GrammarVocab(token_bytes(tok, len(tok)), [tok.eos_token_id])
    grammar = vocab.compile("regex", "café!")
    # "café" as the grammar wants it (UTF-8 c a f C3 A9): byte tokens, then "!".
    pieces = ["c", "a", "f", "Ã", "©", "!"]  # GPT-2's characters of the bytes C3 A9
    ids = tok.convert_tokens_to_ids(pieces)
    assert tok.decode(ids) == "café!"
    allowed = grammar.allowed_tokens(ids)
    assert cafe not in allowed[0], "the added token decodes to 'caf\\ufffd'"
    assert all(token in step for token, step in zip(ids, allowed, strict=False))
    assert tok.eos_token_id in allowed[-1]
