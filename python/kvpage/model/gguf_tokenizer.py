"""The Hugging Face tokenizer a GGUF file's ``tokenizer.*`` metadata describes.

This file owns building it: the vocabulary arrays are type-checked and bounded
(at most ``MAX_VOCAB`` tokens and no more than the embedding has rows, one score and one
token type per token, special token ids inside the vocabulary) before anything decodes
them, and every failure to build the tokenizer is a :class:`CheckpointError` naming the
file. Built by transformers' own GGUF conversion from the parsed metadata, with the
file's chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpage.model.errors import CheckpointError
from kvpage.model.gguf_file import GGUFArray
from kvpage.model.gguf_metadata import (
    MAX_VOCAB,
    describe,
    field,
    int_field,
    open_gguf,
    tensor_shape,
)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer the file's ``tokenizer.*`` metadata describes, with its
    chat template (``tokenizer.chat_template``), or None if the file carries no
    vocabulary. Built by transformers' GGUF conversion, from the file alone."""
    path = Path(path)
    return tokenizer_of(open_gguf(path), path)


def tokenizer_of(reader: Any, path: Path) -> Any:
    """The tokenizer of an open file (None without a vocabulary)."""
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    _check_vocabulary(reader, path)
    try:
        tokenizer = _tokenizer_from_metadata(reader, path)
        if tokenizer is None:
            tokenizer = _tokenizer_through_auto(path)
    except CheckpointError:
        raise
    except ImportError as err:
        raise ValueError(
            f"reading the tokenizer of {path} needs transformers' GGUF support: {err}"
        ) from None
    except Exception as err:  # transformers raises many types; name the file
        raise CheckpointError(f"cannot build the tokenizer of {path}: {err}") from None
    template = field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


def _check_vocabulary(reader: Any, path: Path) -> None:
    """Check the tokenizer metadata's types and bound the arrays the tokenizer decodes
    before anything decodes them: a token list of strings, no longer than ``MAX_VOCAB`` or
    the embedding's rows, merges of strings, scores and token types one per token."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray) or not tokens.strings:
        raise CheckpointError(f"GGUF file {path}: metadata 'tokenizer.ggml.tokens' is "
                              f"{describe(tokens)}, not an array of strings")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    shape = tensor_shape(embedding) if embedding is not None else ()
    rows = shape[0] if len(shape) == 2 else MAX_VOCAB
    if not 0 < len(tokens) <= min(rows, MAX_VOCAB):
        raise CheckpointError(
            f"GGUF file {path}: 'tokenizer.ggml.tokens' holds {len(tokens)} tokens; at "
            f"least 1 and at most {min(rows, MAX_VOCAB)} (the embedding's rows, at most "
            f"{MAX_VOCAB}) are supported"
        )
    merges = field(reader, "tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, GGUFArray) or not merges.strings):
        raise CheckpointError(f"GGUF file {path}: metadata 'tokenizer.ggml.merges' is "
                              f"{describe(merges)}, not an array of strings")
    for key in _TOKENIZER_STRINGS:
        value = field(reader, key)
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {describe(value)}, "
                                  "not a string")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        values = field(reader, key)
        if values is not None and (
            not isinstance(values, GGUFArray) or not values.numeric or len(values) != len(tokens)
        ):
            raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {describe(values)}, "
                                  f"not one number for each of the {len(tokens)} tokens")


def _tokenizer_value(reader: Any, key: str, path: Path) -> Any:
    """A tokenizer metadata value as transformers takes it: arrays decoded to lists, once
    their length is bounded."""
    value = field(reader, key)
    if not isinstance(value, GGUFArray):
        return value
    if len(value) > MAX_VOCAB:
        raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {describe(value)}, "
                              f"more than the {MAX_VOCAB} supported")
    return value.tolist()


_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _tokenizer_from_metadata(reader: Any, path: Path) -> Any:
    """transformers' own GGUF tokenizer conversion fed from the already parsed metadata
    (transformers >= 5; None on older versions). Same result as
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` without re-reading the file or
    importing torch."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        try:  # transformers < 5.13 (what kvpage[tunix] resolves to) keeps them here
            from transformers.integrations.ggml import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:
            return None
    from transformers import PreTrainedTokenizerFast

    groups = {
        group: {
            name: _tokenizer_value(reader, f"tokenizer.{key}", path)
            for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    vocabulary, init = groups["tokenizer"], groups["tokenizer_config"]
    if vocabulary.get("tokenizer_type") == "llama":
        init.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece
    tokens = vocabulary["tokens"]
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = int_field(reader, f"tokenizer.ggml.{key}", path)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise CheckpointError(f"GGUF file {path}: 'tokenizer.ggml.{key}' is {token_id}, "
                                  f"not one of the {len(tokens)} token ids")
        init[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(field(reader, "general.architecture"), vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**init, **extra})


def _tokenizer_through_auto(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
