"""The executable store: a second runner of the same configuration loads every piece
its first one compiled, without tracing, and steps to the same tokens; a stale or
damaged file, another configuration or other arguments are misses, never a wrong
program (issue #41, kvpage.runner.executable_store)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.model.params import param_spec, tree_from_flat
from kvpage.model.presets import preset
from kvpage.runner.executable_store import STORE_DIR_NAME, ExecutableStore
from kvpage.runner.model_runner import ModelRunner
from kvpage.system.compilation_cache import compile_counts

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, block_size=8,
              warmup="none")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Once upon a time", "The module", "A list is a sequence of"]


@contextlib.contextmanager
def _cache_dir(path: Path | None) -> Iterator[None]:
    """The store follows JAX's cache directory setting (JAX's own cache, set up once per
    process, keeps the session's directory)."""
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None if path is None else str(path))
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


@pytest.fixture
def store_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    monkeypatch.setenv("KVPAGE_EXECUTABLE_STORE", "1")
    with _cache_dir(tmp_path):
        yield tmp_path / STORE_DIR_NAME


def _runner(**overrides: Any) -> ModelRunner:
    config = dataclasses.replace(preset("tiny-llama"), num_layers=2)
    rng = np.random.default_rng(0)
    params = tree_from_flat(config, {
        n: rng.standard_normal(s).astype(np.float32) * 0.02
        for n, s in param_spec(config).items()
    })
    kwargs: dict[str, Any] = dict(num_blocks=32, block_size=4, max_model_len=64,
                                  max_num_seqs=4, max_num_batched_tokens=16)
    return ModelRunner(config, params, **(kwargs | overrides))


