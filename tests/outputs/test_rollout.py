"""RL rollouts without tunix installed: the layout hook (a trainer's kernel layout read
in place), ``LLM.rollout``'s arrays and ``LLM.score``, against the dense teacher-forced
forward. The tunix adapter itself: tests/integrations/test_tunix_rollout.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.integrations.tunix_layout import params_from_tunix, tunix_arrays_from_params
from kvpage.model import ModelConfig, load_model
from kvpage.model.dense import dense_logits
from kvpage.model.params import validate_params
from kvpage.model.transposed_weight import TransposedWeight
from kvpage.outputs.rollout import SCORE_PARAMS

ENGINE_ARGS: dict[str, Any] = dict(
    max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, block_size=4,
    compilation_cache_dir="none",
)
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64], [8, 9], list(range(20, 45))]


def tunix_state(config: ModelConfig, params: Any) -> dict[str, Any]:
    """``params`` (HF layout) rearranged as tunix's Llama keeps them (new arrays)."""
    return tunix_arrays_from_params(config, params)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> tuple[ModelConfig, Any]:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(model: tuple[ModelConfig, Any]) -> LLM:
    return LLM.from_params(*model, **ENGINE_ARGS)


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def test_trainer_layout_is_read_in_place(model: tuple[ModelConfig, Any], llm: LLM) -> None:
    config, params = model
    state = tunix_state(config, params)
    mapped = params_from_tunix(state, config)
    validate_params(config, mapped)
    q = mapped["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert isinstance(q, TransposedWeight) and q.shape == (config.q_size, config.hidden_size)
    kernel_llm = LLM.from_params(config, mapped, **ENGINE_ARGS)
    assert kernel_llm.engine.runner.last_update_copies == 0
    assert greedy(kernel_llm) == greedy(llm)

    # A sync from the trainer's tree: its very arrays, no copy, nothing recompiles.
    scaled = jax.tree_util.tree_map(lambda x: x * 1.25, params)
    new_state = tunix_state(config, scaled)
    compiles = kernel_llm.engine.runner.executables.num_compilations
    kernel_llm.update_params(params_from_tunix(new_state, config))
    assert kernel_llm.engine.runner.last_update_copies == 0
    held = {id(x) for x in jax.tree_util.tree_leaves(kernel_llm.engine.runner.params)}
    assert id(new_state["layers"][1]["attn"]["o_proj"]["w"]) in held
    assert id(new_state["embedder"]["input_embedding"]) in held
    assert greedy(kernel_llm) == greedy(LLM.from_params(config, scaled, **ENGINE_ARGS))
    assert kernel_llm.engine.runner.executables.num_compilations == compiles


def test_layout_errors_name_the_tensor(model: tuple[ModelConfig, Any]) -> None:
    config, params = model
    state = tunix_state(config, params)
    del state["layers"][1]["mlp"]["up_proj"]
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.up_proj\.kernel"):
        params_from_tunix(state, config)
    with pytest.raises(ValueError, match="no output axes"):
        TransposedWeight(jnp.zeros((4, 4)), in_axes=2)


def teacher_forced(config: ModelConfig, params: Any, prompt: list[int], completion: np.ndarray,
                   temperature: float = 1.0) -> np.ndarray:
    ids = jnp.asarray([prompt + completion.tolist()], jnp.int32)
    logits = dense_logits(params, config, ids)[0, len(prompt) - 1 : -1] / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(completion)[:, None], -1)[:, 0])


def test_rollout_arrays_and_processed_logprobs(model: tuple[ModelConfig, Any], llm: LLM) -> None:
    config, params = model
    stop = greedy(llm)[0][4]  # a token the first prompt's greedy sample reaches
    batch = llm.rollout(
        [{"prompt_token_ids": p} for p in PROMPTS],
        [SamplingParams(n=2, max_tokens=10, temperature=0.7, top_k=50, seed=3 + i,
                        logprobs_mode="processed_logprobs", ignore_eos=True,
                        stop_token_ids=[stop] if i == 0 else None)
         for i in range(len(PROMPTS))],
        pad_id=-1,
    )
    assert batch.token_ids.shape[0] == 6 and batch.token_ids.dtype == np.int32
    assert batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.params_version == llm.engine.params_version
    for r, n in enumerate(batch.lengths.tolist()):
        row = batch.token_ids[r]
        assert (row[n:] == -1).all() and (batch.logprobs[r, n:] == 0).all()
        assert stop not in row[:n].tolist() or batch.prompt_index[r] != 0
        if batch.finish_reasons[r] == "length":
            assert n == 10
        # top-k renormalises the tempered distribution over 50 tokens: never below it
        full = teacher_forced(config, params, PROMPTS[batch.prompt_index[r]], row[:n], 0.7)
        assert np.all(batch.logprobs[r, :n] >= full - 1e-4)
    greedy_batch = llm.rollout([{"prompt_token_ids": PROMPTS[2]}],
                               SamplingParams(max_tokens=8, temperature=0.7, seed=1,
                                              logprobs_mode="processed_logprobs",
                                              ignore_eos=True))
    n = int(greedy_batch.lengths[0])
    want = teacher_forced(config, params, PROMPTS[2], greedy_batch.token_ids[0, :n], 0.7)
    assert np.abs(greedy_batch.logprobs[0, :n] - want).max() <= 1e-4


