"""The cache-aware routing policy (:mod:`kvpage.ray.routing`), without Ray."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpage import _core
from kvpage.ray.routing import ReplicaCacheView, rank_replicas

BLOCK = 4


def _view(prompts: list[list[int]]) -> ReplicaCacheView:
    view = ReplicaCacheView()
    hashes = np.unique(np.concatenate(
        [_core.prefix_block_hashes(p, BLOCK) for p in prompts] or [np.zeros(0, np.uint64)]))
    view.update({"block_hashes": hashes.astype(np.uint64).tobytes()})
    return view


def test_longest_cached_prefix_wins_when_loads_are_even() -> None:
    shared = list(range(100, 116))
    views = [_view([shared[:8]]), _view([shared]), _view([])]
    hashes = _core.prefix_block_hashes(shared + [1, 2, 3, 4], BLOCK).tolist()
    assert views[1].cached_blocks(hashes) == 4 and views[0].cached_blocks(hashes) == 2
    assert rank_replicas(hashes, views, [3, 3, 3])[0] == 1
    # the cache outweighs a small load difference, not a large one
    assert rank_replicas(hashes, views, [0, 5, 0], imbalance_threshold=8)[0] == 1
    assert rank_replicas(hashes, views, [0, 20, 0], imbalance_threshold=8)[0] == 0


def test_a_hot_prefix_spills_over_once_its_replica_is_far_busier() -> None:
    prompt = list(range(16))
    views = [_view([prompt]), _view([])]
    hashes = _core.prefix_block_hashes(prompt, BLOCK).tolist()
    assert rank_replicas(hashes, views, [8, 0], imbalance_threshold=8)[0] == 0
    assert rank_replicas(hashes, views, [9, 0], imbalance_threshold=8)[0] == 1


def test_new_prefixes_go_to_the_least_loaded_then_the_emptiest_pool() -> None:
    views = [_view([list(range(32))]), _view([])]
    hashes = _core.prefix_block_hashes(list(range(500, 532)), BLOCK).tolist()
    assert rank_replicas(hashes, views, [2, 2])[0] == 1
    assert rank_replicas(hashes, views, [0, 2])[0] == 0
    assert rank_replicas(None, views, [5, 1]) == [1, 0]


def test_routed_blocks_count_as_held_until_they_expire() -> None:
    views = [_view([]), _view([])]
    hashes = _core.prefix_block_hashes(list(range(64)), BLOCK).tolist()
    views[1].predict(hashes, now=100.0)
    assert rank_replicas(hashes, views, [0, 0])[0] == 1
    views[1].forget_before(200.0)
    assert views[1].cached_blocks(hashes) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12)), min_size=1, max_size=6),
       st.integers(0, 6), st.integers(0, 10))
def test_ranking_is_a_permutation_and_prefers_the_longest_prefix(
        replicas: list[tuple[int, int]], prompt_blocks: int, threshold: int) -> None:
    prompt = list(range(BLOCK * prompt_blocks))
    views = [_view([prompt[:BLOCK * cached]]) for cached, _ in replicas]
    loads = [float(load) for _, load in replicas]
    hashes = _core.prefix_block_hashes(prompt, BLOCK).tolist()
    order = rank_replicas(hashes, views, loads, threshold)
    assert sorted(order) == list(range(len(replicas)))
    if hashes and len(set(loads)) == 1:
        best = max(v.cached_blocks(hashes) for v in views)
        assert views[order[0]].cached_blocks(hashes) == best


def test_merged_metrics_label_each_replica_and_keep_one_header_per_family() -> None:
    from kvpage.ray.metrics_merge import merge_metrics

    text = ('# HELP kvpage:num_requests_running Running.\n'
            '# TYPE kvpage:num_requests_running gauge\n'
            'kvpage:num_requests_running{engine="0"} 2.0\n'
            '# HELP kvpage:up Up.\n# TYPE kvpage:up gauge\nkvpage:up 1\n')
    merged = merge_metrics({"b": text, "a": text.replace("2.0", "3.0")}).splitlines()
    assert merged.count("# TYPE kvpage:num_requests_running gauge") == 1
    assert merged[:4] == ['# HELP kvpage:num_requests_running Running.',
                          '# TYPE kvpage:num_requests_running gauge',
                          'kvpage:num_requests_running{engine="0",replica="a"} 3.0',
                          'kvpage:num_requests_running{engine="0",replica="b"} 2.0']
    assert 'kvpage:up{replica="a"} 1' in merged and 'kvpage:up{replica="b"} 1' in merged