def test_a_second_engine_loads_every_piece_and_gives_the_same_tokens(
    store_on: Path, tiny_model_dir: Path
) -> None:
    first = LLM(str(tiny_model_dir), **ENGINE)
    want = [o.outputs[0].token_ids for o in first.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for rows in first.engine.runner.multi_step.buckets():  # built (or awaited) now
        first.engine.runner.multi_step.compile(rows)
    saved = first.engine.runner.executables.store
    assert saved is not None and saved.saves > 0 and saved.loads == 0
    before = compile_counts()
    second = LLM(str(tiny_model_dir), **ENGINE)
    got = [o.outputs[0].token_ids for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for rows in second.engine.runner.multi_step.buckets():
        second.engine.runner.multi_step.compile(rows)
    loaded = second.engine.runner.executables.store
    assert loaded is not None and loaded.directory == saved.directory
    assert got == want
    assert loaded.loads == saved.saves and loaded.saves == 0  # nothing traced again
    assert (compile_counts() - before).loaded >= loaded.loads  # counted as loads


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_store_started_anew_compiles_rather_than_storing_jax_cache_hits(
    store_on: Path, tiny_model_dir: Path
) -> None:
    """jaxlib serializes an executable that JAX's persistent cache returned without its
    machine code ("Function ..._fusion not found" at its first run, once loaded). A
    store started anew (a new kvpage version, or the folder removed) while JAX's cache
    holds the same programs must still store working executables."""
    want = _tokens(LLM(str(tiny_model_dir), **ENGINE))
    shutil.rmtree(store_on)  # JAX's cache (the session's) keeps every program
    jax.clear_caches()
    refilled = LLM(str(tiny_model_dir), **ENGINE)
    assert _tokens(refilled) == want
    store = refilled.engine.runner.executables.store
    assert store is not None and store.saves > 0 and store.loads == 0
    jax.clear_caches()
    loaded = LLM(str(tiny_model_dir), **ENGINE)
    assert _tokens(loaded) == want  # runs every stored piece it loaded
    assert loaded.engine.runner.executables.store.loads >= store.saves


def test_a_step_loads_its_stored_bucket_rather_than_run_in_a_larger_one(
    store_on: Path
) -> None:
    """A stored bucket costs a load, not a compile: a step that needs it loads it rather
    than run in a larger compiled bucket, and the background thread leaves it alone
    while the runner serves."""
    small, large = (4, 4, True), (8, 4, True)
    first = _runner()
    first.executables.bucket(small)
    runner = _runner()
    ex = runner.executables
    assert ex.stored(small) and not ex.stored(large)
    ex.bucket(large)
    ex._last_step = float("inf")  # serving from now on
    background = ex.start_background_compile()
    background.stop()  # after the build in flight, which is never `small`
    assert ("bucket", *small) not in ex.cache.ready_keys()
    assert ex.bucket_for(small)[0] == small and ex.fallback_steps == 0
    assert ex.store.loads >= 1


def test_other_configurations_and_arguments_miss(store_on: Path) -> None:
    runner = _runner()
    runner.executables.bucket((4, 4, False))
    store = runner.executables.store
    assert store is not None and store.saves == 4  # embed, layers, select, head
    assert _runner(max_logprobs=5).executables.store.directory != runner.executables.store.directory
    again = _runner()
    assert again.executables.store.directory == runner.executables.store.directory
    layout, _ = again.executables.layout((4, 4))
    # The stored select piece of (4, 4) asked for with another argument shape: a miss.
    wrong = (jax.ShapeDtypeStruct((8, again.config.hidden_size), np.float32),
             jax.ShapeDtypeStruct((layout.size,), np.int32))
    assert again.executables.store.load(("select", 4, 4, False), wrong) is None
    again.executables.bucket((4, 4, False))
    assert again.executables.store.loads == 4


def test_a_damaged_file_is_a_miss_that_is_replaced(
    store_on: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _runner()
    first.executables.bucket((4, 4, False))
    files = sorted(store_on.rglob("*.exec"))
    assert len(files) == 4
    files[0].write_bytes(files[0].read_bytes()[:100])  # a torn write of another tool
    runner = _runner()
    with caplog.at_level(logging.WARNING, logger="kvpage.compile"):
        runner.executables.bucket((4, 4, False))
    assert runner.executables.store.loads == 3 and runner.executables.store.saves == 1
    assert any("not used" in r.getMessage() for r in caplog.records)
    fresh = _runner()
    fresh.executables.bucket((4, 4, False))
    assert fresh.executables.store.loads == 4


def test_the_key_holds_the_environment_that_traces_read(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpage.runner.executable_store import code_fingerprint

    fingerprint = code_fingerprint.__wrapped__
    base = fingerprint()
    monkeypatch.setenv("KVPAGE_BENCH_REPORT", "/tmp/report-1.json")  # a bench's, per run
    monkeypatch.setenv("KVPAGE_API_KEY", "secret")
    assert fingerprint() == base
    monkeypatch.setenv("KVPAGE_CPU_MATMUL", "0")  # changes which kernels a trace calls
    assert fingerprint() != base
    monkeypatch.delenv("KVPAGE_CPU_MATMUL")
    monkeypatch.setenv("KVPAGE_SOMETHING_NEW", "1")  # unknown: a miss, never a wrong program
    assert fingerprint() != base


def test_the_store_is_off_without_a_cache_or_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVPAGE_EXECUTABLE_STORE", "1")
    with _cache_dir(None):
        assert ExecutableStore.for_compilation_cache({}, jax.devices()[0]) is None
    with _cache_dir(tmp_path):
        assert ExecutableStore.for_compilation_cache({}, jax.devices()[0]) is not None
        monkeypatch.setenv("KVPAGE_EXECUTABLE_STORE", "0")
        assert ExecutableStore.for_compilation_cache({}, jax.devices()[0]) is None


def test_every_handler_a_stored_piece_may_call_is_registered_before_a_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A handler left out made each stored piece calling it a miss ("No FFI handler
    # registered"), compiled at every start: kvpage_qmatmul_invariant_<kind>, then the
    # q/k/v-in-one-call and packed-tile calls. So: every handler the core exports.
    import ctypes
    import re

    from kvpage import _core
    from kvpage.kernels.host import _host_ffi
    from kvpage.runner import executable_store

    names: list[str] = []
    monkeypatch.setattr(_host_ffi, "register", lambda name: names.append(name) or True)
    executable_store.register_host_kernels()
    library = ctypes.CDLL(_core.__file__)
    strings = re.findall(rb"kvpage_[a-z0-9_]+(?=\x00)", Path(_core.__file__).read_bytes())
    exported = {s.decode() for s in strings if hasattr(library, s.decode())}
    probes = {n for n in exported if n.endswith(("_abi", "_vectorized", "_integer_rows",
                                                 "_integer_blocks",
                                                 "_packs", "_nt_lanes"))}
    handlers = exported - probes
    assert len(handlers) > 40  # the scan found the core's handlers
    assert handlers <= set(names), sorted(handlers - set(names))
