"""The declared mapping from tunix's decoder modules to kvpage's params tree.

Owns :func:`params_from_tunix` and :func:`config_from_tunix`. tunix (Google's JAX RL
library) keeps its Llama 3 / Qwen 2 / Qwen 3 (dense) and Gemma / Gemma 2 / Gemma 3
(text) weights as Flax NNX parameters in its own layout: projections are einsum kernels
``[in..., out...]`` (``q_proj.w [hidden, heads, head_dim]``, ``o_proj.w [heads,
head_dim, hidden]``, ``nnx.Linear`` kernels ``[in, out]``). Each becomes a
:class:`~kvpage.model.transposed_weight.TransposedWeight` around the trainer's own
array, and every other tensor (embedding, norms, biases) is used as it is, so the tree
this returns holds **no copy**: a sync is a tree of references, and the engine
multiplies the kernels where they lie.

Gemma's query/key/value kernels put the heads first: ``q_einsum.w [heads, hidden,
head_dim]``, ``kv_einsum.w [2, kv_heads, hidden, head_dim]`` (keys, values) or, when
every head has its own KV, ``qkv_einsum.w [3, heads, hidden, head_dim]``. Those are
views too (:class:`Kernel`: ``in_start=1``, ``entry`` the one of the stacked kernel):
the K and V weights are two views of the one ``kv_einsum`` array. Their input axis is
not leading, so each step transposes them where it multiplies (XLA's choice), the price
of holding the trainer's buffer itself instead of a second, transposed copy per sync.

The mapping is a set of tables (:data:`LAYER_MAP` for Llama / Qwen; :data:`GEMMA_NORMS`,
:data:`GEMMA_Q_KV` or :data:`GEMMA_QKV`, :data:`GEMMA_MLP_O` and :data:`GEMMA_TOP` for
Gemma): kvpage's path of a tensor, the tunix path it comes from, and how the kernel's
axes read (an int: that many leading input axes; a :class:`Kernel`; None: not
a kernel). Nothing here imports tunix or flax: a ``nnx.State`` (or any nested mapping of
arrays or NNX variables) is read by key.

Invariant: every tensor :func:`kvpage.model.params.param_spec` names is mapped exactly
once (``validate_params`` checks the shapes when the engine takes the tree).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from kvpage.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
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

class Kernel(NamedTuple):
    """How a tunix kernel reads as an ``[out, in]`` weight: ``in_axes`` input axes from
    axis ``in_start`` on, of entry ``entry`` of a stacked kernel (None: not stacked);
    :class:`TransposedWeight`'s ``in_axes``, ``in_start`` and ``index``."""

    in_axes: int = 1
    in_start: int = 0
    entry: int | None = None


LayerTable = dict[tuple[str, ...], tuple[tuple[str, ...], "int | Kernel | None"]]

