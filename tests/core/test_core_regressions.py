"""Regression tests, through the Python bindings, of the core bugs found by the
reference-model audit (issue 13). Each states the correct behaviour and failed
before its fix; the Rust suite pins the same bugs (``rust/*regression*``,
``rust/kv/kv_cache_tests.rs``) and ``rust/sched/reference_model_tests.rs`` hunts for more.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvpage._core import KVCacheManager, Scheduler


def _step(sched: Scheduler, token: int = 7):  # noqa: ANN202 - a StepPlan
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, token, np.int64))
    sched.check_invariants()
    return plan


def _run_to_end(sched: Scheduler) -> None:
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            sched.check_invariants()
            assert sched.stats()["num_referenced_blocks"] == 0
            return
        _step(sched)
    raise AssertionError("the scheduler made no progress")


def test_a_cached_parent_outlives_its_forked_child() -> None:
    kv = KVCacheManager(8, 4)
    a = kv.create_sequence()
    kv.allocate_slots(a, 4)
    kv.cache_blocks(a, [0, 1, 2, 3])
    p = kv.create_sequence()
    kv.allocate_slots(p, 8)
    c = kv.fork(p)
    kv.cache_blocks(p, list(range(8)))
    kv.free_sequence(a)
    kv.free_sequence(p)
    kv.check_invariants()
    assert kv.evict(1) == 0, "the parent lives while the fork holds its child"
    q = kv.create_sequence()
    kv.allocate_slots(q, 4)
    kv.cache_blocks(q, [90, 91, 92, 93])
    r = kv.create_sequence()
    assert kv.match_prefix(r, [90, 91, 92, 93, 4, 5, 6, 7, 99]) == 4
    kv.check_invariants()
    for seq in (c, q, r):
        kv.free_sequence(seq)
    kv.check_invariants()


def test_static_samples_never_write_one_slot() -> None:
    sched = Scheduler(32, block_size=4, max_model_len=64, scheduling_policy="static")
    sched.add_request([5, 6, 7, 8, 9], n=3, max_tokens=6, ignore_eos=True)
    scratch = 32 * 4
    for _ in range(3):
        plan = _step(sched)
        written = plan.slot_mapping[plan.slot_mapping != scratch]
        assert len(set(written.tolist())) == len(written), plan.slot_mapping
    _run_to_end(sched)


@pytest.mark.parametrize("finish", ["request", "sample"])
def test_static_finish_before_prefill_keeps_the_scheduler_usable(finish: str) -> None:
    sched = Scheduler(32, block_size=4, max_model_len=64, max_num_batched_tokens=8,
                      scheduling_policy="static")
    a = sched.add_request([9] * 8, max_tokens=4, ignore_eos=True)
    b = sched.add_request([3] * 4, max_tokens=4, ignore_eos=True)
    assert _step(sched).row_request.tolist() == [a], "b is seated but got no budget"
    if finish == "request":
        assert sched.finish_request(b, "stop")
    else:
        assert sched.finish_sample(b, 0, "stop")
    for _ in range(3):  # used to raise PanicException here, and forever after
        _step(sched)
    _run_to_end(sched)


def test_priority_waiting_requests_pin_no_blocks() -> None:
    sched = Scheduler(32, block_size=4, max_model_len=64, max_num_batched_tokens=4,
                      scheduling_policy="priority")
    shared = list(range(100, 116))
    sched.add_request(shared, max_tokens=1, ignore_eos=True)
    _run_to_end(sched)
    sched.add_request([1] * 40, max_tokens=2, ignore_eos=True, priority=5)
    _step(sched)
    sched.add_request([*shared, 1], max_tokens=2, ignore_eos=True, priority=0)
    _step(sched)
    assert sched.num_requests_waiting == 1
    assert sched.stats()["num_referenced_blocks"] == 2, "only the running prefill holds KV"
    _run_to_end(sched)


def test_cached_tokens_of_a_new_prompt_stay_zero_after_preemption() -> None:
    sched = Scheduler(8, block_size=4, max_model_len=32, max_num_batched_tokens=32,
                      long_prefill_token_threshold=4)
    sched.add_request([50] * 16, max_tokens=8, ignore_eos=True)
    for _ in range(4):
        _step(sched)
    late = sched.add_request(list(range(200, 220)), max_tokens=2, ignore_eos=True)
    preempted = False
    while sched.has_unfinished_requests():
        preempted |= late in _step(sched).preempted.tolist()
        cached = sched.num_cached_tokens(late)
        assert cached in (None, 0), f"a never-seen prompt reports {cached} cached tokens"
    assert preempted


def test_slot_usage_stats_are_counters() -> None:
    sched = Scheduler(32, block_size=4, max_model_len=64)
    sched.add_request([1] * 8, n=2, max_tokens=4, ignore_eos=True)
    _step(sched)
    stats = sched.stats()
    assert (stats["kv_slots_reserved"], stats["kv_slots_used"]) == (8, 8)
    _step(sched)
    stats = sched.stats()
    assert (stats["kv_slots_reserved"], stats["kv_slots_used"]) == (16, 10)
    _run_to_end(sched)


def test_invalid_call_orders_are_typed_errors_and_the_scheduler_stays_usable() -> None:
    sched = Scheduler(32, block_size=4, max_model_len=64, scheduling_policy="static")
    handle = sched.add_request([1, 2, 3], n=2, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="without a scheduled step"):
        sched.update(np.array([1], np.int64))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="twice"):
        sched.schedule()
    with pytest.raises(ValueError, match="sampled"):
        sched.update(np.ones(plan.num_sampled + 1, np.int64))
    with pytest.raises(ValueError, match="no sample 5"):
        sched.finish_sample(handle, 5, "stop")
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish_request(handle, "bogus")
    assert sched.finish_sample(handle, 1, "stop")  # between schedule and update
    sched.update(np.full(plan.num_sampled, 7, np.int64))
    sched.check_invariants()
    assert not sched.abort_request(handle + (1 << 40))
    _run_to_end(sched)
