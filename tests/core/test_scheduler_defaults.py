"""The engine's size defaults have one owner, Python's ``EngineConfig``; the Rust
``Scheduler`` constructor mirrors them (``sched::scheduler::defaults``) for callers that
name none. These tests pin the two together through the scheduler's behaviour."""

from __future__ import annotations

from kvpage._core import Scheduler
from kvpage.engine.config import EngineConfig

DEFAULTS = EngineConfig()


def test_block_size_default_is_the_engine_configs() -> None:
    assert Scheduler(1024).block_size == DEFAULTS.block_size


def test_max_num_seqs_default_is_the_engine_configs() -> None:
    sched = Scheduler(4096)
    for i in range(DEFAULTS.max_num_seqs + 10):
        sched.add_request([10 + i % 50], max_tokens=1)
    plan = sched.schedule()
    assert plan.num_seqs == DEFAULTS.max_num_seqs
    assert plan.num_tokens < DEFAULTS.max_num_batched_tokens  # seats were the limit


def test_max_num_batched_tokens_default_is_the_engine_configs() -> None:
    sched = Scheduler(4096)
    for i in range(4):
        sched.add_request([10 + i] * 1000, max_tokens=1)
    plan = sched.schedule()
    assert plan.num_seqs < DEFAULTS.max_num_seqs  # the token budget was the limit
    assert plan.num_tokens == DEFAULTS.max_num_batched_tokens
