"""Mixture-of-experts linear layers on the host CPU, as XLA FFI custom calls.

Owns :func:`expert_qmatmul_call` (quantized experts) and :func:`expert_matmul_call`
(float32 or bfloat16 experts): ``y[n] = x[n] . W[expert_ids[n]]^T`` for the ``N =
tokens * top_k`` rows of a routed MoE layer, by the Rust core's
``rust/kernels/expert_matmul.rs`` (exported by ``rust/kernels/xla_ffi_experts.rs``).

The contract, for both calls:

* ``x [N, K]`` (cast to float32), ``expert_ids`` ``N`` int32 ids (any shape of ``N``
  elements, e.g. the router's ``[tokens, top_k]`` flattened in the order of ``x``'s
  rows); the result is float32 ``[N, M]``.
* The experts are one buffer, expert ``e`` after expert ``e - 1``. Quantized: ``blocks``
  ``[E * M, row_bytes(kind, K)]`` (the GGUF blocks of the ``E`` stacked ``[M, K]``
  weights: expert ``e``'s rows are ``e * M .. (e + 1) * M``; ``[E, M, row_bytes]`` is
  taken too) and, for ``int8``, ``row_scales [E * M]`` float32; the formats are
  :data:`KINDS` (``kvpage.quant.formats``). Float: ``w [E, M, K]``, float32 or
  bfloat16, read as stored.
* Each call registers its target with JAX (once) when traced.
* Only the first ``live_rows`` rows (an int32 scalar, ``0 <= live_rows <= N``; all rows
  when None) are computed; the others are zeros and their ids are never read: a
  padded step's padding rows cost nothing. A live row's id outside ``[0, E)`` makes
  the call fail (an XLA runtime error), never an out-of-bounds read.
* The rows are grouped by expert, so each expert some live row is routed to is read
  from memory once per call, however many rows it serves, and the others are not read
  at all: a one-token decode step with top-4 of 32 experts reads 4 experts' bytes.
  Each expert's rows go through the dense kernels (``cpu_qmatmul``, ``cpu_matmul``), so
  a row's rounding is that of a dense product of the rows sharing its expert (a
  quantized row alone on its expert takes the 16-bit one-row path).

:func:`expert_ffn_call` runs a whole routed MoE feed-forward in one call (the Rust core's
``rust/kernels/expert_ffn.rs``): router logits, top-k and routing weights, each routed
expert's gate and up products, SwiGLU, its down product and the weighted sum of each
token's experts, with quantized (GGUF-block) experts. A one-token decode step of a
MoE layer is then one hand-off to the host instead of XLA's router ops and three calls.

Only the ``cpu`` platform has the targets; callers put these calls in the ``cpu`` branch
of ``lax.platform_dependent`` (as ``kvpage/model/linear_kernels.py`` does for
``cpu_qmatmul``), so one traced program still lowers for GPUs. The calls have no
derivative. ``KVPAGE_CPU_MATMUL_PORTABLE=1`` (read by the core) makes them use the
portable loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvpage.kernels.host._host_ffi import register
from kvpage.quant import formats

# Quantized formats, in the order of Rust's QuantType::ALL (kvpage.quant.formats).
KINDS: tuple[str, ...] = formats.KINDS
# Float expert dtypes (one target, ``kvpage_expert_matmul``, reads either).
FLOAT_KINDS: tuple[str, ...] = ("float32", "bfloat16")
FLOAT_TARGET = "kvpage_expert_matmul"
FFN_TARGET = "kvpage_expert_ffn"
ROUTER_RULES: dict[tuple[str, bool], int] = {
    ("softmax_topk", False): 0,
    ("softmax_topk", True): 1,
    ("topk_softmax", False): 2,
    ("topk_softmax", True): 2,
}
"""The ``config`` code of each (router, renormalise) pair (renormalising a softmax over
the top ``k`` changes nothing)."""


def target(kind: str) -> str:
    """The FFI target of ``kind`` (a quantized format or a float dtype name)."""
    return FLOAT_TARGET if kind in FLOAT_KINDS else f"kvpage_expert_qmatmul_{kind}"


def targets() -> tuple[str, ...]:
    """Every target this module calls (for registering them all up front)."""
    return tuple(target(kind) for kind in KINDS) + (FLOAT_TARGET, FFN_TARGET)


def available(kind: str) -> bool:
    """Whether the core exports (and JAX now has registered) the expert product for
    ``kind``: a quantized format of :data:`KINDS` or a float dtype of
    :data:`FLOAT_KINDS`."""
    return (kind in KINDS or kind in FLOAT_KINDS) and register(target(kind))


def _registered(kind: str) -> str:
    """``kind``'s target, registered for the ``cpu`` platform (RuntimeError without it)."""
    if not available(kind):
        raise RuntimeError(f"kvpage._core does not export {target(kind)}")
    return target(kind)


