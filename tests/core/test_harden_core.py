"""The Rust ``Scheduler`` binding under hostile calls: huge values, token
arrays of every wrong dtype, shape and length, and ids that do not exist.
Only Python exceptions may come out (never a panic or abort across the FFI
boundary), a rejected call changes nothing, and the invariants hold after
every call. Complements the state machines of ``test_scheduler.py`` and
``test_core_bindings.py``."""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpage._core import Scheduler

EOS = 2
MAX_MODEL_LEN = 64
REJECTED = (ValueError, TypeError, OverflowError)
"""What a bad argument may raise (UnicodeEncodeError is a ValueError)."""


def make() -> Scheduler:
    return Scheduler(
        num_blocks=48,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=[EOS],
    )


def drain(sched: Scheduler, token: int = 7, limit: int = 2_000) -> None:
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return
        plan = sched.schedule()
        sched.update(np.full(plan.num_sampled, token, np.int32))
        sched.check_invariants()
    raise AssertionError("the scheduler made no progress")


def still_works(sched: Scheduler) -> None:
    """Invariants hold, a normal request still runs to the end, every block returns."""
    sched.check_invariants()
    handle = sched.add_request([5, 6, 7, 8, 9], max_tokens=3)
    drain(sched)
    assert sched.sample_tokens(handle, 0) is None  # finished and gone
    assert sched.kv_cache_usage_perc == 0.0
    sched.check_invariants()


def _readonly(values: list[int]) -> np.ndarray:
    a = np.array(values, np.int32)
    a.setflags(write=False)
    return a


# (container, the token ids it means, or None when it must be rejected)
CONTAINERS: dict[str, tuple[Any, list[int] | None]] = {
    "int32": (np.array([3, 4], np.int32), [3, 4]),
    "int64": (np.array([3, 4], np.int64), [3, 4]),
    "uint32-max": (np.array([2**32 - 1], np.uint32), [2**32 - 1]),
    "uint8": (np.array([3, 4], np.uint8), [3, 4]),
    "int16": (np.array([3, 4], np.int16), [3, 4]),
    "uint64-small": (np.array([3, 4], np.uint64), [3, 4]),
    "strided-int32": (np.arange(10, dtype=np.int32)[::3], [0, 3, 6, 9]),
    "big-endian-int32": (np.array([3, 4], ">i4"), [3, 4]),
    "readonly-int32": (_readonly([3, 4]), [3, 4]),
    "tuple": ((3, 4, 5), [3, 4, 5]),
    "range": (range(3, 6), [3, 4, 5]),
    "array.array": (array.array("i", [3, 4]), [3, 4]),
    "uint64-over-i64": (np.array([2**64 - 1], np.uint64), None),
    "int64-negative": (np.array([-1], np.int64), None),
    "int8-negative": (np.array([3, -2], np.int8), None),
    "list-over-u32": ([2**32], None),
    "list-huge-int": ([2**70], None),
    "list-negative": ([-1], None),
    "float64": (np.array([3.0, 4.0]), None),
    "float16": (np.array([3, 4], np.float16), None),
    "bool-array": (np.array([True, False]), None),
    "complex": (np.array([1j]), None),
    "2-d": (np.ones((2, 2), np.int32), None),
    "0-d": (np.array(5, np.int32), None),
    "object-with-none": (np.array([1, None], object), None),
    "datetime": (np.array(["2020-01-01"], "datetime64[D]"), None),
    "list-of-floats": ([3.0, 4.5], None),
    "list-with-none": ([3, None], None),
    "nested-list": ([[3, 4]], None),
    "str": ("abc", None),
    "dict": ({3: 4}, None),
    "set": ({3, 4}, None),
    "generator": ((i for i in range(3)), None),
    "numpy-scalar": (np.int64(5), None),
    "none": (None, None),
    "empty": (np.zeros(0, np.int32), None),
    "too-long": (np.full(MAX_MODEL_LEN + 1, 3, np.int32), None),
    "a-million": (np.full(1_000_000, 3, np.int32), None),
}


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_prompt_containers_are_taken_exactly_or_rejected(name: str) -> None:
    container, expected = CONTAINERS[name]
    sched = make()
    if expected is None:
        with pytest.raises(REJECTED):
            sched.add_request(container, max_tokens=2)
        assert not sched.has_unfinished_requests()
    else:
        handle = sched.add_request(container, max_tokens=2)
        assert sched.sample_tokens(handle, 0).tolist() == expected
        drain(sched)
    still_works(sched)


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_sampled_token_containers_are_taken_or_rejected_without_harm(name: str) -> None:
    container, _ = CONTAINERS[name]
    sched = make()
    handle = sched.add_request([5, 6, 7], n=2, max_tokens=4)
    plan = sched.schedule()
    assert plan.num_sampled == 2
    before = sched.sample_tokens(handle, 0).tolist()
    try:
        sched.update(container)
    except REJECTED:
        assert sched.awaiting_update  # the step still waits for a valid update
        assert sched.sample_tokens(handle, 0).tolist() == before
        sched.check_invariants()
        sched.update(np.array([7, 8], np.int32))
    else:  # only a 2-row container of valid ids can be taken
        assert not sched.awaiting_update
    sched.check_invariants()
    drain(sched)
    still_works(sched)


