"""Hostile input to the OpenAI-compatible server, and who gets in.

* Fuzzing from the API's OpenAPI schema (built from the request models of
  ``kvpage.openai.protocol``) with schemathesis, valid and invalid bodies, a bounded
  number of examples: never a 5xx, every rejection a 4xx with an OpenAI error
  body, every 200 a well-formed answer.
* Hand-written hostile cases, by kind: huge bodies (413), deep nesting,
  wrong types, negative / NaN / inf numbers, integers past the engine's
  range, bytes that are not UTF-8, text that is not Unicode, prompts of 0
  tokens and of max_model_len + 1, n / max_tokens / logprobs / stop strings
  far over their limits, unknown model names.
* A prompt that takes long to tokenize does not stall the streams of others.
* ``--api-key`` guards every route but ``/health`` (``/metrics`` too unless
  ``public_metrics``), compared in constant time; the default bind is
  127.0.0.1.

Afterwards the engine is idle, every KV block is free and its invariants hold.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from kvpage.engine.config import EngineConfig
from kvpage.openai.app import build_app
from kvpage.openai.completions import MAX_PROMPTS_PER_REQUEST
from kvpage.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpage.openai.run import run_server
from server_harness import InProcessServer

schemathesis = pytest.importorskip("schemathesis")

KEY = "hardening-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_MODEL_LEN = 128
MAX_BODY = 256 * 1024
OUTCOMES: Counter[str] = Counter()
"""Status codes seen, by kind of input (printed by the last test, ``-s``)."""


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[InProcessServer]:
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=32,
        max_num_waiting=16,
    )
    with InProcessServer(config, model_name=MODEL, api_key=KEY, max_body_bytes=MAX_BODY) as server:
        yield server


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """A 4xx with ``{"error": {"message", "type", "param", "code"}}``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


def assert_well_formed(status: int, content_type: str, body: bytes) -> None:
    """Any answer at all: no 5xx; a 4xx is an OpenAI error; a 200 parses."""
    assert status < 500, (status, body[:300])
    if status >= 400:
        assert_openai_error(httpx.Response(status, content=body))
    elif content_type.startswith("text/event-stream"):
        lines = [x for x in body.decode().split("\n") if x.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            event = json.loads(line[6:])
            assert "error" not in event, event
    elif content_type.startswith("application/json"):
        json.loads(body)


# ---- fuzzing from the OpenAPI schema ------------------------------------------------


def openapi_schema() -> dict[str, Any]:
    """The POST bodies of the API as OpenAPI 3.0, from ``kvpage.openai.protocol``,
    narrowed where the models allow more than the server takes (the served
    model name, token ids in the vocabulary, a few prompts) and with outputs
    capped low, so that valid examples get to generate, quickly. Invalid
    examples break these narrower rules too."""
    components: dict[str, Any] = {}

    def body(model: Any) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        for name in ("max_tokens", "max_completion_tokens"):
            if name in schema["properties"]:
                schema["properties"][name] = {
                    "anyOf": [{"type": "integer", "minimum": 1, "maximum": 8}, {"type": "null"}]
                }
        props = schema["properties"]
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 4}
        props["model"] = {"anyOf": [{"type": "string", "enum": [MODEL]}, {"type": "null"}]}
        if "prompt" in props:  # token ids in the vocabulary, a few prompts at most
            ids = {
                "type": "array",
                "minItems": 1,
                "maxItems": 32,
                "items": {"type": "integer", "minimum": 0, "maximum": 511},
            }
            texts = {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"type": "string", "minLength": 1, "maxLength": 64},
            }
            props["prompt"] = {
                "anyOf": [
                    {"type": "string", "minLength": 1, "maxLength": 200},
                    ids,
                    texts,
                    {"type": "array", "minItems": 1, "maxItems": 3, "items": ids},
                ]
            }
        components[model.__name__] = schema
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        return {
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {
                "200": {"description": "a completion"},
                "400": {"description": "an OpenAI error"},
            },
        }

    ok = {"responses": {"200": {"description": "ok"}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvpage", "version": "1"},
        "paths": {
            "/v1/completions": {"post": body(CompletionRequest)},
            "/v1/chat/completions": {"post": body(ChatCompletionRequest)},
            "/v1/models": {"get": ok},
            "/health": {"get": ok},
            "/metrics": {"get": ok},
        },
        "components": {"schemas": components},
    }


def send_case(case: Any, base_url: str) -> httpx.Response:
    """Send a schemathesis case with httpx, reading the whole answer."""
    kwargs = case.as_transport_kwargs(base_url=base_url, headers=AUTH)
    headers = dict(kwargs.get("headers") or {})
    content = kwargs.get("data")
    if "json" in kwargs:  # NaN and inf as JSON's non-standard literals: hostile too
        content = json.dumps(kwargs["json"]).encode()
        headers["Content-Type"] = "application/json"
    if isinstance(content, str):
        content = content.encode()
    return httpx.request(
        kwargs["method"],
        kwargs["url"],
        headers=headers,
        params=kwargs.get("params") or None,
        content=content,
        timeout=60,
    )


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_from_the_openapi_schema(served: InProcessServer, mode: str) -> None:
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi_schema())
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    for result in schema.get_all_operations():
        operation = result.ok()
        post = operation.method.upper() == "POST"
        if mode == "negative" and not post:
            continue  # nothing to break in a GET without parameters
        examples = 30 if post else 3

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=generation))
        def check(case: Any) -> None:
            response = send_case(case, served.url)
            OUTCOMES[f"fuzz {mode} {case.operation.label} -> {response.status_code}"] += 1
            assert_well_formed(
                response.status_code, response.headers.get("content-type", ""), response.content
            )

        check()
    served.check_pool()


