"""The step-plan contract, documented once in ``rust/sched/step_plan.rs``: the Python
``StepPlan`` (``kvpage.runner.step_plan``, which the test doubles build) has the fields,
dtypes and shapes of the plans the Rust scheduler produces."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest
from kvpage._core import Scheduler
from kvpage.runner.step_plan import StepPlan, StepPlanLike
from kvpage.sampling.token_bitmask import bitmask_words, pad_bitmask
from model_fixtures import PlainPlanner

BLOCK_SIZE = 4
NUM_BLOCKS = 64
VOCAB = 100
PROMPTS = [list(range(10, 16)), [20, 21, 22], list(range(30, 39))]
# The Python plan's optional field the core leaves to the engine
# (`Scheduler.fill_token_bitmask`).
ENGINE_FIELDS = {"token_bitmask"}

# Each field's dtype and shape in the symbols of rust/sched/step_plan.rs
# (T tokens, S rows, R sampled rows, C copies); "W" is any block-table width.
FORMAT: dict[str, tuple[type, tuple[str, ...]]] = {
    "token_ids": (np.int32, ("T",)),
    "positions": (np.int32, ("T",)),
    "slot_mapping": (np.int32, ("T",)),
    "cu_q_lens": (np.int32, ("S+1",)),
    "kv_lens": (np.int32, ("S",)),
    "row_request": (np.uint64, ("S",)),
    "block_tables": (np.int32, ("S", "W")),
    "logits_indices": (np.int32, ("R",)),
    "sample_rows": (np.int32, ("R",)),
    "copy_src": (np.int32, ("C",)),
    "copy_dst": (np.int32, ("C",)),
    "token_bitmask": (np.int32, ("R", "words")),
}
SCALARS = {"num_seqs": int, "num_tokens": int, "decode_only": bool}


def _rust_plans() -> list:
    """Two steps of the Rust scheduler: prefills of different widths, then decodes."""
    sched = Scheduler(
        NUM_BLOCKS, BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
        eos_token_ids=[2],
    )
    for prompt in PROMPTS:
        sched.add_request(prompt, max_tokens=4, ignore_eos=True)
    plans = []
    for _ in range(2):
        plan = sched.schedule()
        bitmask = sched.fill_token_bitmask(bitmask_words(VOCAB))
        plans.append((plan, bitmask))
        sched.update(np.full(plan.num_sampled, 7, np.int32))
    return plans


def _python_plans() -> list[StepPlan]:
    """The same two steps from the test doubles' planner, which builds Python StepPlans."""
    planner = PlainPlanner(NUM_BLOCKS, BLOCK_SIZE, token_budget=64)
    for seat, prompt in enumerate(PROMPTS):
        planner.add(seat, prompt, 4)
    plans = []
    for _ in range(2):
        plan = planner.next_plan()
        assert plan is not None
        plans.append(plan)
        planner.commit(plan, np.full(len(plan.logits_indices), 7, np.int32))
    return plans


def _sizes(plan: object, words: int) -> dict[str, int]:
    return {
        "T": len(plan.token_ids),
        "S": len(plan.kv_lens),
        "S+1": len(plan.kv_lens) + 1,
        "R": len(plan.logits_indices),
        "C": len(plan.copy_src),
        "words": words,
    }


def _check_format(name: str, value: object, sizes: dict[str, int]) -> None:
    dtype, shape = FORMAT[name]
    array = np.asarray(value)
    assert array.dtype == dtype, f"{name}: dtype {array.dtype}, documented {dtype.__name__}"
    assert array.ndim == len(shape), f"{name}: shape {array.shape}, documented {shape}"
    for axis, symbol in enumerate(shape):
        if symbol != "W":
            assert array.shape[axis] == sizes[symbol], f"{name}: shape {array.shape} vs {shape}"


def test_python_fields_are_fields_of_the_core_plan() -> None:
    python_fields = {f.name for f in dataclasses.fields(StepPlan)}
    assert python_fields == set(FORMAT) | set(SCALARS)
    # StepPlanLike (what the runner reads) is the Python plan less the engine's fields.
    assert set(typing.get_type_hints(StepPlanLike)) == python_fields - ENGINE_FIELDS
    (plan, _), _ = _rust_plans()
    missing = [name for name in python_fields - ENGINE_FIELDS if not hasattr(plan, name)]
    assert not missing, f"Python StepPlan fields the Rust plan lacks: {missing}"


@pytest.mark.parametrize("step", [0, 1], ids=["prefill", "decode"])
def test_python_and_rust_plans_have_the_same_dtypes_and_shapes(step: int) -> None:
    rust, bitmask = _rust_plans()[step]
    python = _python_plans()[step]
    words = bitmask_words(VOCAB)
    rust_sizes, python_sizes = _sizes(rust, words), _sizes(python, words)
    assert rust_sizes["T"] == rust.num_tokens and rust_sizes["S"] == rust.num_seqs
    assert rust_sizes["R"] == rust.num_sampled
    for name in set(FORMAT) - ENGINE_FIELDS:
        _check_format(name, getattr(rust, name), rust_sizes)
        _check_format(name, getattr(python, name), python_sizes)
    # The core's bitmask is the Python plan's optional token_bitmask, and the runner
    # pads it to its row bucket.
    _check_format("token_bitmask", bitmask, rust_sizes)
    with_mask = StepPlan(**{n: getattr(rust, n) for n in set(FORMAT) - ENGINE_FIELDS},
                         token_bitmask=bitmask)
    _check_format("token_bitmask", with_mask.token_bitmask, rust_sizes)
    assert pad_bitmask(bitmask, 8, VOCAB).shape == (8, words)
    for name, kind in SCALARS.items():
        assert type(getattr(rust, name)) is kind, name
        assert type(getattr(python, name)) is kind, name
    # The content that does not depend on block allocation is the same plan.
    for name in ("token_ids", "positions", "cu_q_lens", "kv_lens", "logits_indices"):
        assert getattr(rust, name).tolist() == getattr(python, name).tolist(), name


@pytest.mark.parametrize("step", [0, 1], ids=["prefill", "decode"])
def test_python_plan_derives_the_scalars_the_core_reports(step: int) -> None:
    rust, _ = _rust_plans()[step]
    arrays = {n: getattr(rust, n) for n in set(FORMAT) - ENGINE_FIELDS}
    derived = StepPlan(**arrays)
    assert derived.num_seqs == rust.num_seqs
    assert derived.num_tokens == rust.num_tokens
    assert derived.decode_only == rust.decode_only == (step == 1)
    # Unused block-table entries hold the scratch block id, as documented.
    widths = [-(-int(k) // BLOCK_SIZE) for k in rust.kv_lens]
    for row, used in enumerate(widths):
        assert (rust.block_tables[row, used:] == NUM_BLOCKS).all()
