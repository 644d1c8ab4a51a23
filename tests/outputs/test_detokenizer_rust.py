"""The Rust output streams (``kvpage._core.OutputStreams``, detokenizing in the
Rust core) against their Python twin (``kvpage.outputs.output_streams``, detokenizing
with ``kvpage.outputs.detokenizer.IncrementalDetokenizer``): over random token streams on
real tokenizers -- byte-level BPE (the tiny model's, the default model's,
SmolLM2's and a Qwen-style one) and SentencePiece-style ones (byte fallback with
a Strip decoder, and a Metaspace decoder) -- in random chunks, ending on their
length, EOS, a stop token id, a grammar's end or an abort, every output (text or
delta, tokens, finish and stop reasons), every stop decision and the tokens kept
must be identical, in all three output modes.

Then both twins against ``tokenizer.decode`` on SmolLM2 and the Qwen-style
tokenizer: a sample that ends in the middle of a character, the text of the stop
token that ended a sample, and added tokens made of byte-table characters."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from kvpage._core import FINISH_REASONS, OutputStreams, TokenDecoder
from kvpage.outputs import CompletionOutput
from kvpage.outputs.detokenizer import _PROMPT_CONTEXT_TOKENS, rust_token_decoder
from kvpage.outputs.output_streams import PythonOutputStreams
from text_tokenizers import REAL, split_character_ids, tokenizer_named

CODES = {name: code for code, name in FINISH_REASONS.items()}
LENGTH, STOP = CODES["length"], CODES["stop"]
FINISHES = ("length", "eos", "stop_token", "grammar", "abort")
"""How a random case's sample ends: its length, EOS, one of its ``stop_token_ids``
(the stop reason), a grammar's end (``stop`` on an ordinary token), an abort."""

_TEXTS = [
    "Hello world! How are you today? I am fine, thanks.",
    "Ünïcödé, émojis 🙂🚀 and 中文字符 must round-trip byte by byte.",
    "def step(self):\n    plan = self.scheduler.schedule()\n    return plan  # done\n",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 10 100 1000.",
]


def _sentencepiece(decoder: str) -> Any:
    """A BPE with byte fallback and Metaspace pre-tokenization, trained here,
    with Llama 2's decoder (``strip``: Replace/ByteFallback/Fuse/Strip) or a
    plain Metaspace decoder (``metaspace``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    if decoder == "strip":
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.decoder = decoders.Metaspace()
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_TEXTS * 8, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(
    scope="module", params=["tiny-bpe", "default-model", "sp-strip", "sp-metaspace", *REAL]
)
def tokenizer(request: pytest.FixtureRequest) -> Any:
    if request.param in REAL:
        return tokenizer_named(request.param)
    if request.param == "tiny-bpe":
        from kvpage.model.tiny_model import build_tokenizer

        return build_tokenizer()
    if request.param == "default-model":
        from kvpage.assets import default_model_dir
        from kvpage.engine.llm_engine import load_tokenizer

        return load_tokenizer(default_model_dir())
    return _sentencepiece(request.param.removeprefix("sp-"))


def _random_case(rng: random.Random, tokenizer: Any) -> dict[str, Any]:
    """A prompt, a token stream and stop settings. Streams mix real text (so
    stop strings match) with random ids (broken characters, special tokens,
    ids past the tokenizer's vocabulary)."""
    vocab = len(tokenizer)
    text = rng.choice(_TEXTS)
    real = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    while len(stream) < 40:
        kind = rng.random()
        if kind < 0.5:
            start = rng.randrange(len(real))
            stream += real[start : start + rng.randint(1, 12)]
        elif kind < 0.9:
            stream.append(rng.randrange(vocab))
        elif kind < 0.95:
            stream.append(rng.choice(tokenizer.all_special_ids))
        else:
            stream.append(vocab + rng.randrange(5))
    decoded = tokenizer.decode(real)
    stops = []
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        at = rng.randrange(len(decoded))
        stops.append(decoded[at : at + rng.randint(1, 6)])
    finish = rng.choice(FINISHES)
    stop_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 2))]
    if finish == "eos":
        stream[-1] = tokenizer.eos_token_id
    elif finish == "stop_token":
        stream[-1] = rng.choice(stop_ids)
    return {
        "prompt": [rng.randrange(vocab) for _ in range(rng.randint(0, 10))],
        "stream": stream,
        "stop": tuple(s for s in stops if s),
        "include_stop_str_in_output": rng.random() < 0.3,
        "skip_special_tokens": rng.random() < 0.7,
        "finish": finish,
        "stop_token_ids": [tokenizer.eos_token_id, *stop_ids],  # as the engine passes them
    }


