"""Keep Python's cyclic garbage collector off the engine's hot path.

A serving process holds ~0.5M long-lived objects after startup (JAX, NumPy,
transformers, the model), and CPython's full (generation-2) collection walks
all of them: ~0.4 s on a 2-core host. The engine's per-step outputs survive
long enough to be promoted, so at 1024 streaming sequences a full collection
comes every ~20 steps, which costs more host time per step than everything
else the engine does (``kvpage bench host``). ``gc.freeze()`` after startup
moves what exists then out of the collector's reach; full collections then
walk only what requests created.

Frozen objects are still freed by reference counting; only reference cycles
among them are never reclaimed while the process runs, so this runs once per
process (a server builds one engine for its lifetime), after a collection.
"""

from __future__ import annotations

import atexit
import gc

_frozen = False


def freeze_startup_heap() -> bool:
    """Collect, then freeze every object alive now; only the first call in a
    process does anything. Returns whether this call froze the heap."""
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    # Hand everything back at exit, so interpreter teardown frees it as usual
    # (nanobind, under jaxlib, reports objects still alive then as leaks).
    atexit.register(gc.unfreeze)
    return True
