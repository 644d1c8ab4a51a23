"""One kvpage engine as a Ray Serve replica: :class:`KvpageReplica`.

A replica runs the same engine and the same FastAPI app as ``kvpage serve``
(:func:`kvpage.openai.run.build_server`) and answers HTTP requests forwarded by the
ingress (:mod:`kvpage.ray.ingress`) through that app in-process (:meth:`handle_http`:
ASGI, streamed back chunk by chunk), so every route behaves exactly as ``kvpage
serve``'s: completions, chat, SSE streaming, echo and logprobs, structured outputs,
errors, ``/metrics``. A client that goes away mid-stream cancels the call; the app
sees the disconnect and aborts the request, so its KV blocks return to the pool.

It reports what its prefix cache holds to :class:`kvpage.ray.router.KvpageRouter`
through Ray's routing-stats hook (:meth:`record_routing_stats`), and fails Ray's
health check once its engine thread has died, so Ray replaces it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvpage-replica"
"""Response header naming the replica that served a request."""


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress forwards it. The ingress also sets one of the
    attributes ``prompt`` (text) or ``messages`` (chat) for routers that match on text
    (Ray's ``PrefixCacheAffinityRouter`` reads whichever exists); kvpage's router reads
    token ids instead."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class ReplicaOptions:
    """What every replica of an application is built from (picklable)."""

    model: str
    engine_config: Any  # kvpage.engine.config.EngineConfig
    served_model_name: list[str] | None = None
    api_key: str | None = None
    public_metrics: bool = False
    metrics_prefix: str = "kvpage"
    pin_cpus: bool = False
    """Pin replica ``rank`` to CPU ``rank % cpu_count`` (benchmarks on one host)."""


class KvpageReplica:
    """The deployment class: one engine, one app."""

    def __init__(self, options: ReplicaOptions) -> None:
        from ray import serve

        from kvpage.openai.run import build_server

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        if options.pin_cpus and hasattr(os, "sched_setaffinity"):
            rank = getattr(context.rank, "rank", context.rank)
            cpu = sorted(os.sched_getaffinity(0))[int(rank) % len(os.sched_getaffinity(0))]
            os.sched_setaffinity(0, {cpu})
            logger.info("replica %s pinned to CPU %d", self.replica_id, cpu)
        self.engine, self.app = build_server(
            options.model, options.engine_config, served_model_name=options.served_model_name,
            api_key=options.api_key, public_metrics=options.public_metrics,
            metrics_prefix=options.metrics_prefix)
        self._stats_version = itertools.count()

    async def handle_http(self, request: ForwardedRequest, **routing_hints: Any
                          ) -> AsyncIterator[Any]:
        """Run ``request`` through the app: yields ``{"status", "headers"}``, then the
        body's chunks (bytes). ``routing_hints`` are the router's (prompt token ids, a
        replica index), unused here."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path,
            "raw_path": request.path.encode(), "query_string": request.query_string,
            "root_path": "", "client": ("127.0.0.1", 0), "server": ("kvpage-replica", 0),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                        for k, v in request.headers],
        }
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        app_task = asyncio.create_task(self.app(scope, receive, send))
        app_task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1"))
                               for k, v in message.get("headers", [])]
                    headers.append((REPLICA_HEADER, self.replica_id))
                    yield {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if app_task.done() and app_task.exception() is not None:
                raise app_task.exception()  # type: ignore[misc]
        finally:
            gone.set()  # the caller went away or the response ended: the app may finish

    async def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`kvpage.ray.router.KvpageRouter` reads: the hashes of the blocks
        the prefix cache holds (uint64 bytes, taken on the engine thread between
        steps) and a version that changes with every report."""
        hashes = await asyncio.wrap_future(self.engine.submit(
            lambda engine: engine.scheduler.cached_block_hashes().tobytes()))
        return {"block_hashes": hashes, "version": next(self._stats_version)}

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine died is replaced."""
        if not self.engine.is_running:
            raise RuntimeError("the kvpage engine is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(0.0)
