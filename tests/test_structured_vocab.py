"""Token bytes for the grammar engine from Hugging Face tokenizers: byte-level BPE
(GPT-2 style) and SentencePiece-style byte fallback, special and padding ids."""

from __future__ import annotations

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
from kvpage.structured_outputs.vocab import SPECIAL_MARKER, decoder_kind, token_bytes
from kvpage.tiny_model import build_tokenizer


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
