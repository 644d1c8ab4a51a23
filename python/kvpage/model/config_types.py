"""The parts of a model's description that are not the model: RoPE, MoE, layer kinds.

This file owns :class:`RopeConfig`, :class:`MoEConfig` and the names of the attention
layer kinds (:data:`FULL_ATTENTION`, :data:`SLIDING_ATTENTION`). They are plain frozen
dataclasses of hashable fields (a :class:`~kvpage.model.config.ModelConfig` holding them
is a ``jax.jit`` static argument) with no dependency on the rest of the package, so the
config, the HF parsing helpers and every architecture file can share them.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ROPE_TYPES: tuple[str, ...] = (
    "default", "linear", "llama3", "yarn", "longrope", "dynamic"
)

SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES: tuple[str, ...] = (FULL_ATTENTION, SLIDING_ATTENTION)

ROUTERS: tuple[str, ...] = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (the math lives in :mod:`kvpage.model.rope`).

    ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`:

    * ``"default"``: plain RoPE of base ``theta``;
    * ``"linear"``: positions divided by ``factor``;
    * ``"llama3"``: Llama 3.1 frequency-dependent scaling (``factor``,
      ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
    * ``"yarn"``: YaRN (``factor``, ``original_max_position_embeddings``, ``beta_fast``,
      ``beta_slow``, ``truncate``) with the cos/sin attention scaling ``attention_factor``,
      or when that is None the one derived from ``factor``, ``mscale``, ``mscale_all_dim``;
    * ``"longrope"``: Phi-3 LongRoPE, per-frequency divisors ``short_factor`` /
      ``long_factor`` (tuples of ``head_dim / 2`` floats) switched at
      ``original_max_position_embeddings``, attention scaling ``attention_factor`` or
      derived from ``factor``;
    * ``"dynamic"``: dynamic NTK scaling by ``factor`` once a sequence exceeds the model's
      ``max_position_embeddings``.

    Parsed configs have every default already resolved the way transformers resolves it
    (``factor`` of yarn / longrope from the context ratio when absent,
    ``original_max_position_embeddings`` from ``max_position_embeddings``). Every field
    is hashable: the config is a ``jax.jit`` static argument.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: the cos/sin scale; None derives it from ``factor``
    attention_factor: float | None = None
    # longrope
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts feed-forward block (the math: :mod:`kvpage.model.moe`).

    Each token's router logits ``x . gate^T (+ bias)`` pick ``top_k`` of ``num_experts``
    SwiGLU experts of width ``intermediate_size``:

    * ``router="softmax_topk"`` (Mixtral, Qwen3-MoE, OLMoE): softmax over all experts,
      keep the top ``top_k`` probabilities, renormalised to sum 1 when
      ``norm_topk_prob``;
    * ``router="topk_softmax"`` (gpt-oss): top ``top_k`` logits, softmax over those.

    ``shared_expert_intermediate_size`` > 0 adds a dense SwiGLU expert every token runs
    (Qwen2-MoE style), scaled by ``sigmoid(x . shared_expert_gate^T)`` when
    ``shared_expert_gate``. Layers listed in ``dense_layers`` keep an ordinary dense MLP
    of the model's ``intermediate_size`` (Qwen3-MoE's ``mlp_only_layers`` /
    ``decoder_sparse_step``).

    ``expert_bias``: each expert's projections have biases (gpt-oss). ``swiglu_limit``:
    gpt-oss's clamped SwiGLU in the experts (gate clamped above at the limit, up to
    ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``).

    ``dense_compute`` runs every expert for every token (the same outputs): the
    dense-compute baseline of ``kvpage bench moe``, never a default.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    router: str = "softmax_topk"
    router_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    dense_compute: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts <= 1 << 12:
            raise ValueError(
                f"MoE needs 0 < top_k ({self.top_k}) <= num_experts ({self.num_experts}) "
                "<= 4096"
            )
        if not 0 < self.intermediate_size <= 1 << 19:
            raise ValueError(f"MoE intermediate_size must be in [1, 2**19], got "
                             f"{self.intermediate_size}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown MoE router {self.router!r}; known: {', '.join(ROUTERS)}")
