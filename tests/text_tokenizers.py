"""Real-world tokenizers for the text tests (detokenizer, output streams, grammar
vocabulary), each compared against its own ``tokenizer.decode``:

* :func:`smollm2_tokenizer`: SmolLM2-135M-Instruct's byte-level BPE, read from the GGUF
  file of the benchmarks (``kvpage.model.real_models``); the test is skipped when the
  file is not already on this machine (nothing is downloaded);
* :func:`qwen_style_tokenizer`: a byte-level BPE built like Qwen2's (NFC normalizer,
  a regex split then ``ByteLevel`` without prefix space, a ``ByteLevel`` decoder, the
  ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` specials, EOS ``<|im_end|>``),
  trained here, with non-special added tokens: ``<tool_call>`` as Qwen2.5 has, and
  ``café`` -- non-ASCII but made of GPT-2 byte-table characters, so ``decode`` maps it
  through the byte table (``"caf\\ufffd"``), not to its UTF-8.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer split pattern."""

ADDED = ("<tool_call>", "café")
"""The non-special added tokens of :func:`qwen_style_tokenizer`."""

TEXTS = [
    "Hello 😀 world! How are you today? I am fine, thanks.",
    "Ünïcödé, émojis 🙂🚀 and 中文字符 must round-trip byte by byte.",
    '{"name": "Zoë", "city": "Paris", "rank": 3}',
    "def step(self):\n    return self.plan  # done\n",
]


@cache
def _qwen_style() -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:2],
    )
    fast.add_tokens(list(ADDED))
    return fast


def qwen_style_tokenizer() -> Any:
    """A fresh copy of the Qwen-style tokenizer (tests may add tokens to it)."""
    return copy.deepcopy(_qwen_style())


@cache
def _smollm2() -> Any:
    from kvpage.model.gguf_tokenizer import load_gguf_tokenizer
    from kvpage.model.real_models import find_smollm2

    path = find_smollm2()
    return None if path is None else load_gguf_tokenizer(path)


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (a fresh copy), or skip the test when its GGUF file is absent."""
    tokenizer = _smollm2()
    if tokenizer is None:
        pytest.skip("SmolLM2's GGUF is not in the models dir (kvpage.model.real_models)")
    return copy.deepcopy(tokenizer)


def split_character_ids(tokenizer: Any) -> list[int]:
    """Ids of "Hello" then a token holding a whole character and the start of another,
    so the text ends mid-character: SmolLM2's "Hello 😀" cut after ``'ĠðŁĺ'``
    (``decode``: ``"Hello \\ufffd"``), else the first such token of the vocabulary."""
    ids = tokenizer("Hello 😀", add_special_tokens=False)["input_ids"]
    if tokenizer.decode(ids[:-1]) == "Hello \ufffd":
        return ids[:-1]
    for token_id in sorted(tokenizer.get_vocab().values()):
        text = tokenizer.decode([token_id])
        if len(text) > 1 and text[-1] == "\ufffd" and text[-2] != "\ufffd":
            return [*tokenizer("Hello", add_special_tokens=False)["input_ids"], token_id]
    raise AssertionError("no token ends in an incomplete character")


def tokenizer_named(name: str) -> Any:
    """``"smollm2"`` or ``"qwen-style"``: the ids of the text tests' parametrizations."""
    return smollm2_tokenizer() if name == "smollm2" else qwen_style_tokenizer()


REAL = ["smollm2", "qwen-style"]
"""Parametrize over these with :func:`tokenizer_named`."""