def _twins() -> tuple[Any, Any]:
    return OutputStreams(CompletionOutput), PythonOutputStreams(CompletionOutput)


def _add(streams: Any, handle: int, decoder: Any, case: dict[str, Any], mode: str) -> None:
    streams.add_request(
        handle, 1, mode, decoder=decoder, prompt_token_ids=case["prompt"][-_PROMPT_CONTEXT_TOKENS:],
        stop=list(case["stop"]), include_stop_str_in_output=case["include_stop_str_in_output"],
        skip_special_tokens=case["skip_special_tokens"],
        stop_token_ids=case.get("stop_token_ids", []),
    )


def _push(streams: Any, events: list[tuple[int, int, int] | tuple[int, int, int, bool]]) -> Any:
    """Push ``(handle, token, finish code[, stop token flag])`` events of sample 0,
    logprob -1 each."""
    n = len(events)
    return streams.push(
        np.array([e[0] for e in events], np.uint64), np.zeros(n, np.int32),
        np.array([e[1] for e in events], np.int32), np.array([e[2] for e in events], np.uint8),
        np.array([len(e) > 3 and e[3] for e in events], bool), np.full(n, -1.0, np.float32),
        1.5, 0,
    )


def _last_event(handle: int, token: int, finish: str) -> tuple[int, int, int, bool]:
    """The event of a case's last token (an aborted one is not finished by it)."""
    code = {"length": LENGTH, "abort": 0}.get(finish, STOP)
    return handle, token, code, finish == "stop_token"


def _run_twins(
    tokenizer: Any, cases: list[dict[str, Any]], rng: random.Random, mode: str
) -> tuple[int, int]:
    """Feed every case through the Rust output streams and the Python twin in random
    chunks, taking outputs at random steps; every output must be identical.
    Returns (outputs compared, samples a stop string finished)."""
    decoder = rust_token_decoder(tokenizer)
    assert decoder is not None
    rust, python = _twins()
    for handle, case in enumerate(cases):
        _add(rust, handle, decoder, case, mode)
        _add(python, handle, tokenizer, case, mode)
    fed = [0] * len(cases)
    compared = stopped = 0
    while len(rust):
        events: list[Any] = []
        aborts = []
        for handle, case in enumerate(cases):
            for token in case["stream"][fed[handle] : fed[handle] + rng.randint(0, 3)]:
                fed[handle] += 1
                if fed[handle] < len(case["stream"]):
                    events.append((handle, token, 0))
                    continue
                events.append(_last_event(handle, token, case["finish"]))
                if case["finish"] == "abort":
                    aborts.append(handle)
                break
        if events:
            np.testing.assert_array_equal(_push(rust, events), _push(python, events))
        for handle in aborts:  # pending text included
            assert rust.finish_request(handle, "abort") == python.finish_request(handle, "abort")
        if rng.random() < 0.5 or not events:
            rust_stops, python_stops = rust.detokenize(), python.detokenize()
            assert rust_stops == python_stops
            stopped += len(rust_stops)
            got, want = rust.take_outputs(), python.take_outputs()
            assert got == want
            compared += len(got)
        rust.check_invariants()
        python.check_invariants()
    assert len(python) == 0
    return compared, stopped


