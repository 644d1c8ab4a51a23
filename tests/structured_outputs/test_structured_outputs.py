"""Structured outputs end to end on the tiny random model: every sample at temperature
1.0 follows its JSON schema / regex / choice because the grammar's masks are applied
on the device (a random model would never produce valid JSON by itself), through the
offline ``LLM`` API: forks (n > 1), preemption, bad constraints, compile timeouts."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kvpage import LLM, SamplingParams
from kvpage.runner.step_plan import StepPlan
from kvpage.structured_outputs import GuidedDecodingParams, StructuredOutputsParams
from kvpage.structured_outputs.compiler import GrammarCompiler
from random_schemas import random_schema


def make_llm(model: Path, **overrides: object) -> LLM:
    args: dict = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512,
                      block_size=8)
    args.update(overrides)
    return LLM(str(model), **args)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir)


def test_twenty_random_schemas_always_parse_and_validate(llm: LLM) -> None:
    rng = random.Random(2026)
    schemas = [random_schema(rng) for _ in range(20)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=480, seed=i, n=2,
                       structured_outputs=StructuredOutputsParams(json=schema))
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate([f"Record {i}:" for i in range(20)], params, use_tqdm=False)
    for schema, out in zip(schemas, outputs, strict=True):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (schema, sample.text)
            value = json.loads(sample.text)
            jsonschema.validate(value, schema)
    llm.engine.check_invariants()


@pytest.mark.parametrize(
    "pattern",
    [
        r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)",
        r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
        r"(yes|no), [A-Z]{2}",
    ],
)
def test_regex_outputs_match(llm: LLM, pattern: str) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=64, n=4, seed=7,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    (out,) = llm.generate(["Answer:"], params, use_tqdm=False)
    for sample in out.outputs:
        assert re.fullmatch(pattern, sample.text), sample.text
        assert sample.finish_reason == "stop"


def test_the_eos_text_is_no_part_of_the_output_even_with_special_tokens_shown(llm: LLM) -> None:
    """vLLM's rule: the text of the stop token that ended a sample (EOS here, which
    skip_special_tokens=False would show) is left out unless include_stop_str_in_output,
    so the output text still matches the regex the grammar kept it to."""
    pattern = r"(yes|no)(, [A-Z]{2})?"  # may end on EOS after "yes" / "no"
    eos = set(llm.engine.eos_token_ids)
    tokenizer = llm.engine.tokenizer
    for include in (False, True):
        params = SamplingParams(temperature=1.0, max_tokens=64, n=8, seed=7,
                                skip_special_tokens=False, include_stop_str_in_output=include,
                                structured_outputs=StructuredOutputsParams(regex=pattern))
        (out,) = llm.generate(["Answer:"], params, use_tqdm=False)
        on_eos = [s for s in out.outputs if s.token_ids[-1] in eos]
        assert on_eos, "some samples must end on EOS for this test to mean anything"
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            hidden = sample.token_ids[-1] in eos and not include
            shown = sample.token_ids[:-1] if hidden else sample.token_ids
            assert sample.text == tokenizer.decode(shown, skip_special_tokens=False)
            assert bool(re.fullmatch(pattern, sample.text)) == (include is False or
                                                                sample not in on_eos)


def test_choice_and_the_guided_decoding_alias(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral ok"]
    params = SamplingParams(temperature=1.0, max_tokens=32, n=8, seed=3,
                            guided_decoding=GuidedDecodingParams(choice=choices))
    (out,) = llm.generate(["Sentiment:"], params, use_tqdm=False)
    texts = [s.text for s in out.outputs]
    assert all(t in choices for t in texts), texts
    assert len(set(texts)) > 1, "8 samples at temperature 1 should not all agree"
    assert all(s.finish_reason == "stop" for s in out.outputs)
    assert params.structured_outputs == params.guided_decoding


def test_json_object_and_greedy(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200,
                            structured_outputs={"json_object": True})
    (out,) = llm.generate(["{"], params, use_tqdm=False)
    sample = out.outputs[0]
    if sample.finish_reason == "stop":  # greedy may keep adding keys until max_tokens
        assert isinstance(json.loads(sample.text), dict)
    assert sample.text.startswith("{")


def test_unconstrained_requests_share_steps_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 42]}
    (alone,) = llm.generate([prompt], plain, use_tqdm=False)
    guided = SamplingParams(temperature=1.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{5}"))
    mixed = llm.generate([prompt, "x", "y"], [plain, guided, guided], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert all(re.fullmatch("[0-9]{5}", o.outputs[0].text) for o in mixed[1:])


def test_preempted_constrained_sequences_resume_their_grammar(
    llm: LLM, tiny_model_dir: Path
) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "minLength": 24,
                                                     "maxLength": 24}},
              "required": ["v"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = [{"prompt_token_ids": list(range(10 + i, 22 + i))} for i in range(4)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    # 14 blocks of 8 tokens for 4 sequences of ~45 tokens each: preemption by recompute.
    tight = make_llm(tiny_model_dir, num_gpu_blocks=14, max_model_len=96, max_num_seqs=4,
                     max_num_batched_tokens=32)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.get_stats()["num_preemptions"] > 0
    for out, want in zip(outputs, expected, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == want  # greedy: same tokens as without preemption
        assert len(json.loads(out.outputs[0].text)["v"]) == 24
    tight.engine.check_invariants()


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        ({"json": '{"type": "objec"}'}, "json"),
        ({"json": "{not json"}, "json"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"choice": []}, "choice"),
        ({"json": {"type": "integer"}, "regex": "a"}, "exactly one"),
    ],
)
def test_invalid_constraints_are_value_errors_naming_the_field(
    llm: LLM, constraint: dict, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        params = SamplingParams(structured_outputs=constraint)
        llm.generate(["x"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_that_does_not_compile_in_time_is_refused(llm: LLM) -> None:
    engine = llm.engine
    slow = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                           engine.eos_token_ids, timeout_s=0.0)
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+x{i}$"}
        for i in range(1000)}}
    assert slow.vocab.words == 16  # built once, outside the timed compile
    with pytest.raises(ValueError, match="could not be compiled within 0 s"):
        slow.compile(StructuredOutputsParams(json=schema))
    slow.close()


def test_overlapped_masks_sample_like_masks_in_the_plan(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine computes masks while the forward pass runs (two executables); handing
    the same masks in with the plan (one fused executable) samples the same tokens."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": 2, "maxItems": 5}
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=60, n=3,
                            structured_outputs=StructuredOutputsParams(json=schema))
    before = dict(llm.engine.counters)
    (split,) = llm.generate(["Numbers:"], params, use_tqdm=False)
    counters = llm.engine.counters
    steps = counters["structured_mask_steps"] - before["structured_mask_steps"]
    assert steps > 0 and counters["structured_mask_rows"] > before["structured_mask_rows"]
    runner = llm.engine.runner
    dispatch = runner.dispatch

    def fused(plan: Any, prompt_targets: Any = None, token_bitmask_fn: Any = None) -> Any:
        if token_bitmask_fn is not None:  # the core's plan is frozen: the runner's part of it
            fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(StepPlan)
                      if f.name != "token_bitmask"}
            plan = StepPlan(**fields, token_bitmask=token_bitmask_fn())
        return dispatch(plan, prompt_targets)

    monkeypatch.setattr(runner, "dispatch", fused)
    (together,) = llm.generate(["Numbers:"], params, use_tqdm=False)
    assert [s.text for s in split.outputs] == [s.text for s in together.outputs]
    for sample in split.outputs:
        jsonschema.validate(json.loads(sample.text), schema)