def _rows_and_live(
    x: jax.Array, expert_ids: jax.Array, live_rows: jax.Array | int | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    if x.ndim != 2:
        raise ValueError(f"x must be [N, K], got shape {x.shape}")
    rows = x.shape[0]
    if expert_ids.size != rows:
        raise ValueError(
            f"expert_ids must hold one id per row of x ({rows}), got shape {expert_ids.shape}"
        )
    ids = jnp.asarray(expert_ids).astype(jnp.int32).reshape(rows)
    live = jnp.asarray(rows if live_rows is None else live_rows, jnp.int32).reshape(1)
    return x.astype(jnp.float32), ids, live


def expert_qmatmul_call(
    x: jax.Array,
    blocks: jax.Array,
    row_scales: jax.Array | None,
    kind: str,
    expert_ids: jax.Array,
    num_experts: int,
    live_rows: jax.Array | int | None = None,
) -> jax.Array:
    """float32 ``[N, M]``: ``x[n] . dequant(W[expert_ids[n]])^T`` for the first
    ``live_rows`` rows, zeros after, with ``num_experts`` quantized experts stacked in
    ``blocks`` (module docs; lower for ``cpu`` only)."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(KINDS)}")
    x, ids, live = _rows_and_live(x, jnp.asarray(expert_ids), live_rows)
    inner = x.shape[1]
    want_bytes = formats.row_bytes(kind, inner)
    experts = int(num_experts)
    if blocks.ndim == 2 and experts > 0 and blocks.shape[0] % experts == 0:
        blocks = blocks.reshape(experts, blocks.shape[0] // experts, blocks.shape[1])
    if blocks.ndim != 3 or blocks.shape[0] != experts or blocks.shape[2] != want_bytes:
        raise ValueError(
            f"{kind} blocks of {experts} experts with {inner} inputs must be "
            f"[{experts} * M, {want_bytes}], got shape {blocks.shape}"
        )
    outs = blocks.shape[1]
    scales: tuple[jax.Array, ...] = ()
    if kind in formats.ROW_SCALED:
        if row_scales is None or row_scales.size != experts * outs:
            raise ValueError(f"{kind} experts need row_scales of {experts * outs} values")
        scales = (jnp.asarray(row_scales, jnp.float32).reshape(experts * outs),)
    call = jax.ffi.ffi_call(
        _registered(kind), jax.ShapeDtypeStruct((x.shape[0], outs), jnp.float32)
    )
    return call(x, blocks, *scales, ids, live)


def expert_matmul_call(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    live_rows: jax.Array | int | None = None,
) -> jax.Array:
    """float32 ``[N, M]``: ``x[n] . w[expert_ids[n]]^T`` for the first ``live_rows``
    rows, zeros after; ``w [E, M, K]`` float32 or bfloat16 (module docs; lower for
    ``cpu`` only)."""
    x, ids, live = _rows_and_live(x, jnp.asarray(expert_ids), live_rows)
    if w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"w must be [E, M, {x.shape[1]}], got shape {w.shape}")
    if jnp.dtype(w.dtype).name not in FLOAT_KINDS:
        raise ValueError(f"w must be float32 or bfloat16, got {w.dtype}")
    call = jax.ffi.ffi_call(
        _registered(jnp.dtype(w.dtype).name),
        jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
    )
    return call(x, w, ids, live)


def expert_ffn_available(gate_up_kind: str, down_kind: str) -> bool:
    """Whether :func:`expert_ffn_call` takes experts of these formats (the core exports
    it; formats without per-row scales)."""
    kinds_ok = all(k in KINDS and k not in formats.ROW_SCALED for k in (gate_up_kind, down_kind))
    return kinds_ok and register(FFN_TARGET)


def expert_ffn_call(
    x: jax.Array,
    router: jax.Array,
    router_bias: jax.Array | None,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gate_up_kind: str,
    down_kind: str,
    top_k: int,
    router_rule: str,
    renormalize: bool,
    live_tokens: jax.Array | int | None = None,
    packed: tuple[bool, bool] = (False, False),
) -> jax.Array:
    """float32 ``[T, H]``: the routed MoE feed-forward of ``x [T, H]`` (module docs).

    ``router [E, H]`` float (cast to float32), ``router_bias [E]`` or None; ``gate`` and
    ``up`` the blocks of ``[E, M, H]`` expert weights in ``gate_up_kind`` (``[E, M,
    row_bytes]`` or ``[E * M, row_bytes]``), ``down`` of ``[E, H, M]`` in ``down_kind``;
    ``router_rule`` ``"softmax_topk"`` or ``"topk_softmax"``. Tokens from ``live_tokens``
    on are padding (zeros). ``packed``: whether gate and up, and down, are packed
    into tiles (:mod:`kvpage.quant.tiles`). Lower for ``cpu`` only."""
    if x.ndim != 2 or router.ndim != 2 or router.shape[1] != x.shape[1]:
        raise ValueError(f"x [T, H] and router [E, H] expected, got {x.shape}, {router.shape}")
    if not expert_ffn_available(gate_up_kind, down_kind):
        raise RuntimeError(f"kvpage._core has no {FFN_TARGET} for {gate_up_kind}/{down_kind}")
    experts, hidden = router.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} is outside [1, {experts}]")
    gate_bytes = formats.row_bytes(gate_up_kind, hidden)
    gate = gate.reshape(experts, -1, gate_bytes)
    up = up.reshape(experts, -1, gate_bytes)
    width = gate.shape[1]
    down = down.reshape(experts, hidden, formats.row_bytes(down_kind, width))
    bias = (jnp.zeros((0,), jnp.float32) if router_bias is None
            else jnp.asarray(router_bias, jnp.float32).reshape(experts))
    tokens = x.shape[0]
    live = jnp.asarray(tokens if live_tokens is None else live_tokens, jnp.int32).reshape(1)
    config = jnp.array([KINDS.index(gate_up_kind), KINDS.index(down_kind), top_k,
                        ROUTER_RULES[(router_rule, renormalize)], *map(int, packed)],
                       jnp.int32)
    call = jax.ffi.ffi_call(FFN_TARGET, jax.ShapeDtypeStruct((tokens, hidden), jnp.float32))
    return call(x.astype(jnp.float32), router.astype(jnp.float32), bias, gate, up, down,
                live, config)
