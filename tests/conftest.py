"""Shared fixtures: a tiny random Llama HF directory built once per session, and a
hermetic JAX compilation cache (a session temp dir, never the user's home); and the
order files run in."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

HEAVIEST_FILES = (
    "test_tensor_parallel.py", "test_rollout.py", "test_coldstart.py", "test_engine.py",
    "test_load_smoke.py", "test_harden_http.py", "test_lm_eval.py", "test_prompt_logprobs.py",
    "test_structured_outputs.py", "test_bench.py", "test_bench_vs_hf.py", "test_quant.py",
)
"""The files that took longest (``--durations``, 2026-11-26: 35-97 s each), first."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run :data:`HEAVIEST_FILES` first, each file's tests in their own order. Under
    ``scripts/test.sh``'s two processes (``--dist loadfile`` hands out whole files in
    this order) the light files then fill in at the end, instead of one process
    finishing a heavy file alone while the other idles."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
    from kvpage.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
