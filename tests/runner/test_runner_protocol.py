"""ModelRunner and the benchmarks' InstantRunner implement the engine's view of a runner,
:class:`kvpage.runner.protocol.StepRunner`: at run time (``isinstance`` with the
runtime-checkable protocol: every member present) and by signature (each method callable
exactly as the protocol declares it: the same parameters, in order, of the same kind and
with the same defaults; extra parameters only with defaults). Annotations are not
compared (they are strings naming types that exist only for the type checker)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kvpage.bench.host import InstantRunner
from kvpage.model.params import param_spec, tree_from_flat
from kvpage.model.presets import preset
from kvpage.runner.model_runner import ModelRunner
from kvpage.runner.pending import PendingMultiStep, PendingStep
from kvpage.runner.protocol import PendingResult, StepRunner

RUNNERS = [ModelRunner, InstantRunner]


def _members() -> tuple[dict[str, Callable[..., Any]], list[str], dict[str, str]]:
    """The protocol's methods, properties and annotated attributes (name -> type name)."""
    methods, properties = {}, []
    for name, value in vars(StepRunner).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            properties.append(name)
        elif inspect.isfunction(value):
            methods[name] = value
    return methods, properties, dict(StepRunner.__annotations__)


def signature_problems(impl: Callable[..., Any], proto: Callable[..., Any]) -> list[str]:
    """Why ``impl`` cannot be called everywhere ``proto`` can (empty: it can)."""
    want = list(inspect.signature(proto).parameters.values())
    have = list(inspect.signature(impl).parameters.values())
    problems = []
    for i, p in enumerate(want):
        if i >= len(have):
            problems.append(f"missing parameter {p.name!r}")
            continue
        h = have[i]
        if h.kind in (h.VAR_POSITIONAL, h.VAR_KEYWORD):
            break
        if h.name != p.name:
            problems.append(f"parameter {i} is {h.name!r}, the protocol's is {p.name!r}")
        if h.kind != p.kind:
            problems.append(f"{p.name!r} is {h.kind.description}, not {p.kind.description}")
        if p.default is not p.empty and h.default is h.empty:
            problems.append(f"{p.name!r} has no default; the protocol's is {p.default!r}")
        elif p.default is not p.empty and h.default != p.default:
            problems.append(f"{p.name!r} defaults to {h.default!r}, not {p.default!r}")
    for h in have[len(want):]:
        if h.default is h.empty and h.kind not in (h.VAR_POSITIONAL, h.VAR_KEYWORD):
            problems.append(f"extra parameter {h.name!r} has no default")
    return problems


@pytest.mark.parametrize("runner_class", RUNNERS, ids=lambda c: c.__name__)
def test_methods_take_the_protocols_arguments(runner_class: type) -> None:
    methods, _, _ = _members()
    assert {"dispatch", "set_request", "update_params"} <= methods.keys()  # found them
    for name, proto in methods.items():
        impl = getattr(runner_class, name, None)
        assert inspect.isfunction(impl), f"{runner_class.__name__}.{name} is not a method"
        problems = signature_problems(impl, proto)
        assert not problems, f"{runner_class.__name__}.{name}: {'; '.join(problems)}"


def test_pending_results_have_result() -> None:
    for pending in (PendingStep, PendingMultiStep):
        assert not signature_problems(pending.result, PendingResult.result)


def _model_runner() -> ModelRunner:
    config = dataclasses.replace(preset("tiny-llama"), num_layers=2)
    rng = np.random.default_rng(0)
    spec = param_spec(config)
    params = tree_from_flat(
        config, {n: rng.standard_normal(s).astype(np.float32) * 0.02 for n, s in spec.items()}
    )
    return ModelRunner(config, params, num_blocks=16, block_size=4, max_model_len=32,
                       max_num_seqs=4, max_num_batched_tokens=16)


@pytest.mark.parametrize("make", [
    _model_runner,
    lambda: InstantRunner(num_blocks=16, block_size=4, max_model_len=32, max_num_seqs=4,
                          token_cycle=[1, 2, 3]),
], ids=["ModelRunner", "InstantRunner"])
def test_instances_are_step_runners(make: Callable[[], Any]) -> None:
    runner = make()
    assert isinstance(runner, StepRunner)
    _, properties, attributes = _members()
    for name in properties:  # an instance attribute serves for a read-only property
        assert hasattr(runner, name), f"{type(runner).__name__} lacks {name}"
    types = {"int": int, "float": float, "bool": bool}
    for name, kind in attributes.items():
        value = getattr(runner, name)
        assert isinstance(value, types[kind]), f"{name} is {value!r}, not {kind}"
    assert isinstance(runner.num_blocks, int) and runner.num_blocks == 16
    assert runner.background_compiler is None  # no warm-up started


def test_the_signature_check_catches_mismatches() -> None:
    def proto(self: Any, seat: int, params: Any, prompt: Any = ()) -> None: ...

    def renamed(self: Any, slot: int, params: Any, prompt: Any = ()) -> None: ...

    def no_default(self: Any, seat: int, params: Any, prompt: Any) -> None: ...

    def extra(self: Any, seat: int, params: Any, prompt: Any = (), more: int = 1) -> None: ...

    def extra_required(self: Any, seat: int, params: Any, prompt: Any = (), *, more: int) -> None:
        ...

    assert signature_problems(extra, proto) == []
    assert signature_problems(renamed, proto) == ["parameter 1 is 'slot', the protocol's is 'seat'"]
    assert signature_problems(no_default, proto) == [
        "'prompt' has no default; the protocol's is ()"
    ]
    assert signature_problems(extra_required, proto) == ["extra parameter 'more' has no default"]


def test_the_runners_defaults_are_the_engines() -> None:
    """``ModelRunner`` keeps keyword defaults for direct use (tests, notebooks); they are
    ``EngineConfig``'s, which owns them (the runner may not import the engine above it)."""
    from kvpage.engine.config import EngineConfig

    engine = EngineConfig()
    defaults = {
        name: p.default
        for name, p in inspect.signature(ModelRunner.__init__).parameters.items()
    }
    assert defaults["max_num_seqs"] == engine.max_num_seqs
    assert defaults["max_num_batched_tokens"] == engine.max_num_batched_tokens
    assert defaults["max_logprobs"] == engine.max_logprobs
    assert defaults["kv_memory_fraction"] == engine.gpu_memory_utilization