@pytest.mark.parametrize("mode", ["delta", "cumulative", "final"])
def test_rust_streams_the_same_outputs_as_python(tokenizer: Any, mode: str) -> None:
    rng = random.Random(1)
    cases = [_random_case(rng, tokenizer) for _ in range(60)]
    compared, stopped = _run_twins(tokenizer, cases, rng, mode)
    assert compared >= len(cases)
    assert stopped > 5, "the stop strings must match sometimes for this test to mean anything"


def test_one_request_at_a_time_matches_too(tokenizer: Any) -> None:
    rng = random.Random(2)
    for _ in range(40):
        _run_twins(tokenizer, [_random_case(rng, tokenizer)], rng, "delta")


def test_streams_refuse_bad_input_naming_it(tokenizer: Any) -> None:
    decoder = rust_token_decoder(tokenizer)
    for streams, dec in zip(_twins(), (decoder, tokenizer), strict=True):
        streams.add_request(1, 1, "delta", decoder=dec)
        with pytest.raises(ValueError, match="already has output streams"):
            streams.add_request(1, 1, "delta")
        with pytest.raises(ValueError, match="output mode"):
            streams.add_request(2, 1, "sometimes")
        with pytest.raises(ValueError, match="at least one sample"):
            streams.add_request(3, 0, "delta")
        with pytest.raises(ValueError, match="stop strings must not be empty"):
            streams.add_request(4, 1, "delta", decoder=dec, stop=[""])
        with pytest.raises(ValueError, match="sample index 3"):
            streams.push(
                np.array([1], np.uint64), np.array([3], np.int32), np.array([5], np.int32),
                np.zeros(1, np.uint8), np.zeros(1, bool), np.zeros(1, np.float32), 0.0, 0,
            )
    with pytest.raises(ValueError, match="one sample index, token"):
        _twins()[0].push(
            np.array([1], np.uint64), np.zeros(1, np.int32), np.zeros(0, np.int32),
            np.zeros(1, np.uint8), np.zeros(1, bool), np.zeros(1, np.float32), 0.0, 0,
        )
def test_tokenizers_the_rust_core_cannot_match_stay_in_python() -> None:
    class Slow:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(65 + i) for i in ids)

    assert rust_token_decoder(Slow()) is None
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        TokenDecoder("{not json")


# ---- both twins against tokenizer.decode, on SmolLM2 and a Qwen-style tokenizer


def _run_case(
    tokenizer: Any, ids: list[int], finish: str, mode: str, *, flag: bool = False, **spec: Any
) -> list[tuple[Any, str, list[int]]]:
    """Feed ``ids`` one step at a time to both twins (no prompt), the last one ending the
    sample as ``finish`` ("length", "stop" with ``flag`` = one of the request's stop
    token ids, or "abort" after it), taking outputs every step. Returns each twin's
    ``(last output, text as a client reassembles it, token ids)``."""
    results = []
    for streams, decoder in zip(_twins(), (rust_token_decoder(tokenizer), tokenizer),
                                strict=True):
        streams.add_request(1, 1, mode, decoder=decoder, **spec)
        text, tokens, last = "", [], None
        for i, token in enumerate(ids):
            code = 0 if i + 1 < len(ids) or finish == "abort" else CODES[finish]
            _push(streams, [(1, token, code, flag and code != 0)])
            if i + 1 == len(ids) and finish == "abort":
                assert streams.finish_request(1, "abort")
            streams.detokenize()
            for _, _, _, _, (out,) in streams.take_outputs():
                if mode != "delta":
                    text, tokens = "", []
                text += out.text
                tokens += out.token_ids
                last = out
        assert len(streams) == 0
        results.append((last, text, tokens))
    assert results[0] == results[1], "the twins disagree"
    return results