@pytest.mark.parametrize(
    "sampled",
    [
        np.zeros(1, np.int32),
        np.zeros(3, np.int32),
        np.zeros(0, np.int32),
        np.full(2, -1, np.int64),
        np.full(2, 2**40, np.int64),
        np.zeros((2, 1), np.int32),
        np.zeros(2, np.float64),
    ],
    ids=["short", "long", "empty", "negative", "over-u32", "2-d", "float"],
)
def test_wrong_sampled_rows_leave_the_step_pending(sampled: np.ndarray) -> None:
    sched = make()
    sched.add_request([5, 6, 7], n=2, max_tokens=4)
    sched.schedule()
    with pytest.raises(REJECTED):
        sched.update(sampled)
    assert sched.awaiting_update
    sched.check_invariants()
    sched.update(np.array([7, 8], np.int32))
    drain(sched)
    still_works(sched)


HUGE_REQUESTS: list[tuple[str, dict[str, Any], bool]] = [
    # (id, add_request kwargs beyond the prompt, accepted)
    ("n-u32-overflow", {"n": 2**32}, False),
    ("n-over-max-num-seqs", {"n": 2**31}, False),
    ("n-negative", {"n": -1}, False),
    ("max-tokens-u32-max", {"max_tokens": 2**32 - 1}, True),
    ("max-tokens-overflow", {"max_tokens": 2**32}, False),
    # min_tokens beyond the room the prompt leaves in max_model_len can never be met
    ("min-tokens-u32-max", {"min_tokens": 2**32 - 1, "max_tokens": 2**32 - 1}, False),
    ("min-tokens-fill-max-model-len", {"min_tokens": 61, "max_tokens": None}, True),
    ("min-over-max", {"min_tokens": 9, "max_tokens": 3}, False),
    ("priority-i64-max", {"priority": 2**63 - 1}, True),
    ("priority-i64-min", {"priority": -(2**63)}, True),
    ("priority-overflow", {"priority": 2**63}, False),
    ("stop-token-u32-max", {"stop_token_ids": [2**32 - 1]}, True),
    ("stop-token-overflow", {"stop_token_ids": [2**32]}, False),
    ("stop-token-negative", {"stop_token_ids": [-1]}, False),
    ("many-stop-tokens", {"stop_token_ids": list(range(100_000))}, True),
    ("salt-megabyte", {"cache_salt": "s" * 1_000_000}, True),
    ("salt-empty", {"cache_salt": ""}, True),
    ("salt-nul", {"cache_salt": "\0"}, True),
    ("salt-lone-surrogate", {"cache_salt": "\udc00"}, False),
    ("salt-not-a-string", {"cache_salt": 5}, False),
    ("unknown-keyword", {"temperature": 0.5}, False),
]


@pytest.mark.parametrize(
    ("kwargs", "accepted"),
    [(k, a) for _, k, a in HUGE_REQUESTS],
    ids=[name for name, _, _ in HUGE_REQUESTS],
)
def test_huge_and_wrong_request_values(kwargs: dict[str, Any], accepted: bool) -> None:
    sched = make()
    other = sched.add_request([9, 9, 9, 9, 9, 9], max_tokens=5)
    if accepted:
        handle = sched.add_request([5, 6, 7], **kwargs)
        drain(sched)  # runs to the end: max_model_len bounds even a u32::MAX max_tokens
        assert sched.sample_tokens(handle, 0) is None
    else:
        with pytest.raises(REJECTED):
            sched.add_request([5, 6, 7], **kwargs)
        drain(sched)
    assert sched.sample_tokens(other, 0) is None
    still_works(sched)


