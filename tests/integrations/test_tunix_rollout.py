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


# ---- tunix's Gemma 2 and Gemma 3 modules (tunix.models.gemma / gemma3)
from kvpage.integrations import tunix_layout  # noqa: E402
from kvpage.model.transposed_weight import TransposedWeight  # noqa: E402
from tunix.models.gemma import model as gemma  # noqa: E402
from tunix.models.gemma3 import model as gemma3  # noqa: E402

WINDOW = 4  # shorter than every test sequence: the sliding layers see part of it
GEMMA_PROMPTS = ["hello world", "abcdefg", "sliding window"]


def gemma2_model(seed: int) -> Any:
    config = gemma.ModelConfig(
        num_layers=2, num_embed=272, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=16, num_kv_heads=2,  # q_einsum + kv_einsum
        final_logit_softcap=3.0, attn_logits_soft_cap=5.0,  # small enough to bite
        use_post_attn_norm=True, use_post_ffw_norm=True, sliding_window_size=WINDOW,
        attention_types=(gemma.AttentionType.LOCAL_SLIDING, gemma.AttentionType.GLOBAL),
    )
    return random_module(gemma.Gemma, config, seed)


def gemma3_model(seed: int) -> Any:
    config = gemma3.ModelConfig(
        num_layers=6, num_embed=272, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=32, num_kv_heads=4,  # one qkv_einsum
        sliding_window_size=WINDOW, local_base_frequency=10_000,
        global_base_frequency=100_000, global_scale_factor=2.0,
        # scale (64 // 4) ** -0.5, not head_dim ** -0.5
        query_pre_attn_norm=gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS,
        param_dtype=jnp.float32,
    )
    return random_module(gemma3.Gemma3, config, seed)


def random_module(cls: Any, config: Any, seed: int) -> Any:
    """A tunix module with every parameter random, norm scales included (Gemma
    multiplies by 1 + scale); built abstractly and filled from numpy (no per-shape
    compiles of initializers)."""
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray(rng.normal(size=x.shape) * 0.3, x.dtype) for x in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


REF_LEN = 24  # every prompt + completion fits: one compile of tunix's forward


_FORWARDS: dict[Any, Any] = {}


def _tunix_forward(model: Any) -> Any:
    """tunix's forward as one jitted function of the module's split state, per module
    structure (nnx.jit would write new arrays back into the module, which
    KvpageRollout then takes for a trainer's update)."""
    graphdef, _ = nnx.split(model)
    key = (type(model), id(model.config))
    if key not in _FORWARDS:

        @jax.jit
        def forward(state: Any, tokens: jax.Array) -> jax.Array:
            n = tokens.shape[1]
            mask = jnp.tril(jnp.ones((1, n, n), jnp.bool_))
            logits, _ = nnx.merge(graphdef, state)(
                tokens, jnp.arange(n, dtype=jnp.int32)[None], None, mask
            )
            return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)

        _FORWARDS[key] = forward
    return _FORWARDS[key]


def tunix_logprobs(model: Any, ids: list[int]) -> np.ndarray:
    """log-softmax ``[len(ids), vocab]`` of tunix's own forward pass over the whole
    sequence (no cache and no left padding, so positions and cache slots agree; the
    right padding up to :data:`REF_LEN` is after every scored position)."""
    tokens = np.zeros((1, REF_LEN), np.int32)
    tokens[0, : len(ids)] = ids
    forward = _tunix_forward(model)
    return np.asarray(forward(nnx.state(model), jnp.asarray(tokens)))[: len(ids)]