# ---- hand-written hostile cases ---------------------------------------------------

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _nested(depth: int) -> bytes:
    return (
        b'{"model": "tiny", "prompt": "hi", "response_format": '
        + b'{"a": ' * depth
        + b"1"
        + b"}" * depth
        + b"}"
    )


HOSTILE: list[tuple[str, str, str, Any, int]] = [
    # (kind, id, path, body: dict = JSON, bytes = raw, expected status)
    (
        "huge body",
        "declared-too-large",
        "/v1/completions",
        json.dumps({**_CMPL, "prompt": "x" * (MAX_BODY + 1)}).encode(),
        413,
    ),
    (
        "huge body",
        "prompt-list-too-long",
        "/v1/completions",
        {**_CMPL, "prompt": [[5]] * (MAX_PROMPTS_PER_REQUEST + 1)},
        400,
    ),
    ("deep nesting", "array-100k", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("deep nesting", "object-5000", "/v1/completions", _nested(5000), 400),
    ("deep nesting", "object-500-in-a-field", "/v1/completions", _nested(500), 200),
    ("wrong type", "prompt-number", "/v1/completions", {**_CMPL, "prompt": 5}, 400),
    ("wrong type", "prompt-mixed", "/v1/completions", {**_CMPL, "prompt": [1, "a"]}, 400),
    ("wrong type", "max-tokens-string", "/v1/completions", {**_CMPL, "max_tokens": "8"}, 400),
    ("wrong type", "stream-string", "/v1/completions", {**_CMPL, "stream": "yes"}, 400),
    ("wrong type", "priority-float", "/v1/completions", {**_CMPL, "priority": 1.5}, 400),
    ("wrong type", "messages-string", "/v1/chat/completions", {**_CHAT, "messages": "hi"}, 400),
    (
        "wrong type",
        "content-part-image",
        "/v1/chat/completions",
        {**_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
    ),
    ("wrong type", "body-array", "/v1/completions", b"[1, 2]", 400),
    ("wrong type", "body-null", "/v1/completions", b"null", 400),
    ("wrong type", "body-empty", "/v1/completions", b"", 400),
    (
        "bad number",
        "temperature-nan",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
        400,
    ),
    (
        "bad number",
        "temperature-inf",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}',
        400,
    ),
    (
        "bad number",
        "top-p-1e400",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "top_p": 1e400}',
        400,
    ),
    (
        "bad number",
        "min-p-minus-inf",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "min_p": -Infinity}',
        400,
    ),
    (
        "bad number",
        "penalty-nan",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "presence_penalty": NaN}',
        400,
    ),
    ("bad number", "temperature-negative", "/v1/completions", {**_CMPL, "temperature": -1}, 400),
    ("bad number", "max-tokens-negative", "/v1/completions", {**_CMPL, "max_tokens": -1}, 400),
    ("bad number", "max-tokens-zero", "/v1/chat/completions", {**_CHAT, "max_tokens": 0}, 400),
    ("bad number", "seed-negative", "/v1/completions", {**_CMPL, "seed": -1}, 400),
    ("bad number", "token-id-negative", "/v1/completions", {**_CMPL, "prompt": [-1]}, 400),
    ("integer overflow", "priority-2**63", "/v1/completions", {**_CMPL, "priority": 2**63}, 400),
    ("integer overflow", "priority-2**70", "/v1/completions", {**_CMPL, "priority": 2**70}, 400),
    ("integer overflow", "top-k-2**40", "/v1/completions", {**_CMPL, "top_k": 2**40}, 400),
    ("integer overflow", "seed-2**80", "/v1/completions", {**_CMPL, "seed": 2**80}, 400),
    ("integer overflow", "token-id-2**70", "/v1/completions", {**_CMPL, "prompt": [2**70]}, 400),
    (
        "integer overflow",
        "5000-digits",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        400,
    ),
    ("not UTF-8", "invalid-bytes", "/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', 400),
    (
        "not UTF-8",
        "latin-1-body",
        "/v1/completions",
        '{"prompt": "caf\xe9"}'.encode("latin-1"),
        400,
    ),
    (
        "not Unicode",
        "prompt-lone-surrogate",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi \\ud800 there", "max_tokens": 2}',
        400,
    ),
    (
        "not Unicode",
        "chat-lone-surrogate",
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
    ),
    (
        "not Unicode",
        "role-lone-surrogate",
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "\\ud800", "content": "x"}]}',
        400,
    ),
    (
        "not Unicode",
        "salt-lone-surrogate",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "cache_salt": "\\udc00"}',
        400,
    ),
    (
        "not Unicode",
        "model-lone-surrogate",
        "/v1/completions",
        b'{"model": "\\ud800", "prompt": "hi"}',
        404,
    ),
    ("prompt length", "empty-text", "/v1/completions", {**_CMPL, "prompt": ""}, 400),
    ("prompt length", "empty-list", "/v1/completions", {**_CMPL, "prompt": []}, 400),
    ("prompt length", "empty-token-list", "/v1/completions", {**_CMPL, "prompt": [[]]}, 400),
    (
        "prompt length",
        "max-model-len",
        "/v1/completions",
        {**_CMPL, "prompt": [5] * MAX_MODEL_LEN},
        400,
    ),
    (
        "prompt length",
        "max-model-len+1",
        "/v1/completions",
        {**_CMPL, "prompt": [5] * (MAX_MODEL_LEN + 1)},
        400,
    ),
    (
        "prompt length",
        "chat-too-long",
        "/v1/chat/completions",
        {**_CHAT, "messages": [{"role": "user", "content": "hello " * 300}]},
        400,
    ),
    ("over a limit", "n-huge", "/v1/completions", {**_CMPL, "n": 10**9}, 400),
    ("over a limit", "n-over-max-num-seqs", "/v1/completions", {**_CMPL, "n": 9}, 400),
    ("over a limit", "max-tokens-huge", "/v1/completions", {**_CMPL, "max_tokens": 2**70}, 400),
    (
        "over a limit",
        "max-tokens-over-context",
        "/v1/completions",
        {**_CMPL, "max_tokens": MAX_MODEL_LEN},
        400,
    ),
    (
        "over a limit",
        "chat-max-completion-tokens-huge",
        "/v1/chat/completions",
        {**_CHAT, "max_completion_tokens": 10**12},
        400,
    ),
    (
        "over a limit",
        "stop-strings-5000",
        "/v1/completions",
        {**_CMPL, "stop": [f"s{i}" for i in range(5000)]},
        400,
    ),
    (
        "over a limit",
        "stop-string-10k-chars",
        "/v1/completions",
        {**_CMPL, "stop": "x" * 10_000},
        400,
    ),
    (
        "over a limit",
        "stop-token-ids-5000",
        "/v1/completions",
        {**_CMPL, "stop_token_ids": list(range(5000))},
        400,
    ),
    ("over a limit", "logprobs-21", "/v1/completions", {**_CMPL, "logprobs": 21}, 400),
    (
        "over a limit",
        "top-logprobs-huge",
        "/v1/chat/completions",
        {**_CHAT, "logprobs": True, "top_logprobs": 10**6},
        400,
    ),
    (
        "over a limit",
        "cache-salt-100k",
        "/v1/completions",
        {**_CMPL, "cache_salt": "s" * 100_000},
        400,
    ),
    (
        "unsupported",
        "logit-bias-nan",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "logit_bias": {"1": NaN}}',
        400,
    ),
    ("unsupported", "tools", "/v1/chat/completions", {**_CHAT, "tools": [{"type": "f"}]}, 400),
    ("unsupported", "chat-echo", "/v1/chat/completions", {**_CHAT, "echo": True}, 400),
    ("integer overflow", "prompt-logprobs-huge", "/v1/completions",
     {**_CMPL, "prompt_logprobs": 2**40}, 400),
    ("unknown model", "gpt-4", "/v1/completions", {**_CMPL, "model": "gpt-4"}, 404),
    ("unknown model", "chat-empty-name", "/v1/chat/completions", {**_CHAT, "model": ""}, 404),
]


