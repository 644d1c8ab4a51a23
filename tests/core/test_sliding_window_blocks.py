"""Sliding-window models through the ``_core`` Python API: the scheduler drops the KV
blocks that fall out of the window (``Scheduler(sliding_window=W)``), so a long
generation holds about a window's worth of blocks, and every block comes back."""

from __future__ import annotations

import numpy as np
import pytest
from kvpage._core import KVCacheManager, Scheduler

WINDOW = 4096
BLOCK_SIZE = 16


def test_a_16k_generation_holds_about_one_window_of_blocks() -> None:
    num_blocks = 2048  # room for the whole 16k sequence: only the window may limit use
    sched = Scheduler(
        num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        max_model_len=20_000,
        sliding_window=WINDOW,
    )
    assert sched.sliding_window == WINDOW
    prompt = np.arange(100, 612, dtype=np.int32)  # 512 tokens, two prefill chunks
    generate = 16_384
    handle = sched.add_request(prompt, max_tokens=generate, ignore_eos=True)
    window_blocks = -(-WINDOW // BLOCK_SIZE)  # what a 4096-token context needs
    limit = 1.3 * window_blocks
    peak = 0
    produced = 0
    sampled = np.full(1, 7, np.int32)
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if plan.num_seqs:
            # The window of the row's first query is all real blocks; the entries
            # before it were dropped and hold the scratch block id (num_blocks).
            start = int(plan.positions[0])
            first_needed = max(0, start + 1 - WINDOW) // BLOCK_SIZE
            table = plan.block_tables[0]
            assert (table[first_needed:] < num_blocks).all()
            assert (table[:first_needed] == num_blocks).all()
        peak = max(peak, sched.num_referenced_blocks)
        _, _, tokens, _, _, _ = sched.update(sampled[: plan.num_sampled])
        produced += len(tokens)
        peak = max(peak, sched.num_referenced_blocks)
    assert produced == generate
    assert peak <= limit, f"{peak} blocks in use > 1.3 x {window_blocks}"
    assert peak >= window_blocks, "the whole window stays resident"
    sched.check_invariants()
    assert sched.num_referenced_blocks == 0
    assert sched.num_free_blocks + sched.stats()["num_cached_blocks"] == num_blocks
    assert sched.sample_tokens(handle, 0) is None


def test_forks_aborts_and_preemption_return_every_block() -> None:
    sched = Scheduler(
        20,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        max_model_len=1024,
        sliding_window=16,
    )
    handles = [
        sched.add_request(
            np.arange(10 * i, 10 * i + 30, dtype=np.int32), n=3, max_tokens=200, ignore_eos=True
        )
        for i in range(4)
    ]
    for step in range(100_000):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        sched.update(np.full(plan.num_sampled, 5 + step % 11, np.int32))
        sched.check_invariants()
        # Only the windows of running samples are held: 5 blocks each.
        assert sched.num_referenced_blocks <= 5 * sched.num_requests_running
        if step == 150:
            assert sched.abort_request(handles[1])
    assert sched.stats()["num_preemptions"] > 0
    assert sched.num_referenced_blocks == 0
    assert sched.num_free_blocks + sched.stats()["num_cached_blocks"] == 20


def test_the_kv_manager_drops_blocks_out_of_the_window() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, sliding_window=6)
    assert kv.sliding_window == 6
    seq = kv.create_sequence()
    assert kv.allocate_slots(seq, 12) is not None
    table = kv.block_table(seq).tolist()
    assert kv.slide_window(seq, 9) == 1  # query 9 reads positions 4..9
    assert kv.num_dropped_blocks(seq) == 1
    assert kv.block_table(seq).tolist() == [16, *table[1:]]
    assert kv.refcount(table[0]) == 0
    with pytest.raises(ValueError):
        kv.slot_mapping(seq, 0, 4)
    kv.check_invariants()
    kv.free_sequence(seq)
    assert kv.num_free_blocks == 16
    assert KVCacheManager(16, 4).sliding_window is None
    with pytest.raises(ValueError):
        KVCacheManager(16, 4, sliding_window=0)
    with pytest.raises(ValueError):
        Scheduler(64, block_size=4, sliding_window=0)


def test_a_window_lets_a_small_pool_serve_long_sequences() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(64, block_size=16, max_model_len=32_768)
    sched = Scheduler(
        600, block_size=16, max_model_len=32_768, max_num_batched_tokens=2048, sliding_window=WINDOW
    )
    assert sched.sliding_window == WINDOW
    static = Scheduler(4096, block_size=16, scheduling_policy="static", sliding_window=WINDOW)
    assert static.sliding_window is None  # reserves whole lengths up front


def run_one(sched: Scheduler, prompt: np.ndarray, max_tokens: int) -> int:
    """Run one request to completion; return its prompt tokens served from the cache."""
    handle = sched.add_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    cached = -1
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if cached < 0:
            cached = int(sched.num_cached_tokens(handle) or 0)
        sched.update(np.full(plan.num_sampled, 9, np.int32))
        sched.check_invariants()
    return cached


def test_only_prefixes_with_intact_windows_are_reused() -> None:
    sched = Scheduler(64, block_size=16, max_model_len=1024, sliding_window=64)
    # A prompt within the window is cached and reused as usual.
    short = np.arange(1000, 1040, dtype=np.int32)
    assert run_one(sched, short, 4) == 0
    assert run_one(sched, short, 4) == 32
    # A long prompt computed in one chunk slides past its start before its blocks
    # could be cached: nothing of it is kept, nothing pins memory.
    long = np.arange(2000, 2200, dtype=np.int32)
    assert run_one(sched, long, 4) == 0
    assert run_one(sched, long, 4) == 0
    assert sched.num_referenced_blocks == 0
