"""The Rust scheduler through its Python binding: behaviour, step-plan
format, errors, and a hypothesis state machine of random call sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvpage._core import DEFAULT_MAX_TOKENS, Scheduler
from kvpage.bench.sim import simulate
from kvpage.bench.workload import make_workload

EOS = 2


def make(**overrides: object) -> Scheduler:
    kwargs: dict = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        eos_token_ids=[EOS],
    )
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def drain(sched: Scheduler, token: int = 7) -> dict[tuple[int, int], list[int]]:
    """Run to completion; return the tokens of every (request, sample)."""
    outputs: dict[tuple[int, int], list[int]] = {}
    for _ in range(100_000):
        if not sched.has_unfinished_requests():
            return outputs
        plan = sched.schedule()
        handles, samples, tokens, _, _, _ = sched.update(np.full(plan.num_sampled, token, np.int32))
        for h, s, t in zip(handles.tolist(), samples.tolist(), tokens.tolist(), strict=True):
            outputs.setdefault((h, s), []).append(t)
        sched.check_invariants()
    raise AssertionError("the scheduler made no progress")


def test_step_plan_arrays_follow_the_documented_format() -> None:
    sched = make()
    sched.add_request(np.arange(10, 16, dtype=np.int32), max_tokens=4)
    sched.add_request([20, 21, 22], max_tokens=4)
    plan = sched.schedule()
    assert plan.token_ids.dtype == np.int32
    assert plan.token_ids.tolist() == [10, 11, 12, 13, 14, 15, 20, 21, 22]
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert plan.cu_q_lens.tolist() == [0, 6, 9]
    assert plan.kv_lens.tolist() == [6, 3]
    assert plan.block_tables.shape == (2, 2) and plan.block_tables.dtype == np.int32
    # Unused entries of a row hold the scratch block id (num_blocks).
    assert plan.block_tables[1, 1] == 64
    tables = plan.block_tables
    expected_slots = [tables[0, p // 4] * 4 + p % 4 for p in range(6)]
    expected_slots += [tables[1, p // 4] * 4 + p % 4 for p in range(3)]
    assert plan.slot_mapping.tolist() == expected_slots
    assert plan.logits_indices.tolist() == [5, 8]
    assert plan.num_tokens == 9 and plan.num_seqs == 2 and plan.num_sampled == 2


def test_seeds_example_static_is_46_9_percent_efficient_and_continuous_never_idles() -> None:
    work = make_workload(4, input_len=8, dist="fixed", output_lens=[32, 128, 64, 256])
    static = simulate(work, policy="static", max_num_seqs=4, num_blocks=256)
    assert static.output_tokens == 480 and static.steps == 256
    assert static.slot_efficiency == pytest.approx(480 / 1024)
    more = make_workload(12, input_len=8, dist="fixed", output_lens=[32, 128, 64, 256] * 3)
    continuous = simulate(more, policy="fcfs", max_num_seqs=4, num_blocks=256)
    assert continuous.idle_seats_while_waiting == 0
    # Slot efficiency counts every seat-step, so it is not 1 by construction: the
    # three 256-token requests leave seats empty at the end once the queue is drained.
    assert continuous.slot_efficiency == pytest.approx(1440 / (4 * continuous.steps))
    assert static.slot_efficiency < continuous.slot_efficiency < 1.0
    static_more = simulate(more, policy="static", max_num_seqs=4, num_blocks=256)
    assert static_more.seat_utilization == 1.0  # ghosts keep the seats "busy"
    assert static_more.slot_efficiency == pytest.approx(480 / 1024)


def test_paged_kv_waste_is_under_4_percent_and_contiguous_far_more() -> None:
    work = make_workload(120, dist="sharegpt", seed=1)
    paged = simulate(work, policy="fcfs", num_blocks=4096, max_tokens=1024, max_model_len=2048)
    static = simulate(work, policy="static", num_blocks=4096, max_tokens=1024, max_model_len=2048)
    assert paged.kv_waste < 0.04
    assert static.kv_waste > 0.5


def test_preemption_under_tiny_pool_keeps_exact_lengths_and_frees_all() -> None:
    sched = make(num_blocks=16, max_model_len=64)
    handles = [
        sched.add_request(list(range(30 * i + 10, 30 * i + 20)), max_tokens=30, ignore_eos=True)
        for i in range(8)
    ]
    outputs = drain(sched)
    assert sched.stats()["num_preemptions"] > 0
    for h in handles:
        assert len(outputs[(h, 0)]) == 30
    assert sched.kv_cache_usage_perc == 0.0


def test_priority_request_preempts_lower_priority_when_seats_are_full() -> None:
    sched = make(scheduling_policy="priority", max_num_seqs=2)
    low_a = sched.add_request([10, 11, 12], max_tokens=50, priority=5)
    low_b = sched.add_request([40, 41, 42], max_tokens=50, priority=5)
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, 7, np.int32))
    urgent = sched.add_request([80, 81], max_tokens=3, priority=0)
    plan = sched.schedule()
    assert plan.preempted.tolist() == [low_b]
    assert set(plan.sample_request.tolist()) == {low_a, urgent}


def test_abort_in_prefill_decode_and_waiting_frees_every_block() -> None:
    sched = make(max_num_batched_tokens=8, max_num_seqs=2)
    prefilling = sched.add_request(list(range(10, 40)), max_tokens=5)
    decoding = sched.add_request([5, 6, 7], max_tokens=50)
    waiting = sched.add_request([8, 9], max_tokens=5)
    sched.update(np.zeros(sched.schedule().num_sampled, np.int32))
    assert sched.abort_request(prefilling)
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, 7, np.int32))
    assert sched.abort_request(decoding) and sched.abort_request(waiting)
    assert not sched.abort_request(waiting)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_usage_perc == 0.0
    sched.check_invariants()


def test_parallel_sampling_prefills_once_and_shares_prompt_blocks() -> None:
    sched = make()
    h = sched.add_request(list(range(10, 20)), n=3, max_tokens=4, ignore_eos=True)
    plan = sched.schedule()
    assert plan.num_tokens == 10
    assert plan.logits_indices.tolist() == [9, 9, 9]
    assert sched.stats()["num_referenced_blocks"] == 3
    sched.update(np.array([7, 8, 9], np.int32))
    outputs = drain(sched)
    assert [len(outputs[(h, i)]) for i in range(3)] == [3, 3, 3]


def test_prefix_cache_hit_schedules_only_the_suffix() -> None:
    sched = make()
    shared = list(range(100, 116))
    sched.add_request(shared, max_tokens=1)
    drain(sched)
    h = sched.add_request(shared + [7, 8, 9], max_tokens=1)
    plan = sched.schedule()
    assert plan.positions.tolist() == [16, 17, 18]
    assert sched.num_cached_tokens(h) == 16
    assert sched.stats()["prefix_cache_hit_tokens"] == 16


def test_stop_conditions_and_finish_codes() -> None:
    sched = make()
    eos = sched.add_request([10, 11], max_tokens=9)
    min_tok = sched.add_request([10, 11], max_tokens=9, min_tokens=2)
    stop_id = sched.add_request([10, 11], max_tokens=9, stop_token_ids=[EOS])
    plan = sched.schedule()
    assert plan.sample_suppress_stop.tolist() == [False, True, False]
    handles, _, tokens, codes, _, _ = sched.update(np.full(3, EOS, np.int32))
    finished = dict(zip(handles.tolist(), codes.tolist(), strict=True))
    assert finished[eos] == 1 and finished[stop_id] == 1 and finished[min_tok] == 0
    assert sched.finish_request(min_tok, "stop")
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish_request(min_tok, "bogus")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=list(range(129))), "129 tokens"),
        (dict(prompt_token_ids=list(range(120)), min_tokens=9, max_tokens=None),
         "min_tokens=9 cannot be reached: only 8 tokens fit"),
        (dict(prompt_token_ids=[1], n=0), "n must"),
        (dict(prompt_token_ids=[1], max_tokens=0), "max_tokens"),
        (dict(prompt_token_ids=[1], min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(prompt_token_ids=[-1]), "out of range"),
    ],
)
def test_bad_requests_raise_value_error_naming_the_problem(kwargs: dict, message: str) -> None:
    sched = make()
    with pytest.raises(ValueError, match=message):
        sched.add_request(**kwargs)
    sched.check_invariants()


def test_max_tokens_default_is_the_public_default_and_none_runs_to_max_model_len() -> None:
    from kvpage import SamplingParams

    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS == 256
    sched = make()
    default = sched.add_request([1] * 10, ignore_eos=True)
    until_full = sched.add_request([2] * 120, max_tokens=None, ignore_eos=True)
    clamped = sched.add_request([3] * 124, max_tokens=50, ignore_eos=True)
    outputs = drain(sched)
    assert len(outputs[(default, 0)]) == 118, "the default 256 is clamped to the 118 left"
    assert len(outputs[(until_full, 0)]) == 8, "None generates until max_model_len (128)"
    assert len(outputs[(clamped, 0)]) == 4


def test_bad_configs_and_out_of_order_calls_raise() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=4, max_model_len=1000)
    sched = make()
    sched.add_request([1, 2, 3], max_tokens=3)
    sched.schedule()
    with pytest.raises(ValueError, match="twice"):
        sched.schedule()
    with pytest.raises(ValueError, match="sampled 1 rows"):
        sched.update(np.zeros(5, np.int32))
    sched.update(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="without a scheduled step"):
        sched.update(np.zeros(1, np.int32))


class SchedulerMachine(RuleBasedStateMachine):
    """Random, out-of-order and invalid call sequences: only Python
    exceptions, never a crash, and invariants intact after every call."""

    @initialize(policy=st.sampled_from(["fcfs", "priority", "static"]))
    def setup(self, policy: str) -> None:
        self.sched = make(
            num_blocks=24,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=40,
            scheduling_policy=policy,
        )
        self.handles: list[int] = []
        self.awaiting: int | None = None

    @rule(
        prompt=st.lists(st.integers(0, 20), min_size=0, max_size=45),
        n=st.integers(0, 3),
        max_tokens=st.integers(0, 20),
        priority=st.integers(-3, 3),
        salt=st.sampled_from([None, "a", "b"]),
    )
    def add(
        self, prompt: list[int], n: int, max_tokens: int, priority: int, salt: str | None
    ) -> None:
        try:
            h = self.sched.add_request(
                prompt, n=n, max_tokens=max_tokens, priority=priority, cache_salt=salt
            )
        except ValueError:
            return
        self.handles.append(h)

    @rule()
    def schedule(self) -> None:
        try:
            plan = self.sched.schedule()
        except ValueError:
            assert self.awaiting is not None
            return
        # Every non-empty plan awaits its update, even with no sampled rows.
        self.awaiting = plan.num_sampled if plan.num_tokens else None

    @rule(wrong=st.booleans(), token=st.integers(-2, 30))
    def update(self, wrong: bool, token: int) -> None:
        rows = self.awaiting if self.awaiting is not None else 0
        count = rows + 1 if wrong else rows
        try:
            self.sched.update(np.full(count, token, np.int64))
        except ValueError:
            assert wrong or token < 0 or self.awaiting is None
            return
        self.awaiting = None

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(self.handles))
        self.sched.abort_request(h)

    @rule(h=st.integers(0, 2**40))
    def abort_unknown(self, h: int) -> None:
        self.sched.abort_request(h)

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        if self.awaiting is not None:
            self.sched.update(np.zeros(self.awaiting, np.int32))
        for h in self.handles:
            self.sched.abort_request(h)
        self.sched.check_invariants()
        assert self.sched.kv_cache_usage_perc == 0.0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
