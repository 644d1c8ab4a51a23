"""Cold start: compile cost independent of depth, serving before every bucket is
compiled, and a second start that compiles nothing (issue #25)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.cli import build_parser
from kvpage.engine.config import engine_config_from_args
from kvpage.model.params import param_spec, tree_from_flat
from kvpage.model.presets import preset
from kvpage.runner.buckets import FALLBACK_MAX_RATIO, background_order, pick_fallback
from kvpage.runner.layered_step import LAYERS_PER_CALL, layer_groups, layer_plan
from kvpage.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["Once upon a time", "The module", "A list is a sequence of"]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, block_size=8)


def _runner(num_layers: int) -> ModelRunner:
    config = dataclasses.replace(preset("tiny-llama"), num_layers=num_layers)
    rng = np.random.default_rng(0)
    spec = param_spec(config)
    params = tree_from_flat(
        config, {n: rng.standard_normal(s).astype(np.float32) * 0.02 for n, s in spec.items()}
    )
    return ModelRunner(config, params, num_blocks=32, block_size=4, max_model_len=64,
                       max_num_seqs=4, max_num_batched_tokens=16)


def _hlo(compiled: object) -> str:
    """The optimized HLO without source locations (its metadata and stack-frame table)."""
    text = compiled.as_text().split("\nFileNames")[0]  # type: ignore[attr-defined]
    return re.sub(r",? metadata=\{[^}]*\}", "", text)


def test_compiled_step_does_not_grow_with_depth() -> None:
    """The executables of a 24-layer model are those of a 6-layer one: the decoder
    compiles as one group of layers (LAYERS_PER_CALL), called once per group."""
    shallow, deep = _runner(6), _runner(24)
    for key in ((1, 1, False), (16, 4, False)):
        a, b = shallow.executables.bucket(key), deep.executables.bucket(key)
        assert _hlo(a.embed) == _hlo(b.embed) and _hlo(a.select) == _hlo(b.select)
        assert a.layers.keys() == b.layers.keys() == {0}  # one piece: three alike layers
        assert _hlo(a.layers[0]) == _hlo(b.layers[0])
    assert shallow.executables.num_compilations == deep.executables.num_compilations


def test_layer_groups_cover_every_layer_once() -> None:
    for depth in (1, 2, 7, 12, 22, 30, 31, 32, 80):
        groups = layer_groups(depth)
        assert [i for start, n in groups for i in range(start, start + n)] == list(range(depth))
        assert len({n for _, n in groups}) <= 2  # at most one shorter last call
        assert max(n for _, n in groups) <= max(LAYERS_PER_CALL)
    assert layer_groups(30) == [(i, 3) for i in range(0, 30, 3)]
    assert layer_groups(32) == [(i, 4) for i in range(0, 32, 4)]


def _kinds_are_consistent(signatures: list[str]) -> None:
    """Every layer is in one call; calls of one kind hold the same layer structures (so a
    piece is only ever called with the layers it was traced with)."""
    plan = layer_plan(signatures)
    covered = [i for g in plan.groups for i in range(g.start, g.start + g.count)]
    assert covered == list(range(len(signatures)))
    for group in plan.groups:
        first = plan.kinds[group.kind]
        assert (signatures[group.start:group.start + group.count]
                == signatures[first.start:first.start + first.count])
    assert [plan.kinds.index(k) for k in plan.kinds] == list(range(len(plan.kinds)))


def test_layers_that_differ_share_a_piece_only_when_alike() -> None:
    # Qwen2.5-0.5B Q4_K_M: ffn_down Q6_K (A) or Q4_K (B) with v_proj Q8_0 or Q5_0.
    qwen = list("AABABBAAAAABBABBABBABABB")
    plan = layer_plan(qwen)
    assert len(plan.groups) == 24 and [k.count for k in plan.kinds] == [1, 1]
    # Gemma-3-style local/global layers: five sliding, one full. Two-layer groups take
    # two pieces (LL, LG) and half the calls of one layer a call.
    gemma = list("LLLLLG" * 4 + "LL")
    assert [(k.count) for k in layer_plan(gemma).kinds] == [2, 2]
    assert len(layer_plan(gemma).groups) == 13
    # A pattern repeating with the group size keeps three-layer groups.
    assert len(layer_plan(list("AAB" * 10)).groups) == 10
    # Alike layers: the cut of layer_groups, one piece per distinct length.
    assert [(g.start, g.count) for g in layer_plan(["x"] * 29).groups] == layer_groups(29)
    assert len(layer_plan(["x"] * 29).kinds) == 2
    rng = np.random.default_rng(0)
    for depth in (1, 2, 5, 7, 24, 30, 31):
        for alphabet in ("A", "AB", "ABC"):
            _kinds_are_consistent(list(rng.choice(list(alphabet), depth)))
            _kinds_are_consistent([alphabet[i % len(alphabet)] for i in range(depth)])


def test_background_compile_serves_at_once_with_the_same_tokens(tiny_model_dir: Path) -> None:
    lazy = LLM(str(tiny_model_dir), warmup="none", **ENGINE)
    expected = [o.outputs[0].token_ids for o in lazy.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert lazy.engine.runner.background_compiler is None
    lazy_executables = lazy.engine.runner.executables
    assert len(lazy_executables.compiled_buckets) < lazy_executables.max_step_executables

    served = LLM(str(tiny_model_dir), warmup="background", **ENGINE)
    runner = served.engine.runner
    got = [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected  # whichever bucket each step ran in
    background = runner.background_compiler
    assert background is not None and background.wait(timeout=600)
    assert background.failed == []
    assert background.pending == 0 and served.engine.step_executables_pending() == 0
    assert runner.executables.compiled_buckets == sorted(runner.executables.warmup_buckets())
    again = [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert again == expected


def test_the_background_compiler_yields_to_serving_and_reports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The compile thread runs at a lower priority than the thread that started it, logs
    a failed key as an error with its traceback, and ends with one line saying what it
    built and how long it took."""
    import logging
    import threading

    from kvpage.runner.background_compiler import COMPILE_NICENESS, BackgroundCompiler

    class Owner:
        niceness: list[int] = []

        def build(self, key: int) -> None:
            self.niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            if key == 2:
                raise RuntimeError("bucket 2 is broken")

    owner = Owner()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with caplog.at_level(logging.INFO, logger="kvpage.compile"):
        compiler = BackgroundCompiler(owner, "build", [1, 2, 3])
        assert compiler.wait(timeout=30)
    assert compiler.built == 2 and compiler.failed == [(2, "RuntimeError: bucket 2 is broken")]
    assert set(owner.niceness) == {min(mine + COMPILE_NICENESS, 19)}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert any(re.fullmatch(r"background compile done: 2 executables built in [\d.]+ s, "
                            r"1 failed", r.getMessage()) for r in caplog.records)