@pytest.mark.parametrize(
    ("kind", "path", "body", "status"),
    [(k, p, b, s) for k, _, p, b, s in HOSTILE],
    ids=[f"{k}:{i}" for k, i, _, _, _ in HOSTILE],
)
def test_hostile_input_is_a_clean_4xx(
    served: InProcessServer, kind: str, path: str, body: Any, status: int
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        served.url + path,
        content=content,
        timeout=60,
        headers={**AUTH, "content-type": "application/json"},
    )
    OUTCOMES[f"hand-written {kind} -> {response.status_code}"] += 1
    if status == 200:
        assert response.status_code == 200, response.text[:300]
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert_openai_error(response, status)


def test_streamed_body_over_the_limit_is_413(served: InProcessServer) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: counted while read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY // 8192 + 2):
            yield b"x" * 8192
        yield b'"}'

    response = httpx.post(
        served.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60
    )
    OUTCOMES[f"hand-written huge body -> {response.status_code}"] += 1
    assert assert_openai_error(response, 413)["code"] == "request_too_large"


def test_wrong_methods_and_paths_are_openai_errors(served: InProcessServer) -> None:
    for method, path, status in [
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/models", 405),
        ("DELETE", "/health", 405),
        ("GET", "/v1/nope", 404),
        ("GET", "/v1/models/nope", 404),
        ("POST", "/metrics", 405),
    ]:
        response = httpx.request(method, served.url + path, headers=AUTH, timeout=30)
        OUTCOMES[f"hand-written wrong method or path -> {response.status_code}"] += 1
        assert_openai_error(response, status)


