"""Data files shipped inside the kvpage package.

* ``default_model/`` -- a tiny Llama (HF format, with its tokenizer) trained by
  ``examples/train_and_sample.py`` on English prose from the Python standard library's
  documentation; ``MODEL_CARD.md`` there records the corpus, its licence and the
  training command. ``kvpage generate`` uses it when no model directory is given.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def default_model_dir() -> Path:
    """The directory of the model shipped with kvpage (FileNotFoundError if absent)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the default model is missing from this kvpage install ({DEFAULT_MODEL_DIR}); "
            "pass a model directory, or write a random one with `kvpage make-tiny-model PATH`"
        )
    return DEFAULT_MODEL_DIR
