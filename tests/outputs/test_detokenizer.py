"""Incremental detokenization: multi-byte characters and stop strings."""

from __future__ import annotations

from typing import Any

import pytest
from kvpage.outputs.detokenizer import IncrementalDetokenizer
from text_tokenizers import REAL, split_character_ids, tokenizer_named


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvpage.model.tiny_model import build_tokenizer

    return build_tokenizer()


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for token in ids:
        done = detok.add_token(token)
        deltas.append(detok.take_delta(done))
        if done:
            break
    return deltas


def test_text_matches_full_decode_and_never_holds_a_partial_character(tokenizer: Any) -> None:
    text = "Hello 🙂 中文 Ünïcödé world"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = feed(detok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    byte_tokens = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert byte_tokens, "the emoji must span several tokens for this test to mean anything"


def test_stop_string_is_cut_from_the_text_and_held_back_while_streaming(tokenizer: Any) -> None:
    ids = tokenizer("The quick brown fox jumps")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], stop=("brown fox",))
    deltas = feed(detok, ids)
    assert detok.stop_reason == "brown fox"
    assert detok.text == "The quick "
    assert "".join(deltas) == "The quick "
    assert not any("brown" in d for d in deltas), "text that the stop removes is never sent"


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    ids = tokenizer("Hello world! How are you")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], stop=("world",), include_stop_str_in_output=True)
    feed(detok, ids)
    assert detok.text == "Hello world"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer("one two three four")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], stop=("four", "two"))
    feed(detok, ids)
    assert detok.text == "one " and detok.stop_reason == "two"


@pytest.mark.parametrize("name", REAL)
def test_finish_releases_a_cut_character_as_decode_renders_it(name: str) -> None:
    tok = tokenizer_named(name)
    ids = split_character_ids(tok)
    want = tok.decode(ids)
    assert want == "Hello \ufffd"
    detok = IncrementalDetokenizer(tok, [])
    deltas = feed(detok, ids)
    assert "".join(deltas) == "Hello", "held back while the sample may go on"
    assert detok.finish() is False
    assert detok.text == want
    assert "".join(deltas) + detok.take_delta(True) == want
    assert detok.finish() is False and detok.text == want  # nothing held back any more


def test_finish_still_applies_stop_strings(tokenizer: Any) -> None:
    # "ab" then " " and the first two bytes of "中" (E4 B8 AD), one token each.
    ids = [*tokenizer("ab")["input_ids"], *tokenizer.convert_tokens_to_ids(["Ġ", "ä", "¸"])]
    assert tokenizer.decode(ids) == "ab \ufffd"
    detok = IncrementalDetokenizer(tokenizer, [], stop=("b \ufffd",))
    feed(detok, ids)
    assert detok.stop_reason is None
    assert detok.finish() is True
    assert detok.stop_reason == "b \ufffd" and detok.text == "a"
