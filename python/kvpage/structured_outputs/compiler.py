"""Compiling structured-output constraints for one model, off the engine thread.

:class:`GrammarCompiler` owns the model's grammar vocabulary (the Rust
``GrammarVocab``: token bytes + EOS ids, built once, on first use) and a small cache of
compiled grammars keyed by ``(kind, text)``. Compilation runs in the Rust core with the
GIL released, on a background thread bounded by ``timeout_s``: a constraint that does
not compile in time is a ``ValueError`` (HTTP 400) and the caller moves on; the
abandoned compilation finishes (llguidance bounds its work) and fills the cache.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvpage._core import Grammar, GrammarVocab
from kvpage.structured_outputs.params import StructuredOutputsParams
from kvpage.structured_outputs.vocab import token_bytes

COMPILE_TIMEOUT_S = 5.0
CACHE_SIZE = 128


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` into Rust ``Grammar`` objects."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        max_workers: int = 2,
    ) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        if not self.eos_token_ids:
            raise ValueError("structured outputs need an EOS token id inside the vocabulary")
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        self._vocab: GrammarVocab | None = None
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, str], concurrent.futures.Future[Grammar]] = (
            OrderedDict()
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="kvpage-grammar"
        )

    @property
    def vocab(self) -> GrammarVocab:
        """The model's grammar vocabulary (built on first use, once)."""
        with self._lock:
            if self._vocab is None:
                tokens = token_bytes(self._tokenizer, self.vocab_size)
                self._vocab = GrammarVocab(tokens, self.eos_token_ids)
            return self._vocab

    @property
    def words(self) -> int:
        """int32 words per mask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The compiled grammar; ValueError naming the problem, or the timeout."""
        key = params.spec()
        vocab = self.vocab
        with self._lock:
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(vocab.compile, *key)
                self._pending[key] = future
                while len(self._pending) > self._cache_size:
                    self._pending.popitem(last=False)
            else:
                self._pending.move_to_end(key)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"{key[0]}: the constraint could not be compiled within {self.timeout_s:g} s; "
                "simplify it"
            ) from None
        except ValueError:
            with self._lock:
                if self._pending.get(key) is future:
                    del self._pending[key]  # do not keep failures
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
