"""Multi-LoRA serving through the OpenAI client: ``--lora-modules`` adapters are models
of their own in ``/v1/models`` and in ``model``, and answer as the offline engine does
under the same adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvpage import LLM, LoRARequest, SamplingParams
from kvpage.engine.config import EngineConfig
from kvpage.lora.random_adapter import write_random_adapter
from server_harness import InProcessServer

ARGS: dict = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=8)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> list[LoRARequest]:
    llm = LLM(str(tiny_model_dir), enable_lora=True, **ARGS)
    shapes = llm.engine.runner.lora.shapes(llm.engine.runner.params)
    root = tmp_path_factory.mktemp("served-adapters")
    poet = json.dumps({"name": "poet",
                       "path": str(write_random_adapter(root / "poet", shapes, seed=5))})
    return LoRARequest.parse_modules(
        [f"sql={write_random_adapter(root / 'sql', shapes, rank=8, seed=4)}", poet])


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, adapters: list[LoRARequest]) -> Iterator[openai.OpenAI]:
    config = EngineConfig(model=str(tiny_model_dir), enable_lora=True, max_loras=2, **ARGS)
    with InProcessServer(config, model_name="tiny", lora_modules=adapters) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def test_adapters_are_listed_and_answer_as_offline(
    client: openai.OpenAI, tiny_model_dir: Path, adapters: list[LoRARequest]
) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "sql", "poet"}
    assert models["sql"].parent == "tiny" and models["sql"].root == adapters[0].lora_path

    texts = {name: client.completions.create(model=name, prompt=PROMPT, max_tokens=8,
                                             temperature=0).choices[0].text
             for name in models}
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, **ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for name, lora in [("tiny", None), ("sql", adapters[0]), ("poet", adapters[1])]:
        offline = llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=lora)
        assert texts[name] == offline[0].outputs[0].text, name
    assert len(set(texts.values())) == 3, "each adapter answers differently"


def test_an_unknown_model_is_a_404_naming_the_served_ones(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="sql"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_bad_lora_modules_are_refused() -> None:
    with pytest.raises(ValueError, match="name=path"):
        LoRARequest.parse_modules(["justaname"])
    with pytest.raises(ValueError, match="given twice"):
        LoRARequest.parse_modules(["a=x", "a=y"])


def test_all_slots_pinned_is_a_503_to_retry() -> None:
    from kvpage.lora.slots import LoRASlotsFullError
    from kvpage.openai.errors import engine_error

    error = engine_error(LoRASlotsFullError("all max_loras=2 adapter slots are in use"))
    assert error.status == 503 and "max_loras" in str(error.body())
