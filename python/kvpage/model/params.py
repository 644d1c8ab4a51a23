"""The parameter pytree: its documented layout, HF-name mapping, validation and casting.

Layout (nested plain dicts of arrays; names are the HF tensor names with the
``model.`` prefix dropped and every ``.`` turned into one nesting level)::

    params = {
        "embed_tokens": {"weight": [vocab, hidden]},
        "layers": [                                    # one dict per layer, or see below
            {
                "input_layernorm": {"weight": [hidden]},
                "self_attn": {
                    "q_proj": {"weight": [heads * head_dim, hidden], "bias": [heads * head_dim]},
                    "k_proj": {"weight": [kv_heads * head_dim, hidden], "bias": [...]},
                    "v_proj": {"weight": [kv_heads * head_dim, hidden], "bias": [...]},
                    "o_proj": {"weight": [hidden, heads * head_dim]},   # "bias" if o_proj_bias
                    "q_norm": {"weight": [head_dim]},                 # Qwen3 only
                    "k_norm": {"weight": [head_dim]},                 # Qwen3 only
                },
                "post_attention_layernorm": {"weight": [hidden]},
                "mlp": {
                    "gate_proj": {"weight": [intermediate, hidden]},
                    "up_proj": {"weight": [intermediate, hidden]},
                    "down_proj": {"weight": [hidden, intermediate]},
                },
            },
            ...
        ],
        "norm": {"weight": [hidden]},
        "lm_head": {"weight": [vocab, hidden]},        # absent when embeddings are tied
    }

Linear weights keep the HF/PyTorch ``[out_features, in_features]`` orientation
(``y = x @ W.T + b``), so an HF checkpoint loads by renaming only. Biases exist only
where the config asks for them (``qkv_bias``, ``o_proj_bias``, ``mlp_bias``).

``layers`` may instead be a single dict of the same per-layer structure whose leaves
carry a leading ``num_layers`` axis (the "stacked" layout that scan-based JAX training
code produces); the decoder accepts both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.config import ModelConfig
from kvpage.model.errors import CheckpointError
from kvpage.model.transposed_weight import is_transposed
from kvpage.quant.weights import is_quantized

Params = dict[str, Any]
Path_ = tuple[str | int, ...]

_DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def jnp_dtype(name: str) -> Any:
    """The jax dtype for a config dtype name (float32 / bfloat16 / float16)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}; supported: {', '.join(_DTYPES)}"
        ) from None