def check_against_tunix(model: Any, arch: str) -> None:
    tok = ByteTokenizer()
    ours = KvpageRollout(rollout_actor=model, tokenizer=tok, mesh=None, rollout_config=ROLLOUT,
                         compilation_cache_dir="none")
    config = ours.model_config
    assert config.architecture == arch
    assert config.sliding_window == WINDOW and config.layer_types
    assert ours.llm.engine.runner.last_update_copies == 0
    state = nnx.state(model, nnx.Param)
    held = {id(x) for x in jax.tree.leaves(ours.llm.engine.runner.params)}
    assert all(id(x) in held for x in jax.tree.leaves(state))  # every array, as it is

    greedy = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, temperature=1e-6, max_prompt_length=16, kv_cache_size=64,
    )
    a = ours.generate(GEMMA_PROMPTS, greedy)
    sampled = ours.generate(GEMMA_PROMPTS, ROLLOUT)  # temperature 1: raw logprobs
    prompts = jnp.asarray(a.left_padded_prompt_tokens)
    scored = np.asarray(ours.get_per_token_logps(prompts, padded(a.tokens, 8)))
    for r, text in enumerate(GEMMA_PROMPTS):
        prompt = ours._tokenize(text).tolist()
        assert len(prompt) > WINDOW
        # greedy: each token is the argmax of tunix's logits after the tokens before it
        completion = a.tokens[r].tolist()
        assert len(completion) == 8
        ref = tunix_logprobs(model, prompt + completion)[len(prompt) - 1 : -1]
        assert completion == ref.argmax(-1).tolist()
        np.testing.assert_allclose(
            scored[r], ref[np.arange(8), completion], atol=1e-4, rtol=0
        )
        # decode-path logprobs of a temperature-1 sample
        completion = sampled.tokens[r].tolist()
        ref = tunix_logprobs(model, prompt + completion)[len(prompt) - 1 : -1]
        np.testing.assert_allclose(
            sampled.logprobs[r], ref[np.arange(len(completion)), completion], atol=1e-4,
            rtol=0,
        )
    # a sync from the trainer: the very arrays, nothing recompiles
    other = random_module(type(model), model.config, 5)
    compiles = ours.llm.engine.runner.executables.num_compilations
    ours.update_params(nnx.state(other, nnx.Param))
    assert ours.llm.engine.runner.last_update_copies == 0
    b = ours.generate(GEMMA_PROMPTS, greedy)  # the shapes above: nothing recompiles
    assert ours.llm.engine.runner.executables.num_compilations == compiles
    prompt = ours._tokenize(GEMMA_PROMPTS[0]).tolist()
    completion = b.tokens[0].tolist()
    ref = tunix_logprobs(other, prompt + completion)[len(prompt) - 1 : -1]
    assert completion == ref.argmax(-1).tolist()


def test_gemma2_module_matches_tunix() -> None:
    """Sliding and full layers, both soft-caps, sandwich norms, GQA through
    q_einsum / kv_einsum views."""
    check_against_tunix(gemma2_model(3), "Gemma2ForCausalLM")


def test_gemma3_module_matches_tunix() -> None:
    """Five sliding layers and a full one with their own RoPE (linear factor 2 on the
    full one), q/k norms, the embed_dim / num_heads query scale, one qkv_einsum."""
    check_against_tunix(gemma3_model(4), "Gemma3ForCausalLM")


