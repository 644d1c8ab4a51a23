"""The tunix adapter against tunix's own ``VanillaRollout`` on a tiny Llama 3: same
output shapes, logprobs within 1e-4, and a weight sync that the next rollout uses.

Needs ``kvpage[tunix]``, which pins older transformers/safetensors than the dev
environment: CI runs this file in its own environment (scripts/tunix_env.sh)."""

from __future__ import annotations

from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest

tunix = pytest.importorskip("tunix")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from kvpage.integrations.tunix import KvpageRollout  # noqa: E402
from tunix.models.llama3 import model as llama  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402


class ByteTokenizer:
    """Bytes as ids 3..258; 0 pad, 1 BOS, 2 EOS (tunix's tokenizer protocol)."""

    def encode(self, text: str, **_: Any) -> list[int]:
        return [3 + b for b in text.encode()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


CONFIG = dict(num_layers=2, vocab_size=272, embed_dim=64, hidden_dim=128, num_heads=4,
              head_dim=16, num_kv_heads=2, rope_theta=10000, norm_eps=1e-5)
ROLLOUT = base_rollout.RolloutConfig(
    max_tokens_to_generate=8, temperature=1.0, max_prompt_length=16, return_logprobs=True,
    kv_cache_size=64,
)
PROMPTS = ["hello", "abc", "hello world", "abc"]


def randomize(model: Any, seed: int) -> None:
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    key = jax.random.key(seed)
    new = [
        jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype) * 0.3
        if x.ndim > 1 else jnp.ones_like(x)
        for i, x in enumerate(leaves)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, new))


@pytest.fixture(scope="module")
def engines() -> tuple[Any, KvpageRollout, Any]:
    model = llama.Llama3(llama.ModelConfig(**CONFIG), rngs=nnx.Rngs(0))
    randomize(model, 1)
    tok = ByteTokenizer()
    ours = KvpageRollout(rollout_actor=model, tokenizer=tok, mesh=None, rollout_config=ROLLOUT,
                         compilation_cache_dir="none")
    cache = base_rollout.CacheConfig(cache_size=64, num_layers=2, num_kv_heads=2, head_dim=16)
    theirs = vanilla_rollout.VanillaRollout(model, tok, cache)
    return model, ours, theirs


def padded(tokens: list[np.ndarray], width: int) -> jax.Array:
    out = np.zeros((len(tokens), width), np.int32)
    for r, t in enumerate(tokens):
        out[r, : len(t)] = t
    return jnp.asarray(out)


def test_same_shapes_and_logprobs_as_vanilla(engines: Any) -> None:
    _, ours, theirs = engines
    a = ours.generate(PROMPTS, ROLLOUT)
    b = theirs.generate(PROMPTS, ROLLOUT)
    np.testing.assert_array_equal(a.left_padded_prompt_tokens, b.left_padded_prompt_tokens)
    assert [len(t) for t in a.tokens] == [len(t) for t in b.tokens] == [8] * 4
    assert all(2 not in t.tolist() for t in a.tokens)  # EOS excluded
    assert [len(x) for x in a.logprobs] == [len(t) for t in a.tokens]
    completions = padded(a.tokens, 8)
    prompts = jnp.asarray(a.left_padded_prompt_tokens)
    mine = np.asarray(ours.get_per_token_logps(prompts, completions))
    vanilla = np.asarray(theirs.get_per_token_logps(prompts, completions))
    assert np.abs(mine - vanilla).max() <= 1e-4
    # at temperature 1 the sampled (processed) logprobs are the scored ones
    for r, lp in enumerate(a.logprobs):
        assert np.abs(lp - mine[r, : len(lp)]).max() <= 1e-4
    assert ours.pad_id() == 0 and ours.eos_id() == 2


def test_update_params_then_regenerate_uses_the_new_weights(engines: Any) -> None:
    model, ours, theirs = engines
    other = llama.Llama3(llama.ModelConfig(**CONFIG), rngs=nnx.Rngs(0))
    randomize(other, 7)
    state = nnx.state(other, nnx.Param)
    compiles = ours.llm.engine.runner.executables.num_compilations
    ours.update_params(state)
    theirs.update_params(state)
    assert ours.llm.engine.runner.last_update_copies == 0
    held = {id(x) for x in jax.tree.leaves(ours.llm.engine.runner.params)}
    assert all(id(x) in held for x in jax.tree.leaves(state))
    ours.generate(PROMPTS, ROLLOUT)  # the first test's shapes: nothing recompiles
    assert ours.llm.engine.runner.executables.num_compilations == compiles
    greedy = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, temperature=1e-6, max_prompt_length=16, kv_cache_size=64,
    )
    a = ours.generate(PROMPTS[:2], greedy)
    b = theirs.generate(PROMPTS[:2], greedy)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    prompts = jnp.asarray(a.left_padded_prompt_tokens)
    mine = np.asarray(ours.get_per_token_logps(prompts, padded(a.tokens, 8)))
    vanilla = np.asarray(theirs.get_per_token_logps(prompts, padded(a.tokens, 8)))
    assert np.abs(mine - vanilla).max() <= 1e-4


def test_an_actor_updated_in_place_is_followed(engines: Any) -> None:
    """tunix calls no sync when the rollout's model() is the actor (shared weights):
    the next generate must still sample from the trainer's new arrays."""
    model, ours, theirs = engines
    version = ours.llm.engine.params_version
    randomize(model, 11)  # what an optimizer step does to the actor's variables
    greedy = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, temperature=1e-6, max_prompt_length=16, kv_cache_size=64,
    )
    fresh = vanilla_rollout.VanillaRollout(
        model, ByteTokenizer(),
        base_rollout.CacheConfig(cache_size=64, num_layers=2, num_kv_heads=2, head_dim=16),
    )
    a = ours.generate(PROMPTS[:2], greedy)
    assert ours.llm.engine.params_version == version + 1
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in
                                              fresh.generate(PROMPTS[:2], greedy).tokens]
    ours.generate(PROMPTS[:2], greedy)  # nothing changed: no sync
    assert ours.llm.engine.params_version == version + 1
    del theirs
