"""KV-cache events for cache-aware routers, with vLLM's ``--kv-events-config``.

This file owns :class:`KVEventsConfig` (vLLM's JSON keys, checked here) and
:class:`KVEventPublisher`, which sends what the Rust prefix cache stored and dropped
(``Scheduler.take_kv_events()``, drained after every engine step) over a ZMQ PUB socket
in vLLM's wire format, so that ``vllm-router --policy kv_aware``, llm-d or Dynamo route
on what each kvpage engine actually caches:

* frames ``[topic, seq, payload]``: the topic (UTF-8, ``""`` by default), the batch's
  sequence number (8-byte big-endian, from 0), and a msgpack ``KVEventBatch``
  ``[ts, events, data_parallel_rank]``;
* each event a msgpack map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``), ``AllBlocksCleared``.

Hashes are kvpage's chained 64-bit content hashes (``rust/kv/prefix_cache/events.rs``):
a block's hash names the whole prefix it ends, under its cache salt. Consecutive stored
blocks of one chain go out as one ``BlockStored``, as vLLM sends a request's blocks.
``medium`` is ``"GPU"``, vLLM's name for an engine's primary KV pool (device memory,
or host memory on a CPU-only host); vLLM's ``"CPU"`` means an offloaded copy, which
routers discount.

Publishing runs on the engine thread after a step and never blocks it: a send that
would block (the high-water mark reached with no reader) drops the batch and counts it
(``dropped_batches``), as a PUB socket does for slow subscribers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvpage.engine.json_config import config_dict

PUBLISHERS = ("null", "zmq")
MEDIUM = "GPU"


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: where and how to publish (module docs)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    """Bound when it names a wildcard host (``*``, ``::``) or is ``ipc://`` / ``inproc://``,
    else connected (vLLM's rule)."""
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv-events-config: publisher must be one of {PUBLISHERS}, got "
                f"{self.publisher!r}")
        if self.replay_endpoint is not None:
            raise ValueError("kv-events-config: replay_endpoint is not supported by kvpage "
                             "yet (subscribers start from the live stream)")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv-events-config: {name} must be a positive integer, "
                                 f"got {value!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(value: KVEventsConfig | dict[str, Any] | str | None
                           ) -> KVEventsConfig | None:
    """``value`` (a config, a dict of vLLM's keys, its JSON text, or None) as a
    :class:`KVEventsConfig`; enabling events selects the ZMQ publisher, as vLLM does."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    value = config_dict(value, "kv-events-config", set(KVEventsConfig.__dataclass_fields__))
    if value.get("enable_kv_cache_events") and "publisher" not in value:
        value = {**value, "publisher": "zmq"}
    return KVEventsConfig(**value)


def _binds(endpoint: str) -> bool:
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def vllm_events(events: list[tuple], block_size: int) -> list[dict[str, Any]]:
    """The Rust core's event tuples (``("stored", hash, parent, tokens, salt)``,
    ``("removed", hash)``, ``("cleared",)``) as vLLM's tagged event maps, consecutive
    stores of one chain and consecutive removals merged."""
    out: list[dict[str, Any]] = []
    for event in events:
        kind = event[0]
        last = out[-1] if out else None
        if kind == "stored":
            _, block_hash, parent, tokens, _salt = event
            if (last is not None and last["type"] == "BlockStored"
                    and parent is not None and last["block_hashes"][-1] == parent):
                last["block_hashes"].append(block_hash)
                last["token_ids"].extend(tokens)
                continue
            out.append({"type": "BlockStored", "block_hashes": [block_hash],
                        "parent_block_hash": parent, "token_ids": list(tokens),
                        "block_size": block_size, "lora_id": None, "medium": MEDIUM,
                        "lora_name": None})
        elif kind == "removed":
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(event[1])
                continue
            out.append({"type": "BlockRemoved", "block_hashes": [event[1]],
                        "medium": MEDIUM})
        elif kind == "cleared":
            out.append({"type": "AllBlocksCleared"})
        else:  # pragma: no cover - the Rust core's three kinds
            raise ValueError(f"unknown KV event {event!r}")
    return out


class KVEventPublisher:
    """Publishes each step's prefix-cache events on a ZMQ PUB socket (module docs)."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        try:
            import msgspec
            import zmq
        except ImportError as exc:  # pragma: no cover - both are in kvpage[serve]
            raise ImportError("KV-cache events need pyzmq and msgspec: "
                              "pip install 'kvpage[serve]'") from exc
        self.config = config
        self.block_size = block_size
        self._encode = msgspec.msgpack.Encoder().encode
        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if _binds(config.endpoint):
                self._socket.bind(config.endpoint)
            else:
                self._socket.connect(config.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(f"kv-events-config: cannot open endpoint "
                             f"{config.endpoint!r}: {exc}") from None
        self._topic = config.topic.encode()
        self.seq = 0
        self.published_events = 0
        self.dropped_batches = 0

    def publish(self, events: list[tuple]) -> None:
        """Send one batch of the Rust core's event tuples (nothing when empty)."""
        if not events:
            return
        batch = vllm_events(events, self.block_size)
        payload = self._encode([time.time(), batch, 0])
        frames = [self._topic, self.seq.to_bytes(8, "big"), payload]
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped_batches += 1
        self.seq += 1
        self.published_events += len(batch)

    def close(self) -> None:
        self._socket.close(linger=0)
