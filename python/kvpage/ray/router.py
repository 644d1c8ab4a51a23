"""kvpage's Ray Serve request router: :class:`KvpageRouter`.

A Ray Serve ``RequestRouter`` (Ray's custom-router API) that sends each request to the
replica whose engine holds the longest cached prefix of its prompt, balanced against
queue length and KV pressure. The policy and the per-replica view are
:mod:`kvpage.ray.routing`'s; this file adapts them to Ray: the prompt's token ids come
as the ``prompt_token_ids`` keyword of the call (:mod:`kvpage.ray.ingress` renders them
with the engine's tokenizer), what each replica holds comes from its routing stats
(:meth:`kvpage.ray.replica.KvpageReplica.record_routing_stats`), loads from Ray's
queue-length cache (probed when stale).

Select it with ``RequestRouterConfig(request_router_class=KvpageRouter,
request_router_kwargs={"block_size": 16})`` (:func:`kvpage.ray.application.build_app` does).
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvpage import _core
from kvpage.ray.routing import (
    DEFAULT_IMBALANCE_THRESHOLD,
    DEFAULT_PREDICTION_TTL_S,
    ReplicaCacheView,
    rank_replicas,
)

PROMPT_TOKEN_IDS_KWARG = "prompt_token_ids"
"""The keyword of a replica call that carries the prompt's token ids for routing."""

REPLICA_INDEX_KWARG = "replica_index"
"""The keyword of a call for the ``k``-th replica (by id, modulo their number): how the
ingress asks every replica for its ``/metrics``."""


class KvpageRouter(RequestRouter):
    """Routes on the engines' own prefix caches (module docs)."""

    def initialize_state(self, block_size: int = 16,
                         imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
                         prediction_ttl_s: float = DEFAULT_PREDICTION_TTL_S,
                         **_: Any) -> None:
        self._block_size = int(block_size)
        self._imbalance_threshold = float(imbalance_threshold)
        self._prediction_ttl_s = float(prediction_ttl_s)
        self._views: dict[ReplicaID, ReplicaCacheView] = {}
        self._stats_seen: dict[ReplicaID, Any] = {}
        self._last_forget = time.monotonic()

    def _view(self, replica: RunningReplica) -> ReplicaCacheView:
        view = self._views.setdefault(replica.replica_id, ReplicaCacheView())
        stats = replica.routing_stats or {}
        version = stats.get("version")
        if version is not None and self._stats_seen.get(replica.replica_id) != version:
            view.update(stats)
            self._stats_seen[replica.replica_id] = version
        return view

    async def _loads(self, replicas: list[RunningReplica]) -> list[float]:
        loads: dict[ReplicaID, float] = {}
        stale = []
        for r in replicas:
            queue_len = self._replica_queue_len_cache.get(r.replica_id)
            if queue_len is None:
                stale.append(r)
            else:
                loads[r.replica_id] = queue_len
        if stale:
            for r, queue_len in await self._probe_queue_lens(stale, 0):
                if queue_len is not None:
                    loads[r.replica_id] = queue_len
        # a replica that did not answer the probe is ranked as the most loaded
        worst = max(loads.values(), default=0.0) + 1.0
        return [loads.get(r.replica_id, worst) for r in replicas]

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[int] | None:
        """The chained hashes of the prompt's full blocks (hashed in the core: cheap enough
        to redo when Ray asks again for the same request)."""
        token_ids = None if pending_request is None else \
            pending_request.kwargs.get(PROMPT_TOKEN_IDS_KWARG)
        if not token_ids:
            return None
        return _core.prefix_block_hashes(token_ids, self._block_size).tolist()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        index = None if pending_request is None else \
            pending_request.kwargs.get(REPLICA_INDEX_KWARG)
        if index is not None:
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[int(index) % len(ordered)]]]
        self._forget_old_predictions()
        hashes = self._prompt_hashes(pending_request)
        views = [self._view(r) for r in candidate_replicas]
        loads = await self._loads(candidate_replicas)
        order = rank_replicas(hashes, views, loads, self._imbalance_threshold)
        if hashes:  # Ray takes the first rank unless its queue is full
            views[order[0]].predict(hashes, time.monotonic())
        return [[candidate_replicas[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        # Called when replicas may reject (strict max_ongoing_requests): the replica
        # that took the request, which may not be the first choice.
        hashes = self._prompt_hashes(pending_request)
        if hashes:
            self._views.setdefault(replica_id, ReplicaCacheView()).predict(
                hashes, time.monotonic())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._views.pop(replica_id, None)
        self._stats_seen.pop(replica_id, None)

    def _forget_old_predictions(self) -> None:
        now = time.monotonic()
        if now - self._last_forget < 1.0:
            return
        self._last_forget = now
        for view in self._views.values():
            view.forget_before(now - self._prediction_ttl_s)