def test_gemma_configs_and_tables() -> None:
    g2 = gemma2_model(1)
    assert tunix_layout.tunix_architecture(g2) == "gemma2"
    c2 = tunix_layout.config_from_tunix(g2.config, architecture="gemma2", dtype=jnp.float32)
    assert c2.layer_types == ("sliding_attention", "full_attention")
    assert (c2.attn_logit_softcap, c2.final_logit_softcap) == (5.0, 3.0)
    assert c2.query_scale == 16**-0.5 and c2.rms_norm_eps == 1e-6 and c2.norm_offset == 1.0
    assert c2.embedding_multiplier == 8.0 and c2.tie_word_embeddings and c2.sandwich_norms
    params = tunix_layout.params_from_tunix(nnx.state(g2, nnx.Param), c2)
    k = params["layers"][0]["self_attn"]["k_proj"]["weight"]
    v = params["layers"][0]["self_attn"]["v_proj"]["weight"]
    kv = g2.layers[0].attn.kv_einsum.w.get_value()
    assert k.kernel is kv and v.kernel is kv and (k.index, v.index) == (0, 1)
    assert k.shape == (c2.kv_size, c2.hidden_size)

    g1 = random_module(gemma.Gemma, gemma.ModelConfig(
        num_layers=2, num_embed=272, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
        num_kv_heads=4, final_logit_softcap=None, use_post_attn_norm=False,
        use_post_ffw_norm=False, attention_types=(gemma.AttentionType.GLOBAL,) * 2,
    ), 0)
    assert tunix_layout.tunix_architecture(g1) == "gemma"
    c1 = tunix_layout.config_from_tunix(g1.config, architecture="gemma")
    assert c1.architecture == "GemmaForCausalLM" and not c1.layer_types
    assert not c1.sandwich_norms and c1.final_logit_softcap is None
    p1 = tunix_layout.params_from_tunix(nnx.state(g1, nnx.Param), c1)
    assert p1["layers"][1]["self_attn"]["v_proj"]["weight"].kernel is (
        g1.layers[1].attn.qkv_einsum.w.get_value())
    assert p1["layers"][1]["post_attention_layernorm"]["weight"] is (
        g1.layers[1].pre_ffw_norm.scale.get_value())

    g3 = gemma3_model(2)
    assert tunix_layout.tunix_architecture(g3) == "gemma3"
    c3 = tunix_layout.config_from_tunix(g3.config, architecture="gemma3")
    assert c3.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert c3.rope.theta == 100_000 and c3.rope.rope_type == "linear" and c3.rope.factor == 2.0
    assert c3.rope_local is not None and c3.rope_local.theta == 10_000
    assert c3.rope_local.rope_type == "default"
    assert c3.query_scale == 16**-0.5 and c3.qk_norm and c3.dtype == "float32"
    vision = gemma3.ModelConfig(num_layers=1, num_embed=8, embed_dim=8, hidden_dim=8,
                                num_heads=1, head_dim=8, num_kv_heads=1,
                                sliding_window_size=4, vision_config=object())
    with pytest.raises(ValueError, match="vision encoder"):
        tunix_layout.config_from_tunix(vision, architecture="gemma3")


def test_transposed_weight_head_first_views() -> None:
    """``in_start`` / ``index`` views multiply as the explicit ``[out, in]`` matrix."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)  # [heads, in, head_dim]
    w = TransposedWeight(q, 1, in_start=1)
    dense = np.transpose(np.asarray(q), (0, 2, 1)).reshape(12, 5)  # [heads * head_dim, in]
    assert w.shape == (12, 5) and not w.plain
    np.testing.assert_allclose(np.asarray(w.as_in_out()), dense.T)
    kv = jnp.asarray(rng.normal(size=(2, 3, 5, 4)), jnp.float32)
    v = TransposedWeight(kv, 1, in_start=1, index=1)
    assert v.shape == (12, 5) and v.nbytes == kv.nbytes // 2
    np.testing.assert_allclose(
        np.asarray(v.as_in_out()),
        np.transpose(np.asarray(kv)[1], (0, 2, 1)).reshape(12, 5).T,
    )
    leaves, treedef = jax.tree.flatten(v)
    assert leaves == [kv]
    again = jax.tree.unflatten(treedef, leaves)
    assert (again.in_axes, again.in_start, again.index) == (1, 1, 1)
    assert v.with_kernel(kv * 2).index == 1
    assert TransposedWeight(q, 1).plain
    with pytest.raises(ValueError, match="index 2"):
        TransposedWeight(kv, 1, in_start=1, index=2)
    with pytest.raises(ValueError, match="no output axes"):
        TransposedWeight(jnp.zeros((4, 4)), 1, in_start=2)
