"""The MoE block's kernels agree: routed experts (gathered for a few rows, grouped with
``ragged_dot`` for many, the Rust host kernel inside a runner-style trace) against every
expert computed for every token, float and quantized weights, both routers, with a
shared expert."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model.config import ModelConfig, MoEConfig
from kvpage.model.linear_kernels import host_matmuls
from kvpage.model.moe import dense_moe_block, expert_matmul_nt, moe_block, route
from kvpage.quant.weights import QuantizedWeight

H, E, INTER = 64, 8, 32


def config(**moe: object) -> ModelConfig:
    return ModelConfig("Qwen3MoeForCausalLM", 64, H, 48, 1, 4, 2, 16, dtype="float32",
                       moe=MoEConfig(E, 2, INTER, **moe))  # type: ignore[arg-type]


def mlp_params(seed: int, shared: bool = False) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> jnp.ndarray:
        return jnp.asarray(rng.normal(0, 0.2, shape), jnp.float32)

    params = {"gate": {"weight": w(E, H)}, "experts": {
        "gate_proj": {"weight": w(E, INTER, H)}, "up_proj": {"weight": w(E, INTER, H)},
        "down_proj": {"weight": w(E, H, INTER)}}}
    if shared:
        params["shared_expert"] = {"gate_proj": {"weight": w(48, H)},
                                   "up_proj": {"weight": w(48, H)},
                                   "down_proj": {"weight": w(H, 48)}}
        params["shared_expert_gate"] = {"weight": w(1, H)}
    return params


@pytest.mark.parametrize("tokens", [1, 3, 40])  # gathered (N <= E) and grouped paths
@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax"])
def test_routed_equals_every_expert_computed(tokens: int, router: str) -> None:
    cfg = config(router=router, norm_topk_prob=router == "softmax_topk",
                 shared_expert_intermediate_size=48, shared_expert_gate=True)
    params = mlp_params(1, shared=True)
    x = jax.random.normal(jax.random.key(tokens), (tokens, H), jnp.float32)
    routed = jax.jit(lambda p, x: moe_block(cfg, p, x))(params, x)
    dense = jax.jit(lambda p, x: dense_moe_block(cfg, p, x))(params, x)
    np.testing.assert_allclose(routed, dense, atol=1e-5)
    ids, weights = route(cfg, params["gate"], x)
    assert ids.shape == (tokens, 2)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_dense_compute_switch_gives_the_same_outputs() -> None:
    cfg = config()
    dense_cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dense_compute=True))
    params = mlp_params(2)
    x = jax.random.normal(jax.random.key(0), (5, H), jnp.float32)
    np.testing.assert_allclose(moe_block(dense_cfg, params, x), moe_block(cfg, params, x),
                               atol=1e-5)


@pytest.mark.parametrize("rows", [4, 24])
def test_host_kernel_and_quantized_experts_match_xla(rows: int) -> None:
    """Inside a host-kernel trace (as the runner traces its steps) the Rust expert kernel
    reads float and Q8_0 experts; outside, XLA gathers or groups them: same products."""
    import gguf

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.2, (E, INTER, H)).astype(np.float32)
    blocks = gguf.quants.quantize(w.reshape(E * INTER, H), gguf.GGMLQuantizationType.Q8_0)
    qw = QuantizedWeight(blocks.reshape(E, INTER, -1), "q8_0", (E, INTER, H), jnp.float32)
    x = jnp.asarray(rng.normal(0, 1, (rows, H)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, E, rows), jnp.int32)
    for weight in (jnp.asarray(w), qw):
        xla = jax.jit(lambda x, ids, weight=weight: expert_matmul_nt(x, weight, ids))(x, ids)
        with host_matmuls():
            host = jax.jit(lambda x, ids, weight=weight: expert_matmul_nt(x, weight, ids))(
                x, ids)
        np.testing.assert_allclose(host, xla, atol=2e-2 if weight is qw else 1e-4)
    dequantized = np.einsum("ni,noi->no", np.asarray(x), np.asarray(qw.dequantize())[ids])
    np.testing.assert_allclose(xla, dequantized, atol=1e-4)


def _quantized_experts(seed: int) -> dict:
    """Q8_0 gate and up, Q4_0 down (formats may differ between gate/up and down)."""
    import gguf

    rng = np.random.default_rng(seed)

    def quantized(shape: tuple[int, int, int], kind: str) -> QuantizedWeight:
        w = rng.normal(0, 0.2, shape).astype(np.float32)
        blocks = gguf.quants.quantize(w.reshape(-1, shape[2]),
                                      getattr(gguf.GGMLQuantizationType, kind.upper()))
        return QuantizedWeight(blocks.reshape(*shape[:2], -1), kind, shape, jnp.float32)

    return {"gate_proj": {"weight": quantized((E, INTER, H), "q8_0")},
            "up_proj": {"weight": quantized((E, INTER, H), "q8_0")},
            "down_proj": {"weight": quantized((E, H, INTER), "q4_0")}}


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax"])
def test_one_host_call_matches_the_three_expert_calls(router: str, monkeypatch) -> None:
    """Quantized SwiGLU experts in a host-kernel trace run as one ``kvpage_expert_ffn``
    call (router, products, activation, weighted sum); it matches XLA's router and three
    expert calls, with a router bias and a shared expert, and padding tokens stay out."""
    from kvpage.model.linear_kernels import live_rows

    cfg = config(router=router, norm_topk_prob=router == "softmax_topk",
                 shared_expert_intermediate_size=48, shared_expert_gate=True)
    params = mlp_params(4, shared=True)
    params["experts"] = _quantized_experts(5)
    params["gate"]["bias"] = jnp.asarray(np.random.default_rng(6).normal(0, 0.3, E),
                                         jnp.float32)
    x = jax.random.normal(jax.random.key(7), (6, H), jnp.float32)

    def block(p: dict, x: jax.Array, live: jax.Array) -> jax.Array:
        with live_rows(x.shape[0], live):
            return moe_block(cfg, p, x)

    with host_matmuls():
        lowered = jax.jit(block).lower(params, x, jnp.int32(6)).as_text()
        one_call = jax.jit(block)(params, x, jnp.int32(6))
        padded = jax.jit(block)(params, x, jnp.int32(4))
    assert "kvpage_expert_ffn" in lowered
    monkeypatch.setenv("KVPAGE_MOE_ONE_CALL", "0")
    with host_matmuls():  # a new function: jit's cache does not key on the variable
        traced = jax.jit(lambda p, x, live: block(p, x, live))
        lowered = traced.lower(params, x, jnp.int32(6)).as_text()
        three_calls = traced(params, x, jnp.int32(6))
    assert "kvpage_expert_ffn" not in lowered
    np.testing.assert_allclose(one_call, three_calls, atol=1e-6)
    np.testing.assert_allclose(padded[:4], one_call[:4], atol=1e-6)
    # XLA alone (no host kernels): the experts dequantized, the same block.
    np.testing.assert_allclose(one_call, jax.jit(lambda p, x: moe_block(cfg, p, x))(params, x),
                               atol=2e-2)
