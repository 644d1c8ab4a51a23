"""vLLM's side endpoints, errors, request extras and metrics names, against
an in-process server on the tiny model that ships with kvpage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from kvpage.assets import default_model_dir
from kvpage.bench.loopback import free_port
from kvpage.engine.async_engine import AsyncLLMEngine
from kvpage.engine.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.metrics import EngineMetrics, cache_config_info
from kvpage.openai.app import build_app
from server_harness import InProcessServer

MODEL = "tiny"
KEY = "k-vllm"
AUTH = {"authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def served() -> Iterator[InProcessServer]:
    config = EngineConfig(model=str(default_model_dir()), max_num_seqs=4, max_model_len=256,
                          max_num_batched_tokens=32, max_num_waiting=16)
    with InProcessServer(config, model_name=MODEL, api_key=KEY) as server:
        yield server


def post(served: InProcessServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + path, json=body, headers=AUTH, timeout=60)


def error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    return err


def test_tokenize_detokenize_round_trip(served: InProcessServer) -> None:
    tok = served.engine.tokenizer
    out = post(served, "/tokenize", {"model": MODEL, "prompt": "The module",
                                     "return_token_strs": True}).json()
    assert out["tokens"] == tok("The module")["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert len(out["token_strs"]) == out["count"]
    back = post(served, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}).json()
    assert back["prompt"] == tok.decode(out["tokens"])
    chat = post(served, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    error(post(served, "/tokenize", {"model": MODEL}), 400, "prompt")
    error(post(served, "/detokenize", {"model": MODEL, "tokens": [10**9]}), 400, "tokens")
    error(post(served, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model")


def test_version_ping_and_model_card(served: InProcessServer) -> None:
    from kvpage import __version__

    assert httpx.get(served.url + "/version", headers=AUTH).json() == {"version": __version__}
    assert httpx.get(served.url + "/ping").status_code == 200  # open, like /health
    assert httpx.post(served.url + "/ping").status_code == 200
    card = httpx.get(served.url + f"/v1/models/{MODEL}", headers=AUTH).json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 256
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    err = error(httpx.get(served.url + "/v1/models/nope", headers=AUTH), 404, "model")
    assert err["code"] == "model_not_found"


def test_unknown_model_is_404_model_not_found(served: InProcessServer) -> None:
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})]:
        err = error(post(served, path, {**body, "model": "nope"}), 404, "model")
        assert err["code"] == "model_not_found"
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


@pytest.mark.parametrize("top_logprobs", [-1, 10**6])
def test_chat_top_logprobs_errors_name_top_logprobs(served: InProcessServer,
                                                    top_logprobs: int) -> None:
    error(post(served, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                "logprobs": True,
                                                "top_logprobs": top_logprobs}),
          400, "top_logprobs")


def test_stream_options_without_stream_is_400(served: InProcessServer) -> None:
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})]:
        error(post(served, path, {**body, "model": MODEL,
                                  "stream_options": {"include_usage": True}}),
              400, "stream_options")


@pytest.mark.parametrize("field, value", [
    ("use_beam_search", True), ("guided_decoding_backend", "xgrammar"),
    ("return_tokens_as_token_ids", True), ("truncate_prompt_tokens", 4),
    ("allowed_token_ids", [1, 2]), ("chat_template", "{{ x }}"),
    ("chat_template_kwargs", {"enable_thinking": False}), ("vllm_xargs", {"a": 1}),
])
def test_unimplemented_vllm_extras_are_refused(served: InProcessServer, field: str,
                                               value: Any) -> None:
    err = error(post(served, "/v1/chat/completions",
                     {"model": MODEL, "messages": MESSAGES, field: value}), 400, field)
    assert err["code"] == "unsupported_parameter"


def test_extras_at_their_off_values_are_accepted(served: InProcessServer) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "use_beam_search": False,
            "chat_template_kwargs": {}, "spaces_between_special_tokens": True,
            "prompt_logprobs": None}
    assert post(served, "/v1/chat/completions", body).status_code == 200


def test_continue_final_message(served: InProcessServer) -> None:
    tok = served.engine.tokenizer
    messages = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True,
            "return_token_ids": True}
    out = post(served, "/v1/chat/completions", body).json()
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("Hi, I am")
    assert out["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    error(post(served, "/v1/chat/completions", {**body, "add_generation_prompt": True}),
          400, "continue_final_message")


def test_return_token_ids(served: InProcessServer) -> None:
    tok = served.engine.tokenizer
    out = post(served, "/v1/completions", {"model": MODEL, "prompt": "The module", "n": 2,
                                           "max_tokens": 3, "return_token_ids": True}).json()
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == tok("The module")["input_ids"]
        assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] // 2 \
            or choice["finish_reason"] == "stop"
    chat = post(served, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                 "max_tokens": 2,
                                                 "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] and isinstance(chat["choices"][0]["token_ids"], list)
    error(post(served, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True,
                                           "return_token_ids": True}), 400, "return_token_ids")


def test_add_special_tokens(served: InProcessServer) -> None:
    tok = served.engine.tokenizer
    plain = tok("The module", add_special_tokens=False)["input_ids"]
    out = post(served, "/v1/completions", {"model": MODEL, "prompt": "The module",
                                           "max_tokens": 1, "add_special_tokens": False,
                                           "return_token_ids": True}).json()
    assert out["choices"][0]["prompt_token_ids"] == plain


def test_vllm_metrics_prefix_serves_the_dashboard_series() -> None:
    """build_app over an engine whose metrics use prefix "vllm": the series
    vLLM's Grafana dashboard reads, with the model_name and engine labels."""
    import threading
    import time

    import uvicorn

    config = EngineConfig(model=str(default_model_dir()), max_num_seqs=2, max_model_len=128,
                          max_num_batched_tokens=32)
    inner = LLMEngine.from_config(config)
    metrics = EngineMetrics(MODEL, prefix="vllm", max_model_len=inner.max_model_len,
                            cache_config=cache_config_info(inner), log_interval_s=None)
    engine = AsyncLLMEngine(inner, metrics=metrics)
    app = build_app(engine, served_model_name=MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "The module", "max_tokens": 4,
                                "n": 2, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            r.read()
        text = httpx.get(url + "/metrics").text
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(5)
    labels = f'engine="0",model_name="{MODEL}"'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_inference_time_seconds_bucket", "request_prefill_time_seconds_bucket",
                 "request_decode_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket", "request_params_n_bucket",
                 "request_params_max_tokens_bucket", "iteration_tokens_total_bucket"):
        if name.endswith("_bucket"):
            assert f'vllm:{name}{{engine="0",le="+Inf",model_name="{MODEL}"}}' in text, name
        else:
            assert f"vllm:{name}{{{labels}}}" in text, name
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",' \
        f'model_name="{MODEL}"}} 1.0' in text
    assert f'vllm:request_params_n_sum{{{labels}}} 2.0' in text
    assert f'vllm:request_generation_tokens_sum{{{labels}}} 8.0' in text
    assert f'vllm:request_params_max_tokens_sum{{{labels}}} 4.0' in text
    assert "vllm:cache_config_info{" in text and 'block_size="' in text
    assert "kvpage:" not in text


def test_serve_without_its_extra_fails_at_startup(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from kvpage import cli
    from kvpage.system import extras

    monkeypatch.setitem(extras.SERVE_MODULES, "kvpage_no_such_module", "no-such-dist")
    assert cli.main(["serve", "no-such-model-dir"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "no-such-dist" in err and "install kvpage[serve]" in err


def test_cli_help_needs_no_serve_packages() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "for m in ('httpx', 'fastapi', 'uvicorn', 'prometheus_client'): sys.modules[m] = None\n"
            "from kvpage.cli import build_parser\n"
            "build_parser().parse_args(['bench', 'serve', '--help'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--base-url" in out.stdout


def test_missing_jinja2_is_a_server_error(served: InProcessServer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def no_jinja(*args: Any, **kwargs: Any) -> str:
        raise ImportError("apply_chat_template requires jinja2 to be installed")

    monkeypatch.setattr(served.engine.tokenizer, "apply_chat_template", no_jinja)
    err = error(post(served, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
                500)
    assert "kvpage[serve]" in err["message"] and err["code"] == "missing_dependency"
