"""Which replica should take a request: the cache-aware choice, without Ray.

This file owns :class:`ReplicaCacheView` (what one replica holds, from its engine's own
radix tree, plus what was just sent to it) and :func:`rank_replicas` (the policy).
:mod:`kvpage.ray.router` feeds them from Ray's routing stats and queue lengths.

What a replica holds is exact, not guessed from request text: its engine reports the
chained hash of every block its prefix cache holds (``Scheduler.cached_block_hashes``,
polled every ``request_routing_stats_period_s``), and a prompt's full blocks hash the
same way (``kvpage._core.prefix_block_hashes``), so a prompt's cached prefix on a
replica is its longest run of leading block hashes the replica reports. Between two
polls, the blocks of requests just routed to a replica count as held there for
``prediction_ttl_s`` (a burst of requests sharing a new prefix follows the first).

The policy (:func:`rank_replicas`), per request:

1. With no prompt tokens (a route that generates nothing, an unparsable body), the
   least-loaded replicas first.
2. A replica whose load (ongoing requests, waiting ones included, as Ray counts them
   when it routes) exceeds the least-loaded one's by more than ``imbalance_threshold``
   is set aside: one hot prefix cannot pin all traffic to one replica. (The engines'
   own waiting counts arrive with the stats, up to a period late; setting aside a
   replica that reported waiting requests sent cached prefixes away and cost 8 points
   of hit rate in ``kvpage bench scaleout``, so the live count decides.)
3. Among the rest, the longest cached prefix wins, ties to the less loaded; a prompt
   no replica holds any block of goes to the least-loaded replica, ties to the one
   holding (or about to hold) the fewest blocks, so new prefixes spread over the pools.

Invariants: the ranking is a permutation of the candidates; with equal loads and no
replica set aside, the first replica holds the longest cached prefix of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_IMBALANCE_THRESHOLD = 8
"""Ongoing requests a replica may carry above the least-loaded one and still be
chosen for its cache."""

DEFAULT_PREDICTION_TTL_S = 10.0
"""Seconds the blocks of a request just routed count as held on its replica."""


@dataclass
class ReplicaCacheView:
    """One replica as the router sees it."""

    held: frozenset[int] = frozenset()
    """Hashes of the blocks its prefix cache held at the last poll."""
    predicted: dict[int, float] = field(default_factory=dict)
    """Hash -> when a request whose prompt has that block was routed here."""

    def update(self, stats: dict) -> None:
        """Take a replica's routing stats (:meth:`KvpageReplica.record_routing_stats`)."""
        hashes = stats.get("block_hashes", b"")
        self.held = frozenset(np.frombuffer(hashes, dtype=np.uint64).tolist())

    def predict(self, hashes: Sequence[int], now: float) -> None:
        """The blocks of ``hashes`` count as held here until ``now + ttl``."""
        for h in hashes:
            self.predicted[h] = now

    @property
    def num_blocks(self) -> int:
        """Blocks held or predicted here: the size of its pool's content."""
        return len(self.held) + sum(1 for h in self.predicted if h not in self.held)

    def forget_before(self, cutoff: float) -> None:
        self.predicted = {h: t for h, t in self.predicted.items() if t >= cutoff}

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (its block ``hashes``) held or predicted here."""
        n = 0
        for h in hashes:
            if h not in self.held and h not in self.predicted:
                break
            n += 1
        return n


def rank_replicas(hashes: Sequence[int] | None, views: Sequence[ReplicaCacheView],
                  loads: Sequence[float],
                  imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD) -> list[int]:
    """Indices of the replicas (``views`` and their ongoing-request ``loads``), best
    first, for a prompt whose full blocks hash to ``hashes`` (the module's policy)."""
    order = list(range(len(views)))
    if not order:
        return order
    by_load = sorted(order, key=lambda i: (loads[i], views[i].num_blocks))
    if not hashes:
        return by_load
    least = min(loads)
    eligible = [i for i in order if loads[i] - least <= imbalance_threshold]
    cached = {i: views[i].cached_blocks(hashes) for i in eligible}
    best = max(cached.values())
    if best == 0:
        first = min(eligible, key=lambda i: (loads[i], views[i].num_blocks))
    else:
        first = min(eligible, key=lambda i: (-cached[i], loads[i]))
    return [first] + [i for i in by_load if i != first]