# tunix.models.gemma (Gemma 1 and 2) and tunix.models.gemma3 (Gemma 3, text). Norms
# hold Gemma's ``scale`` (the model multiplies by ``1 + scale``: ``norm_offset=1``).
GEMMA_MLP_O: LayerTable = {
    ("self_attn", "o_proj", "weight"): (("attn", "attn_vec_einsum", "w"), 2),
    ("mlp", "gate_proj", "weight"): (("mlp", "gate_proj", "kernel"), 1),
    ("mlp", "up_proj", "weight"): (("mlp", "up_proj", "kernel"), 1),
    ("mlp", "down_proj", "weight"): (("mlp", "down_proj", "kernel"), 1),
}
GEMMA_Q_KV: LayerTable = {  # num_heads != num_kv_heads: q_einsum + kv_einsum
    ("self_attn", "q_proj", "weight"): (("attn", "q_einsum", "w"), Kernel(1, 1)),
    ("self_attn", "k_proj", "weight"): (("attn", "kv_einsum", "w"), Kernel(1, 1, 0)),
    ("self_attn", "v_proj", "weight"): (("attn", "kv_einsum", "w"), Kernel(1, 1, 1)),
}
GEMMA_QKV: LayerTable = {  # num_heads == num_kv_heads: one qkv_einsum
    ("self_attn", "q_proj", "weight"): (("attn", "qkv_einsum", "w"), Kernel(1, 1, 0)),
    ("self_attn", "k_proj", "weight"): (("attn", "qkv_einsum", "w"), Kernel(1, 1, 1)),
    ("self_attn", "v_proj", "weight"): (("attn", "qkv_einsum", "w"), Kernel(1, 1, 2)),
}
GEMMA_NORMS: dict[str, LayerTable] = {
    "GemmaForCausalLM": {  # no sandwich: pre_ffw_norm is the Llama layout's pre-MLP norm
        ("input_layernorm", "weight"): (("pre_attention_norm", "scale"), None),
        ("post_attention_layernorm", "weight"): (("pre_ffw_norm", "scale"), None),
    },
    "Gemma2ForCausalLM": {
        ("input_layernorm", "weight"): (("pre_attention_norm", "scale"), None),
        ("post_attention_layernorm", "weight"): (("post_attn_norm", "scale"), None),
        ("pre_feedforward_layernorm", "weight"): (("pre_ffw_norm", "scale"), None),
        ("post_feedforward_layernorm", "weight"): (("post_ffw_norm", "scale"), None),
    },
    "Gemma3ForCausalLM": {
        ("input_layernorm", "weight"): (("pre_attention_norm", "scale"), None),
        ("post_attention_layernorm", "weight"): (("post_attention_norm", "scale"), None),
        ("pre_feedforward_layernorm", "weight"): (("pre_ffw_norm", "scale"), None),
        ("post_feedforward_layernorm", "weight"): (("post_ffw_norm", "scale"), None),
        ("self_attn", "q_norm", "weight"): (("attn", "_query_norm", "scale"), None),
        ("self_attn", "k_norm", "weight"): (("attn", "_key_norm", "scale"), None),
    },
}
GEMMA_ARCHITECTURES = tuple(GEMMA_NORMS)  # the kvpage architectures these tables serve
GEMMA_TOP: dict[tuple[str, ...], tuple[str, ...]] = {  # embeddings tied: no lm_head
    ("embed_tokens", "weight"): ("embedder", "input_embedding"),
    ("norm", "weight"): ("final_norm", "scale"),
}
GEMMA_EPS = 1e-6
"""tunix's Gemma RMSNorm epsilon (a constant in its modules, not a config field)."""
GEMMA3_PATTERN = 6
"""tunix's Gemma 3 layers cycle ``GEMMA3_ATTENTION_PATTERN``: five sliding, one full."""


def gemma_layer_map(config: ModelConfig) -> LayerTable:
    """The declared table of one Gemma layer of ``config`` (each kvpage tensor once)."""
    attn = GEMMA_QKV if config.num_heads == config.num_kv_heads else GEMMA_Q_KV
    return {**GEMMA_NORMS[config.architecture], **attn, **GEMMA_MLP_O}


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


def _weight(value: Any, layout: int | Kernel | None) -> Any:
    if layout is None:
        return value
    if isinstance(layout, int):
        return TransposedWeight(value, layout)
    return TransposedWeight(value, layout.in_axes, in_start=layout.in_start,
                            index=layout.entry)


def params_from_tunix(state: Any, config: ModelConfig) -> Params:
    """kvpage's params tree over the arrays of tunix model ``state`` (``nnx.state(model,
    nnx.Param)``): no array is copied or transposed."""
    if config.architecture in GEMMA_ARCHITECTURES:
        return _gemma_params(state, config)
    layers_state = state["layers"]
    layers: list[dict[str, Any]] = []
    for i in range(config.num_layers):
        src = layers_state[i]
        layer: dict[str, Any] = {}
        for dst, (path, in_axes) in LAYER_MAP.items():
            _set(layer, dst, _weight(_get(src, path, f"layers.{i}."), in_axes))
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


def _gemma_params(state: Any, config: ModelConfig) -> Params:
    table = gemma_layer_map(config)
    layers_state = state["layers"]
    layers: list[dict[str, Any]] = []
    for i in range(config.num_layers):
        layer: dict[str, Any] = {}
        for dst, (path, layout) in table.items():
            _set(layer, dst, _weight(_get(layers_state[i], path, f"layers.{i}."), layout))
        layers.append(layer)
    params: Params = {"layers": layers}
    for dst, path in GEMMA_TOP.items():
        _set(params, dst, _get(state, path, ""))
    return params


def config_from_tunix(
    model_config: Any,
    *,
    architecture: str,
    rope_theta: float | None = None,
    eos_token_ids: tuple[int, ...] = (),
    max_position_embeddings: int = 4096,
    dtype: Any = None,
) -> ModelConfig:
    """kvpage's :class:`ModelConfig` of a tunix ``ModelConfig`` (Llama 3, Qwen 2 or
    Qwen 3 dense; Gemma, Gemma 2 or Gemma 3 text). ``rope_theta`` overrides the base the
    tunix Llama / Qwen module applies; ``dtype`` (default: the config's ``param_dtype``,
    else float32) should be the dtype of the module's arrays."""
    arch = architecture.lower()
    if arch in ("gemma", "gemma2", "gemma3"):
        return _gemma_config(model_config, arch, eos_token_ids, max_position_embeddings,
                             dtype)
    if arch not in ("llama3", "qwen2", "qwen3"):
        raise ValueError(
            f"no kvpage mapping for tunix model {architecture!r}; known: {', '.join(KNOWN)}"
        )
    c = model_config
    if getattr(c, "num_experts", None):
        raise ValueError("tunix mixture-of-experts models have no kvpage mapping")
    if rope_theta is None:
        rope_theta = TUNIX_FIXED_ROPE_THETA if arch != "qwen2" else float(c.rope_theta)
    if dtype is None:
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


