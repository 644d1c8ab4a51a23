"""The declared mapping from tunix's decoder modules to kvpage's params tree.

Owns :func:`params_from_tunix` and :func:`config_from_tunix`. tunix (Google's JAX RL
library) keeps its Llama 3 / Qwen 2 / Qwen 3 (dense) weights as Flax NNX parameters in
its own layout: projections are einsum kernels ``[in..., out...]`` (``q_proj.w
[hidden, heads, head_dim]``, ``o_proj.w [heads, head_dim, hidden]``, ``nnx.Linear``
kernels ``[in, out]``). Each becomes a :class:`~kvpage.model.transposed_weight.
TransposedWeight` around the trainer's own array, and every other tensor (embedding,
norms, biases) is used as it is, so the tree this returns holds **no copy**: a sync
is a tree of references, and the engine multiplies the kernels where they lie.

The mapping is a table (:data:`LAYER_MAP`): kvpage's path of a tensor, the tunix path
it comes from, and how many leading axes of the kernel are input axes (None: not a
kernel). Nothing here imports tunix or flax: a ``nnx.State`` (or any nested mapping of
arrays or NNX variables) is read by key.

Invariant: every tensor :func:`kvpage.model.params.param_spec` names is mapped exactly
once (``validate_params`` checks the shapes when the engine takes the tree).
"""

from __future__ import annotations

from typing import Any

from kvpage.model.config import ModelConfig, RopeConfig
from kvpage.model.params import Params
from kvpage.model.transposed_weight import TransposedWeight

# kvpage path within a layer -> (tunix path within a layer, input axes of the kernel).
LAYER_MAP: dict[tuple[str, ...], tuple[tuple[str, ...], int | None]] = {
    ("input_layernorm", "weight"): (("input_layernorm", "w"), None),
    ("post_attention_layernorm", "weight"): (("post_attention_layernorm", "w"), None),
    ("self_attn", "q_proj", "weight"): (("attn", "q_proj", "w"), 1),
    ("self_attn", "k_proj", "weight"): (("attn", "k_proj", "w"), 1),
    ("self_attn", "v_proj", "weight"): (("attn", "v_proj", "w"), 1),
    ("self_attn", "o_proj", "weight"): (("attn", "o_proj", "w"), 2),
    ("mlp", "gate_proj", "weight"): (("mlp", "gate_proj", "kernel"), 1),
    ("mlp", "up_proj", "weight"): (("mlp", "up_proj", "kernel"), 1),
    ("mlp", "down_proj", "weight"): (("mlp", "down_proj", "kernel"), 1),
}
QKV_BIAS_MAP: dict[tuple[str, ...], tuple[str, ...]] = {  # Qwen 2
    ("self_attn", "q_proj", "bias"): ("attn", "q_bias"),
    ("self_attn", "k_proj", "bias"): ("attn", "k_bias"),
    ("self_attn", "v_proj", "bias"): ("attn", "v_bias"),
}
QK_NORM_MAP: dict[tuple[str, ...], tuple[str, ...]] = {  # Qwen 3
    ("self_attn", "q_norm", "weight"): ("attn", "q_norm", "w"),
    ("self_attn", "k_norm", "weight"): ("attn", "k_norm", "w"),
}

TUNIX_FIXED_ROPE_THETA = 1_000_000.0
"""The RoPE base tunix 0.1.7's Llama 3 and Qwen 3 modules apply whatever their config
says (their ``apply_rope`` is called without ``rope_theta``; Qwen 2's passes it).
kvpage mirrors what the trainer's model computes, so rollouts sample from the policy
being trained. A model trained with another base (SmolLM2: 1e5) needs tunix's
``apply_rope`` patched to its base and ``KvpageRollout(..., rope_theta=...)``."""


def _array(node: Any) -> Any:
    """The array of an NNX variable (or the node itself if it is an array)."""
    if hasattr(node, "get_value"):
        return node.get_value()
    if hasattr(node, "value") and not hasattr(node, "shape"):
        return node.value
    return node


