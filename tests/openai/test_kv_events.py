"""KV-cache events (``--kv-events-config``): what a cache-aware router reads from a
kvpage server, in vLLM's wire format, against an in-process server on the tiny model
that ships with kvpage; and the render routes such a router tokenizes with."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from kvpage.assets import default_model_dir
from kvpage.bench.loopback import free_port
from kvpage.engine.config import EngineConfig
from kvpage.engine.kv_events import parse_kv_events_config, vllm_events
from kvpage.engine.llm_engine import LLMEngine
from kvpage.sampling.params import SamplingParams
from server_harness import InProcessServer

MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[InProcessServer, zmq.Socket]]:
    port = free_port()
    config = EngineConfig(
        model=str(default_model_dir()), max_num_seqs=4, max_model_len=256,
        max_num_batched_tokens=64, block_size=BLOCK,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    with InProcessServer(config, model_name=MODEL) as server:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(f"tcp://127.0.0.1:{port}")
        subscribed(sub, lambda i: complete(server, list(range(1000 + 20 * i, 1040 + 20 * i))))
        yield server, sub
        sub.close(linger=0)


def subscribed(sub: zmq.Socket, poke: Callable[[int], None]) -> None:
    """Poke the engine into publishing until a batch arrives, then drain: a PUB socket
    drops what it sends before a subscription lands, which takes a while on a busy host."""
    for i in range(30):
        poke(i)
        if receive(sub, until=1.0):
            receive(sub, until=0.5)
            return
    raise AssertionError("no KV event arrived in 30 pokes")


def receive(sub: zmq.Socket, until: float = 10.0) -> list[tuple[int, list[dict[str, Any]]]]:
    """Every batch that arrives within ``until`` seconds of quiet-ending: (seq, events)."""
    batches, deadline = [], time.monotonic() + until
    while time.monotonic() < deadline:
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            if batches:
                break
            continue
        assert topic == b""
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 0
        batches.append((int.from_bytes(seq, "big"), events))
    return batches


def complete(server: InProcessServer, prompt: list[int]) -> None:
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def test_a_prompt_s_full_blocks_are_published_as_one_chain(served) -> None:
    server, sub = served
    prompt = list(range(100, 140))  # 2 full blocks and 8 tokens
    complete(server, prompt)
    batches = receive(sub)
    seqs = [seq for seq, _ in batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stored = [e for _, events in batches for e in events if e["type"] == "BlockStored"]
    first = stored[0]
    assert set(first) == {"type", "block_hashes", "parent_block_hash", "token_ids",
                          "block_size", "lora_id", "medium", "lora_name"}
    assert first["parent_block_hash"] is None and first["block_size"] == BLOCK
    assert first["token_ids"][:2 * BLOCK] == prompt[:2 * BLOCK]
    assert len(first["token_ids"]) == BLOCK * len(first["block_hashes"])
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first["block_hashes"])
    # Every later store continues a chain a subscriber already knows.
    known = set(first["block_hashes"])
    for event in stored[1:]:
        assert event["parent_block_hash"] in known | {None}
        known |= set(event["block_hashes"])

    # The same prompt again hits the cache: no block of it is stored twice.
    complete(server, prompt)
    again = [e for _, events in receive(sub, until=3.0) for e in events
             if e["type"] == "BlockStored"]
    assert not set(first["block_hashes"][:2]) & {h for e in again for h in e["block_hashes"]}


def test_render_routes_answer_the_token_ids_generation_would_use(served) -> None:
    server, _ = served
    tok = server.engine.tokenizer
    def render(prompt: Any) -> Any:
        return httpx.post(server.url + "/v1/completions/render", timeout=30, json={
            "model": MODEL, "prompt": prompt}).json()

    assert render(["The module", "A"]) == [
        {"token_ids": tok("The module")["input_ids"], "prompt": "The module"},
        {"token_ids": tok("A")["input_ids"], "prompt": "A"}]
    assert render([5, 6, 7]) == [{"token_ids": [5, 6, 7], "prompt": None}]
    messages = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(server.url + "/v1/chat/completions/render", timeout=30, json={
        "model": MODEL, "messages": messages}).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == {"token_ids": tok(text, add_special_tokens=False)["input_ids"],
                    "prompt": text}
    bad = httpx.post(server.url + "/v1/completions/render", timeout=30,
                     json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404, bad.text
    sources = httpx.get(server.url + "/kv_event_sources", timeout=30).json()
    assert sources["0"]["enable_kv_cache_events"] and sources["0"]["publisher"] == "zmq"


def test_evictions_and_resets_are_published() -> None:
    """An engine whose pool is too small for two prompts evicts the first one's blocks;
    a reset clears everything. Replayed, the events give exactly what is cached."""
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    engine = LLMEngine.from_config(EngineConfig(
        model=str(default_model_dir()), max_num_seqs=1, max_model_len=128, block_size=BLOCK,
        num_gpu_blocks=10, warmup="none",
        kv_events_config={"enable_kv_cache_events": True,
                          "endpoint": f"tcp://*:{port}"}))
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def run(request_id: str, prompt: list[int]) -> None:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                engine.step()

        def poke(i: int) -> None:
            run(f"poke{i}", list(range(1000 + 20 * i, 1040 + 20 * i)))
            engine.reset_prefix_cache()  # the pokes leave no blocks behind
            engine.step()

        subscribed(sub, poke)
        for i, first in enumerate((200, 400)):
            run(f"r{i}", list(range(first, first + 96)))
        engine.reset_prefix_cache()
        engine.step()
        events = [e for _, batch in receive(sub) for e in batch]
    finally:
        engine.kv_events.close()
        sub.close(linger=0)
    kinds = [e["type"] for e in events]
    assert "BlockRemoved" in kinds and kinds[-1] == "AllBlocksCleared"
    held: set[int] = set()
    for event in events[:-1]:
        if event["type"] == "BlockStored":
            held |= set(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            assert set(event["block_hashes"]) <= held
            held -= set(event["block_hashes"])


def test_bad_configs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown keys \\['endpoints'\\]"):
        parse_kv_events_config({"enable_kv_cache_events": True, "endpoints": "x"})
    with pytest.raises(ValueError, match="publisher must be one of"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_kv_events_config("{enable")
    with pytest.raises(ValueError, match="replay_endpoint"):
        parse_kv_events_config({"enable_kv_cache_events": True,
                                "replay_endpoint": "tcp://*:5558"})
    off = parse_kv_events_config({"enable_kv_cache_events": False})
    assert off is not None and not off.active


def test_consecutive_events_merge_as_vllm_batches_them() -> None:
    merged = vllm_events([("stored", 1, None, [1] * 4, None), ("stored", 2, 1, [2] * 4, None),
                          ("stored", 9, 5, [3] * 4, None), ("removed", 1), ("removed", 2),
                          ("cleared",)], block_size=4)
    assert [e["type"] for e in merged] == ["BlockStored", "BlockStored", "BlockRemoved",
                                          "AllBlocksCleared"]
    assert merged[0]["block_hashes"] == [1, 2] and merged[0]["token_ids"] == [1] * 4 + [2] * 4
    assert merged[1]["parent_block_hash"] == 5 and merged[2]["block_hashes"] == [1, 2]
