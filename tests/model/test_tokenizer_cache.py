"""The tokenizer on a warm start (kvpage.model.tokenizer_cache): a start after the first
reads a cached ``tokenizers`` backend without importing transformers, gives the ids and
text of the Hugging Face tokenizer it was cached from, and hands everything else to that
tokenizer, built on first need."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from gguf_fixtures import TOKENIZER_VOCAB, write_gguf
from kvpage.engine.llm_engine import load_tokenizer
from kvpage.model.gguf_tokenizer import load_gguf_tokenizer
from kvpage.model.tokenizer_cache import CachedTokenizer, load_through_cache
from kvpage.outputs.detokenizer import rust_token_decoder
from model_fixtures import build_hf_model

TEXTS = ["The capital of France is", "  two spaces, then the end", "<|im_start|>user\nhi",
         "", "tabs\tand\nnewlines and the", "café ünïcode 漢字 🙂"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_hf_model("llama", seed=3, vocab_size=TOKENIZER_VOCAB)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, "llama")


def _sources(gguf_file: Path, tiny_model_dir: Path) -> dict[str, tuple[Path, Any]]:
    return {"gguf": (gguf_file, lambda: load_gguf_tokenizer(gguf_file)),
            "hf-dir": (tiny_model_dir, lambda: load_tokenizer(tiny_model_dir))}


@pytest.mark.parametrize("kind", ["gguf", "hf-dir"])
def test_the_cached_tokenizer_answers_as_the_one_it_came_from(
    kind: str, gguf_file: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    source, build = _sources(gguf_file, tiny_model_dir)[kind]
    first = load_through_cache(source, tmp_path, build)
    assert not isinstance(first, CachedTokenizer)  # the first start builds it
    cached = load_through_cache(source, tmp_path, build)
    assert isinstance(cached, CachedTokenizer) and cached._hf is None
    for text in TEXTS:
        ids = first(text)["input_ids"]
        assert cached(text)["input_ids"] == ids == cached.encode(text), text
        for skip in (False, True):
            assert cached.decode(ids, skip_special_tokens=skip) == first.decode(
                ids, skip_special_tokens=skip)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "chat_template"):
        assert getattr(cached, name) == getattr(first, name), name
    assert cached._hf is None  # nothing above needed transformers
    decoder = rust_token_decoder(cached)
    assert decoder is not None
    # Anything else is the Hugging Face tokenizer's, built on first need.
    messages = [{"role": "user", "content": "hello there"}]
    if first.chat_template:
        assert cached.apply_chat_template(messages, tokenize=False) == first.apply_chat_template(
            messages, tokenize=False)
    assert len(cached) == len(first)
    assert cached(TEXTS[:2], add_special_tokens=False)["input_ids"] == first(
        TEXTS[:2], add_special_tokens=False)["input_ids"]
    assert cached._hf is not None


def test_a_warm_start_does_not_import_transformers(
    gguf_file: Path, tmp_path: Path
) -> None:
    load_through_cache(gguf_file, tmp_path, lambda: load_gguf_tokenizer(gguf_file))
    probe = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from kvpage.model.gguf_tokenizer import load_gguf_tokenizer
        from kvpage.model.tokenizer_cache import load_through_cache
        path = Path({str(gguf_file)!r})
        tok = load_through_cache(path, Path({str(tmp_path)!r}),
                                 lambda: load_gguf_tokenizer(path))
        ids = tok("The capital of France is")["input_ids"]
        print(type(tok).__name__, "transformers" in sys.modules, len(ids))
    """)
    env = dict(os.environ, KVPAGE_HUGE_PAGES="0")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    name, imported, count = done.stdout.split()
    assert name == "CachedTokenizer" and imported == "False" and int(count) > 0


def test_a_damaged_or_stale_cache_is_a_miss(
    gguf_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build = lambda: load_gguf_tokenizer(gguf_file)  # noqa: E731
    load_through_cache(gguf_file, tmp_path, build)
    (cached_file,) = tmp_path.glob("*.json")
    cached_file.write_text(json.dumps({"backend": "{not json", "facts": {}}))
    with caplog.at_level(logging.WARNING, logger="kvpage.tokenizer"):
        again = load_through_cache(gguf_file, tmp_path, build)
    assert not isinstance(again, CachedTokenizer)
    assert any("not used" in r.getMessage() for r in caplog.records)
    assert isinstance(load_through_cache(gguf_file, tmp_path, build), CachedTokenizer)
    # A changed source file is another key: not the old tokenizer.
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert not isinstance(load_through_cache(gguf_file, tmp_path, build), CachedTokenizer)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_the_background_build_waits_for_its_signal(gguf_file: Path, tmp_path: Path) -> None:
    """``kvpage serve`` builds the Hugging Face tokenizer once the warm-up is done."""
    import threading
    import time

    load_through_cache(gguf_file, tmp_path, lambda: load_gguf_tokenizer(gguf_file))
    built = threading.Event()

    def build() -> Any:
        built.set()
        return load_gguf_tokenizer(gguf_file)

    cached = load_through_cache(gguf_file, tmp_path, build)
    ready = threading.Event()
    cached.prepare_in_background(after=ready.is_set, poll_s=0.01)
    time.sleep(0.2)
    assert not built.is_set()
    ready.set()
    assert built.wait(30)
