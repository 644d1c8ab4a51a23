"""Compiled step pieces kept on disk, loaded back without tracing or lowering.

This file owns :class:`ExecutableStore`. JAX's persistent compilation cache is keyed by
the lowered program, so a warm start still traces and lowers every piece before the
cache can answer: ~1 s a bucket for SmolLM2, most of a warm start (issue #41; a cache
hit itself is ~0.1 s). The store is keyed by what the trace depends on instead, and a
hit is a deserialized executable (``jax.experimental.serialize_executable``): ~0.07 s
for a whole bucket.

What a trace depends on, and so what the key holds (:func:`code_fingerprint` and the
runner's :meth:`~kvpage.runner.model_runner.ModelRunner.trace_inputs`):

* kvpage's code: every ``.py`` file of ``kvpage`` and the
  compiled core (size and modification time);
* JAX, jaxlib and the device (platform, kind, the host CPU's feature flags), the
  ``XLA_FLAGS`` and every ``KVPAGE_*`` environment variable but the few that no trace
  reads (:data:`NOT_TRACED`: a bench's report path, the API key, ...);
* the runner's configuration: model config, the params' structure, shapes and dtypes,
  the KV pool, buckets' layout parameters, sampler settings, attention backend;
* the piece itself (its name and bucket key).

Invariants: a stored executable is returned only if its argument structure, shapes and
dtypes equal the ones the caller is about to pass (checked on every load; a mismatch is
a miss); a file is written whole or not at all (temporary file, then rename), so a
reader never sees a partial one; an unreadable or stale file is a miss, logged once, and
replaced; only an executable XLA compiled in this process is stored, never one that
JAX's persistent cache returned. jaxlib 0.10 serializes such an executable without its
machine code, and loading it back fails at its first run ("Function ..._fusion not
found"). Each piece is therefore jitted under a name that carries a random salt kept
in the store's folder (:meth:`ExecutableStore.compile`), so that a new kvpage version or
a store removed by hand, both starting empty, compile their pieces instead of finding
them in JAX's cache; a cache hit anyway (one file of the store removed or damaged)
renews the salt and compiles again.

Loading runs code from the cache directory, which is trusted as JAX's own cache is (both
live under the user's cache directory).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax

from kvpage.system.compilation_cache import CACHE_HIT, STORE_LOAD

logger = logging.getLogger("kvpage.compile")

STORE_DIR_NAME = "kvpage-executables"
"""The store's folder inside the compilation cache directory."""


NOT_TRACED = frozenset({
    "KVPAGE_API_KEY", "KVPAGE_BENCH_REPORT", "KVPAGE_CACHE_DIR", "KVPAGE_MODELS_DIR",
    "KVPAGE_PUBLIC_METRICS", "KVPAGE_REEXECED", "KVPAGE_TEST_WORKERS",
})
"""kvpage's environment variables that no trace reads (every other ``KVPAGE_*`` one is in
the key: an unknown one costs a miss, never a wrong program)."""