def test_keys_cheap_to_build_later_wait_while_the_owner_serves() -> None:
    """Deferrable keys (stored executables, loaded by the steps that need them) wait
    while the owner is busy; the others are built meanwhile; all once it is idle."""
    import threading

    from kvpage.runner.background_compiler import BackgroundCompiler

    class Owner:
        busy = True
        built: list[int] = []
        first_built = threading.Event()

        def build(self, key: int) -> None:
            self.built.append(key)
            if key == 3:
                self.first_built.set()

        def serving(self) -> bool:
            return self.busy

    owner = Owner()
    compiler = BackgroundCompiler(owner, "build", [1, 2, 3, 4], deferrable=lambda k: k in (1, 2),
                                  busy_name="serving")
    assert owner.first_built.wait(30)
    assert not compiler.wait(timeout=0.3)  # 1 and 2 wait for the owner
    assert owner.built == [3, 4] and compiler.remaining == 2
    # only loads are left: whoever waits for the compiles (multi-step decode) need not
    assert not compiler.compiles_left
    owner.busy = False
    assert compiler.wait(timeout=30)
    assert owner.built == [3, 4, 1, 2]


def test_a_step_runs_in_a_close_larger_bucket_or_its_own() -> None:
    compiled = [(1, 1, True), (4, 4, True), (16, 4, False), (64, 8, False)]
    assert pick_fallback((2, 2, True), compiled) == (4, 4, True)
    assert pick_fallback((4, 2, False), compiled) == (16, 4, False)
    assert pick_fallback((16, 8, True), compiled) == (64, 8, False)
    assert pick_fallback((8, 8, True), compiled) is None  # 64 > 4 x 8
    # never more than FALLBACK_MAX_RATIO times the tokens, never a decode-only bucket
    # for a step with prefill rows, never fewer sequences
    assert pick_fallback((2, 1, False), compiled) is None
    assert FALLBACK_MAX_RATIO < 32
    assert pick_fallback((16, 8, False), compiled) == (64, 8, False)
    assert pick_fallback((32, 16, False), compiled) is None
    order = background_order([(16, 4, False), (4, 4, True), (1, 1, True), (8, 2, False)])
    assert order == [(1, 1, True), (4, 4, True), (8, 2, False), (16, 4, False)]


def test_warmup_flags() -> None:
    parser = build_parser()

    def mode(*flags: str) -> str:
        args = parser.parse_args(["generate", "--prompt", "x", *flags])
        return engine_config_from_args(args, "m").warmup

    assert mode() == "none"
    assert mode("--warmup") == "full"
    assert mode("--warmup", "background") == "background"
    assert mode("--no-warmup") == "none"
    args = parser.parse_args(["generate", "--prompt", "x", "--compilation-cache-dir", "none"])
    assert engine_config_from_args(args, "m").compilation_cache_dir is None
    # the Python API reads the CLI's words too, never as a directory named "none"
    import jax
    from kvpage.system.compilation_cache import enable_compilation_cache

    configured = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert enable_compilation_cache("none") is None
        assert enable_compilation_cache("Off") is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", configured)
    with pytest.raises(ValueError, match="warmup must be one of"):
        LLM("unused", warmup="sometimes")


_START = textwrap.dedent(
    """
    import json, sys
    from kvpage import LLM, SamplingParams
    from kvpage.system.compilation_cache import compile_counts
    llm = LLM(sys.argv[1], max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              block_size=8)
    outs = llm.generate(["Once upon a time", "The module"],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    c = compile_counts()
    print(json.dumps({"compiled": c.compiled, "loaded": c.loaded,
                      "cache": str(llm.engine.compilation_cache_dir),
                      "tokens": [o.outputs[0].token_ids for o in outs]}))
    """
)


def test_second_start_compiles_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two starts of the same model and flags: the second loads every executable from
    the persistent cache ($XDG_CACHE_HOME/kvpage/xla) and compiles none."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def start() -> dict:
        done = subprocess.run([sys.executable, "-c", _START, str(tiny_model_dir)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["cache"] == str(tmp_path / "xdg" / "kvpage" / "xla")
    assert first["compiled"] > 0
    assert second["compiled"] == 0
    assert second["loaded"] == first["compiled"] + first["loaded"]
    assert second["tokens"] == first["tokens"]
