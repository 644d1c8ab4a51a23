"""The persistent XLA compilation cache: where it lives, turning it on, counting compiles.

This file owns the cache's location and the compile counters. A second start of the same
model with the same flags compiles nothing: every executable the runner builds is keyed
only by shapes that the configuration fixes (the KV pool's size included:
:mod:`kvpage.runner.kv_cache_sizing` never keys it on the moment's free memory), and
kvpage stores every executable, however fast it compiled (JAX's default skips those under
a second, which would leave a warm start compiling dozens of small pieces).

Location: ``$XDG_CACHE_HOME/kvpage/xla``, else ``~/.cache/kvpage/xla``; ``--compilation-
cache-dir DIR`` picks another, ``--compilation-cache-dir none`` turns it off. A cache the
process configured itself (``jax.config.update("jax_compilation_cache_dir", ...)``) is
left alone.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import jax

logger = logging.getLogger("kvpage.compile")

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
STORE_LOAD = "/kvpage/executable_store/load"
"""Recorded by :mod:`kvpage.runner.executable_store` for each executable it loads."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvpage/xla`` (``~/.cache/kvpage/xla`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpage" / "xla"


def cache_dir(path: str | None) -> Path | None:
    """The directory :func:`enable_compilation_cache` uses for ``path``, without
    turning anything on (the folder kvpage's other start-up caches live in)."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    if not path or path.lower() in ("none", "off"):
        return None
    return default_cache_dir() if path == "auto" else Path(path).expanduser()


def enable_compilation_cache(path: str | None) -> Path | None:
    """Turn JAX's persistent cache on at ``path`` (``"auto"``: :func:`default_cache_dir`)
    unless the process already configured one; returns the directory in use (None: off;
    ``None``, ``""``, ``"none"`` and ``"off"`` turn it off, as the CLI flag does).
    Also stores executables of any compile time (JAX's default threshold is 1 s)."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        directory: Path | None = Path(configured)
    elif not path or path.lower() in ("none", "off"):
        return None
    else:
        directory = default_cache_dir() if path == "auto" else Path(path).expanduser()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            logger.warning("compilation cache off: cannot create %s (%s)", directory, err)
            return None
        jax.config.update("jax_compilation_cache_dir", str(directory))
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


@dataclass(frozen=True, slots=True)
class CompileCounts:
    """XLA executables built since the process started: ``compiled`` by XLA, ``loaded``
    from the persistent cache or the executable store."""

    compiled: int
    loaded: int

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.compiled - other.compiled, self.loaded - other.loaded)


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.hits = 0
        self.stored = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, _duration: float, **_: object) -> None:
        if event == _BACKEND_COMPILE:
            with self.lock:
                self.requests += 1

    def _on_event(self, event: str, **_: object) -> None:
        if event == CACHE_HIT:
            with self.lock:
                self.hits += 1
        elif event == STORE_LOAD:
            with self.lock:
                self.stored += 1


_COUNTER: _Counter | None = None
_COUNTER_LOCK = threading.Lock()


def compile_counts() -> CompileCounts:
    """Counts so far (listening starts at the first call; the engine makes that call
    before it builds anything)."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            _COUNTER = _Counter()
    with _COUNTER.lock:
        return CompileCounts(_COUNTER.requests - _COUNTER.hits, _COUNTER.hits + _COUNTER.stored)