def _attention_spec(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = config.hidden_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    spec: dict[str, tuple[int, ...]] = {}
    for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        spec[f"self_attn.{name}.weight"] = (out, h)
        if config.qkv_bias:
            spec[f"self_attn.{name}.bias"] = (out,)
    spec["self_attn.o_proj.weight"] = (h, q)
    if config.o_proj_bias:
        spec["self_attn.o_proj.bias"] = (h,)
    if config.attention_sinks:
        spec["self_attn.sinks"] = (config.num_heads,)
    if config.qk_norm:
        per_head = config.qk_norm_over == "head"
        spec["self_attn.q_norm.weight"] = (d,) if per_head else (q,)
        spec["self_attn.k_norm.weight"] = (d,) if per_head else (kv,)
    return spec


def _gated_mlp_spec(prefix: str, hidden: int, inter: int, bias: bool
                    ) -> dict[str, tuple[int, ...]]:
    spec: dict[str, tuple[int, ...]] = {}
    for name, out, inp in (
        ("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)
    ):
        spec[f"{prefix}.{name}.weight"] = (out, inp)
        if bias:
            spec[f"{prefix}.{name}.bias"] = (out,)
    return spec


def _moe_spec(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    moe = config.moe
    assert moe is not None
    h, e, inter = config.hidden_size, moe.num_experts, moe.intermediate_size
    spec: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (e, h)}
    if moe.router_bias:
        spec["mlp.gate.bias"] = (e,)
    for name, out, inp in (("gate_proj", inter, h), ("up_proj", inter, h),
                           ("down_proj", h, inter)):
        spec[f"mlp.experts.{name}.weight"] = (e, out, inp)
        if moe.expert_bias:
            spec[f"mlp.experts.{name}.bias"] = (e, out)
    if moe.shared_expert_intermediate_size:
        spec.update(_gated_mlp_spec(
            "mlp.shared_expert", h, moe.shared_expert_intermediate_size, False
        ))
        if moe.shared_expert_gate:
            spec["mlp.shared_expert_gate.weight"] = (1, h)
    return spec


def layer_spec(config: ModelConfig, index: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of decoder layer ``index``'s tensors, keyed by the name inside the layer."""
    h = config.hidden_size
    spec: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
    spec.update(_attention_spec(config))
    spec["post_attention_layernorm.weight"] = (h,)
    if config.sandwich_norms:
        spec["pre_feedforward_layernorm.weight"] = (h,)
        spec["post_feedforward_layernorm.weight"] = (h,)
    if config.is_moe_layer(index):
        spec.update(_moe_spec(config))
    else:
        spec.update(_gated_mlp_spec("mlp", h, config.intermediate_size, config.mlp_bias))
    return spec


def uniform_layers(config: ModelConfig) -> bool:
    """Whether every layer has the same tensors (required by the stacked layout)."""
    return config.moe is None or not config.moe.dense_layers


def param_spec(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs: HF checkpoint name -> shape, in a stable order."""
    spec: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size)
    }
    for i in range(config.num_layers):
        for name, shape in layer_spec(config, i).items():
            spec[f"model.layers.{i}.{name}"] = shape
    spec["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        spec["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return spec


def hf_name_to_path(name: str) -> Path_:
    """``model.layers.3.mlp.up_proj.weight`` -> ``("layers", 3, "mlp", "up_proj", "weight")``."""
    parts = name.removeprefix("model.").split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def tree_from_flat(config: ModelConfig, tensors: Mapping[str, Any]) -> Params:
    """Nest a flat ``{hf_name: array}`` mapping (exactly :func:`param_spec`'s names)."""
    params: Params = {"layers": [{} for _ in range(config.num_layers)]}
    for name, value in tensors.items():
        path = hf_name_to_path(name)
        node: Any = params
        for key in path[:-1]:
            if isinstance(key, int):
                node = node[key]
            else:
                node = node.setdefault(key, {})
        node[path[-1]] = value
    return params


def iter_leaves(config: ModelConfig, params: Params) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    """Yield ``(hf_name, array_or_None, expected_shape)`` for every tensor of the model.

    Works for both the list-of-layers and the stacked-layers layout (for the stacked one
    the expected shape includes the leading ``num_layers`` axis and the name uses
    ``layers.*``).
    """
    top = {k: v for k, v in param_spec(config).items() if not k.startswith("model.layers.")}
    for name, shape in top.items():
        yield name, _lookup(params, hf_name_to_path(name)), shape
    layers = params.get("layers") if isinstance(params, Mapping) else None
    if isinstance(layers, Mapping):
        if not uniform_layers(config):
            raise CheckpointError("the stacked layers layout needs layers of one structure; "
                                  "this model mixes dense and MoE layers (use a list)")
        for name, shape in layer_spec(config).items():
            value = _lookup(layers, hf_name_to_path(name))
            yield f"model.layers.*.{name}", value, (config.num_layers, *shape)
        return
    for i in range(config.num_layers):
        layer = layers[i] if isinstance(layers, list | tuple) and i < len(layers) else None
        for name, shape in layer_spec(config, i).items():
            value = None if layer is None else _lookup(layer, hf_name_to_path(name))
            yield f"model.layers.{i}.{name}", value, shape


def _lookup(tree: Any, path: Path_) -> Any:
    node = tree
    for key in path:
        if isinstance(key, int):
            if not isinstance(node, list | tuple) or key >= len(node):
                return None
            node = node[key]
        else:
            if not isinstance(node, Mapping) or key not in node:
                return None
            node = node[key]
    return node


def is_weight_node(leaf: Any) -> bool:
    """Whether a params-tree node is one tensor made of several children or of a
    reshaped one (:class:`~kvpage.quant.QuantizedWeight`,
    :class:`~kvpage.model.transposed_weight.TransposedWeight`)."""
    return is_quantized(leaf) or is_transposed(leaf)


def _count_leaves(params: Params) -> int:
    """Tensors in the tree (a quantized or transposed weight is one)."""
    return len(jax.tree_util.tree_leaves(params, is_leaf=is_weight_node))


def validate_params(config: ModelConfig, params: Params) -> None:
    """Raise :class:`CheckpointError` naming every missing, misshapen or unexpected tensor."""
    if not isinstance(params, Mapping):
        raise CheckpointError(f"params must be a dict, got {type(params).__name__}")
    layers = params.get("layers")
    if isinstance(layers, list | tuple) and len(layers) != config.num_layers:
        raise CheckpointError(
            f"params have {len(layers)} layers, config expects {config.num_layers}"
        )
    missing, wrong = [], []
    expected = 0
    for name, value, shape in iter_leaves(config, params):
        expected += 1
        if value is None:
            missing.append(name)
        elif tuple(np.shape(value)) != shape:
            wrong.append(f"{name}: got {tuple(np.shape(value))}, expected {shape}")
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}" + (
            f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong[:8])}")
    if not problems and _count_leaves(params) != expected:
        known = {id(v) for _, v, _ in iter_leaves(config, params)}
        extra = [
            jax.tree_util.keystr(path)
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                params, is_leaf=is_weight_node
            )[0]
            if id(leaf) not in known
        ]
        problems.append(f"unexpected tensors: {', '.join(extra[:8]) or '(repeated leaves)'}")
    if problems:
        raise CheckpointError("invalid parameter tree: " + " | ".join(problems))


def cast_params(params: Params, dtype: str | None, device: jax.Device | None = None) -> Params:
    """Put every leaf on ``device`` as a jax array of ``dtype`` (None keeps each leaf's
    dtype). A :class:`~kvpage.quant.QuantizedWeight` keeps its stored arrays; a
    :class:`~kvpage.model.transposed_weight.TransposedWeight` casts its kernel."""
    target = None if dtype is None else jnp_dtype(dtype)

    def convert(x: Any) -> Any:
        if is_quantized(x):
            return jax.device_put(x, device) if device is not None else x
        if is_transposed(x):
            return x.with_kernel(convert(x.kernel))
        arr = jnp.asarray(x) if not isinstance(x, jax.Array) else x
        if target is not None and arr.dtype != target:
            arr = arr.astype(target)
        return jax.device_put(arr, device) if device is not None else arr

    return jax.tree_util.tree_map(convert, params, is_leaf=is_weight_node)


def check_same_layout(old: Params, new: Params) -> None:
    """ValueError naming the first difference when ``new`` does not have ``old``'s tree
    structure, shapes and dtypes (what a live weight swap requires)."""
    old_def = jax.tree_util.tree_structure(old)
    new_def = jax.tree_util.tree_structure(new)
    if old_def != new_def:
        raise ValueError(
            f"new params have a different tree structure: expected {old_def}, got {new_def}"
        )
    for (path, old_leaf), new_leaf in zip(
        jax.tree_util.tree_leaves_with_path(old), jax.tree_util.tree_leaves(new), strict=True
    ):
        shape, dtype = tuple(np.shape(new_leaf)), jnp.dtype(new_leaf.dtype)
        if old_leaf.shape != shape or old_leaf.dtype != dtype:
            raise ValueError(
                f"new params change {jax.tree_util.keystr(path)} from "
                f"{old_leaf.shape} {old_leaf.dtype} to {shape} {dtype}"
            )
