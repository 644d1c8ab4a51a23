"""Structured outputs through the OpenAI-compatible server, driven by the ``openai``
client: ``response_format`` (json_schema, json_object), vLLM's ``guided_*`` extras and
``structured_outputs``, streaming, and 400s naming the problem. The tiny model has
random weights: only the grammar's masks make its output valid."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from kvpage.engine.config import EngineConfig
from random_schemas import random_schema
from server_harness import InProcessServer

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[InProcessServer]:
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, max_model_len=512,
                          max_num_batched_tokens=64)
    with InProcessServer(config, model_name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_chat_response_format_json_schema_validates(client: openai.OpenAI) -> None:
    rng = random.Random(16)
    for i in range(4):
        schema = random_schema(rng)
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=480, n=2, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_output_parses(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), schema)


def test_streamed_deltas_join_to_the_final_text_without_the_eos_text(
    served: InProcessServer, client: openai.OpenAI,
) -> None:
    """With skip_special_tokens=False, a sample ended by EOS shows no EOS text
    (vLLM's rule), streamed or not: the deltas join to the non-streamed text, which
    matches the regex."""
    pattern = r"(yes|no)(, [A-Z]{2})?"  # may end on EOS after "yes" / "no"
    eos = set(served.engine.submit(lambda engine: engine.eos_token_ids).result(timeout=30))
    body: dict[str, Any] = dict(model=MODEL, prompt="Answer:", temperature=1.0, max_tokens=32,
                                n=8, seed=7)
    extra = {"structured_outputs": {"regex": pattern}, "skip_special_tokens": False}
    whole = client.completions.create(**body, extra_body={**extra, "return_token_ids": True})
    parts = [""] * 8
    for chunk in client.completions.create(**body, extra_body=extra, stream=True):
        for choice in chunk.choices:
            parts[choice.index] += choice.text
    assert parts == [c.text for c in whole.choices]
    on_eos = 0
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.text), choice.text
        on_eos += choice.model_extra["token_ids"][-1] in eos
    assert on_eos, "some samples must end on EOS for this test to mean anything"


def test_completion_response_format_json_object(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="JSON:", temperature=1.0, max_tokens=60, seed=5, n=4,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # cut by max_tokens: still an object being written, a key next
            assert choice.text == "{}" or choice.text.startswith('{"'), choice.text


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", t)),
    ({"guided_choice": ["cat", "dog", "fish"]}, lambda t: t in ("cat", "dog", "fish")),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                      "maxItems": 3}},
     lambda t: isinstance(json.loads(t), list) and 1 <= len(json.loads(t)) <= 3),
    ({"structured_outputs": {"regex": "(ab|cd){2}", "backend": None}},
     lambda t: re.fullmatch("(ab|cd){2}", t)),
    ({"guided_grammar": 'start: "x" ("+" "x")*\n'},
     lambda t: re.fullmatch(r"x(\+x)*", t)),
])
def test_vllm_guided_extras(client: openai.OpenAI, extra: dict[str, Any], check: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=64, n=3, seed=1,
        extra_body=extra,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert check(choice.message.content), choice.message.content


def _error(served: InProcessServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "at most one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs",
     "whitespace_pattern"),
    ({"guided_json": {"type": "objec"}}, None, "json"),
    ({"guided_regex": "(a"}, None, "regex"),
    ({"guided_grammar": "start: missing"}, None, "grammar"),
])
def test_invalid_constraints_are_400s(served: InProcessServer, body: dict[str, Any],
                                     param: str | None, needle: str) -> None:
    err = _error(served, body)
    assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    served.engine.submit(lambda engine: engine.check_invariants()).result(timeout=30)