class _SlowTokenizer:
    """The engine's tokenizer, but encoding a text that contains SLOW takes
    ``delay_s`` (like a huge prompt would); everything else is delegated."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and "SLOW" in text:
            time.sleep(self.delay_s)
        return self.inner(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_slow_tokenization_does_not_stall_other_streams(served: InProcessServer) -> None:
    inner = served.engine.engine.tokenizer
    delay = 1.5
    dispatch = served.engine.engine.runner.dispatch

    def slow_step(  # ~25 ms a token: the stream lasts a few seconds
        plan: Any, prompt_targets: Any = None, token_bitmask_fn: Any = None
    ) -> Any:
        time.sleep(0.025)
        return dispatch(plan, prompt_targets, token_bitmask_fn)

    def arm(engine: Any) -> None:
        engine.tokenizer = _SlowTokenizer(inner, delay)
        engine.runner.dispatch = slow_step

    def disarm(engine: Any) -> None:
        engine.tokenizer = inner
        del engine.runner.dispatch

    # Every step bucket compiled first: a compile in the middle of the stream (CPU
    # buckets start at one row) would be a gap that has nothing to do with tokenization.
    served.call(lambda engine: engine.runner.warmup(progress=False))
    # One token per step, so the stream lasts past the slow request (several decode
    # steps per call would finish the tiny model's 110 tokens in a few bursts).
    served.call(lambda engine: setattr(engine.runner, "num_scheduler_steps", 1))
    served.call(arm)
    try:

        async def main() -> tuple[list[float], float, int]:
            async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
                body = {
                    "model": MODEL,
                    "prompt": [7] * 8,
                    "max_tokens": 110,
                    "stream": True,
                    "ignore_eos": True,
                }
                arrivals: list[float] = []
                slow_done: list[float] = []

                async def slow() -> int:
                    await asyncio.sleep(0.2)
                    start = time.monotonic()
                    response = await http.post(
                        served.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "a SLOW prompt", "max_tokens": 2},
                    )
                    slow_done.append(time.monotonic() - start)
                    return response.status_code

                async with http.stream(
                    "POST", served.url + "/v1/completions", json=body
                ) as response:
                    task = asyncio.ensure_future(slow())
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            arrivals.append(time.monotonic())
                    status = await task
                return arrivals, slow_done[0], status

        arrivals, slow_s, status = asyncio.run(main())
    finally:
        served.call(disarm)
    assert status == 200 and slow_s >= delay
    # the stream outlived the slow request, and kept flowing meanwhile
    assert arrivals[-1] - arrivals[0] > delay, "the stream was too short to tell"
    worst = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert worst < delay / 2, f"a {worst:.2f} s gap: tokenization blocked the event loop"
    served.check_pool()



def _half_upload(url: str, path: str, declared: int, sent: bytes) -> None:
    """A POST whose client sends ``sent`` of a ``declared``-byte body, then hangs up."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + sent)
        time.sleep(0.05)  # the server has started reading the body


