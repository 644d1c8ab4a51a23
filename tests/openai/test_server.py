"""End-to-end tests of the OpenAI-compatible server on the tiny random Llama.

One server (uvicorn in a background thread, 127.0.0.1, a free port) is shared
by the module; it is driven with the official ``openai`` client and, where
the client would hide what is tested (raw bodies, disconnects), with httpx.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from kvpage.engine.async_engine import AsyncLLMEngine
from kvpage.engine.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.model.tiny_model import build_tiny_model
from kvpage.openai.app import build_app

API_KEY = "test-key-123"
MODEL = "tiny"
MAX_WAITING = 4
MAX_BODY = 64 * 1024
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@dataclass
class Served:
    url: str
    engine: AsyncLLMEngine

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def call(self, fn: Any) -> Any:
        """Run ``fn(llm_engine)`` on the engine thread between steps."""
        return self.engine.submit(fn).result(timeout=30)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.call(lambda e: e.get_num_unfinished_requests()) == 0:
                return self.call(lambda e: e.get_stats())
            time.sleep(0.02)
        raise AssertionError("the engine did not become idle")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Served]:
    config = EngineConfig(model=str(tiny_model), max_num_seqs=8, max_model_len=256,
                          max_num_batched_tokens=64, max_num_waiting=MAX_WAITING)
    engine = AsyncLLMEngine(LLMEngine.from_config(config), model_name=MODEL, log_stats=False)
    app = build_app(engine, served_model_name=MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread:
    thread.start()                                              # no signal handlers
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(5)


def _post(served: Served, path: str, *, key: str | None = API_KEY, timeout: float = 60,
          **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(served.url + path, headers=headers, timeout=timeout, **kwargs)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def _tokens(served: Served, text: str, special: bool = True) -> list[int]:
    return served.engine.tokenizer(text, add_special_tokens=special)["input_ids"]


# ---- completions ------------------------------------------------------------


def test_completion_with_logprobs(served: Served) -> None:
    prompt = "The quick brown fox"
    out = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                             temperature=0, logprobs=2, extra_body=NO_EOS)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(_tokens(served, prompt))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_completion_streaming_matches_non_streaming(served: Served) -> None:
    client = served.client()
    args = dict(model=MODEL, prompt="Hello world! How are", max_tokens=12, temperature=0,
                extra_body=NO_EOS)
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_n2_seeded_and_batched_prompts(served: Served) -> None:
    client = served.client()
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, seed=7,
                temperature=1.0, extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                                             "min_tokens": 6, "ignore_eos": True})
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 12
    two = client.completions.create(model=MODEL, prompt=["Hello", "World"], max_tokens=3,
                                    n=2, extra_body=NO_EOS, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.usage.prompt_tokens == len(_tokens(served, "Hello")) + len(_tokens(served, "World"))
    assert two.usage.completion_tokens == 12


def test_stop_string_and_min_tokens(served: Served) -> None:
    client = served.client()
    base = client.completions.create(model=MODEL, prompt="The sea and the", max_tokens=20,
                                     temperature=0, extra_body=NO_EOS).choices[0].text
    assert len(base) > 4
    stop = base[2:4]
    out = client.completions.create(model=MODEL, prompt="The sea and the", max_tokens=20,
                                    temperature=0, extra_body=NO_EOS, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and base.startswith(out.choices[0].text)
    # min_tokens: every ordinary token is a stop token here, so without min_tokens the
    # first one stops the sample; with min_tokens=3 the device may not sample any of them
    # (nor EOS) for the first three tokens, and the sample stops only after those.
    vocab = served.call(lambda e: e.model_config.vocab_size)
    special = set(range(4)) | set(served.call(lambda e: e.eos_token_ids))
    stop_ids = [t for t in range(vocab) if t not in special]
    args = dict(model=MODEL, prompt="The sea and the", max_tokens=8, temperature=0)
    free = client.completions.create(**args, extra_body={"stop_token_ids": stop_ids})
    assert free.usage.completion_tokens == 1 and free.choices[0].finish_reason == "stop"
    held = client.completions.create(**args, extra_body={"stop_token_ids": stop_ids,
                                                         "min_tokens": 3})
    assert held.usage.completion_tokens > 3, "a stop token was sampled before min_tokens"


def test_cached_tokens_on_repeated_prompt(served: Served) -> None:
    prompt = ("Continuous batching schedules one step at a time: after every step finished "
              "sequences leave and waiting ones join, over and over again, in the KV cache.")
    assert len(_tokens(served, prompt)) > 32
    client = served.client()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body=NO_EOS)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body=NO_EOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    salted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                       extra_body={"cache_salt": "tenant-b", "priority": 1})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


# ---- chat -------------------------------------------------------------------


MESSAGES = [{"role": "system", "content": "You write stories."},
            {"role": "user", "content": "Tell me about the sea."}]


def test_chat_non_streaming_n2_logprobs(served: Served) -> None:
    out = served.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=4, n=2, logprobs=True,
        top_logprobs=2, extra_body=NO_EOS)
    text = served.engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                       add_generation_prompt=True)
    assert out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(_tokens(served, text, special=False))
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert out.usage.completion_tokens == 8


def test_chat_streaming_matches_non_streaming(served: Served) -> None:
    client = served.client()
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=NO_EOS)
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- other routes, auth, errors ---------------------------------------------


def test_models_health_metrics(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(served.url + "/health")  # no key needed
    assert health.status_code == 200
    _error(httpx.get(served.url + "/metrics"), 401)
    served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=NO_EOS)
    metrics = httpx.get(served.url + "/metrics", headers={"authorization": f"Bearer {API_KEY}"})
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "iteration_tokens_total_bucket"):
        assert f"kvpage:{name}{{" in metrics.text, name
    line = next(x for x in metrics.text.splitlines()
                if x.startswith('kvpage:request_success_total{engine="0",finished_reason="length"'))
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_wrong_or_missing_api_key(served: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        served.client(api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert info.value.status_code == 401
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    _error(_post(served, "/v1/completions", key=None, json=body), 401)
    assert _error(_post(served, "/v1/chat/completions", key="nope", json=body),
                  401)["code"] == "invalid_api_key"
    _error(httpx.get(served.url + "/v1/models"), 401)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "Hi",', None),
        ("/v1/completions", b'["not", "an", "object"]', None),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello " * 300}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": "hello " * 300}]}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1000}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi",
                             "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": [100000]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 500}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 16}, "n"),
    ],
    ids=["bad-json", "not-object", "temperature", "top-p", "too-long", "chat-too-long",
         "max-tokens-too-many", "stream-options-no-stream", "wrong-type", "prompt-type",
         "missing-prompt",
         "messages-type", "token-out-of-vocab", "logprobs-too-many", "n-over-max-num-seqs"],
)
def test_bad_requests_are_400(served: Served, path: str, body: Any, param: str | None) -> None:
    if isinstance(body, bytes):
        response = _post(served, path, content=body)
    else:
        response = _post(served, path, json=body)
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_openai_client_sees_400(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):  # 404 model_not_found, as OpenAI and vLLM
        served.client().chat.completions.create(model="nope", messages=MESSAGES)


def test_body_too_large_is_413(served: Served) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}).encode()
    _error(_post(served, "/v1/completions", content=big), 413)

    def chunks() -> Iterator[bytes]:  # no content-length: counted while read
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    assert _error(_post(served, "/v1/completions", content=chunks()),
                  413)["code"] == "request_too_large"


def test_queue_full_is_503(served: Served) -> None:
    """With the engine thread held, a flood lands in one inbox batch: exactly
    max_num_waiting requests are accepted, the rest get 503."""
    gate = threading.Event()
    held = served.engine.submit(lambda e: gate.wait(30))
    flood = 10

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers={
                "authorization": f"Bearer {API_KEY}"}) as client:
            body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "ignore_eos": True}
            return await asyncio.gather(*(client.post(served.url + "/v1/completions", json=body)
                                          for _ in range(flood)))

    results: list[list[httpx.Response]] = []
    sender = threading.Thread(target=lambda: results.append(asyncio.run(send_all())))
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while len(served.engine._inbox) < flood:
            assert time.monotonic() < deadline, "the flood did not reach the engine"
            time.sleep(0.01)
    finally:
        gate.set()
    held.result(30)
    sender.join(60)
    statuses = sorted(r.status_code for r in results[0])
    assert statuses == [200] * MAX_WAITING + [503] * (flood - MAX_WAITING)
    error = _error(next(r for r in results[0] if r.status_code == 503), 503)
    assert error["code"] == "queue_full" and "full" in error["message"]
    served.wait_idle()


def test_client_disconnect_aborts_request(served: Served) -> None:
    before = served.call(lambda e: e.get_stats())["num_aborted_requests"]
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 230,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", served.url + "/v1/completions", json=body,
            headers={"authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    stats = served.wait_idle()
    assert stats["num_aborted_requests"] == before + 1
    assert stats["kv_cache_usage_perc"] == 0
    served.call(lambda e: e.check_invariants())


def test_non_streaming_client_disconnect_aborts_request(served: Served) -> None:
    before = served.call(lambda e: e.get_stats())["num_aborted_requests"]
    body = {"model": MODEL, "prompt": "Tell me another story", "max_tokens": 230,
            "ignore_eos": True}
    gate = threading.Event()  # hold the engine so the request cannot finish first
    held = served.engine.submit(lambda e: gate.wait(30))
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            _post(served, "/v1/completions", json=body, timeout=0.5)
    finally:
        gate.set()
    held.result(30)
    stats = served.wait_idle()
    assert stats["num_aborted_requests"] == before + 1
    assert stats["kv_cache_usage_perc"] == 0


def test_step_failure_fails_in_flight_requests_then_recovers(served: Served) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "A story about the sky", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    runner_methods = ("execute", "dispatch")

    def arm(engine: LLMEngine) -> None:
        runner = engine.runner

        def boom(*args: Any, **kwargs: Any) -> Any:
            for name in runner_methods:  # raise once, then back to the real methods
                runner.__dict__.pop(name, None)
            raise RuntimeError("injected device fault")

        for name in runner_methods:
            if hasattr(runner, name):
                setattr(runner, name, boom)

    with httpx.Client(timeout=60, headers=headers) as client:
        with client.stream("POST", served.url + "/v1/completions", json=body) as first, \
                client.stream("POST", served.url + "/v1/completions", json=body) as second:
            lines = [first.iter_lines(), second.iter_lines()]
            for it in lines:  # both are running: each has streamed a token
                assert next(x for x in it if x.startswith("data: ")).startswith("data: {")
            served.call(arm)
            for it in lines:
                rest = [x for x in it if x.startswith("data: ")]
                assert rest[-1] == "data: [DONE]"
                events = [json.loads(x[6:]) for x in rest[:-1]]
                assert "injected device fault" in events[-1]["error"]["message"]
                assert all(e.get("choices", [{}])[0].get("finish_reason") != "length"
                           for e in events[:-1])
    served.call(arm)  # non-streaming: a 500 with an OpenAI error body
    with pytest.raises(openai.InternalServerError):
        served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    out = served.client().completions.create(model=MODEL, prompt="Hi again", max_tokens=3,
                                             extra_body=NO_EOS)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    stats = served.wait_idle()
    assert stats["kv_cache_usage_perc"] == 0
    served.call(lambda e: e.check_invariants())
    assert served.engine.is_running and served.engine.num_failed_steps == 2
    metrics = served.engine.metrics.render()[0].decode()
    assert ('kvpage:request_success_total{engine="0",finished_reason="error",'
            'model_name="tiny"} 3.0') in metrics
