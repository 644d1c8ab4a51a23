"""A qwix-LoRA tunix actor (tunix's LoRA GRPO recipes) on ``KvpageRollout``: the engine
serves the frozen base plus the actor's adapter, with tunix's own sampler's logprobs, and
a LoRA-only sync rewrites the adapter with nothing recompiled.

Runs in the tunix environment (scripts/tunix_env.sh), as test_tunix_rollout.py."""

from __future__ import annotations

import time
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest

tunix = pytest.importorskip("tunix")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from kvpage.integrations.tunix import KvpageRollout  # noqa: E402
from test_tunix_rollout import CONFIG, PROMPTS, ROLLOUT, ByteTokenizer, padded, randomize  # noqa: E402
from tunix.models.llama3 import model as llama  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

RANK, ALPHA = 4, 8.0
GREEDY = base_rollout.RolloutConfig(max_tokens_to_generate=8, temperature=1e-6,
                                    max_prompt_length=16, kv_cache_size=64)
CACHE = base_rollout.CacheConfig(cache_size=64, num_layers=2, num_kv_heads=2, head_dim=16)


def lora_model(seed: int) -> Any:
    model = llama.Llama3(llama.ModelConfig(**CONFIG), rngs=nnx.Rngs(0))
    randomize(model, 1)
    provider = qwix.LoraProvider(
        module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        rank=RANK, alpha=ALPHA)
    model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(3), **model.get_model_input())
    randomize_lora(model, seed)
    return model


def randomize_lora(model: Any, seed: int) -> None:
    """What training does to the adapter (qwix starts B at zero: no effect)."""
    state = nnx.state(model, nnx.LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    key = jax.random.key(seed)
    nnx.update(model, jax.tree.unflatten(treedef, [
        jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype) * 0.2
        for i, x in enumerate(leaves)]))


def agree(ours: KvpageRollout, model: Any) -> None:
    theirs = vanilla_rollout.VanillaRollout(model, ByteTokenizer(), CACHE)
    a = ours.generate(PROMPTS[:2], GREEDY)
    b = theirs.generate(PROMPTS[:2], GREEDY)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    prompts = jnp.asarray(a.left_padded_prompt_tokens)
    mine = np.asarray(ours.get_per_token_logps(prompts, padded(a.tokens, 8)))
    vanilla = np.asarray(theirs.get_per_token_logps(prompts, padded(a.tokens, 8)))
    assert np.abs(mine - vanilla).max() <= 1e-4


def test_a_lora_actor_samples_as_tunix_and_syncs_its_adapter_alone() -> None:
    model = lora_model(2)
    with pytest.raises(ValueError, match="lora_scaling"):
        KvpageRollout(model, ByteTokenizer(), None, ROLLOUT, compilation_cache_dir="none")
    ours = KvpageRollout(model, ByteTokenizer(), None, ROLLOUT, lora_scaling=ALPHA / RANK,
                         compilation_cache_dir="none")
    assert ours.llm.engine.lora is not None
    agree(ours, model)

    trainer = lora_model(5)  # the trainer's next adapter (same frozen base)
    runner = ours.llm.engine.runner
    compiles = runner.executables.num_compilations
    base = [id(x) for x in jax.tree.leaves(runner.base_params())]
    state = nnx.state(trainer, nnx.LoRAParam)
    ours.update_params(state, (nnx.LoRAParam,))  # compiles the adapter write once
    randomize_lora(trainer, 6)
    state = nnx.state(trainer, nnx.LoRAParam)
    start = time.perf_counter()
    ours.update_params(state, (nnx.LoRAParam,))
    jax.block_until_ready(jax.tree.leaves(runner.params))
    sync_ms = (time.perf_counter() - start) * 1e3
    assert [id(x) for x in jax.tree.leaves(runner.base_params())] == base, "base untouched"
    nnx.update(model, state)  # the reference: tunix's own sampler on the synced actor
    agree(ours, model)
    assert runner.executables.num_compilations == compiles
    assert sync_ms < 1000