def test_clients_that_hang_up_mid_upload_are_one_info_line_each(
    served: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Aborted uploads cannot flood the log: one INFO line per client, no traceback, no
    ERROR, and the request does not run; the server answers afterwards, pool clean."""
    clients = 10
    watched = ("kvpage", "uvicorn", "fastapi", "starlette")
    uvicorn_logger = logging.getLogger("uvicorn")  # does not propagate to the root
    uvicorn_logger.addHandler(caplog.handler)
    before = served.call(lambda engine: engine.get_stats())["prompt_tokens_total"]
    try:
        with caplog.at_level(logging.INFO):
            for i in range(clients):
                path = "/v1/chat/completions" if i % 2 else "/v1/completions"
                _half_upload(served.url, path, 4096, b'{"model": "tiny", "prompt": "hel')

            def ours() -> list[logging.LogRecord]:
                return [r for r in caplog.records if r.name.startswith(watched)]

            deadline = time.monotonic() + 20
            while len(ours()) < clients and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # anything more they would log
            records = ours()
    finally:
        uvicorn_logger.removeHandler(caplog.handler)
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records]
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING], lines
    assert len(records) == clients, lines  # one line per client
    assert all(r.levelno == logging.INFO for r in records), lines
    assert served.call(lambda engine: engine.get_stats())["prompt_tokens_total"] == before
    response = httpx.post(served.url + "/v1/completions", headers=AUTH, timeout=60,
                          json=_CMPL)
    assert response.status_code == 200, response.text[:300]
    served.check_pool()


# ---- who gets in ------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(served: InProcessServer) -> None:
    routes = [
        (method, route.path)
        for route in served.app.routes
        for method in sorted(getattr(route, "methods", None) or ())
        if method != "HEAD"
    ]
    assert {path for _, path in routes} >= {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
    }
    for method, path in routes:
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": KEY},
            {"authorization": f"Basic {KEY}"},
            {"authorization": f"Bearer {KEY[:-1]}"},
            {"authorization": f"Bearer {KEY}x"},
        ):
            response = httpx.request(method, served.url + path, headers=headers, timeout=30)
            OUTCOMES[f"auth bad key {method} {path} -> {response.status_code}"] += 1
            if path in ("/health", "/ping"):  # open: load balancers' health checks
                assert response.status_code == 200
            else:
                assert assert_openai_error(response, 401)["code"] == "invalid_api_key"
        response = httpx.request(method, served.url + path, headers=AUTH, timeout=30)
        assert response.status_code != 401


def test_api_key_is_compared_in_constant_time(
    served: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("kvpage.openai.guard.hmac.compare_digest", spy)
    assert (
        httpx.get(
            served.url + "/v1/models", headers={"authorization": "Bearer nope"}, timeout=30
        ).status_code
        == 401
    )
    assert httpx.get(served.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert calls == [(b"nope", KEY.encode()), (KEY.encode(), KEY.encode())]


def test_public_metrics_opens_only_metrics(served: InProcessServer) -> None:
    app = build_app(served.engine, served_model_name=MODEL, api_key=KEY, public_metrics=True)

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            return [
                (await http.get(path)).status_code for path in ("/metrics", "/health", "/v1/models")
            ]

    assert asyncio.run(main()) == [200, 200, 401]


def test_default_bind_is_loopback() -> None:
    from kvpage.cli import build_parser

    assert inspect.signature(run_server).parameters["host"].default == "127.0.0.1"
    args = build_parser().parse_args(["serve", "some-model"])
    assert args.host == "127.0.0.1"


def test_zz_server_is_healthy_and_pool_is_clean(served: InProcessServer) -> None:
    """Runs last in this module: after all of the above, a normal request
    works and no KV block, sampling slot or request was leaked."""
    response = httpx.post(
        served.url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json={**_CMPL, "max_tokens": 4, "ignore_eos": True},
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
    stats = served.check_pool()
    assert stats["num_requests_waiting"] == 0
    assert threading.active_count() < 200
    print("\nhostile-input outcomes (kind -> status: count):")
    for key, count in sorted(OUTCOMES.items()):
        print(f"  {key}: {count}")