KNOWN = ("llama3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


def _rope(base: Any, scale: Any) -> RopeConfig:
    """tunix's Gemma RoPE: angles ``position / base ** (2i / head_dim) / scale``, which
    is kvpage's linear RoPE of factor ``scale`` (default RoPE when it is 1)."""
    scale = float(scale)
    if scale == 1.0:
        return RopeConfig(theta=float(base))
    return RopeConfig(theta=float(base), rope_type="linear", factor=scale)


def _gemma_config(c: Any, arch: str, eos_token_ids: tuple[int, ...],
                  max_position_embeddings: int, dtype: Any) -> ModelConfig:
    """tunix's Gemma modules as kvpage's Gemma architectures: norms ``1 + scale`` with
    eps 1e-6, tanh GELU, embeddings times ``sqrt(embed_dim)``, tied embeddings."""
    n = int(c.num_layers)
    hidden, heads, head_dim = int(c.embed_dim), int(c.num_heads), int(c.head_dim)
    fields: dict[str, Any] = {}
    if arch == "gemma3":
        if getattr(c, "vision_config", None) is not None:
            raise ValueError(
                "tunix Gemma 3 with a vision encoder (vision_config set) has no kvpage "
                "mapping: build the model text-only (text_only=True)"
            )
        types = tuple(
            FULL_ATTENTION if i % GEMMA3_PATTERN == GEMMA3_PATTERN - 1 else SLIDING_ATTENTION
            for i in range(n)
        )
        norm = getattr(getattr(c, "query_pre_attn_norm", None), "name",
                       "BY_ONE_OVER_SQRT_HEAD_DIM")
        if norm == "BY_ONE_OVER_SQRT_HEAD_DIM":
            query_scale = head_dim**-0.5
        elif norm == "BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS":
            query_scale = (hidden // heads) ** -0.5
        else:
            raise ValueError(f"unknown tunix query_pre_attn_norm {norm!r}")
        fields.update(
            architecture="Gemma3ForCausalLM",
            rope=_rope(c.global_base_frequency, c.global_scale_factor),
            rope_local=_rope(c.local_base_frequency, c.local_scale_factor),
            qk_norm=True,
            sandwich_norms=True,
        )
        if dtype is None:
            dtype = getattr(c, "param_dtype", None)
    else:
        post_attn, post_ffw = bool(c.use_post_attn_norm), bool(c.use_post_ffw_norm)
        if post_attn != post_ffw:
            raise ValueError(
                f"tunix Gemma with use_post_attn_norm={post_attn} and use_post_ffw_norm="
                f"{post_ffw} has no kvpage mapping (both or neither)"
            )
        kinds = [getattr(t, "name", str(t)) for t in c.attention_types][:n]
        if len(kinds) < n:  # tunix zips the layers with attention_types
            n = len(kinds)
        unknown = set(kinds) - {"GLOBAL", "LOCAL_SLIDING"}
        if unknown:
            raise ValueError(f"unknown tunix attention types {sorted(unknown)}")
        types = tuple(
            SLIDING_ATTENTION if k == "LOCAL_SLIDING" else FULL_ATTENTION for k in kinds
        )
        query_scale = head_dim**-0.5  # tunix's Gemma 1/2 module, whatever the model size
        fields.update(
            architecture="Gemma2ForCausalLM" if post_attn else "GemmaForCausalLM",
            rope=RopeConfig(theta=10_000.0),  # tunix's Gemma 1/2 apply_rope default
            sandwich_norms=post_attn,
            attn_logit_softcap=_optional_float(getattr(c, "attn_logits_soft_cap", None)),
            final_logit_softcap=_optional_float(getattr(c, "final_logit_softcap", None)),
        )
    window = getattr(c, "sliding_window_size", None)
    sliding = SLIDING_ATTENTION in types
    if sliding and window is None:
        raise ValueError("tunix Gemma sliding-window layers need sliding_window_size")
    return ModelConfig(
        vocab_size=int(c.num_embed),
        hidden_size=hidden,
        intermediate_size=int(c.hidden_dim),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(c.num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=GEMMA_EPS,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        norm_offset=1.0,
        hidden_act="gelu_tanh",
        embedding_multiplier=math.sqrt(hidden),
        query_scale=query_scale,
        layer_types=types if sliding else (),
        sliding_window=int(window) if sliding and window is not None else None,
        dtype=_dtype_name(dtype or "float32"),
        eos_token_ids=tuple(eos_token_ids),
        **fields,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _dtype_name(dtype: Any) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def tunix_architecture(model: Any) -> str:
    """``llama3``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2`` or ``gemma3`` from a tunix
    model object's module path (tunix's one ``gemma`` module serves Gemma 1 and 2: its
    config's ``use_post_attn_norm`` tells them apart). A class qwix derived from one
    (LoRA applied) maps as its base."""
    for cls in type(model).__mro__:
        module = f".{cls.__module__}."
        for arch in ("llama3", "qwen2", "qwen3", "gemma3"):
            if f".{arch}." in module:
                return arch
        if ".gemma." in module:
            config = getattr(model, "config", None)
            return "gemma2" if getattr(config, "use_post_attn_norm", False) else "gemma"
    raise ValueError(f"no kvpage mapping for tunix model class {type(model).__qualname__} "
                     f"({type(model).__module__}); known: {', '.join(KNOWN)}")


def tunix_arrays_from_params(config: ModelConfig, params: Params) -> dict[str, Any]:
    """The inverse direction, for loading: kvpage's HF-layout ``params`` rearranged as
    tunix's modules keep them (a nested dict of new arrays for ``nnx.update``; plain
    ``[out, in]`` arrays only). Used to put a checkpoint kvpage can read (a GGUF file,
    say) into a tunix model. Llama 3 / Qwen 2 / Qwen 3 layouts only (the Gemma layouts
    are not used by a loader)."""
    import jax.numpy as jnp
    import numpy as np

    if config.architecture in GEMMA_ARCHITECTURES:
        raise NotImplementedError("tunix_arrays_from_params covers Llama 3 / Qwen 2 / "
                                  "Qwen 3 layouts only")

    def kernel(weight: Any, shape: tuple[int, ...]) -> Any:
        return jnp.asarray(np.ascontiguousarray(np.asarray(weight).T).reshape(shape))

    def walk(tree: Any, path: tuple[str, ...]) -> Any:
        for key in path:
            tree = tree[key]
        return tree

    h, n, k, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    f = config.intermediate_size
    shapes: dict[tuple[str, ...], tuple[int, ...]] = {
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


def tunix_lora(state: Any, config: ModelConfig, scale: float = 1.0
               ) -> dict[tuple[int, str], tuple[Any, Any]]:
    """The LoRA pairs of a qwix-LoRA tunix Llama / Qwen ``state`` (``nnx.state(model,
    nnx.LoRAParam)``) in kvpage's layout: ``(layer, module) -> (A [r, in], B [out, r] *
    scale)`` (qwix multiplies by ``alpha / rank``, which the state does not hold). qwix
    names them after the kernel (``w_lora_a [in..., r]``, ``w_lora_b [r, out...]``;
    ``kernel_lora_*`` for the MLP). One device call reshapes them all; empty when the
    state has none."""
    if config.architecture in GEMMA_ARCHITECTURES:
        raise NotImplementedError("LoRA on tunix's Gemma modules is not mapped yet")
    raw: dict[tuple[int, str], tuple[Any, Any]] = {}
    layers = state["layers"] if "layers" in state else {}
    for i in range(config.num_layers if layers else 0):
        for dst, (path, _) in LAYER_MAP.items():
            try:
                node = _get(layers[i], path[:-1], f"layers.{i}.")
                a, b = node[path[-1] + "_lora_a"], node[path[-1] + "_lora_b"]
            except (KeyError, IndexError, TypeError):
                continue
            raw[(i, dst[1])] = (_array(a), _array(b))
    return _lora_to_kvpage(raw, scale) if raw else {}


def jax_jit_once(fn: Any) -> Any:
    """``jax.jit(fn)``, imported when first called (this module imports no JAX)."""
    jitted: list[Any] = []

    def call(*args: Any) -> Any:
        if not jitted:
            import jax

            jitted.append(jax.jit(fn))
        return jitted[0](*args)

    return call


@jax_jit_once
def _lora_to_kvpage(raw: dict[tuple[int, str], tuple[Any, Any]], scale: Any
                    ) -> dict[tuple[int, str], tuple[Any, Any]]:
    out = {}
    for key, (a, b) in raw.items():
        rank = a.shape[-1]
        out[key] = (a.reshape(-1, rank).T, b.reshape(rank, -1).T * scale)
    return out
