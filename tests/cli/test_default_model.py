"""The tiny trained model shipped inside the package: it is there, small, loads, and
``kvpage generate`` without a model directory writes English words with it."""

from __future__ import annotations

import re

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from kvpage.assets import DEFAULT_MODEL_DIR, default_model_dir
from kvpage.model import load_model

# Words a model trained on the stdlib documentation cannot avoid.
COMMON = {"the", "a", "an", "is", "of", "to", "and", "in", "be", "if", "it", "for", "as", "or"}


def test_default_model_ships_in_the_package() -> None:
    path = default_model_dir()
    assert path == DEFAULT_MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"):
        assert (path / name).is_file(), name
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 10 * 2**20, f"the default model should stay small, it is {size} bytes"
    config, _ = load_model(path)
    assert config.num_heads % 8 == 0 and config.num_kv_heads % 8 == 0  # shards up to TP 8


def test_generate_without_a_model_dir_prints_english(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpage.cli import main

    rc = main(
        [
            "generate",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--max-num-seqs",
            "4",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Once upon a time" in printed
    text = printed.split("Once upon a time", 2)[-1]
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 5, printed
    assert sum(w.lower() in COMMON for w in words) >= 2, printed


def test_generate_exits_nonzero_when_the_engine_fails_a_sample(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises (the engine's fault, not the request's) fails the sample with
    an error, logged with its traceback; ``kvpage generate`` must not exit 0 then."""
    from kvpage.cli import main
    from kvpage.runner.model_runner import ModelRunner

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(ModelRunner, "dispatch", broken)
    monkeypatch.setattr(ModelRunner, "dispatch_multi_step", broken)
    rc = main(["generate", "--prompt", "Once upon a time", "--max-tokens", "4",
               "--max-num-seqs", "4"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "(0 tokens, error)" in captured.out
    assert "injected step failure" in captured.err