def _unknown_id_calls(live: int) -> list[tuple[str, Callable[[Scheduler], Any], Any]]:
    # (id, call, expected result or the exception type)
    return [
        ("abort-unknown", lambda s: s.abort_request(10**6), False),
        ("abort-u64-max", lambda s: s.abort_request(2**64 - 1), False),
        ("abort-u64-overflow", lambda s: s.abort_request(2**64), OverflowError),
        ("abort-negative", lambda s: s.abort_request(-1), OverflowError),
        ("finish-unknown", lambda s: s.finish_request(10**6, "stop"), False),
        ("finish-bad-reason", lambda s: s.finish_request(live, "bogus"), ValueError),
        ("finish-empty-reason", lambda s: s.finish_request(live, ""), ValueError),
        ("finish-surrogate-reason", lambda s: s.finish_request(live, "\udc00"), ValueError),
        ("finish-sample-unknown-request", lambda s: s.finish_sample(10**6, 0, "stop"), False),
        (
            "finish-sample-unknown-index",
            lambda s: s.finish_sample(live, 2**32 - 1, "stop"),
            ValueError,
        ),
        (
            "finish-sample-index-overflow",
            lambda s: s.finish_sample(live, 2**32, "stop"),
            OverflowError,
        ),
        ("sample-tokens-unknown", lambda s: s.sample_tokens(10**6, 0), None),
        ("sample-tokens-unknown-index", lambda s: s.sample_tokens(live, 2**32 - 1), None),
        ("cached-tokens-u64-max", lambda s: s.num_cached_tokens(2**64 - 1), None),
        ("cached-tokens-negative", lambda s: s.num_cached_tokens(-1), OverflowError),
    ]


@pytest.mark.parametrize(
    "index", range(len(_unknown_id_calls(0))), ids=[name for name, _, _ in _unknown_id_calls(0)]
)
def test_unknown_ids_and_bad_reasons_change_nothing(index: int) -> None:
    sched = make()
    live = sched.add_request([5, 6, 7], n=2, max_tokens=6)
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, 7, np.int32))
    before = [sched.sample_tokens(live, i).tolist() for i in range(2)]
    stats = {k: v for k, v in sched.stats().items() if k != "num_steps"}
    _, call, expected = _unknown_id_calls(live)[index]
    if isinstance(expected, type):
        with pytest.raises(expected):
            call(sched)
    else:
        assert call(sched) == expected
    sched.check_invariants()
    assert [sched.sample_tokens(live, i).tolist() for i in range(2)] == before
    assert {k: v for k, v in sched.stats().items() if k != "num_steps"} == stats
    drain(sched)
    still_works(sched)


def test_abort_twice_and_after_finish_is_a_no_op() -> None:
    sched = make()
    handle = sched.add_request([5, 6, 7], max_tokens=2)
    assert sched.abort_request(handle) is True
    assert sched.abort_request(handle) is False
    assert sched.finish_request(handle, "stop") is False
    done = sched.add_request([5, 6, 7], max_tokens=1)
    drain(sched)
    assert sched.abort_request(done) is False
    still_works(sched)


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(-(2**40), 2**40), max_size=6),
    st.lists(st.floats(allow_nan=True), max_size=3),
)


@settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    prompt=_ANY_VALUE,
    n=_ANY_VALUE,
    max_tokens=_ANY_VALUE,
    priority=_ANY_VALUE,
    salt=_ANY_VALUE,
    stop=_ANY_VALUE,
)
def test_random_argument_values_only_raise(
    prompt: Any, n: Any, max_tokens: Any, priority: Any, salt: Any, stop: Any
) -> None:
    sched = make()
    try:
        sched.add_request(
            prompt,
            n=n,
            max_tokens=max_tokens,
            priority=priority,
            cache_salt=salt,
            stop_token_ids=stop,
        )
    except REJECTED:
        assert not sched.has_unfinished_requests()
    sched.check_invariants()
    drain(sched)
    assert sched.kv_cache_usage_perc == 0.0


def test_pool_too_large_for_memory_is_an_error_not_an_abort() -> None:
    """Pool sizes come from users: a pool the process cannot allocate raises
    ValueError (it used to abort the interpreter)."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4_000_000_000, 4_000_000_000))\n"
        "from kvpage._core import Scheduler\n"
        "try:\n"
        "    Scheduler(num_blocks=10**8, block_size=4, max_model_len=128)\n"
        "except ValueError as err:\n"
        "    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "out of memory" in done.stdout


def test_engine_side_bounds_match_the_core() -> None:
    from kvpage.sampling.params import SamplingParams

    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**31)
