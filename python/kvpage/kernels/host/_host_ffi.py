"""Registration of kvpage's Rust XLA FFI handlers as ``cpu`` custom-call targets.

Owns :func:`register`: the one place that finds a handler symbol in the compiled core
(``rust/kernels/xla_ffi.rs`` exports them from ``kvpage._core``'s shared library) and registers
it with JAX. The kernels that use it (``cpu_decode_attention.py``, ``cpu_matmul.py``)
only ask whether their target is there, when they are traced (an executable loaded
without a trace registers its targets itself: ``kvpage.runner.executable_store``).
"""

from __future__ import annotations

import ctypes
import functools

import jax


@functools.cache
def core_library() -> ctypes.CDLL | None:
    """kvpage's compiled core as a C library (None without it)."""
    try:
        from kvpage import _core
    except ImportError:  # a checkout without kvpage's compiled core
        return None
    return ctypes.CDLL(_core.__file__)


@functools.cache
def register(target: str) -> bool:
    """Register ``target`` for the ``cpu`` platform once; False without kvpage's core or
    with a core built before the handler existed."""
    library = core_library()
    handler = None if library is None else getattr(library, target, None)
    if handler is None:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return True

