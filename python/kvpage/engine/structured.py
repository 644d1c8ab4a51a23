"""Structured outputs: the model's grammar compiler, each constrained request's grammar
in the scheduler, and the grammar masks of each step's sampled rows.

The masks are computed in the Rust core with the GIL released, while the device runs
the step's forward pass (the runner calls :meth:`StructuredOutputs.bitmask_fn`'s
function after enqueueing it); the ``structured_mask_*`` counters are their host cost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvpage.structured_outputs.compiler import GrammarCompiler

if TYPE_CHECKING:
    from kvpage._core import Grammar
    from kvpage.engine.context import EngineContext
    from kvpage.engine.requests import RequestTable
    from kvpage.structured_outputs.params import StructuredOutputsParams


class StructuredOutputs:
    __slots__ = ("_compiler", "_ctx", "_lock", "_requests")

    def __init__(self, ctx: EngineContext, requests: RequestTable) -> None:
        self._ctx = ctx
        self._requests = requests
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model (created on first use;
        the server calls it off the event loop before ``add_request``)."""
        with self._lock:  # the server's event loop and the engine thread
            if self._compiler is None:
                ctx = self._ctx
                self._compiler = GrammarCompiler(
                    ctx.tokenizer, ctx.model_config.vocab_size, ctx.eos_token_ids
                )
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """A request's grammar (ValueError: the constraint does not compile)."""
        return self.compiler.compile(spec)

    def constrain(self, handle: int, grammar: Grammar) -> None:
        """Make a newly added request follow ``grammar``."""
        self._ctx.scheduler.set_grammar(handle, grammar)
        self._requests.constrained.add(handle)

    def bitmask_fn(self) -> Callable[[], np.ndarray] | None:
        """The runner's ``token_bitmask_fn`` for the scheduled step: None when no
        sampled row follows a grammar."""
        if self._requests.constrained and self._ctx.scheduler.num_constrained_rows() > 0:
            return self._token_bitmask
        return None

    def _token_bitmask(self) -> np.ndarray:
        """The grammar masks of the scheduled step's sampled rows."""
        scheduler, counters = self._ctx.scheduler, self._ctx.counters
        start = time.perf_counter()
        bitmask = scheduler.fill_token_bitmask(self.compiler.words)
        counters["structured_mask_s"] += time.perf_counter() - start
        counters["structured_mask_rows"] += scheduler.num_constrained_rows()
        counters["structured_mask_steps"] += 1
        return bitmask
