"""Live params: ``LLM.from_params`` on arrays already on device (adopted, not copied),
``update_params`` while requests are in flight (versions in the outputs, no
recompilation, prefix cache dropped, KV pool kept), clear errors that leave the old
params live, and the dense training forward agreeing with the paged one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.engine.llm_engine import load_tokenizer
from kvpage.model import ModelConfig, load_model
from kvpage.model.dense import causal_lm_loss, dense_logits

PROMPTS = [
    {"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64]},
    {"prompt_token_ids": [8, 9]},
    {"prompt_token_ids": list(range(20, 45))},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE_ARGS: dict[str, Any] = dict(
    max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, block_size=8
)


def leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> tuple[ModelConfig, Any]:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def other_params(model: tuple[ModelConfig, Any]) -> Any:
    return jax.tree_util.tree_map(lambda x: x * 1.3, model[1])


@pytest.fixture(scope="module")
def llm(model: tuple[ModelConfig, Any], tiny_model_dir: Path) -> LLM:
    config, params = model
    return LLM.from_params(config, params, tokenizer=load_tokenizer(tiny_model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def expected(llm: LLM, model: tuple[ModelConfig, Any], other_params: Any) -> dict[str, Any]:
    """Greedy tokens of the original and the scaled params (each run once, whole)."""
    old = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.update_params(other_params)
    new = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.update_params(model[1])
    assert old != new
    return {"old": old, "new": new}


def test_from_params_adopts_device_arrays_without_copy(
    llm: LLM, model: tuple[ModelConfig, Any], tiny_model_dir: Path
) -> None:
    config, params = model
    fresh = LLM.from_params(config, params, **ENGINE_ARGS)
    runner = fresh.engine.runner
    assert runner.last_update_copies == 0
    assert all(a is b for a, b in zip(leaves(runner.params), leaves(params), strict=True))
    # Same tokens as loading the directory the usual way.
    from_dir = LLM(str(tiny_model_dir), **ENGINE_ARGS)
    assert token_ids(fresh.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(
        from_dir.generate(PROMPTS, GREEDY, use_tqdm=False)
    )


def test_from_params_accepts_sharded_arrays(model: tuple[ModelConfig, Any]) -> None:
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    from kvpage.runner.tensor_parallel import make_mesh, shard_params

    config, params = model
    sharded = shard_params(config, params, make_mesh(2))
    llm = LLM.from_params(config, sharded, tensor_parallel_size=2, **ENGINE_ARGS)
    runner = llm.engine.runner
    assert runner.last_update_copies == 0

    def pointers(tree: Any) -> list[int]:
        return [s.data.unsafe_buffer_pointer() for x in leaves(tree) for s in x.addressable_shards]

    assert pointers(runner.params) == pointers(sharded)
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10


def test_update_params_mid_flight(
    llm: LLM, model: tuple[ModelConfig, Any], other_params: Any, expected: dict[str, Any]
) -> None:
    engine = llm.engine
    runner = engine.runner
    compilations = runner.executables.num_compilations
    pool_buffers = [k.unsafe_buffer_pointer() for k, _ in runner.kv_pools]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"live-{i}", prompt, GREEDY)
    finished: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 6:  # requests are mid-decode: swap at this step boundary
            version = engine.update_params(other_params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        steps += 1
    assert runner.executables.num_compilations == compilations, "update_params recompiled"
    assert [k.unsafe_buffer_pointer() for k, _ in runner.kv_pools] == pool_buffers
    assert runner.last_update_copies == 0  # already on the device with the right dtype
    assert all(a is b for a, b in zip(leaves(runner.params), leaves(other_params), strict=True))
    for i in range(len(PROMPTS)):
        completion = finished[f"live-{i}"]
        versions = completion.params_versions
        assert versions[0] == (0, version - 1) and versions[-1][1] == version
        switch = versions[-1][0]
        assert 0 < switch < 10
        # Tokens before the switch are exactly those of the old params.
        assert completion.token_ids[:switch] == expected["old"][i][:switch]
    engine.update_params(model[1])


def test_update_params_drops_the_prefix_cache(
    llm: LLM, model: tuple[ModelConfig, Any], other_params: Any, expected: dict[str, Any]
) -> None:
    prompt = [{"prompt_token_ids": list(range(100, 140))}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_params(other_params)
    try:
        out = llm.generate(prompt + PROMPTS, GREEDY, use_tqdm=False)
        assert out[0].num_cached_tokens == 0  # KV computed by the old weights is not reused
        assert token_ids(out[1:]) == expected["new"]
    finally:
        llm.update_params(model[1])


def test_mismatched_params_are_rejected_and_old_params_stay_live(
    llm: LLM, model: tuple[ModelConfig, Any], expected: dict[str, Any]
) -> None:
    config, params = model
    version = llm.engine.params_version
    wrong_structure = dict(params, extra={"weight": jnp.zeros(3)})
    missing = {k: v for k, v in params.items() if k != "norm"}
    wrong_shape = dict(params, norm={"weight": jnp.ones(config.hidden_size + 1)})
    wrong_dtype = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    for bad, pattern in (
        (wrong_structure, "unexpected tensors"),
        (missing, "missing tensors: model.norm.weight"),
        (wrong_shape, "wrong shapes: model.norm.weight"),
        (wrong_dtype, r"from \(\d+, \d+\) float32 to \(\d+, \d+\) bfloat16"),
    ):
        with pytest.raises(ValueError, match=pattern):
            llm.update_params(bad)
        assert llm.engine.params_version == version
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected["old"]


def test_deleted_params_give_a_clear_error(model: tuple[ModelConfig, Any]) -> None:
    config, params = model
    copy = jax.tree_util.tree_map(jnp.copy, params)
    llm = LLM.from_params(config, copy, **ENGINE_ARGS)
    for leaf in leaves(copy):  # what donating them to a training step does
        leaf.delete()
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "update_params" in out.error and "deleted" in out.error
    llm.update_params(params)
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10


def test_dense_training_forward_matches_the_engine(
    llm: LLM, model: tuple[ModelConfig, Any], expected: dict[str, Any]
) -> None:
    config, params = model
    prompt = PROMPTS[0]["prompt_token_ids"]
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    completion = llm.generate([PROMPTS[0]], sampling, use_tqdm=False)[0].outputs[0]
    tokens = jnp.asarray([prompt + completion.token_ids])
    logits = jax.jit(dense_logits, static_argnums=1)(params, config, tokens)
    logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    positions = range(len(prompt) - 1, tokens.shape[1] - 1)
    # The engine's greedy tokens are the dense model's argmax, with the same logprobs.
    assert [int(np.argmax(logp[i])) for i in positions] == completion.token_ids
    dense_sum = sum(float(logp[i, int(tokens[0, i + 1])]) for i in positions)
    assert dense_sum == pytest.approx(completion.cumulative_logprob, abs=1e-3)
    loss, grads = jax.jit(jax.value_and_grad(causal_lm_loss), static_argnums=1)(
        params, config, tokens
    )
    assert np.isfinite(float(loss))
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)
