"""The Rust detokenizer (``kvpage._core.Detokenizer``) against the Python one
(``kvpage.detokenizer.IncrementalDetokenizer``): over random token streams on
real tokenizers -- byte-level BPE (the tiny model's and the default model's)
and SentencePiece-style ones (byte fallback with a Strip decoder, and a
Metaspace decoder) -- the text, every streamed delta, the stop decision and
the tokens taken must be identical, one token at a time and in batches."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvpage._core import Detokenizer, TokenDecoder, detokenize_batch
from kvpage.detokenizer import _PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, rust_token_decoder

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


@pytest.fixture(scope="module", params=["tiny-bpe", "default-model", "sp-strip", "sp-metaspace"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    if request.param == "tiny-bpe":
        from kvpage.tiny_model import build_tokenizer

        return build_tokenizer()
    if request.param == "default-model":
        from kvpage.assets import default_model_dir
        from kvpage.engine import load_tokenizer

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
    return {
        "prompt": [rng.randrange(vocab) for _ in range(rng.randint(0, 10))],
        "stream": stream,
        "stop": tuple(s for s in stops if s),
        "include_stop_str_in_output": rng.random() < 0.3,
        "skip_special_tokens": rng.random() < 0.7,
    }


def _pair(decoder: TokenDecoder, tokenizer: Any, case: dict[str, Any]) -> tuple[Any, Any]:
    kwargs = {k: case[k] for k in ("include_stop_str_in_output", "skip_special_tokens")}
    py = IncrementalDetokenizer(tokenizer, case["prompt"], stop=case["stop"], **kwargs)
    rs = Detokenizer(decoder, case["prompt"][-_PROMPT_CONTEXT_TOKENS:], stop=list(case["stop"]),
                     **kwargs)
    return py, rs


def test_rust_decodes_windows_exactly_as_the_tokenizer(tokenizer: Any) -> None:
    decoder = rust_token_decoder(tokenizer)
    assert decoder is not None
    rng = random.Random(3)
    backend = tokenizer.backend_tokenizer
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer) + 3) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            assert decoder.decode(ids, skip) == backend.decode(ids, skip_special_tokens=skip)


def test_rust_streams_the_same_deltas_and_stops_as_python(tokenizer: Any) -> None:
    decoder = rust_token_decoder(tokenizer)
    assert decoder is not None
    rng = random.Random(1)
    stops_seen = 0
    for _ in range(150):
        case = _random_case(rng, tokenizer)
        py, rs = _pair(decoder, tokenizer, case)
        for token in case["stream"]:
            py_done, rs_done = py.add_token(token), rs.add_token(token)
            assert py_done == rs_done, case
            finished = py_done or rng.random() < 0.05
            assert py.take_delta(finished) == rs.take_delta(finished), case
            assert (py.text, py.emitted, py.stop_reason) == (rs.text, rs.emitted, rs.stop_reason)
            if py_done:
                stops_seen += 1
                break
        assert py.take_delta(True) == rs.take_delta(True)
    assert stops_seen > 10, "the stop strings must match sometimes for this test to mean anything"


def test_batches_take_the_same_tokens_as_one_at_a_time(tokenizer: Any) -> None:
    decoder = rust_token_decoder(tokenizer)
    assert decoder is not None
    rng = random.Random(2)
    cases = [_random_case(rng, tokenizer) for _ in range(40)]
    pairs = [_pair(decoder, tokenizer, case) for case in cases]
    fed = [0] * len(cases)
    done = [False] * len(cases)
    while not all(done):
        batch, counts, tokens, owners = [], [], [], []
        for i, case in enumerate(cases):
            if done[i]:
                continue
            chunk = case["stream"][fed[i] : fed[i] + rng.randint(1, 4)]
            if not chunk:
                done[i] = True
                continue
            batch.append(pairs[i][1])
            counts.append(len(chunk))
            tokens += chunk
            owners.append((i, chunk))
        if not batch:
            break
        stopped = dict(detokenize_batch(batch, counts, tokens))
        for j, (i, chunk) in enumerate(owners):
            took = stopped.get(j, len(chunk))
            py = pairs[i][0]
            py_took = 0
            for token in chunk:
                if py.stop_reason is not None:
                    break
                py.add_token(token)
                py_took += 1
            assert took == py_took
            assert (j in stopped) == (py.stop_reason is not None)
            fed[i] += len(chunk)
            done[i] = done[i] or py.stop_reason is not None
            assert pairs[i][1].text == py.text and pairs[i][1].stop_reason == py.stop_reason
            assert pairs[i][1].take_delta(False) == py.take_delta(False)


def test_batch_rejects_mismatched_counts(tokenizer: Any) -> None:
    decoder = rust_token_decoder(tokenizer)
    detok = Detokenizer(decoder, [])
    with pytest.raises(ValueError, match="one count per"):
        detokenize_batch([detok], [2], [5])
    with pytest.raises(ValueError, match="one count per"):
        detokenize_batch([detok], [], [])


def test_tokenizers_the_rust_core_cannot_match_stay_in_python() -> None:
    class Slow:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(65 + i) for i in ids)

    assert rust_token_decoder(Slow()) is None
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        TokenDecoder("{not json")
