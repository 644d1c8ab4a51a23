"""Keep Python's cyclic garbage collector off the engine's hot path.

A serving process holds ~0.5M long-lived objects after startup (JAX, NumPy,
transformers, the model), and CPython's full (generation-2) collection walks
all of them: ~0.4 s on a 2-core host. The engine's per-step outputs survive
long enough to be promoted, so at 1024 streaming sequences a full collection
comes every ~20 steps, which costs more host time per step than everything
else the engine does (``kvpage bench host``). ``gc.freeze()`` after startup
moves what exists then out of the collector's reach; full collections then
walk only what requests created.

Frozen objects are still freed by reference counting, but reference cycles
among them are never reclaimed while they stay frozen. An engine is such a
cycle, and it owns compiled executables (memory mappings of JIT code, which the
kernel caps per process): so the heap is frozen while at least one holder (a
started ``AsyncLLMEngine``, a host benchmark) runs, and handed back to the
collector when the last one releases it. A process that starts and stops engines
again and again (tests, notebooks, RL loops) therefore leaks nothing.

While the heap is held, the youngest generation's threshold is also raised to
:data:`SERVING_GEN0_THRESHOLD` allocations (CPython's default is 700). A step at
4096 streaming sequences allocates ~28k tracked objects (outputs, lists) that
reference counting frees a step later; at 700 the collector ran ~30 times a
step, found nothing to collect (0 objects in a measured run), and promoted the
live outputs into older generations that it then walked again: ~1 us per
sequence per step, a third of the host's time (``kvpage bench host``). The
previous thresholds come back with the last release.

Invariant: the heap is frozen, and the threshold raised, exactly while
``holders() > 0``.
"""

from __future__ import annotations

import atexit
import gc
import threading

SERVING_GEN0_THRESHOLD = 50_000
"""Net allocations of tracked objects between young collections while held."""

_lock = threading.Lock()
_holders = 0
_atexit_registered = False
_saved_thresholds: tuple[int, int, int] | None = None


def freeze_startup_heap() -> bool:
    """Take a hold on the frozen heap: the first holder collects, then freezes
    every object alive now. Returns whether this call froze the heap. Pair each
    call with :func:`release_startup_heap`."""
    global _holders, _atexit_registered, _saved_thresholds
    with _lock:
        _holders += 1
        if _holders > 1:
            return False
        gc.collect()
        gc.freeze()
        _saved_thresholds = gc.get_threshold()
        young, middle, old = _saved_thresholds
        gc.set_threshold(max(young, SERVING_GEN0_THRESHOLD), middle, old)
        if not _atexit_registered:
            # Hand everything back at exit, so interpreter teardown frees it as usual
            # (nanobind, under jaxlib, reports objects still alive then as leaks).
            atexit.register(gc.unfreeze)
            _atexit_registered = True
        return True


def release_startup_heap() -> bool:
    """Drop a hold; the last one unfreezes the heap, so the next collection can
    reclaim engines dropped since, and restores the thresholds. Returns whether
    this call unfroze it."""
    global _holders, _saved_thresholds
    with _lock:
        if _holders == 0:
            raise RuntimeError("release_startup_heap() without a matching freeze_startup_heap()")
        _holders -= 1
        if _holders:
            return False
        gc.unfreeze()
        if _saved_thresholds is not None:
            gc.set_threshold(*_saved_thresholds)
            _saved_thresholds = None
        return True


def holders() -> int:
    """How many holders keep the heap frozen now."""
    return _holders