@functools.cache
def code_fingerprint() -> str:
    """A hash of everything process-wide that a trace depends on (module docstring)."""
    import jaxlib

    import kvpage
    from kvpage import _core

    digest = hashlib.sha256()
    for package in (kvpage,):
        root = Path(package.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    core = Path(_core.__file__).stat()
    digest.update(f"{core.st_size}:{core.st_mtime_ns}".encode())
    device = jax.devices()[0]
    environment = sorted(
        (k, v) for k, v in os.environ.items()
        if (k.startswith("KVPAGE_") and k not in NOT_TRACED) or k == "XLA_FLAGS"
    )
    digest.update(repr((
        jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
        _cpu_flags(), environment, jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
    )).encode())
    return digest.hexdigest()


def _cpu_flags() -> str:
    """The host CPU's feature flags (an executable compiled for AVX-512 must not load on
    a machine without it, should a cache directory be shared)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def register_host_kernels() -> None:
    """Register every XLA FFI handler kvpage's core exports: a stored executable may call
    any of them, and only a trace registers them otherwise."""
    from kvpage.kernels.host import (
        cpu_decode_attention,
        cpu_expert_matmul,
        cpu_matmul,
        cpu_qmatmul,
    )
    from kvpage.kernels.host._host_ffi import register
    from kvpage.runner.kv_cache import LAZY_ZEROS_TARGET

    # A handler missing here makes every stored piece that calls it a miss ("No FFI
    # handler registered"), compiled again at each start: batch_invariant engines' pieces
    # were, then those with a layer's q/k/v in one call or packed weights (2026-11-28).
    names = [cpu_decode_attention.TARGET, cpu_matmul.TARGET, LAZY_ZEROS_TARGET]
    names += [*cpu_qmatmul.targets(), *cpu_expert_matmul.targets()]
    for name in names:
        register(name)


_cache_hits = threading.local()
"""``count``: JAX persistent-cache hits in this thread (a compile on the background
thread must not count against the foreground's)."""


@functools.cache
def _count_cache_hits() -> None:
    def on_event(event: str, **_: object) -> None:
        if event == CACHE_HIT:
            _cache_hits.count = getattr(_cache_hits, "count", 0) + 1

    jax.monitoring.register_event_listener(on_event)


def _hits_in_this_thread() -> int:
    return getattr(_cache_hits, "count", 0)


def signature(tree: Any) -> tuple[Any, ...]:
    """Structure, shapes and dtypes of ``tree`` (arrays or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


class ExecutableStore:
    """Serialized executables under ``directory``, keyed by ``trace_inputs`` (the
    runner's configuration, hashed with :func:`code_fingerprint`) and a piece's key."""

    def __init__(self, directory: Path, trace_inputs: Any, device: jax.Device) -> None:
        digest = hashlib.sha256(code_fingerprint().encode())
        digest.update(repr(trace_inputs).encode())
        self.directory = Path(directory) / digest.hexdigest()[:32]
        self.device = device
        """The one device the executables run on (a process may see several)."""
        self.loads = 0
        """Executables loaded from disk."""
        self.saves = 0
        self._salt: str | None = None
        """Read from the folder at the first compile (:meth:`_read_salt`)."""

    @classmethod
    def for_compilation_cache(cls, trace_inputs: Any, device: jax.Device
                              ) -> ExecutableStore | None:
        """The store inside JAX's persistent cache directory, when one is configured and
        the store is not turned off (``KVPAGE_EXECUTABLE_STORE=0``)."""
        cache_dir = jax.config.jax_compilation_cache_dir
        if not cache_dir or os.environ.get("KVPAGE_EXECUTABLE_STORE", "1") == "0":
            return None
        return cls(Path(cache_dir) / STORE_DIR_NAME, trace_inputs, device)

    def compile(self, piece: Hashable, fn: Callable[..., Any], args: tuple[Any, ...],
                lower: Callable[[Callable[..., Any]], jax.stages.Lowered]
                ) -> jax.stages.Compiled:
        """The stored executable of ``piece``, else ``lower(fn)`` compiled and stored.
        ``fn`` is lowered under a name carrying this store's salt, so that JAX's cache
        holds it only for this store (module docstring). A hit in JAX's cache anyway
        means a file of this store went missing or bad: the salt is renewed and the
        piece compiled again, to be stored."""
        found = self.load(piece, args)
        if found is not None:
            return found
        compiled, from_jax_cache = self._compile(fn, lower)
        if from_jax_cache:
            logger.info("executable of %s came from JAX's cache: compiling it anew to "
                        "store it", piece)
            self._salt = self._new_salt()
            compiled, from_jax_cache = self._compile(fn, lower)
        if not from_jax_cache:
            self.save(piece, compiled)
        return compiled

    def _compile(self, fn: Callable[..., Any],
                 lower: Callable[[Callable[..., Any]], jax.stages.Lowered]
                 ) -> tuple[jax.stages.Compiled, bool]:
        """``lower(fn)`` under this store's name for it, compiled; and whether JAX's
        persistent cache answered."""
        _count_cache_hits()
        hits = _hits_in_this_thread()

        def piece(*args: Any) -> Any:
            return fn(*args)

        name = getattr(fn, "__name__", "piece")
        if self._salt is None:
            self._salt = self._read_salt()
        piece.__name__ = piece.__qualname__ = f"{name}_{self._salt}"
        compiled = lower(piece).compile()
        return compiled, _hits_in_this_thread() != hits

    def _read_salt(self) -> str:
        """This store folder's salt, made by the first process to ask (a folder made
        anew gets a new one)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError), open(
                    self.directory / "salt", "x", encoding="ascii") as file:
                file.write(os.urandom(8).hex())
            salt = (self.directory / "salt").read_text(encoding="ascii").strip()
        except OSError:
            return os.urandom(8).hex()  # an unwritable store: a salt for this process
        return salt if len(salt) == 16 else os.urandom(8).hex()  # being written

    def _new_salt(self) -> str:
        """A new salt for this store folder, replacing the old one whole."""
        salt = os.urandom(8).hex()
        with contextlib.suppress(OSError):
            with tempfile.NamedTemporaryFile("w", dir=self.directory, delete=False,
                                             encoding="ascii") as file:
                file.write(salt)
            os.replace(file.name, self.directory / "salt")
        return salt

    def _path(self, piece: Hashable) -> Path:
        name = hashlib.sha256(repr(piece).encode()).hexdigest()[:32]
        return self.directory / f"{name}.exec"

    def has(self, piece: Hashable) -> bool:
        """Whether a file for ``piece`` is stored (it may still be stale: :meth:`load`)."""
        return self._path(piece).exists()

    def load(self, piece: Hashable, args: tuple[Any, ...]) -> jax.stages.Compiled | None:
        """The stored executable of ``piece`` if there is one for exactly ``args``'
        structure, shapes and dtypes; else None."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(piece)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            stored_piece, serialized, in_tree, out_tree = pickle.loads(blob)
            if stored_piece != repr(piece):
                raise ValueError(f"the file holds {stored_piece}")
            register_host_kernels()  # which no trace registered
            compiled = deserialize_and_load(serialized, in_tree, out_tree,
                                            execution_devices=[self.device])
            if signature(compiled.args_info) != signature((args, {})):
                raise ValueError("its arguments differ from the ones this runner passes")
        except Exception as err:  # a stale or damaged file is a miss, replaced on save
            logger.warning("stored executable %s not used (%s: %s); compiling it",
                           path.name, type(err).__name__, err)
            return None
        self.loads += 1
        jax.monitoring.record_event(STORE_LOAD)
        return compiled

    def save(self, piece: Hashable, compiled: jax.stages.Compiled) -> None:
        """Keep ``compiled`` for ``piece`` (best effort: a full disk only logs)."""
        from jax.experimental.serialize_executable import serialize

        try:
            serialized, in_tree, out_tree = serialize(compiled)
            blob = pickle.dumps((repr(piece), serialized, in_tree, out_tree))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as file:
                file.write(blob)
            os.replace(file.name, self._path(piece))
        except Exception as err:  # the store is an optimisation; the step still runs
            logger.warning("could not store the executable of %s: %s: %s", piece,
                           type(err).__name__, err)
            return
        self.saves += 1
