"""Shared fixtures: a tiny random Llama HF directory built once per session, and a
hermetic JAX compilation cache (a session temp dir, never the user's home)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def hermetic_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point JAX's persistent compilation cache at a session temp dir. The engine only
    sets its default (``EngineConfig.compilation_cache_dir``, under ``~``) when none is
    configured, so no test writes compiled executables into the user's home."""
    previous = jax.config.jax_compilation_cache_dir
    previous_enabled = jax.config.jax_enable_compilation_cache
    cache_dir = tmp_path_factory.mktemp("xla-compilation-cache")
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_enable_compilation_cache", True)
    yield cache_dir
    jax.config.update("jax_enable_compilation_cache", previous_enabled)
    jax.config.update("jax_compilation_cache_dir", previous)


@pytest.fixture(scope="session", autouse=True)
def no_executable_store() -> Iterator[None]:
    """Keep the executable store (``kvpage.runner.executable_store``) off unless a test
    turns it on: a stored executable skips the trace, so a test that patches a function
    the trace calls (``dispatch.on_gpu``, a kernel) would run another test's program.
    ``tests/runner/test_executable_store.py`` tests the store itself; the wheel check runs
    ``kvpage generate`` and ``kvpage serve`` with it."""
    previous = os.environ.get("KVPAGE_EXECUTABLE_STORE")
    os.environ["KVPAGE_EXECUTABLE_STORE"] = "0"
    yield
    if previous is None:
        os.environ.pop("KVPAGE_EXECUTABLE_STORE", None)
    else:
        os.environ["KVPAGE_EXECUTABLE_STORE"] = previous


@pytest.fixture(scope="module", autouse=True)
def release_compiled_executables() -> Iterator[None]:
    """Free each module's compiled executables when it ends.

    Every XLA:CPU executable keeps its JIT-compiled code in a few memory mappings, and
    the kernel caps a process at ``vm.max_map_count`` (65,530 by default). Engines
    dropped by a module sit in reference cycles that CPython's full collection reaches
    only rarely on a large heap, and ``jax.jit`` caches keep their executables too: the
    whole suite in one process passed 60k mappings and XLA segfaulted when an mmap
    failed inside a compile. A collection plus ``jax.clear_caches()`` after each module
    keeps the count near one module's worth."""
    yield
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpage.model.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
