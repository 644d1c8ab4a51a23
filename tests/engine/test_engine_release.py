"""Engines give their memory back when dropped: an ``LLM``, and a served app whose
engine was shut down, are collected with their compiled executables.

Each XLA:CPU executable holds a few memory mappings of JIT code and the kernel caps
mappings per process (``vm.max_map_count``), so a process that builds engine after
engine (tests, notebooks, RL loops generating with fresh params) must not pin old ones.
Two pins were found this way: FastAPI's process-wide cache of endpoint functions held
route closures over the engine, and the frozen startup heap (``kvpage.system.gc_heap``) kept
an engine's reference cycles out of the collector after the server stopped.
"""

from __future__ import annotations

import gc
import urllib.request
import weakref
from pathlib import Path

from kvpage import LLM, SamplingParams
from kvpage.engine.config import EngineConfig
from kvpage.system import gc_heap
from server_harness import InProcessServer

SMALL = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32)


def test_a_dropped_llm_is_collected(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **SMALL)
    llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    runner = weakref.ref(llm.engine.runner)
    del llm
    gc.collect()
    assert runner() is None


def test_a_stopped_server_releases_its_engine_and_the_frozen_heap(tiny_model_dir: Path) -> None:
    assert gc_heap.holders() == 0
    thresholds = gc.get_threshold()
    config = EngineConfig(model=str(tiny_model_dir), **SMALL)
    with InProcessServer(config, model_name="tiny") as server:
        assert gc_heap.holders() == 1  # frozen while the engine thread runs
        assert gc.get_threshold()[0] >= gc_heap.SERVING_GEN0_THRESHOLD
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as response:
            assert response.status == 200
        runner = weakref.ref(server.engine.engine.runner)
    assert gc_heap.holders() == 0
    assert gc.get_threshold() == thresholds
    del server
    gc.collect()
    assert runner() is None