@pytest.mark.parametrize("mode", ["delta", "cumulative", "final"])
@pytest.mark.parametrize("finish", ["length", "stop", "abort"])
@pytest.mark.parametrize("name", REAL)
def test_a_sample_ending_mid_character_keeps_the_text_decode_gives(
    name: str, finish: str, mode: str
) -> None:
    tokenizer = tokenizer_named(name)
    ids = split_character_ids(tokenizer)
    want = tokenizer.decode(ids)
    assert want.endswith(" \ufffd") and len(want) > 2
    for last, text, tokens in _run_case(tokenizer, ids, finish, mode):
        assert text == want, (name, finish, mode)
        assert tokens == ids
        assert last.finish_reason == finish
    # Then EOS: its text is left out, the split character is released.
    eos = tokenizer.eos_token_id
    for skip in (True, False):
        for _, text, tokens in _run_case(
            tokenizer, [*ids, eos], "stop", mode, skip_special_tokens=skip,
            stop_token_ids=[eos],
        ):
            assert text == want, (name, mode, skip)
            assert tokens == [*ids, eos]


@pytest.mark.parametrize("mode", ["delta", "cumulative", "final"])
@pytest.mark.parametrize("name", REAL)
def test_the_text_of_a_stop_token_is_left_out_unless_include_stop_str_in_output(
    name: str, mode: str
) -> None:
    tokenizer = tokenizer_named(name)
    eos = tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(eos) == "<|im_end|>"
    ids = tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"]
    period = ids[-1]
    assert tokenizer.decode([period]) == "."
    cases = [  # (ids, stop token ids flag, stop token ids)
        ([*ids, eos], False, [eos]),  # EOS
        (ids, True, [eos, period]),  # a stop token id: "."
    ]
    for tokens, flag, stop_token_ids in cases:
        for include in (False, True):
            want = tokenizer.decode(tokens if include else tokens[:-1], skip_special_tokens=False)
            for last, text, got in _run_case(
                tokenizer, tokens, "stop", mode, flag=flag, skip_special_tokens=False,
                include_stop_str_in_output=include, stop_token_ids=stop_token_ids,
            ):
                assert text == want, (name, mode, flag, include)
                assert got == tokens, "token ids keep the stop token"
                assert last.finish_reason == "stop"
                assert last.stop_reason == (period if flag else None)
    # Without skip_special_tokens=False, EOS shows no text anyway; a length finish on
    # a stop token (not what finished it) keeps its text.
    (_, text, _), _ = _run_case(tokenizer, [*ids, eos], "length", mode,
                                skip_special_tokens=False, stop_token_ids=[eos])
    assert text == tokenizer.decode([*ids, eos], skip_special_tokens=False)
    assert text.endswith("<|im_end|>")


@pytest.mark.parametrize("name", REAL)
def test_added_tokens_of_byte_table_characters_decode_as_the_tokenizer_does(name: str) -> None:
    tokenizer = tokenizer_named(name)
    tokenizer.add_tokens(["café", "naïve"])  # SmolLM2 has no plain added tokens of its own
    cafe = tokenizer.convert_tokens_to_ids("café")
    assert tokenizer.decode([cafe]) == "caf\ufffd"  # byte table: c a f 0xE9
    decoder = rust_token_decoder(tokenizer)
    assert decoder is not None and decoder.is_byte_level
    added = [i for i, t in tokenizer.added_tokens_decoder.items() if not t.special]
    for token_id in added:
        for skip in (True, False):
            assert decoder.decode([token_id], skip) == tokenizer.decode(
                [token_id], skip_special_tokens=skip
            )
    ids = tokenizer("Say café, naïve ok", add_special_tokens=False)["input_ids"]
    assert cafe in ids
    for mode in ("delta", "final"):
        for _, text, _ in _run_case(tokenizer, ids, "length", mode):
            assert text == tokenizer.decode(ids)