def test_score_matches_teacher_forcing_and_shares_prompts(
    model: tuple[ModelConfig, Any], llm: LLM
) -> None:
    config, params = model
    rng = np.random.default_rng(0)
    completions = [rng.integers(3, config.vocab_size, size=s).tolist() for s in (6, 1, 9, 6)]
    completions[3] = completions[0]  # the same pair twice: equal scores, no hang
    completions[2][:3] = completions[0][:3]  # a completion prefix shared with another
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[0]]
    for _ in range(2):  # the second call finds everything in the prefix cache
        scores = llm.score(prompts, completions)
        assert [len(s) for s in scores] == [6, 1, 9, 6]
        for prompt, completion, got in zip(prompts, completions, scores, strict=True):
            want = teacher_forced(config, params, prompt, np.asarray(completion))
            assert np.abs(got - want).max() <= 1e-4
        assert np.array_equal(scores[0], scores[3])
    assert llm.score([[1, 2]], [[]])[0].shape == (0,)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.score([[]], [[3]])
    with pytest.raises(ValueError, match="2 prompts and 1 completions"):
        llm.score([[1], [2]], [[3]])
    llm.engine.check_invariants()


def test_a_rollout_that_stopped_at_max_model_len_can_be_scored(
    model: tuple[ModelConfig, Any], llm: LLM
) -> None:
    """``rollout`` stops at max_model_len (finish "length"); scoring that sample needs no
    room to generate, so ``score`` accepts prompt + completion = max_model_len tokens."""
    config, params = model
    prompt = PROMPTS[2]
    batch = llm.rollout([{"prompt_token_ids": prompt}],
                        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))
    n = int(batch.lengths[0])
    assert len(prompt) + n == ENGINE_ARGS["max_model_len"]
    completion = batch.token_ids[0, :n]
    got = llm.score([prompt], [completion.tolist()])[0]
    assert np.abs(got - teacher_forced(config, params, prompt, completion)).max() <= 1e-4
    llm.engine.check_invariants()


def test_scoring_reuses_the_prompt_but_computes_the_completion(llm: LLM) -> None:
    prompt, completion = PROMPTS[2], [7, 8, 9, 10, 11, 12, 13, 14, 15]
    first = llm.score([prompt], [completion])[0]
    llm.engine.add_request(
        "again", {"prompt_token_ids": prompt + completion}, SCORE_PARAMS, final_only=True,
        score_from=len(prompt),
    )
    out = next(o for _ in range(50) for o in llm.engine.step() if o.finished)
    # 25 prompt tokens with blocks of 4: 24 of them cached, none of the completion.
    assert out.num_cached_tokens == 24
    np.testing.assert_array_equal(out.prompt_logprob_array, first)
    with pytest.raises(ValueError, match="score_from"):
        llm.engine.add_request("bad", {"prompt_token_ids": prompt}, SCORE_PARAMS,
                               score_from=len(prompt))


def test_a_trainers_mesh_is_used_as_it_is(
    model: tuple[ModelConfig, Any], llm: LLM, tiny_model_dir: Path
) -> None:
    """``mesh=``: a trainer's 2-axis mesh; weights split over its "tp" axis, in the
    trainer's kernel layout too, give the single-device tokens."""
    from jax.sharding import Mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    config, params = model
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tp"))
    mapped = params_from_tunix(tunix_state(config, params), config)
    sharded = LLM.from_params(config, mapped, mesh=mesh, **ENGINE_ARGS)
    assert sharded.engine.runner.tensor_parallel_size == 2
    q = sharded.engine.runner.params["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert q.kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert greedy(sharded) == greedy(llm)
    loaded = LLM(str(tiny_model_dir), mesh=mesh, **ENGINE_ARGS)  # from a checkpoint too
    assert loaded.engine.runner.tensor_parallel_size == 2
    assert greedy(loaded) == greedy(llm)
    with pytest.raises(ValueError, match="no 'tp' axis"):
        LLM.from_params(config, params, mesh=Mesh(np.asarray(jax.devices()[:2]), ("dp",)),
                        **ENGINE_ARGS)
