"""The model's tokenizer on a warm start, without importing transformers.

Building a Hugging Face tokenizer costs a start ~1.5 s on this 2-core machine, most of
it importing ``transformers`` (issue #41: 5.8 s of a 19.6 s ``kvpage generate`` in one
profile). The engine's hot path needs little of it: encode a prompt, the ``tokenizers``
backend for the Rust detokenizer, the special token ids. So the first start builds the
tokenizer as before (``AutoTokenizer``, or transformers' GGUF conversion) and keeps its
``tokenizers`` backend and those few facts in a file; every later start reads the file
into a :class:`CachedTokenizer` that answers them from the backend, and builds the
Hugging Face tokenizer only when something else is asked of it (a chat template, any
other attribute: delegated, so a caller sees one Hugging Face tokenizer).

Invariants:

* A cached tokenizer's backend is the one the Hugging Face tokenizer had (serialized
  after transformers built it), so ``tokenizer(text)["input_ids"]`` and ``decode`` give
  the same ids and text; everything else goes to the Hugging Face tokenizer itself.
* The cache file is keyed by the tokenizer's source files (path, size, modification
  time), the transformers and tokenizers versions and :data:`FORMAT`; anything else is a
  miss, and an unreadable file is a logged miss.
* A file is written whole or not at all (temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvpage.tokenizer")

FORMAT = 1
"""Version of the cache file's layout."""

TOKENIZER_DIR_NAME = "kvpage-tokenizers"
"""The cache's folder inside the compilation cache directory."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
"""The files of an HF directory a tokenizer is built from."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def source_key(source: Path) -> str:
    """The cache key of the tokenizer built from ``source`` (a GGUF file or an HF
    directory)."""
    source = source.resolve()
    files = [source] if source.is_file() else [source / n for n in TOKENIZER_FILES]
    facts: list[Any] = [FORMAT, str(source), _version("transformers"), _version("tokenizers")]
    for path in files:
        try:
            stat = path.stat()
            facts.append((path.name, stat.st_size, stat.st_mtime_ns))
        except OSError:
            facts.append((path.name, None))
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:32]


class CachedTokenizer:
    """A Hugging Face tokenizer's hot path from its cached ``tokenizers`` backend; the
    Hugging Face tokenizer itself (built by ``build`` on first need) for the rest."""

    def __init__(self, backend_json: str, facts: dict[str, Any],
                 build: Callable[[], Any]) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_str(backend_json)
        self.eos_token_id: int | None = facts["eos_token_id"]
        self.bos_token_id: int | None = facts["bos_token_id"]
        self.pad_token_id: int | None = facts["pad_token_id"]
        self.chat_template: str | None = facts["chat_template"]
        self.clean_up_tokenization_spaces: bool = facts["clean_up_tokenization_spaces"]
        self._build = build
        self._hf: Any = None
        self._lock = threading.Lock()

    def hf(self) -> Any:
        """The Hugging Face tokenizer (built now if it is not yet)."""
        with self._lock:
            if self._hf is None:
                self._hf = self._build()
            return self._hf

    def prepare_in_background(self, after: Callable[[], bool] = lambda: True,
                              poll_s: float = 0.5) -> None:
        """Build the Hugging Face tokenizer on a daemon thread once ``after()`` is true
        (polled), so a later chat template (say) does not wait for it."""

        def build() -> None:
            while not after():
                time.sleep(poll_s)
            self.hf()

        threading.Thread(target=build, name="kvpage-tokenizer", daemon=True).start()

    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and not args and not kwargs:
            return {"input_ids": self.backend_tokenizer.encode(text).ids}
        return self.hf()(text, *args, **kwargs)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and not args and not kwargs:
            return self.backend_tokenizer.encode(text).ids
        return self.hf().encode(text, *args, **kwargs)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs or self.clean_up_tokenization_spaces:
            return str(self.hf().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                        **kwargs))
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def __len__(self) -> int:
        return len(self.hf())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_hf", "_build", "_lock"):
            raise AttributeError(name)
        return getattr(self.hf(), name)

    def __repr__(self) -> str:
        return f"CachedTokenizer(vocab={self.backend_tokenizer.get_vocab_size()})"


def _facts(tokenizer: Any) -> dict[str, Any]:
    return {
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template": tokenizer.chat_template,
        "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
    }


def load_through_cache(source: Path, cache_dir: Path | None, build: Callable[[], Any]) -> Any:
    """The tokenizer of ``source``: a :class:`CachedTokenizer` from ``cache_dir`` when an
    earlier start left one, else ``build()`` (a Hugging Face tokenizer, or None for a
    source without one), kept in ``cache_dir`` for the next start."""
    if cache_dir is None:
        return build()
    path = cache_dir / f"{source_key(source)}.json"
    try:
        stored = json.loads(path.read_text())
        return CachedTokenizer(stored["backend"], stored["facts"], build)
    except FileNotFoundError:
        pass
    except Exception as err:  # a damaged file is a miss, replaced below
        logger.warning("cached tokenizer %s not used (%s: %s)", path.name,
                       type(err).__name__, err)
    tokenizer = build()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # no tokenizer, or a slow one: nothing to keep
        return tokenizer
    try:
        blob = json.dumps({"backend": backend.to_str(), "facts": _facts(tokenizer)})
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache_dir, delete=False,
                                         encoding="utf-8") as file:
            file.write(blob)
        os.replace(file.name, path)
    except Exception as err:  # the cache is an optimisation
        logger.warning("could not keep the tokenizer of %s: %s: %s", source,
                       type(err).__name__, err)
    return tokenizer
