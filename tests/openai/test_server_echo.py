"""``echo`` and vLLM's ``prompt_logprobs`` over HTTP, through the official openai client:
response shapes, the numbers equal to the offline API's, streaming echo, max_tokens 0,
and 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvpage import LLM, SamplingParams
from kvpage.engine.config import EngineConfig
from server_harness import InProcessServer

MODEL = "tiny"
PROMPT_IDS = [5, 17, 99, 3, 42, 7, 250, 11, 64, 120, 121]
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[InProcessServer]:
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, max_model_len=128,
                          max_num_batched_tokens=32, block_size=4, compilation_cache_dir=None)
    with InProcessServer(config, model_name=MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(server: InProcessServer) -> list:
    """Prompt logprobs of PROMPT_IDS from the offline API on the same engine."""
    llm = LLM.from_engine(server.engine.engine)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    return server.call(lambda _: llm.generate([{"prompt_token_ids": PROMPT_IDS}], params,
                                              use_tqdm=False))[0].prompt_logprobs


def post(server: InProcessServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_echo_logprobs_cover_prompt_then_output(
    server: InProcessServer, client: openai.OpenAI, offline: list
) -> None:
    """What lm-eval's local-completions sends for loglikelihood requests."""
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1, logprobs=1,
                                    echo=True, temperature=0, seed=1234)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(PROMPT_IDS) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(PROMPT_IDS)):
        want = offline[j][PROMPT_IDS[j]].logprob
        assert lp.token_logprobs[j] == pytest.approx(want, abs=1e-5)
        # logprobs=1: the top token, plus the prompt token when it is not the top one
        assert 1 <= len(lp.top_logprobs[j]) <= 2
        assert max(lp.top_logprobs[j].values()) >= lp.token_logprobs[j]
    prompt_text = server.engine.engine.tokenizer.decode(PROMPT_IDS)
    assert choice.text.startswith(prompt_text) and len(choice.text) >= len(prompt_text)
    assert lp.text_offset[0] == 0
    assert lp.text_offset[-1] == sum(len(t) for t in lp.tokens[:-1])
    assert out.usage.prompt_tokens == len(PROMPT_IDS) and out.usage.completion_tokens == 1
    server.check_pool()


def test_max_tokens_zero_scores_only_the_prompt(
    server: InProcessServer, client: openai.OpenAI, offline: list
) -> None:
    out = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, logprobs=0,
                                    echo=True)
    choice = out.choices[0]
    assert choice.text == TEXT
    ids = server.engine.engine.tokenizer(TEXT)["input_ids"]
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    server.check_pool()


def test_echo_without_logprobs_prepends_the_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=[TEXT, "Hello"], max_tokens=3,
                                    echo=True, temperature=0, n=2)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert [t[: len(TEXT)] for t in texts[:2]] == [TEXT, TEXT]
    assert all(t.startswith("Hello") for t in texts[2:])
    assert all(c.logprobs is None for c in out.choices)


def test_vllm_prompt_logprobs_field(server: InProcessServer, offline: list) -> None:
    response = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2,
                                                "prompt_logprobs": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    field = choice["prompt_logprobs"]
    assert field[0] is None and len(field) == len(PROMPT_IDS)
    for j in range(1, len(PROMPT_IDS)):
        assert {int(t) for t in field[j]} == set(offline[j])
        for t, entry in field[j].items():
            assert entry["logprob"] == pytest.approx(offline[j][int(t)].logprob, abs=1e-5)
            assert entry["rank"] == offline[j][int(t)].rank
            assert isinstance(entry["decoded_token"], str)
    assert not choice["text"].startswith(server.engine.engine.tokenizer.decode(PROMPT_IDS))


def test_chat_prompt_logprobs(server: InProcessServer) -> None:
    response = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello world"}]})
    assert len(body["prompt_logprobs"]) == len(ids.json()["tokens"])
    assert body["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])


def test_streaming_echo_comes_with_the_first_chunk(
    server: InProcessServer, client: openai.OpenAI, offline: list
) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4,
                                            logprobs=2, echo=True, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.startswith(server.engine.engine.tokenizer.decode(PROMPT_IDS))
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1] == pytest.approx(
        offline[1][PROMPT_IDS[1]].logprob, abs=1e-5)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len(PROMPT_IDS) + 4
    offsets = [o for c in chunks if c.choices for o in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(first.text)
    server.check_pool()


def test_prompt_logprobs_with_prefix_cache_hits_match(
    server: InProcessServer, client: openai.OpenAI, offline: list
) -> None:
    """The same prompt again (its prefix now cached) scores identically."""
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1,
                                        echo=True, logprobs=1, temperature=0)
        got = out.choices[0].logprobs.token_logprobs[1 : len(PROMPT_IDS)]
        want = [offline[j][PROMPT_IDS[j]].logprob for j in range(1, len(PROMPT_IDS))]
        assert got == pytest.approx(want, abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1)
    plain = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # caching still on for others
    server.check_pool()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "prompt_logprobs": 99}, "prompt_logprobs"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: InProcessServer, path: str, body: dict, param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = json.loads(response.text)["error"]
    assert error["param"] == param and param in error["message"]
