"""EleutherAI lm-evaluation-harness against the real HTTP server (``local-completions``).

Local tasks only (tests/openai/lm_eval_tasks: JSONL data + task YAMLs; nothing from the hub):

* a multiple-choice task and a generate_until task, as a user would run them; on the
  tiny random model the scores are just numbers in [0, 1], so the test also checks that
  lm-eval's generations are the server's own greedy completions;
* a sanity pair built at test time from the model's own greedy continuations: with
  correct prompt logprobs every continuation token is the argmax at its position
  (lm-eval's loglikelihood ``acc`` = is_greedy must be 1.0) and the continuation beats
  a shuffled distractor (multiple-choice ``acc`` 1.0). Off-by-one or wrong-row logprobs
  fail these.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvpage.engine.config import EngineConfig
from server_harness import InProcessServer

lm_eval = pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
MODEL = "tiny"
LIMIT = 12
SEEDS = [
    "The quick brown fox", "Hello world! How are", "Once upon a time there was",
    "Continuous batching schedules one", "PagedAttention stores the KV cache in",
    "Copy-on-write blocks share prompt", "I am fine,", "Serving one request is",
    "0 1 2 3 4", "The lazy dog", "the sea and the", "How are you",
]


@pytest.fixture(scope="module")
def hermetic_hf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Hugging Face caches in a temp dir and no hub access for this module."""
    root = tmp_path_factory.mktemp("hf")
    env = {"HF_HOME": str(root), "HF_DATASETS_CACHE": str(root / "datasets"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, hermetic_hf: Path) -> Iterator[InProcessServer]:
    # few buckets to compile: the test's time is mostly XLA compiling on a CPU
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=4, max_model_len=256,
                          max_num_batched_tokens=32, block_size=8, compilation_cache_dir=None)
    with InProcessServer(config, model_name=MODEL) as served:
        yield served


def task_config(name: str, data: Path, cache: Path) -> dict[str, Any]:
    """A YAML task of tests/openai/lm_eval_tasks with its data path made absolute."""
    config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
    config["dataset_kwargs"] = {"data_files": {"test": str(data)}, "cache_dir": str(cache)}
    return config


def greedy(server: InProcessServer, prompt: str, max_tokens: int, stop: list[str] | None = None
           ) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "stop": stop}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]


def greedy_docs(server: InProcessServer, tokenizer: Any) -> list[dict[str, str]]:
    """Prompts with the model's greedy 3-token continuation, kept where lm-eval's
    tokenization of context + continuation gives back exactly the generated tokens."""
    docs, rng = [], random.Random(0)
    for seed in SEEDS:
        choice = greedy(server, seed, 3)
        continuation = choice["text"]
        context_ids = tokenizer(seed)["input_ids"]
        whole = tokenizer(seed + continuation)["input_ids"]
        if not continuation.strip() or whole[: len(context_ids)] != context_ids \
                or whole[len(context_ids):] != choice["token_ids"]:
            continue
        words = list(continuation)
        distractor = continuation
        while distractor == continuation:
            rng.shuffle(words)
            distractor = "".join(words)
        docs.append({"context": seed, "continuation": continuation, "distractor": distractor})
    return docs


def sanity_tasks(docs_path: Path, cache: Path) -> list[dict[str, Any]]:
    common = {"dataset_path": "json", "test_split": "test", "target_delimiter": "",
              "dataset_kwargs": {"data_files": {"test": str(docs_path)},
                                 "cache_dir": str(cache)},
              "doc_to_text": "{{context}}", "metadata": {"version": 1.0}}
    return [
        {**common, "task": "kvpage_greedy_loglikelihood", "output_type": "loglikelihood",
         "doc_to_target": "{{continuation}}",
         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        {**common, "task": "kvpage_greedy_mc", "output_type": "multiple_choice",
         "doc_to_choice": "{{[continuation, distractor]}}", "doc_to_target": 0,
         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    ]


def test_local_completions_mc_and_generate_until(
    server: InProcessServer, tiny_model_dir: Path, hermetic_hf: Path, tmp_path: Path
) -> None:
    from lm_eval import simple_evaluate

    tokenizer = server.engine.engine.tokenizer
    docs = greedy_docs(server, tokenizer)
    assert len(docs) >= 4, "too few greedy continuations survive re-tokenization"
    docs_path = tmp_path / "greedy.jsonl"
    docs_path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cache = hermetic_hf / "datasets"
    tasks = [task_config("kvpage_mc", TASKS_DIR / "mc.jsonl", cache),
             task_config("kvpage_gen", TASKS_DIR / "gen.jsonl", cache),
             *sanity_tasks(docs_path, cache)]
    results = simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{server.url}/v1/completions",
                    "tokenizer": str(tiny_model_dir), "tokenizer_backend": "huggingface",
                    "num_concurrent": 4, "max_retries": 1, "max_length": 250},
        tasks=tasks, limit=LIMIT, log_samples=True, bootstrap_iters=0,
    )
    assert results is not None
    scores = results["results"]
    mc, gen = scores["kvpage_mc"], scores["kvpage_gen"]
    for value in (mc["acc,none"], mc["acc_norm,none"], gen["exact_match,first_word"]):
        assert 0.0 <= value <= 1.0
    assert len(results["samples"]["kvpage_mc"]) == LIMIT
    # loglikelihoods are finite, negative sums over the choices' tokens
    for sample in results["samples"]["kvpage_mc"]:
        lls = [ll for (ll, _greedy) in sample["filtered_resps"]]
        assert len(lls) == 4 and all(-1e4 < ll < 0 for ll in lls)
    # lm-eval's generations are exactly the server's greedy completions
    for sample in results["samples"]["kvpage_gen"][:5]:
        prompt = sample["arguments"][0][0]
        want = greedy(server, prompt, 8, ["\n", ".", tokenizer.eos_token])["text"]
        assert sample["resps"][0][0] == want
    # the sanity pair: only right if each logprob is the right position's
    assert scores["kvpage_greedy_loglikelihood"]["acc,none"] == 1.0
    assert scores["kvpage_greedy_mc"]["acc,none"] == 1.0
    server.check_pool()