def _get(tree: Any, path: tuple[Any, ...], where: str) -> Any:
    node = tree
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError) as e:
            raise KeyError(f"tunix parameter {where}{'.'.join(map(str, path))} not found") from e
    return _array(node)


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def params_from_tunix(state: Any, config: ModelConfig) -> Params:
    """kvpage's params tree over the arrays of tunix model ``state`` (``nnx.state(model,
    nnx.Param)``): no array is copied or transposed."""
    layers_state = state["layers"]
    layers: list[dict[str, Any]] = []
    for i in range(config.num_layers):
        src = layers_state[i]
        layer: dict[str, Any] = {}
        for dst, (path, in_axes) in LAYER_MAP.items():
            value = _get(src, path, f"layers.{i}.")
            _set(layer, dst, value if in_axes is None else TransposedWeight(value, in_axes))
        if config.qkv_bias:
            for dst, path in QKV_BIAS_MAP.items():
                _set(layer, dst, _get(src, path, f"layers.{i}."))
        if config.qk_norm:
            for dst, path in QK_NORM_MAP.items():
                _set(layer, dst, _get(src, path, f"layers.{i}."))
        layers.append(layer)
    params: Params = {
        "embed_tokens": {"weight": _get(state, ("embedder", "input_embedding"), "")},
        "layers": layers,
        "norm": {"weight": _get(state, ("final_norm", "w"), "")},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = {"weight": TransposedWeight(_get(state, ("lm_head", "w"), ""), 1)}
    return params


def config_from_tunix(
    model_config: Any,
    *,
    architecture: str,
    rope_theta: float | None = None,
    eos_token_ids: tuple[int, ...] = (),
    max_position_embeddings: int = 4096,
) -> ModelConfig:
    """kvpage's :class:`ModelConfig` of a tunix ``ModelConfig`` (Llama 3, Qwen 2 or
    Qwen 3 dense). ``rope_theta`` overrides the base the tunix module applies."""
    arch = architecture.lower()
    if arch not in ("llama3", "qwen2", "qwen3"):
        raise ValueError(
            f"no kvpage mapping for tunix model {architecture!r}; known: llama3, qwen2, qwen3"
        )
    c = model_config
    if getattr(c, "num_experts", None):
        raise ValueError("tunix mixture-of-experts models have no kvpage mapping")
    if rope_theta is None:
        rope_theta = TUNIX_FIXED_ROPE_THETA if arch != "qwen2" else float(c.rope_theta)
    dtype = getattr(c, "param_dtype", None) or getattr(c, "dtype", None) or "float32"
    return ModelConfig(
        architecture={"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}[arch],
        vocab_size=int(c.vocab_size),
        hidden_size=int(c.embed_dim),
        intermediate_size=int(c.hidden_dim),
        num_layers=int(c.num_layers),
        num_heads=int(c.num_heads),
        num_kv_heads=int(c.num_kv_heads),
        head_dim=int(c.head_dim),
        rms_norm_eps=float(c.norm_eps),
        rope=RopeConfig(theta=float(rope_theta)),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "weight_tying", False)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        dtype=_dtype_name(dtype),
        eos_token_ids=tuple(eos_token_ids),
    )


def _dtype_name(dtype: Any) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def tunix_architecture(model: Any) -> str:
    """``llama3``, ``qwen2`` or ``qwen3`` from a tunix model object's module path."""
    module = type(model).__module__
    for arch in ("llama3", "qwen2", "qwen3"):
        if f".{arch}." in f".{module}.":
            return arch
    raise ValueError(f"no kvpage mapping for tunix model class {type(model).__qualname__} "
                     f"({module}); known: llama3, qwen2, qwen3")



def tunix_arrays_from_params(config: ModelConfig, params: Params) -> dict[str, Any]:
    """The inverse direction, for loading: kvpage's HF-layout ``params`` rearranged as
    tunix's modules keep them (a nested dict of new arrays for ``nnx.update``; plain
    ``[out, in]`` arrays only). Used to put a checkpoint kvpage can read (a GGUF file,
    say) into a tunix model."""
    import jax.numpy as jnp
    import numpy as np

    def kernel(weight: Any, shape: tuple[int, ...]) -> Any:
        return jnp.asarray(np.ascontiguousarray(np.asarray(weight).T).reshape(shape))

    def walk(tree: Any, path: tuple[str, ...]) -> Any:
        for key in path:
            tree = tree[key]
        return tree

    h, n, k, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    f = config.intermediate_size
    shapes = {
        ("self_attn", "q_proj", "weight"): (h, n, d),
        ("self_attn", "k_proj", "weight"): (h, k, d),
        ("self_attn", "v_proj", "weight"): (h, k, d),
        ("self_attn", "o_proj", "weight"): (n, d, h),
        ("mlp", "gate_proj", "weight"): (h, f),
        ("mlp", "up_proj", "weight"): (h, f),
        ("mlp", "down_proj", "weight"): (f, h),
    }
    extra = {**(QKV_BIAS_MAP if config.qkv_bias else {}), **(QK_NORM_MAP if config.qk_norm else {})}
    layers: dict[int, Any] = {}
    for i, layer in enumerate(params["layers"]):
        out: dict[str, Any] = {}
        for src, (path, in_axes) in LAYER_MAP.items():
            value = walk(layer, src)
            _set(out, path, value if in_axes is None else kernel(value, shapes[src]))
        for src, path in extra.items():
            _set(out, path, walk(layer, src))
        layers[i] = out
    state: dict[str, Any] = {
        "embedder": {"input_embedding": params["embed_tokens"]["weight"]},
        "layers": layers,
        "final_norm": {"w": params["norm"]["weight"]},
    }
    if not config.tie_word_embeddings:
        state["lm_head"] = {"w": kernel(params["lm_head"]["weight"], (h, config.vocab_size))}
    return state
